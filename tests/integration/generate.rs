//! Generation: a stream's cached steps against the whole window run at once, batched
//! streams against each alone, streams through a pool, and bad input.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use carve::nn::serve::{InferencePool, Model, PoolConfig, Sampling, StreamBatch};
use carve::nn::{
    Activations, ForwardCtx, Infer, Input, Layer, Network, NetworkConfig, NetworkConfigBuilder, StreamState,
};
use carve::Error;
use ndarray::{Array2, ArrayView2};

/// A GPT of `blocks` pre-LN blocks (as the transformer tests'), its weights drawn from
/// `seed` and made larger than GPT-2's start so that its distributions are far from
/// uniform.
fn gpt(vocab: usize, d: usize, heads: usize, context: usize, blocks: usize) -> NetworkConfigBuilder {
    let mut b = NetworkConfig::builder(vocab).embedding(d).position_embedding(context);
    for _ in 0..blocks {
        b = b.residual(|b| b.layer_norm().attention(heads)).residual(|b| b.layer_norm().dense(4 * d).gelu().dense(d));
    }
    b.layer_norm().dense(vocab)
}

fn model(context: usize, seed: u64) -> Model {
    let net = Network::new(gpt(13, 16, 2, context, 2).seed(seed).build().unwrap()).unwrap();
    let mut params = net.params().to_vec();
    // Weights far from N(0, 0.02²): the tokens then depend on every layer.
    params.iter_mut().for_each(|v| *v *= 4.0);
    Model::from_config(&gpt(13, 16, 2, context, 2).seed(seed).build().unwrap(), params).unwrap()
}

#[test]
fn a_streams_cached_steps_give_the_bits_of_its_window_run_at_once() {
    let model12 = model(12, 5);
    assert_eq!(model12.context().unwrap(), 12);
    // Two blocks' attention: keys and values of 12 steps of 16 features.
    assert_eq!(model12.kv_cache_bytes().unwrap(), 2 * 12 * 2 * 16 * 4);
    // A context below one block of 16 steps, and one of two blocks and a part.
    for (model, tokens) in [(model12, 40), (model(40, 6), 70)] {
        cached_steps_give_the_bits_of_their_windows(&model, tokens);
    }
}

/// Steps a stream `tokens` times and checks each step's logits, bit for bit, against
/// its window run afresh, and the network's inference of the window against them;
/// checks that the window slid (keeping half the context) more than `tokens / context`
/// times.
fn cached_steps_give_the_bits_of_their_windows(model: &Model, tokens: usize) {
    let context = model.context().unwrap();
    let mut stream = model.stream(&[1, 2, 3], Sampling::random(1.0, 0, 9).unwrap()).unwrap();
    let mut slides = 0;
    let mut last_len = stream.window(0).unwrap().len();
    for i in 0..tokens {
        stream.next_token().unwrap();
        let window = stream.window(0).unwrap().to_vec();
        if window.len() < last_len {
            slides += 1;
            assert_eq!(window.len(), context / 2, "a slide keeps half the context");
        }
        last_len = window.len();
        // The same window, prompted afresh: one pass over every step.
        let alone = model.stream(&window, Sampling::greedy()).unwrap();
        let (cached, whole) = (stream.logits(0).unwrap(), alone.logits(0).unwrap());
        assert!(
            cached.iter().zip(whole).all(|(a, b)| a.to_bits() == b.to_bits()),
            "context {context}, token {i} (window of {}): cached {cached:?} vs whole {whole:?}",
            window.len()
        );
        // And the network's own inference of the window agrees with the logits.
        let ids = Array2::from_shape_vec((1, window.len()), window.clone()).unwrap();
        let probs = model.output(Input::tokens(ids.view())).unwrap();
        let last = probs.row(window.len() - 1);
        let max = cached.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = cached.iter().map(|&l| f64::from(l - max).exp()).sum();
        for (&p, &l) in last.iter().zip(cached) {
            let expected = f64::from(l - max).exp() / sum;
            assert!((f64::from(p) - expected).abs() < 1e-5, "token {i}: probability {p} vs {expected}");
        }
    }
    assert!(slides > tokens / context, "context {context}: {slides} slides");
}

#[test]
fn wide_heads_cached_steps_give_the_bits_of_their_windows() {
    // Heads of 32 and 40 features: a cached step's values run 16 features at a time,
    // several heads' sums interleaved, the last 8 of a 40-wide head alone; its scores
    // 16 steps at a time, the last part of a block as a whole block or alone.
    for (d, heads, context, tokens) in [(128, 4, 40, 100), (80, 2, 40, 100), (48, 1, 20, 50)] {
        let config = || gpt(13, d, heads, context, 1).seed(11).build().unwrap();
        let params: Vec<f32> = Network::new(config()).unwrap().params().iter().map(|v| v * 4.0).collect();
        cached_steps_give_the_bits_of_their_windows(&Model::from_config(&config(), params).unwrap(), tokens);
    }
}

#[test]
fn a_prompt_longer_than_a_score_block_gives_the_bits_of_steps_taken_one_at_a_time() {
    // A context of 300: a window prompted afresh runs its scores 128 rows at a time (so
    // that they take 128 × context values, not context²), and gives the bits of the
    // same window built a cached step at a time, through two slides.
    let config = || gpt(13, 16, 2, 300, 1).seed(12).build().unwrap();
    let params: Vec<f32> = Network::new(config()).unwrap().params().iter().map(|v| v * 4.0).collect();
    cached_steps_give_the_bits_of_their_windows(&Model::from_config(&config(), params).unwrap(), 460);
}

#[test]
fn greedy_tokens_follow_the_most_probable_of_the_network_inference() {
    let model = model(16, 8);
    let prompt = [4u32, 4, 7];
    let tokens = model.generate(&prompt, 10, Sampling::greedy()).unwrap();
    let mut window = prompt.to_vec();
    for &token in &tokens {
        let ids = Array2::from_shape_vec((1, window.len()), window.clone()).unwrap();
        let probs = model.output(Input::tokens(ids.view())).unwrap();
        let last = probs.row(window.len() - 1);
        let best = last.iter().enumerate().fold(0, |b, (i, &p)| if p > last[b] { i } else { b });
        assert_eq!(token as usize, best, "{window:?}");
        window.push(token);
    }
    // Distinct tokens: the weights are not degenerate.
    assert!(tokens.iter().collect::<std::collections::BTreeSet<_>>().len() > 1, "{tokens:?}");
}

