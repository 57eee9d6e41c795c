//! carve's character-level GPT against the same GPT in candle (`candle-nn`, AdamW),
//! trained in one process with the runs interleaved: nanoGPT's CPU "baby" shape (4
//! pre-LN blocks, 4 heads, width 128, context 64, batch 12, an untied head, no dropout)
//! on the Shakespeare corpus that `examples/train_gpt.rs` trains on.
//!
//! Both start from carve's initial weights: carve saves them under nanoGPT's names
//! (`Network::save`) and candle's `VarMap::load` reads that file into variables named
//! the same way, so the two models' first losses on the same batch agree to about 1e-5
//! (reported). Both see the same batches (random windows of the training split, from
//! one seed) in the same order and step with the same updater: AdamW (lr 1e-3, betas
//! 0.9/0.99, ε 1e-8) decaying the matrices by 0.1 and not the vectors — candle's AdamW
//! has no parameter groups, so it runs as two optimizers over the same gradients, one per
//! group, as PyTorch's parameter groups do.
//!
//! candle's model is written from candle's differentiable tensor operations: its fused
//! `layer_norm` and `softmax_last_dim` kernels have no backward pass, so a model that
//! trains composes them (`mean_keepdim`, `broadcast_div`, `candle_nn::ops::softmax`),
//! and `Tensor::gelu` is the tanh form carve uses.
//!
//! The steps run in rounds of a few steps each, one framework after the other, the
//! order alternating from round to round; the first round of each is not timed. Reports
//! each one's median step, carve's as a ratio of candle's, heap allocations per step
//! (all threads) and the losses.
//!
//! ```text
//! cargo bench --bench gpt_compare --features candle            # a table
//! cargo bench --bench gpt_compare --features candle -- --json  # and one JSON object
//! ```
//!
//! Flags: `--rounds N` (timed rounds, default 6), `--threads T` (1 or more, default 1:
//! carve's `Network::set_threads`, candle inside a rayon pool of `T` threads with
//! `RAYON_NUM_THREADS=T`, which its matrix multiply reads per call), `--attention
//! keep|recompute` (carve's attention form, default recompute), `--json`.

use std::io::Read;
use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{AdamW, Embedding, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use carve::alloc_check::{process_counts, CountingAllocator, Threads};
use carve::nn::{Input, Labels, Network, NetworkConfig, Updater};
use carve::WorkspaceMode;
use carve_rng::Rng;
use ndarray::Array2;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::system();

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const LAYERS: usize = 4;
const HEADS: usize = 4;
const WIDTH: usize = 128;
const CONTEXT: usize = 64;
const BATCH: usize = 12;
const LR: f32 = 1e-3;
const WEIGHT_DECAY: f32 = 0.1;
/// Steps per round.
const STEPS: usize = 5;

struct Args {
    rounds: usize,
    threads: usize,
    recompute: bool,
    json: bool,
}

fn args() -> Res<Args> {
    let mut args = Args { rounds: 6, threads: 1, recompute: true, json: false };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match flag.as_str() {
            "--rounds" => args.rounds = value("--rounds")?.parse()?,
            "--threads" => args.threads = value("--threads")?.parse()?,
            "--attention" => {
                args.recompute = match value("--attention")?.as_str() {
                    "recompute" => true,
                    "keep" => false,
                    other => return Err(format!("--attention is keep or recompute, not '{other}'").into()),
                }
            }
            "--json" => args.json = true,
            "--bench" => {} // what `cargo bench` passes
            other => return Err(format!("unknown flag '{other}'").into()),
        }
    }
    if args.rounds == 0 || args.threads == 0 || args.threads > 64 {
        return Err("--rounds must be at least 1 and --threads between 1 and 64".into());
    }
    Ok(args)
}

