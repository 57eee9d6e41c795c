//! A generated token makes no heap allocation once its step's shape has run in the
//! arena: a stream of `Model::stream` (the thread's serving arena), a stream of an
//! `InferencePool` (its leased arena), a batch of streams, and stream slots (streams
//! started and ended between steps), their windows sliding
//! meanwhile. The count leaves out the harness's thread (the streams run in a thread
//! of their own), and the binary holds one test, so that nothing but the code under
//! test is counted.

use std::sync::Arc;

use carve::nn::serve::{InferencePool, PoolConfig, Sampling};
use carve::nn::{Network, NetworkConfig};
use carve::workspace_core::alloc_check::CountingAllocator;
use carve::workspace_core::alloc_check::{process_counts, Threads};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

fn allocations() -> u64 {
    process_counts(Threads::ExceptMain).allocations
}

/// Stream slots of a model whose context is longer than an arena's default number of
/// plans: every count of streams stepped (and sliding) together is planned, then a
/// stream of every prompt length starts (a plan each, more than the default keeps), and
/// the token steps of every count are counted again: none of their plans was evicted.
fn every_prompt_length_then_each_count(sampling: Sampling) -> (u64, usize) {
    let (context, slots) = (80, 4);
    let mut b = NetworkConfig::builder(12).embedding(8).position_embedding(context);
    b = b.residual(|b| b.layer_norm().attention(2)).residual(|b| b.layer_norm().dense(16).gelu().dense(8));
    let model = Arc::new(Network::new(b.layer_norm().dense(12).seed(5).build().unwrap()).unwrap().freeze().unwrap());
    let pool = InferencePool::new(model, PoolConfig::direct(1)).unwrap();
    let mut slots = pool.stream_slots(slots).unwrap();
    let mut out = slots.buffer();
    // Each count's steps, through a slide (every stream from the same prompt slides at
    // the same step); counted when asked.
    let mut each_count = |slots: &mut carve::nn::serve::StreamSlots<'_>| {
        let (mut allocated, mut tokens) = (0, 0);
        for n in 1..=slots.slots() {
            let started: Vec<usize> = (0..n).map(|_| slots.start(&[1], sampling).unwrap()).collect();
            for _ in 0..context + 2 {
                let before = allocations();
                slots.next_tokens(&mut out).unwrap();
                allocated += allocations() - before;
                tokens += n;
            }
            started.into_iter().for_each(|s| slots.end(s).unwrap());
        }
        (allocated, tokens)
    };
    each_count(&mut slots);
    for len in 1..=context {
        let prompt: Vec<u32> = (0..len as u32).map(|t| t % 12).collect();
        let s = slots.start(&prompt, sampling).unwrap();
        slots.end(s).unwrap();
    }
    each_count(&mut slots)
}

#[test]
fn a_generated_token_allocates_nothing() {
    let context = 16;
    let mut b = NetworkConfig::builder(20).embedding(16).position_embedding(context);
    for _ in 0..2 {
        b = b.residual(|b| b.layer_norm().attention(2)).residual(|b| b.layer_norm().dense(64).gelu().dense(16));
    }
    let model = Arc::new(Network::new(b.layer_norm().dense(20).seed(4).build().unwrap()).unwrap().freeze().unwrap());
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    let sampling = Sampling::random(1.0, 5, 3).unwrap();
    // Each stream: two contexts of tokens to warm up (every shape a step takes: one
    // token, and a slide's half context), then four contexts counted.
    let measured = 4 * context;
    let counted = std::thread::scope(|s| {
        s.spawn(|| {
            let mut counts = Vec::new();
            let mut model_stream = model.stream(&[1, 2, 3], sampling).unwrap();
            let mut pool_stream = pool.stream(&[4, 5], sampling).unwrap();
            let prompts: [&[u32]; 5] = [&[1], &[2, 3], &[4], &[5, 6, 7], &[8]];
            let mut batch = model.streams(&prompts, &[sampling; 5]).unwrap();
            let mut out = [0u32; 5];
            for _ in 0..2 * context {
                model_stream.next_token().unwrap();
                pool_stream.next_token().unwrap();
                batch.next_tokens(&mut out).unwrap();
            }
            let before = allocations();
            for _ in 0..measured {
                model_stream.next_token().unwrap();
            }
            counts.push(("Model::stream", allocations() - before, measured));
            let before = allocations();
            for _ in 0..measured {
                pool_stream.next_token().unwrap();
            }
            counts.push(("InferencePool::stream", allocations() - before, measured));
            let before = allocations();
            for _ in 0..measured {
                batch.next_tokens(&mut out).unwrap();
            }
            counts.push(("Model::streams (5)", allocations() - before, measured));
            // Stream slots of a pool's arena: three streams at their own positions (one
            // ended and another started in its slot while warming up), warmed up as the
            // others, then counted.
            drop((model_stream, pool_stream));
            let mut slots = pool.stream_slots(3).unwrap();
            for prompt in [&[1u32][..], &[2, 3], &[4, 5, 6]] {
                slots.start(prompt, sampling).unwrap();
            }
            let mut out = slots.buffer();
            let mut step = |slots: &mut carve::nn::serve::StreamSlots<'_>| {
                slots.next_tokens(&mut out).unwrap();
                assert!(out.iter().all(|t| matches!(t, Some(Ok(_)))), "{out:?}");
            };
            for i in 0..3 * context {
                if i == context / 2 {
                    slots.end(1).unwrap();
                    assert_eq!(slots.start(&[7, 8], sampling).unwrap(), 1);
                }
                step(&mut slots);
            }
            let before = allocations();
            for _ in 0..measured {
                step(&mut slots);
            }
            counts.push(("InferencePool::stream_slots (3)", allocations() - before, measured));
            let (count, tokens) = every_prompt_length_then_each_count(sampling);
            counts.push(("stream slots after every prompt length", count, tokens));
            counts
        })
        .join()
        .unwrap()
    });
    for (what, count, tokens) in counted {
        assert_eq!(count, 0, "{what}: {count} heap allocations over {tokens} tokens");
    }
    // The count can see an allocation: a stream's start allocates its cache.
    let start = std::thread::scope(|s| {
        s.spawn(|| {
            let before = allocations();
            drop(model.stream(&[1], sampling).unwrap());
            allocations() - before
        })
        .join()
        .unwrap()
    });
    assert!(start > 0, "a stream's start allocates (its cache), and the count sees it");
}