#[test]
fn batched_streams_give_each_streams_bits_alone() {
    let model = model(10, 3);
    // Seventeen streams (more rows than a few-row product takes: their one-token steps
    // take the packed path), prompts of different lengths (some longer than the
    // context), greedy and random draws.
    let prompts: Vec<Vec<u32>> =
        (0..17).map(|s| (0..1 + s * 3 / 2).map(|t| ((s * 5 + t * 3) % 13) as u32).collect()).collect();
    let sampling: Vec<Sampling> = (0..17)
        .map(|s| match s % 3 {
            0 => Sampling::greedy(),
            1 => Sampling::random(0.8, 0, s as u64).unwrap(),
            _ => Sampling::random(1.3, 4, 100 + s as u64).unwrap(),
        })
        .collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut batch = model.streams(&refs, &sampling).unwrap();
    assert_eq!(batch.streams(), 17);
    let mut alone: Vec<_> = refs.iter().zip(&sampling).map(|(p, &s)| model.stream(p, s).unwrap()).collect();
    let mut out = [0u32; 17];
    for step in 0..25 {
        batch.next_tokens(&mut out).unwrap();
        for (s, stream) in alone.iter_mut().enumerate() {
            assert_eq!(stream.next_token().unwrap(), out[s], "stream {s}, step {step}");
            let same =
                stream.logits(0).unwrap().iter().zip(batch.logits(s).unwrap()).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "stream {s}, step {step}: logits differ");
        }
    }
    assert!(batch.next_token().is_err(), "next_token steps one stream");
    assert!(matches!(batch.next_tokens(&mut [0; 3]), Err(Error::ShapeMismatch { .. })));
}

#[test]
fn sampling_is_seeded_and_top_k_keeps_to_the_most_probable() {
    let model = model(16, 4);
    let draw = |s: Sampling| model.generate(&[1, 2], 30, s).unwrap();
    let a = draw(Sampling::random(1.0, 0, 11).unwrap());
    assert_eq!(a, draw(Sampling::random(1.0, 0, 11).unwrap()), "the same seed, the same tokens");
    assert_ne!(a, draw(Sampling::random(1.0, 0, 12).unwrap()), "another seed");
    assert_eq!(draw(Sampling::random(2.0, 1, 5).unwrap()), draw(Sampling::greedy()), "top-1 is greedy");
    // Top-2: every token is one of the two most probable.
    let mut stream = model.stream(&[3], Sampling::random(5.0, 2, 1).unwrap()).unwrap();
    for _ in 0..30 {
        let token = stream.next_token().unwrap() as usize;
        let logits = stream.logits(0).unwrap();
        let above = logits.iter().filter(|&&l| l > logits[token]).count();
        assert!(above < 2, "token {token} has {above} more probable");
    }
}

#[test]
fn a_pool_serves_streams_from_its_arenas_with_each_streams_bits_alone() {
    let model = Arc::new(model(12, 6));
    let expected: Vec<Vec<u32>> =
        (0..6).map(|s| model.generate(&[s as u32 + 1], 20, Sampling::random(1.0, 5, s).unwrap()).unwrap()).collect();
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(2)).unwrap();
    std::thread::scope(|scope| {
        for (s, expected) in expected.iter().enumerate() {
            let pool = &pool;
            scope.spawn(move || {
                let mut stream = pool.stream(&[s as u32 + 1], Sampling::random(1.0, 5, s as u64).unwrap()).unwrap();
                let tokens: Vec<u32> = (0..20).map(|_| stream.next_token().unwrap()).collect();
                assert_eq!(&tokens, expected, "stream {s}");
            });
        }
    });
    // A stream abandoned mid-generation gives its arena back.
    let mut held = pool.stream(&[1], Sampling::greedy()).unwrap();
    held.next_token().unwrap();
    let other = pool.stream(&[2], Sampling::greedy()).unwrap();
    assert!(matches!(pool.try_lease(), Err(Error::PoolBusy { .. })), "both arenas hold a stream");
    // A call that cannot start a stream is refused at once, not after a wait for an
    // arena (from another thread: this one holds them, and would be refused for that).
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let wait = std::time::Duration::from_secs(5);
            let start = std::time::Instant::now();
            for refused in [
                pool.stream_timeout(&[], Sampling::greedy(), wait).map(drop),
                pool.stream_timeout(&[13], Sampling::greedy(), wait).map(drop),
                pool.streams(&[&[1], &[]], &[Sampling::greedy(); 2]).map(drop),
                pool.streams(&[&[1]], &[]).map(drop),
            ] {
                assert!(matches!(refused, Err(Error::InvalidInput(_))), "{refused:?}");
            }
            assert!(start.elapsed() < std::time::Duration::from_secs(2), "{:?}", start.elapsed());
        });
    });
    drop(held);
    drop(pool.try_lease().expect("the abandoned stream's arena is back"));
    drop(other);
    let stats = pool.stats();
    assert_eq!(stats.workers, 2);
    assert!(stats.arena_bytes > 0);
}