/// The corpus as token ids (the sorted distinct characters), the training split, and
/// the vocabulary's size.
fn corpus() -> Res<(Vec<u32>, usize)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/shakespeare.txt.gz");
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?)
        .read_to_string(&mut text)?;
    let mut chars: Vec<char> = text.chars().collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    chars.sort_unstable();
    let ids: Vec<u32> = text.chars().map(|c| chars.binary_search(&c).expect("in the vocabulary") as u32).collect();
    let split = ids.len() * 9 / 10;
    Ok((ids[..split].to_vec(), chars.len()))
}

/// `n` batches of random windows: inputs and the targets one step on.
fn batches(train: &[u32], n: usize, seed: u64) -> Vec<(Array2<u32>, Array2<u32>)> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| {
            let mut x = Array2::zeros((BATCH, CONTEXT));
            let mut y = Array2::zeros((BATCH, CONTEXT));
            for r in 0..BATCH {
                let start = rng.below(train.len() - CONTEXT - 1);
                for t in 0..CONTEXT {
                    x[[r, t]] = train[start + t];
                    y[[r, t]] = train[start + t + 1];
                }
            }
            (x, y)
        })
        .collect()
}

fn carve_net(vocab: usize, recompute: bool, threads: usize) -> Res<Network> {
    let mut b = NetworkConfig::builder(vocab).embedding(WIDTH).position_embedding(CONTEXT);
    for _ in 0..LAYERS {
        b = b.residual(|b| match recompute {
            true => b.layer_norm().attention_recompute(HEADS),
            false => b.layer_norm().attention(HEADS),
        });
        b = b.residual(|b| b.layer_norm().dense(4 * WIDTH).gelu().dense(WIDTH));
    }
    let config = b
        .layer_norm()
        .dense(vocab)
        .updater(Updater::AdamW {
            learning_rate: LR,
            beta1: 0.9,
            beta2: 0.99,
            epsilon: 1e-8,
            weight_decay: WEIGHT_DECAY,
        })
        .seed(0)
        .training_workspace_mode(WorkspaceMode::Enabled)
        .build()?;
    let mut net = Network::new(config)?;
    net.set_threads(threads)?;
    Ok(net)
}

/// A layer norm from candle's differentiable operations (its fused kernel has no
/// backward pass).
struct Norm {
    weight: Tensor,
    bias: Tensor,
}

impl Norm {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Norm> {
        let weight = vb.get_with_hints(WIDTH, "weight", candle_nn::Init::Const(1.0))?;
        let bias = vb.get_with_hints(WIDTH, "bias", candle_nn::Init::Const(0.0))?;
        Ok(Norm { weight, bias })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
        let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
        centred.broadcast_div(&(var + 1e-5)?.sqrt()?)?.broadcast_mul(&self.weight)?.broadcast_add(&self.bias)
    }
}

struct Block {
    ln_1: Norm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: Norm,
    c_fc: Linear,
    mlp_proj: Linear,
}

/// nanoGPT's model in candle, its variables under nanoGPT's names.
struct CandleGpt {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: Norm,
    lm_head: Linear,
    /// `[T, T]`: 0 on and below the diagonal, −∞ above.
    causal: Tensor,
    positions: Tensor,
}

impl CandleGpt {
    fn new(vocab: usize, vb: VarBuilder<'_>, device: &Device) -> candle_core::Result<CandleGpt> {
        let t = vb.pp("transformer");
        let blocks = (0..LAYERS)
            .map(|i| {
                let h = t.pp(format!("h.{i}"));
                Ok(Block {
                    ln_1: Norm::new(h.pp("ln_1"))?,
                    c_attn: candle_nn::linear(WIDTH, 3 * WIDTH, h.pp("attn.c_attn"))?,
                    attn_proj: candle_nn::linear(WIDTH, WIDTH, h.pp("attn.c_proj"))?,
                    ln_2: Norm::new(h.pp("ln_2"))?,
                    c_fc: candle_nn::linear(WIDTH, 4 * WIDTH, h.pp("mlp.c_fc"))?,
                    mlp_proj: candle_nn::linear(4 * WIDTH, WIDTH, h.pp("mlp.c_proj"))?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let causal: Vec<f32> =
            (0..CONTEXT * CONTEXT).map(|i| if i % CONTEXT <= i / CONTEXT { 0.0 } else { f32::NEG_INFINITY }).collect();
        Ok(CandleGpt {
            wte: candle_nn::embedding(vocab, WIDTH, t.pp("wte"))?,
            wpe: candle_nn::embedding(CONTEXT, WIDTH, t.pp("wpe"))?,
            blocks,
            ln_f: Norm::new(t.pp("ln_f"))?,
            lm_head: candle_nn::linear(WIDTH, vocab, vb.pp("lm_head"))?,
            causal: Tensor::from_vec(causal, (CONTEXT, CONTEXT), device)?,
            positions: Tensor::arange(0u32, CONTEXT as u32, device)?,
        })
    }

    /// Logits `[B·T, vocab]` of token ids `[B, T]`.
    fn logits(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let hd = WIDTH / HEADS;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut x = self.wte.forward(ids)?.broadcast_add(&self.wpe.forward(&self.positions)?)?;
        for blk in &self.blocks {
            let qkv = blk.c_attn.forward(&blk.ln_1.forward(&x)?)?;
            let head = |i: usize| -> candle_core::Result<Tensor> {
                qkv.narrow(2, i * WIDTH, WIDTH)?.reshape((b, t, HEADS, hd))?.transpose(1, 2)?.contiguous()
            };
            let (q, k, v) = (head(0)?, head(1)?, head(2)?);
            let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&self.causal)?;
            let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
            let y = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, WIDTH))?;
            x = (x + blk.attn_proj.forward(&y)?)?;
            let h = blk.c_fc.forward(&blk.ln_2.forward(&x)?)?.gelu()?;
            x = (x + blk.mlp_proj.forward(&h)?)?;
        }
        self.lm_head.forward(&self.ln_f.forward(&x)?)?.reshape((b * t, ()))
    }
}

/// candle's model and its two AdamW groups (matrices decayed, vectors not).
struct CandleRun {
    gpt: CandleGpt,
    decayed: AdamW,
    plain: AdamW,
    device: Device,
}

impl CandleRun {
    fn new(vocab: usize, weights: &Path) -> Res<CandleRun> {
        let device = Device::Cpu;
        let mut varmap = VarMap::new();
        let gpt = CandleGpt::new(vocab, VarBuilder::from_varmap(&varmap, DType::F32, &device), &device)?;
        varmap.load(weights)?;
        let (matrices, vectors): (Vec<_>, Vec<_>) = varmap.all_vars().into_iter().partition(|v| v.rank() >= 2);
        let params = |weight_decay: f32| ParamsAdamW {
            lr: f64::from(LR),
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: f64::from(weight_decay),
        };
        Ok(CandleRun {
            gpt,
            decayed: AdamW::new(matrices, params(WEIGHT_DECAY))?,
            plain: AdamW::new(vectors, params(0.0))?,
            device,
        })
    }