#[test]
fn bad_prompts_and_models_that_cannot_generate_are_clear_errors() {
    let model = model(8, 1);
    match model.stream(&[], Sampling::greedy()) {
        Err(Error::InvalidInput(m)) => assert!(m.contains("empty"), "{m}"),
        other => panic!("{other:?}"),
    }
    match model.stream(&[1, 13], Sampling::greedy()) {
        Err(Error::InvalidInput(m)) => assert!(m.contains("token 13") && m.contains("vocabulary of 13"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(model.streams(&[&[1]], &[]), Err(Error::InvalidInput(_))));
    assert!(matches!(Sampling::random(f32::NAN, 0, 0), Err(Error::InvalidConfig { .. })));
    // A prompt longer than the context: its last `context` tokens.
    let long: Vec<u32> = (0..30).map(|t| t % 13).collect();
    let stream = model.stream(&long, Sampling::greedy()).unwrap();
    assert_eq!(stream.window(0).unwrap(), &long[22..]);
    // An MLP reads no tokens.
    let mlp = Network::new(NetworkConfig::builder(4).dense(3).build().unwrap()).unwrap().freeze().unwrap();
    match mlp.stream(&[1], Sampling::greedy()) {
        Err(Error::InvalidConfig { reason }) => assert!(reason.contains("token embedding"), "{reason}"),
        other => panic!("{other:?}"),
    }
    // A recurrent layer's steps depend on each other: it cannot run a step alone.
    let lstm = NetworkConfig::builder(13).embedding(8).position_embedding(8).lstm(8).dense(13).build().unwrap();
    let lstm = Network::new(lstm).unwrap().freeze().unwrap();
    // Said before a stream starts, by the check a server makes once (`context`), and
    // naming the layer.
    for refused in [
        lstm.context().map(|_| ()),
        lstm.kv_cache_bytes().map(|_| ()),
        lstm.stream(&[1], Sampling::greedy()).map(|_| ()),
    ] {
        match refused {
            Err(Error::InvalidConfig { reason }) => {
                assert!(reason.contains("'lstm") && reason.contains("cannot run token by token"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
    // No position embedding: nothing bounds the cache.
    let unbounded = NetworkConfig::builder(13).embedding(8).residual(|b| b.attention(2)).dense(13).build().unwrap();
    let unbounded = Network::new(unbounded).unwrap().freeze().unwrap();
    assert!(matches!(unbounded.kv_cache_bytes(), Err(Error::InvalidConfig { .. })));
}

#[test]
fn a_step_refused_inside_another_request_leaves_its_streams_as_they_were() {
    // A stream of `Model::stream` (and slots of `Model::stream_slots`) steps in its
    // thread's serving arena, which a request of another model on the same thread holds
    // while its closure runs: a step there cannot run. It is refused before anything
    // changes, and the streams go on, through slides (context 8), as if it had never
    // been asked for.
    let model = model(8, 5);
    let mlp = Network::new(NetworkConfig::builder(4).dense(3).build().unwrap()).unwrap().freeze().unwrap();
    let x = Array2::<f32>::zeros((1, 4));
    let sampling = Sampling::random(1.0, 0, 9).unwrap();
    let alone = model.generate(&[1, 2], 20, sampling).unwrap();
    let mut stream = model.stream(&[1, 2], sampling).unwrap();
    let mut slots = model.stream_slots(2).unwrap();
    let slot = slots.start(&[1, 2], sampling).unwrap();
    let mut out = slots.buffer();
    let (mut tokens, mut slot_tokens) = (Vec::new(), Vec::new());
    for i in 0..20 {
        if i % 3 == 1 {
            (&mlp)
                .infer(x.view(), |_| {
                    match stream.next_token() {
                        Err(Error::InvalidInput(m)) => assert!(m.contains("inside another model request"), "{m}"),
                        other => panic!("{other:?}"),
                    }
                    match slots.next_tokens(&mut out) {
                        Err(Error::InvalidInput(m)) => assert!(m.contains("inside another model request"), "{m}"),
                        other => panic!("{other:?}"),
                    }
                    assert!(out[slot].is_none(), "{:?}", out[slot]);
                    Ok(())
                })
                .unwrap();
        }
        tokens.push(stream.next_token().unwrap());
        slots.next_tokens(&mut out).unwrap();
        slot_tokens.push(out[slot].take().unwrap().unwrap());
    }
    assert_eq!(tokens, alone);
    assert_eq!(slot_tokens, alone);
}

/// A layer of the user's own that keeps state per stream and runs its own stream step
/// (here: its input as it is), and says nothing of `runs_in_stream`.
struct Echo;

impl Layer for Echo {
    fn name(&self) -> &str {
        "echo"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        Ok(carve::freeze(ctx.activations.copy_of(&input)?))
    }
    fn stream_state_len(&self, _inputs: usize, _context: usize) -> carve::Result<usize> {
        Ok(1)
    }
    fn forward_stream<'a>(
        &self,
        _params: &[f32],
        input: Activations<'a>,
        _state: &mut StreamState<'_>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<Activations<'a>> {
        let x = input.sequence("echo")?;
        Ok(Activations::Sequence(carve::freeze(ctx.activations.copy_of(&x)?)))
    }
}

#[test]
fn a_users_layer_with_state_per_stream_generates_without_saying_runs_in_stream() {
    // Its own `forward_stream` and state per stream say it runs in a stream: a model of
    // it generates (it was refused as a layer that cannot run token by token).
    let config = || NetworkConfig::builder(13).embedding(8).position_embedding(8).layer(Echo).dense(13).seed(4).build();
    let net = Network::new(config().unwrap()).unwrap();
    let model = Model::from_config(&config().unwrap(), net.params().to_vec()).unwrap();
    assert_eq!(model.context().unwrap(), 8);
    let tokens = model.generate(&[1, 2, 3], 5, Sampling::greedy()).unwrap();
    assert_eq!(tokens.len(), 5);
}

/// A per-step layer that panics while its flag is set.
struct Tripwire(&'static AtomicBool);

static ARMED: AtomicBool = AtomicBool::new(false);

impl Layer for Tripwire {
    fn name(&self) -> &str {
        "tripwire"
    }
    fn output_size(&self, inputs: usize) -> carve::Result<usize> {
        Ok(inputs)
    }
    fn per_step(&self) -> bool {
        true
    }
    fn forward_rows<'a>(
        &self,
        _params: &[f32],
        input: ArrayView2<'a, f32>,
        ctx: &ForwardCtx<'a, '_>,
    ) -> carve::Result<ArrayView2<'a, f32>> {
        assert!(!self.0.load(Ordering::Relaxed), "the tripwire went off");
        Ok(carve::freeze(ctx.activations.copy_of(&input)?))
    }
}

#[test]
fn a_step_that_panics_fails_its_streams_and_the_arena_goes_on() {
    let config = || {
        let b = NetworkConfig::builder(13).embedding(8).position_embedding(8).residual(|b| b.attention(2));
        b.layer(Tripwire(&ARMED)).dense(13).seed(2).build().unwrap()
    };
    let net = Network::new(config()).unwrap();
    let model = Model::from_config(&config(), net.params().to_vec()).unwrap();
    let pool = InferencePool::new(Arc::new(model), PoolConfig::direct(1)).unwrap();
    let expected = pool.model().generate(&[1, 2], 5, Sampling::greedy()).unwrap();
    let mut stream = pool.stream(&[1, 2], Sampling::greedy()).unwrap();
    stream.next_token().unwrap();
    ARMED.store(true, Ordering::Relaxed);
    let caught = stream.next_token();
    ARMED.store(false, Ordering::Relaxed);
    match caught {
        Err(Error::Panicked { message }) => assert!(message.contains("tripwire"), "{message}"),
        other => panic!("{other:?}"),
    }
    match stream.next_token() {
        Err(Error::InvalidInput(m)) => assert!(m.contains("failed at an earlier step"), "{m}"),
        other => panic!("{other:?}"),
    }
    drop(stream);
    let mut again = pool.stream(&[1, 2], Sampling::greedy()).unwrap();
    let tokens: Vec<u32> = (0..5).map(|_| again.next_token().unwrap()).collect();
    assert_eq!(tokens, expected, "the arena serves the next stream as before");
}

#[test]
fn a_models_symbols_read_and_write_text_and_its_file_keeps_them() {
    let symbols = "\nabcdefghijkl";
    let text_model = model(8, 2).with_symbols(symbols).unwrap();
    assert_eq!(text_model.symbols().unwrap().iter().collect::<String>(), symbols);
    let tokens = text_model.encode("a\nlab").unwrap();
    assert_eq!(tokens, [1, 0, 12, 1, 2]);
    assert_eq!(text_model.decode(&tokens).unwrap(), "a\nlab");
    match text_model.encode("abz") {
        Err(Error::InvalidInput(m)) => assert!(m.contains("'z'") && m.contains("character 2"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(text_model.decode(&[13]), Err(Error::InvalidInput(_))));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt.safetensors");
    text_model.save(&path).unwrap();
    let loaded = Model::load(&path).unwrap();
    assert_eq!(loaded.symbols(), text_model.symbols());
    let prompt = loaded.encode("abc").unwrap();
    let sampling = Sampling::random(0.9, 3, 4).unwrap();
    assert_eq!(loaded.generate(&prompt, 20, sampling).unwrap(), text_model.generate(&prompt, 20, sampling).unwrap());
    // Symbols that do not fit the model: too few, or one twice.
    for bad in ["abc", "\nabcdefghijka"] {
        assert!(matches!(model(8, 2).with_symbols(bad), Err(Error::InvalidConfig { .. })), "{bad:?}");
    }
    // A model without symbols reads no text.
    assert!(matches!(model(8, 2).encode("a"), Err(Error::InvalidInput(_))));
    // Symbols in any order, of any width: each character is its own token.
    let wide = "€zé\u{1F600}ab\ncdefgh";
    let wide_model = model(8, 2).with_symbols(wide).unwrap();
    let text: String = wide.chars().rev().collect();
    let expected: Vec<u32> = (0..13u32).rev().collect();
    assert_eq!(wide_model.encode(&text).unwrap(), expected);
    assert_eq!(wide_model.decode(&expected).unwrap(), text);
    match wide_model.encode("ab\u{1F601}") {
        Err(Error::InvalidInput(m)) => assert!(m.contains("'\u{1F601}'") && m.contains("character 2"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn generating_no_tokens_or_more_than_memory_holds_is_refused_before_the_prompt_runs() {
    let model = model(8, 2);
    for tokens in [0, usize::MAX, usize::MAX / 4 + 1] {
        match model.generate(&[1, 2], tokens, Sampling::greedy()) {
            Err(Error::InvalidInput(m)) => assert!(m.contains(&format!("{tokens} tokens")), "{tokens}: {m}"),
            other => panic!("{tokens}: {other:?}"),
        }
    }
    assert_eq!(model.generate(&[1, 2], 1, Sampling::greedy()).unwrap().len(), 1);
}

#[test]
fn a_file_whose_symbols_lie_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt.safetensors");
    model(8, 2).with_symbols("\nabcdefghijkl").unwrap().save(&path).unwrap();
    // The same file with a symbol twice in its metadata (the header's length kept).
    let mut bytes = std::fs::read(&path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let text = String::from_utf8(bytes[8..8 + header].to_vec()).unwrap();
    let lied = text.replace("abcdefghijkl", "abcdefghijkk");
    assert_eq!(lied.len(), text.len());
    assert_ne!(lied, text);
    bytes[8..8 + header].copy_from_slice(lied.as_bytes());
    std::fs::write(&path, &bytes).unwrap();
    match Model::load(&path) {
        Err(Error::ModelFile { reason, .. }) => assert!(reason.contains("carve.symbols"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn past_a_slice_of_the_multiply_a_cached_step_still_gives_the_bits_of_its_window() {
    // A context of 300 steps: past 256 a step's sums cross the multiply's first slice of
    // its shared dimension, and the cached step must add its slices as the multiply does.
    // Heads of 4 features (each sum alone) and of 32 (16 features at a time).
    for (d, heads) in [(8, 2), (32, 1)] {
        let config = || {
            let b = NetworkConfig::builder(13).embedding(d).position_embedding(300);
            b.residual(|b| b.layer_norm().attention(heads)).layer_norm().dense(13).seed(4).build().unwrap()
        };
        let net = Network::new(config()).unwrap();
        let params: Vec<f32> = net.params().iter().map(|v| v * 4.0).collect();
        let model = Model::from_config(&config(), params).unwrap();
        let mut stream = model.stream(&[1, 2, 3], Sampling::random(1.0, 0, 2).unwrap()).unwrap();
        for _ in 0..280 {
            stream.next_token().unwrap();
        }
        let window = stream.window(0).unwrap().to_vec();
        assert!(window.len() > 257, "{}", window.len());
        let alone = model.stream(&window, Sampling::greedy()).unwrap();
        let (cached, whole) = (stream.logits(0).unwrap(), alone.logits(0).unwrap());
        assert!(cached.iter().zip(whole).all(|(a, b)| a.to_bits() == b.to_bits()), "{cached:?} vs {whole:?}");
        // And a stream that is not there is an error, not a panic.
        assert!(matches!(stream.logits(1), Err(Error::InvalidInput(_))));
        assert!(matches!(stream.window(7), Err(Error::InvalidInput(_))));
    }
}

#[test]
fn a_batched_pool_serves_streams_and_requests_side_by_side() {
    use std::time::Duration;
    let model = Arc::new(model(12, 7));
    let expected = model.generate(&[3, 1], 15, Sampling::greedy()).unwrap();
    let pool = InferencePool::new(model.clone(), PoolConfig::batched(2, 8, Duration::from_micros(100))).unwrap();
    let mut stream = pool.stream(&[3, 1], Sampling::greedy()).unwrap();
    let ids = Array2::from_shape_vec((1, 2), vec![3u32, 1]).unwrap();
    let alone = model.output(Input::tokens(ids.view())).unwrap();
    let mut tokens = Vec::new();
    for _ in 0..15 {
        tokens.push(stream.next_token().unwrap());
        // A request of the caller's own between the stream's tokens, in the other arena
        // (a batched pool coalesces flat rows only: a sequence model's requests go
        // through a lease).
        assert_eq!(pool.lease().unwrap().output(Input::tokens(ids.view())).unwrap(), alone);
    }
    assert_eq!(tokens, expected);
    drop(stream);
    assert!(pool.stats().stream_bytes > 0, "the arena keeps the stream's buffers for its next stream");
}

#[test]
fn a_batched_pool_refuses_a_sequence_request_for_what_it_is_whoever_holds_the_arenas() {
    use std::time::Duration;
    let model = Arc::new(model(12, 7));
    let pool = InferencePool::new(model, PoolConfig::batched(1, 8, Duration::from_micros(100))).unwrap();
    let ids = Array2::from_shape_vec((1, 2), vec![3u32, 1]).unwrap();
    let refused = |error: &Error| matches!(error, Error::InvalidInput(m) if m.contains("coalesces flat rows"));
    let free = pool.output(Input::tokens(ids.view())).unwrap_err();
    assert!(refused(&free), "{free}");
    // The same answer while this thread's stream holds the only arena (not that it would
    // wait for itself: no batch could run it once the arena came back).
    let _stream = pool.stream(&[3, 1], Sampling::greedy()).unwrap();
    let held = pool.output(Input::tokens(ids.view())).unwrap_err();
    assert!(refused(&held), "{held}");
    let mut out = Array2::<f32>::zeros((1, pool.model().classes()));
    let now = pool.try_output(Input::tokens(ids.view()), out.view_mut()).unwrap_err();
    assert!(refused(&now), "{now}");
}

/// Runs `callers` threads, caller `i` joining `batch` with `prompts[i]` and
/// `sampling[i]` and drawing `tokens` tokens; each caller's tokens and last logits.
fn batched_callers(
    batch: &StreamBatch<'_>,
    prompts: &[Vec<u32>],
    sampling: &[Sampling],
    tokens: usize,
) -> Vec<(Vec<u32>, Vec<f32>)> {
    std::thread::scope(|scope| {
        let callers: Vec<_> = prompts
            .iter()
            .zip(sampling)
            .map(|(prompt, &sampling)| {
                scope.spawn(move || {
                    let mut stream = batch.join(prompt, sampling).unwrap();
                    let drawn: Vec<u32> = (0..tokens).map(|_| stream.next_token().unwrap()).collect();
                    (drawn, stream.logits().unwrap())
                })
            })
            .collect();
        callers.into_iter().map(|c| c.join().unwrap()).collect()
    })
}

#[test]
fn independent_callers_in_a_stream_batch_draw_each_streams_bits_alone() {
    // Six callers of one batch of four slots: two wait for a slot, and the streams are
    // at different positions, slide at different steps, and start while others step.
    let model = Arc::new(model(16, 3));
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    let batch = pool.stream_batch(4, std::time::Duration::from_millis(1)).unwrap();
    assert_eq!((batch.slots(), batch.streams(), batch.context()), (4, 0, 16));
    assert_eq!(batch.kv_cache_bytes(), model.kv_cache_bytes().unwrap());
    let prompts: Vec<Vec<u32>> = (0..6u32).map(|i| (0..=i * 2).map(|t| (t * 5 + i) % 13).collect()).collect();
    let sampling: Vec<Sampling> =
        (0..6).map(|i| if i % 2 == 0 { Sampling::greedy() } else { Sampling::random(0.9, 4, i).unwrap() }).collect();
    let tokens = 40;
    for round in 0..3 {
        let got = batched_callers(&batch, &prompts, &sampling, tokens);
        for (i, (drawn, logits)) in got.iter().enumerate() {
            let mut alone = model.stream(&prompts[i], sampling[i]).unwrap();
            let expected: Vec<u32> = (0..tokens).map(|_| alone.next_token().unwrap()).collect();
            assert_eq!(drawn, &expected, "round {round}, caller {i}");
            let (a, b) = (logits, alone.logits(0).unwrap());
            assert!(a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits()), "round {round}, caller {i}");
        }
        assert_eq!(batch.streams(), 0, "every caller's slot is free again");
    }
}

#[test]
fn a_stream_batch_is_shared_by_reference_and_its_streams_move() {
    fn sync<T: Sync>() {}
    fn send<T: Send>() {}
    sync::<StreamBatch<'static>>();
    send::<carve::nn::serve::BatchedStream<'static, 'static>>();
}

#[test]
fn a_full_stream_batch_refuses_in_time_and_a_dropped_stream_frees_its_slot() {
    let model = Arc::new(model(12, 4));
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    assert!(matches!(pool.stream_batch(0, std::time::Duration::ZERO), Err(Error::InvalidInput(_))));
    let too_long = carve::nn::serve::MAX_BATCH_WAIT + std::time::Duration::from_millis(1);
    assert!(matches!(pool.stream_batch(2, too_long), Err(Error::InvalidInput(m)) if m.contains("at most")));
    let batch = pool.stream_batch(2, std::time::Duration::ZERO).unwrap();
    let mut first = batch.join(&[1, 2], Sampling::greedy()).unwrap();
    let second = batch.join(&[3], Sampling::greedy()).unwrap();
    match batch.join_timeout(&[4], Sampling::greedy(), std::time::Duration::from_millis(20)) {
        Err(e @ Error::BatchFull { slots: 2, .. }) => assert!(e.to_string().contains("2 slots"), "{e}"),
        other => panic!("{other:?}"),
    }
    // Bad prompts are refused at once, full or not, and their slot is free again.
    assert!(matches!(batch.join(&[], Sampling::greedy()), Err(Error::InvalidInput(_))));
    drop(second);
    assert!(matches!(batch.join(&[], Sampling::greedy()), Err(Error::InvalidInput(_))));
    match batch.join(&[1, 13], Sampling::greedy()) {
        Err(Error::InvalidInput(m)) => assert!(m.contains("token 13"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(batch.streams(), 1);
    // A stream joined after another left starts afresh: the bits of its run alone.
    let mut third = batch.join(&[5, 6, 7], Sampling::greedy()).unwrap();
    let drawn: Vec<u32> = (0..20).map(|_| third.next_token().unwrap()).collect();
    assert_eq!(drawn, model.generate(&[5, 6, 7], 20, Sampling::greedy()).unwrap());
    assert_eq!(third.window().unwrap(), {
        let mut alone = model.stream(&[5, 6, 7], Sampling::greedy()).unwrap();
        for _ in 0..20 {
            alone.next_token().unwrap();
        }
        alone.window(0).unwrap().to_vec()
    });
    first.next_token().unwrap();
    // The pool's one arena is the batch's while it lives.
    assert!(matches!(pool.try_lease(), Err(Error::PoolBusy { .. })));
    drop((first, third));
    drop(batch);
    pool.try_lease().unwrap();
}

#[test]
fn a_thread_holding_every_slot_of_a_batch_is_refused_rather_than_waiting_for_itself() {
    let model = Arc::new(model(12, 4));
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    // The longest wait a batch allows: a step that waited for this thread's own other
    // stream would be seen.
    let batch = pool.stream_batch(2, carve::nn::serve::MAX_BATCH_WAIT).unwrap();
    let mut first = batch.join(&[1, 2], Sampling::greedy()).unwrap();
    let mut second = batch.join(&[3], Sampling::greedy()).unwrap();
    // A third join with no timeout would wait for a slot only this thread can free.
    match batch.join(&[4], Sampling::greedy()) {
        Err(Error::InvalidInput(m)) => assert!(m.contains("wait for itself") && m.contains("join_timeout"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        batch.join_timeout(&[4], Sampling::greedy(), std::time::Duration::from_millis(5)),
        Err(Error::BatchFull { slots: 2, .. })
    ));
    // One thread stepping both streams in turn: each step goes at once, alone, and draws
    // its run's bits.
    let started = std::time::Instant::now();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..6 {
        a.push(first.next_token().unwrap());
        b.push(second.next_token().unwrap());
    }
    assert!(started.elapsed() < carve::nn::serve::MAX_BATCH_WAIT, "a step waited: {:?}", started.elapsed());
    assert_eq!(a, model.generate(&[1, 2], 6, Sampling::greedy()).unwrap());
    assert_eq!(b, model.generate(&[3], 6, Sampling::greedy()).unwrap());
    // A stream forgotten keeps its slot: this thread is refused, not left waiting.
    std::mem::forget(second);
    match batch.join(&[4], Sampling::greedy()) {
        Err(Error::InvalidInput(m)) => assert!(m.contains("forgotten"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Another thread waits for a slot (it is not this thread's to free), and gets the
    // one this thread frees.
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| batch.join(&[6], Sampling::greedy()).map(|mut s| s.next_token()));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!waiter.is_finished(), "the other thread waits for a slot");
        drop(first);
        let token = waiter.join().unwrap().unwrap().unwrap();
        assert_eq!(token, model.generate(&[6], 1, Sampling::greedy()).unwrap()[0]);
    });
}

/// Slots beyond the machine were granted by an overcommitting kernel and the process
/// killed once their caches were zeroed: refused, with the bytes, before any is made.
/// (Linux: where the machine's memory can be told.)
#[cfg(target_os = "linux")]
#[test]
fn slots_beyond_the_machines_memory_are_refused_with_their_bytes() {
    let model = Arc::new(model(12, 4));
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    for slots in [1usize << 40, usize::MAX / 1024] {
        for refused in
            [pool.stream_batch(slots, std::time::Duration::ZERO).map(drop), pool.stream_slots(slots).map(drop)]
        {
            match refused {
                Err(Error::InvalidInput(m)) => {
                    assert!(m.contains("machine's memory") || m.contains("overflow"), "{slots}: {m}")
                }
                other => panic!("{slots} slots: {other:?}"),
            }
        }
    }
    // The pool is as it was.
    let mut slots = pool.stream_slots(2).unwrap();
    assert_eq!(slots.slots(), 2);
    assert_eq!(slots.start(&[1], Sampling::greedy()).unwrap(), 0);
}

#[test]
fn reading_a_streams_state_puts_off_a_waiting_step_at_most_once() {
    // A stream that does not step delays the others' steps by at most twice the batch's
    // wait (the wait, and once more after a use of the arena past it), however often its
    // thread reads its window meanwhile.
    let model = Arc::new(model(12, 4));
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    let wait = std::time::Duration::from_millis(200);
    let batch = pool.stream_batch(2, wait).unwrap();
    std::thread::scope(|scope| {
        let (joined, ready) = std::sync::mpsc::channel();
        let batch = &batch;
        scope.spawn(move || {
            let reader = batch.join(&[1], Sampling::greedy()).unwrap();
            joined.send(()).unwrap();
            let started = std::time::Instant::now();
            while started.elapsed() < std::time::Duration::from_millis(1500) {
                assert_eq!(reader.window().unwrap(), &[1]);
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        });
        ready.recv().unwrap();
        let mut stepped = batch.join(&[2, 3], Sampling::greedy()).unwrap();
        let started = std::time::Instant::now();
        let token = stepped.next_token().unwrap();
        let took = started.elapsed();
        assert!(took < wait * 3, "the step waited {took:?} (the batch's wait is {wait:?})");
        assert_eq!(token, model.generate(&[2, 3], 1, Sampling::greedy()).unwrap()[0]);
    });
}

#[test]
fn a_thread_that_hands_its_streams_to_others_joins_again_when_they_end() {
    // A dispatcher: it joins a stream and hands it to a thread of its own, for each
    // prompt in turn, through a batch of one slot; each join waits for the stream before
    // it to end, there, even when that thread is slow to take its first step.
    let model = Arc::new(model(12, 4));
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    let batch = pool.stream_batch(1, std::time::Duration::from_millis(5)).unwrap();
    let prompts: [&[u32]; 3] = [&[1, 2], &[3], &[4, 5, 6]];
    let drawn = std::thread::scope(|scope| {
        let mut workers = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let mut stream = batch.join(prompt, Sampling::greedy()).unwrap();
            workers.push(scope.spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(50 * i as u64));
                (0..5).map(|_| stream.next_token().unwrap()).collect::<Vec<u32>>()
            }));
        }
        workers.into_iter().map(|w| w.join().unwrap()).collect::<Vec<_>>()
    });
    for (prompt, drawn) in prompts.iter().zip(&drawn) {
        assert_eq!(drawn, &model.generate(prompt, 5, Sampling::greedy()).unwrap(), "{prompt:?}");
    }
}

static ARMED_BATCH: AtomicBool = AtomicBool::new(false);

#[test]
fn a_panicking_step_fails_its_batchs_streams_and_the_batch_goes_on() {
    let config = || {
        let b = NetworkConfig::builder(13).embedding(8).position_embedding(8).residual(|b| b.attention(2));
        b.layer(Tripwire(&ARMED_BATCH)).dense(13).seed(2).build().unwrap()
    };
    let net = Network::new(config()).unwrap();
    let model = Arc::new(Model::from_config(&config(), net.params().to_vec()).unwrap());
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    let batch = pool.stream_batch(3, std::time::Duration::from_millis(2)).unwrap();
    let mut a = batch.join(&[1, 2], Sampling::greedy()).unwrap();
    a.next_token().unwrap();
    ARMED_BATCH.store(true, Ordering::Relaxed);
    let caught = a.next_token();
    ARMED_BATCH.store(false, Ordering::Relaxed);
    match caught {
        Err(Error::Panicked { message }) => assert!(message.contains("tripwire"), "{message}"),
        other => panic!("{other:?}"),
    }
    // The failed stream says so at every later call; the batch serves new streams.
    assert!(matches!(a.next_token(), Err(Error::Panicked { .. })));
    assert!(matches!(a.window(), Err(Error::Panicked { .. })));
    let mut b = batch.join(&[1, 2], Sampling::greedy()).unwrap();
    let drawn: Vec<u32> = (0..6).map(|_| b.next_token().unwrap()).collect();
    assert_eq!(drawn, model.generate(&[1, 2], 6, Sampling::greedy()).unwrap());
    // A prompt whose pass panics fails its join alone.
    ARMED_BATCH.store(true, Ordering::Relaxed);
    let joined = batch.join(&[3, 4], Sampling::greedy());
    ARMED_BATCH.store(false, Ordering::Relaxed);
    assert!(matches!(joined, Err(Error::Panicked { .. })), "{joined:?}");
    assert_eq!(batch.streams(), 2);
    assert_eq!(b.next_token().unwrap(), model.generate(&[1, 2], 7, Sampling::greedy()).unwrap()[6]);
}

/// A small GPT (context 8) whose position 5's embedding is NaN: a stream's logits are
/// not finite from the step that reaches it.
fn nan_at_position_5() -> Model {
    let config = || {
        let b = NetworkConfig::builder(13).embedding(8).position_embedding(8).residual(|b| b.attention(2));
        b.dense(13).seed(2).build().unwrap()
    };
    let net = Network::new(config()).unwrap();
    let mut params = net.params().to_vec();
    // The position table (layer 1) where the flat layout keeps it.
    let table = Model::from_config(&config(), params.clone()).unwrap().layer_params(1).to_vec();
    let at = params.windows(table.len()).position(|w| w == table.as_slice()).unwrap();
    params[at + 5 * 8..at + 6 * 8].fill(f32::NAN);
    Model::from_config(&config(), params).unwrap()
}

#[test]
fn logits_that_are_not_finite_fail_their_stream_alone() {
    // A stream fails at the step that reaches position 5, and a stream beside it in the
    // same step goes on with its bits alone.
    let model = Arc::new(nan_at_position_5());
    let (long, short) = ([1u32, 2, 3, 4], [7u32]);
    let alone = model.generate(&short, 4, Sampling::greedy()).unwrap();
    // The long prompt's stream steps position 4, then 5 at its third token.
    let pool = InferencePool::new(model.clone(), PoolConfig::direct(1)).unwrap();
    let batch = pool.stream_batch(2, carve::nn::serve::MAX_BATCH_WAIT).unwrap();
    // Both streams joined before either steps, so that their steps go together.
    let joined = std::sync::Barrier::new(2);
    let (failing, going_on) = std::thread::scope(|scope| {
        let (batch, joined) = (&batch, &joined);
        let other = scope.spawn(move || {
            let mut stream = batch.join(&long, Sampling::greedy()).unwrap();
            joined.wait();
            let drawn: Vec<carve::Result<u32>> = (0..3).map(|_| stream.next_token()).collect();
            (drawn, stream.next_token(), stream.window())
        });
        let mut stream = batch.join(&short, Sampling::greedy()).unwrap();
        joined.wait();
        let mut drawn: Vec<u32> = (0..3).map(|_| stream.next_token().unwrap()).collect();
        let failing = other.join().unwrap();
        // Alone in the batch now: the failed stream has left its slot.
        drawn.push(stream.next_token().unwrap());
        (failing, drawn)
    });
    let (drawn, later, window) = failing;
    assert!(drawn[0].is_ok() && drawn[1].is_ok(), "{drawn:?}");
    match &drawn[2] {
        Err(Error::InvalidInput(m)) => assert!(m.contains("NaN") && m.contains("this stream's step"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(later, Err(Error::InvalidInput(_))), "a failed stream stays failed: {later:?}");
    assert!(window.is_err(), "a failed stream's window is not read: {window:?}");
    assert_eq!(going_on, alone, "the stream beside it draws its tokens alone");
    // Streams stepped together by one caller go together: the call fails, naming the
    // stream, and so does every later one.
    let mut both = model.streams(&[&long, &short], &[Sampling::greedy(); 2]).unwrap();
    let mut out = [0u32; 2];
    both.next_tokens(&mut out).unwrap();
    both.next_tokens(&mut out).unwrap();
    match both.next_tokens(&mut out) {
        Err(Error::InvalidInput(m)) => assert!(m.contains("stream 0") && m.contains("NaN"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(both.next_tokens(&mut out), Err(Error::InvalidInput(m)) if m.contains("earlier step")));
}

#[test]
fn stream_slots_start_and_end_streams_between_steps_each_with_its_bits_alone() {
    let model = model(12, 5);
    // (prompt, sampling, tokens, the step from which it may start): more streams than
    // slots, so later ones start in the slots of those that ended, at other positions
    // than the streams beside them, and every stream slides (context 12).
    let jobs: Vec<(Vec<u32>, Sampling, usize, usize)> = vec![
        (vec![1, 2, 3], Sampling::greedy(), 30, 0),
        (vec![4], Sampling::random(0.9, 4, 1).unwrap(), 20, 5),
        (vec![5, 6], Sampling::random(1.0, 0, 2).unwrap(), 15, 6),
        (vec![7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7], Sampling::greedy(), 25, 9),
    ];
    let mut slots = model.stream_slots(2).unwrap();
    let mut out = slots.buffer();
    let (mut running, mut drawn) = (Vec::<(usize, usize)>::new(), vec![Vec::new(); jobs.len()]);
    let (mut next, mut step) = (0, 0);
    while next < jobs.len() || !running.is_empty() {
        while next < jobs.len() && jobs[next].3 <= step && slots.streams() < slots.slots() {
            let (prompt, sampling, _, _) = &jobs[next];
            running.push((next, slots.start(prompt, *sampling).unwrap()));
            next += 1;
        }
        if next < jobs.len() && jobs[next].3 <= step {
            // Every slot holds a stream: a start is refused, and nothing changes.
            let full = slots.start(&[1], Sampling::greedy());
            assert!(matches!(&full, Err(Error::InvalidInput(m)) if m.contains("all 2 slots")), "{full:?}");
        }
        slots.next_tokens(&mut out).unwrap();
        for &(job, slot) in &running {
            drawn[job].push(out[slot].take().unwrap().unwrap());
        }
        assert!(out.iter().all(Option::is_none), "a token for a slot without a stream: {out:?}");
        running.retain(|&(job, slot)| {
            let done = drawn[job].len() == jobs[job].2;
            if done {
                slots.end(slot).unwrap();
            }
            !done
        });
        step += 1;
    }
    for ((prompt, sampling, tokens, _), drawn) in jobs.iter().zip(&drawn) {
        assert_eq!(drawn, &model.generate(prompt, *tokens, *sampling).unwrap(), "{prompt:?}: its tokens alone");
    }
    // Bad calls are clear errors, and leave the slots as they were.
    assert_eq!(slots.streams(), 0);
    assert!(slots.start(&[13], Sampling::greedy()).is_err(), "a token beyond the vocabulary");
    assert!(slots.start(&[], Sampling::greedy()).is_err(), "an empty prompt");
    assert_eq!(slots.streams(), 0);
    assert!(matches!(slots.end(0), Err(Error::InvalidInput(_))));
    assert!(matches!(slots.window(1), Err(Error::InvalidInput(_))));
    assert!(matches!(slots.next_tokens(&mut out[..1]), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(model.stream_slots(0), Err(Error::InvalidInput(_))));
}

#[test]
fn a_stream_slot_that_fails_fails_alone_until_it_is_ended() {
    let pool = InferencePool::new(Arc::new(nan_at_position_5()), PoolConfig::direct(1)).unwrap();
    let model = pool.model();
    let mut slots = pool.stream_slots(2).unwrap();
    let (long, short) =
        (slots.start(&[1, 2, 3, 4], Sampling::greedy()).unwrap(), slots.start(&[7], Sampling::greedy()).unwrap());
    let mut out = slots.buffer();
    let mut drawn = Vec::new();
    for step in 0..4 {
        slots.next_tokens(&mut out).unwrap();
        drawn.push(out[short].take().unwrap().unwrap());
        let long_token = out[long].take().unwrap();
        match step {
            // The long stream's third token steps position 5.
            0 | 1 => assert!(long_token.is_ok(), "{long_token:?}"),
            _ => assert!(matches!(&long_token, Err(Error::InvalidInput(m)) if m.contains("NaN")), "{long_token:?}"),
        }
    }
    assert_eq!(drawn, model.generate(&[7], 4, Sampling::greedy()).unwrap(), "the stream beside it goes on");
    assert!(slots.window(long).is_err() && slots.logits(long).is_err());
    assert_eq!(slots.window(short).unwrap().len(), 4);
    // Ended, its slot starts the next stream.
    slots.end(long).unwrap();
    assert_eq!(slots.start(&[2], Sampling::greedy()).unwrap(), long);
    slots.next_tokens(&mut out).unwrap();
    assert_eq!(out[long].take().unwrap().unwrap(), model.generate(&[2], 1, Sampling::greedy()).unwrap()[0]);
}

static ARMED_SLOTS: AtomicBool = AtomicBool::new(false);

#[test]
fn a_panicking_step_fails_every_stream_slot_and_a_failed_prompt_leaves_its_slot_free() {
    let config = || {
        let b = NetworkConfig::builder(13).embedding(8).position_embedding(8).residual(|b| b.attention(2));
        b.layer(Tripwire(&ARMED_SLOTS)).dense(13).seed(2).build().unwrap()
    };
    let net = Network::new(config()).unwrap();
    let model = Model::from_config(&config(), net.params().to_vec()).unwrap();
    let mut slots = model.stream_slots(3).unwrap();
    let (a, b) = (slots.start(&[1, 2], Sampling::greedy()).unwrap(), slots.start(&[3], Sampling::greedy()).unwrap());
    let mut out = slots.buffer();
    slots.next_tokens(&mut out).unwrap();
    // A prompt whose pass panics: its start fails, and its slot stays free.
    ARMED_SLOTS.store(true, Ordering::Relaxed);
    let started = slots.start(&[4], Sampling::greedy());
    assert!(matches!(started, Err(Error::Panicked { .. })), "{started:?}");
    assert_eq!(slots.streams(), 2);
    // A step that panics fails both streams, each as a panic.
    let stepped = slots.next_tokens(&mut out);
    ARMED_SLOTS.store(false, Ordering::Relaxed);
    assert!(matches!(stepped, Err(Error::Panicked { .. })), "{stepped:?}");
    for slot in [a, b] {
        assert!(matches!(out[slot].take(), Some(Err(Error::Panicked { .. }))), "slot {slot}");
    }
    // Later steps say they failed, until they are ended; a new stream goes on as alone.
    let c = slots.start(&[5, 6], Sampling::greedy()).unwrap();
    slots.next_tokens(&mut out).unwrap();
    assert!(matches!(&out[a], Some(Err(Error::InvalidInput(m))) if m.contains("failed")), "{:?}", out[a]);
    assert_eq!(out[c].take().unwrap().unwrap(), model.generate(&[5, 6], 1, Sampling::greedy()).unwrap()[0]);
    slots.end(a).unwrap();
    slots.end(b).unwrap();
    assert_eq!(slots.streams(), 1);
}