    fn step(&mut self, x: &Array2<u32>, y: &Array2<u32>) -> candle_core::Result<f32> {
        let ids = Tensor::from_slice(x.as_slice().expect("standard layout"), x.dim(), &self.device)?;
        let targets = Tensor::from_slice(y.as_slice().expect("standard layout"), y.len(), &self.device)?;
        let loss = candle_nn::loss::cross_entropy(&self.gpt.logits(&ids)?, &targets)?;
        let grads = loss.backward()?;
        self.decayed.step(&grads)?;
        self.plain.step(&grads)?;
        loss.to_scalar::<f32>()
    }
}

/// What one framework measured.
#[derive(Default)]
struct Outcome {
    step_ms: Vec<f64>,
    allocations: u64,
    steps_timed: u64,
    losses: Vec<f32>,
}

impl Outcome {
    fn median_ms(&self) -> f64 {
        let mut v = self.step_ms.clone();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    fn allocs_per_step(&self) -> f64 {
        self.allocations as f64 / self.steps_timed.max(1) as f64
    }
}

/// Runs `f` inside `pool`, with `RAYON_NUM_THREADS` set to its size for candle's
/// matrix multiply (nothing else reads the environment while this runs).
fn in_pool<T: Send>(pool: &rayon::ThreadPool, threads: usize, f: impl FnOnce() -> T + Send) -> T {
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    let out = pool.install(f);
    std::env::remove_var("RAYON_NUM_THREADS");
    out
}

fn main() -> Res<()> {
    let args = args()?;
    let (train, vocab) = corpus()?;
    let all = batches(&train, (args.rounds + 1) * STEPS, 1);
    let mut carve = carve_net(vocab, args.recompute, args.threads)?;
    let weights = std::env::temp_dir().join(format!("carve-gpt-compare-{}.safetensors", std::process::id()));
    carve.save(&weights)?;
    let candle = CandleRun::new(vocab, &weights);
    let _ = std::fs::remove_file(&weights);
    let mut candle = candle?;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(args.threads).build()?;
    let (mut c, mut p) = (Outcome::default(), Outcome::default());
    for round in 0..=args.rounds {
        let steps = &all[round * STEPS..(round + 1) * STEPS];
        for turn in 0..2 {
            let carve_turn = (turn + round) % 2 == 0;
            let out = if carve_turn { &mut c } else { &mut p };
            let before = process_counts(Threads::All).allocations;
            for (x, y) in steps {
                let start = Instant::now();
                let loss = if carve_turn {
                    carve.fit_batch(Input::tokens(x.view()), Labels::from(y.view()))?
                } else {
                    in_pool(&pool, args.threads, || candle.step(x, y))?
                };
                if round > 0 {
                    out.step_ms.push(start.elapsed().as_secs_f64() * 1e3);
                }
                out.losses.push(loss);
            }
            if round > 0 {
                out.allocations += process_counts(Threads::All).allocations - before;
                out.steps_timed += STEPS as u64;
            }
        }
    }
    let ratio = c.median_ms() / p.median_ms();
    println!(
        "GPT {LAYERS} layers × {HEADS} heads, width {WIDTH}, context {CONTEXT}, batch {BATCH}, AdamW: {} timed rounds \
         of {STEPS} steps, {} thread(s), carve's attention {}",
        args.rounds,
        args.threads,
        if args.recompute { "recomputed" } else { "kept" }
    );
    for (name, o) in [("carve", &c), ("candle", &p)] {
        println!(
            "{name:>7}: {:8.1} ms per step (median), {:9.1} heap allocations per step, loss first {:.5} last {:.4}",
            o.median_ms(),
            o.allocs_per_step(),
            o.losses[0],
            o.losses[o.losses.len() - 1]
        );
    }
    println!("carve / candle time per step: {ratio:.3}");
    if args.json {
        let json = serde_json::json!({
            "rounds": args.rounds,
            "steps_per_round": STEPS,
            "threads": args.threads,
            "attention": if args.recompute { "recompute" } else { "keep" },
            "carve_step_ms_median": c.median_ms(),
            "candle_step_ms_median": p.median_ms(),
            "step_time_ratio_carve_over_candle": ratio,
            "carve_allocs_per_step": c.allocs_per_step(),
            "candle_allocs_per_step": p.allocs_per_step(),
            "carve_first_loss": c.losses[0],
            "candle_first_loss": p.losses[0],
            "carve_last_loss": c.losses[c.losses.len() - 1],
            "candle_last_loss": p.losses[p.losses.len() - 1],
            "carve_losses": c.losses,
            "candle_losses": p.losses,
        });
        println!("{json}");
    }
    Ok(())
}
