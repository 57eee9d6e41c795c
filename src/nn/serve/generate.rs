//! Generation: a language model's streams of tokens, one step at a time, each stream's
//! keys and values kept in a cache sized before its first token.
//!
//! A stream starts from a prompt (one forward pass over it, its keys and values written
//! to the cache), then each [`TokenStream::next_token`] draws a token from the last
//! step's distribution and runs that one token through the layers ([`Layer::forward_stream`]:
//! attention reads the cache, a position embedding adds the token's position, the other
//! layers run their step alone). Every step runs in a planned arena (the calling
//! thread's serving arena for [`Model::stream`], a leased arena of an
//! [`InferencePool`](super::InferencePool) for its streams), keyed by the model and
//! the step's shape, so that once a shape has run a step allocates nothing.
//!
//! **The window.** A stream holds at most the model's context of steps (its position
//! embedding's). When the cache is full, the stream keeps its last `context / 2`
//! tokens (at least one), computes their keys and values again from position 0 (one
//! forward pass over them), and goes on: every token is drawn from at least
//! `context / 2` tokens of history, and a slide costs a pass over half a context every
//! half a context of tokens. (Shifting the cache in place is not an option with learned
//! positions: a kept token's keys depend on its position.)
//!
//! **Batches of streams.** [`TokenStreams`] steps several streams as one batch (each
//! product's rows are the streams); each stream's tokens are the bits it draws alone,
//! as every product computes a row the same whatever the rows beside it, and every
//! stream attends to its own cache.

use std::marker::PhantomData;
use std::time::Duration;

use carve_rng::Rng;
use ndarray::Axis;
use workspace_core::{ArrayType, LayerWorkspaceMgr};

use super::arenas::{StreamArena, StreamBuffers};
use super::combine::Combiner;
use super::model::{in_thread_arena, thread_arena_ready, Model, SERVING_PLANS};
use super::pool::InferencePool;
use crate::nn::layer::{Activations, StreamRow};
use crate::nn::residual::join_of;
use crate::nn::step::{self, StepLayers, Streams};
use crate::nn::Embedding;
use crate::{Error, Result};

/// How a stream draws its next token from the model's distribution.
///
/// ```
/// use carve::nn::serve::Sampling;
///
/// assert_eq!(Sampling::greedy().temperature(), 0.0);
/// let s = Sampling::random(0.8, 40, 7)?;
/// assert_eq!((s.top_k(), s.seed()), (40, 7));
/// assert!(Sampling::random(-1.0, 0, 7).is_err());
/// # Ok::<(), carve::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    temperature: f32,
    top_k: usize,
    seed: u64,
}

impl Sampling {
    /// The most probable token, always (the first of equals).
    pub fn greedy() -> Sampling {
        Sampling { temperature: 0.0, top_k: 0, seed: 0 }
    }

    /// A token drawn from the distribution of the logits divided by `temperature`,
    /// among the `top_k` most probable (0: among all), by a generator seeded with
    /// `seed` (nanoGPT's `generate`). A temperature of 0 is [`Sampling::greedy`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a temperature that is negative or not finite.
    pub fn random(temperature: f32, top_k: usize, seed: u64) -> Result<Sampling> {
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(Error::InvalidConfig {
                reason: format!("a sampling temperature of {temperature}: it must be finite and at least 0"),
            });
        }
        Ok(Sampling { temperature, top_k, seed })
    }

    /// The temperature (0: greedy).
    pub fn temperature(&self) -> f32 {
        self.temperature
    }

    /// Among how many of the most probable tokens a token is drawn (0: all).
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The seed of the stream's generator.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

/// The longest context a stream holds (a bound on what a layer's `max_steps` may say).
pub const MAX_CONTEXT: usize = 1 << 24;

/// Where a model's streams keep their state: per stream slot, each layer's region
/// ([`Layer::stream_state_len`](crate::nn::Layer::stream_state_len)).
#[derive(Clone, Debug)]
pub(crate) struct StatePlan {
    /// Each layer's values within a slot's.
    regions: Vec<std::ops::Range<usize>>,
    /// A slot's values.
    per_slot: usize,
    /// The most steps a stream holds.
    context: usize,
    vocabulary: usize,
}

impl StatePlan {
    /// The plan of `model`'s streams, or why it cannot generate.
    pub(crate) fn of(model: &Model) -> Result<StatePlan> {
        let layers = model.layers();
        let first: &dyn std::any::Any = layers[0].as_ref();
        if first.downcast_ref::<Embedding>().is_none() {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "the model cannot generate tokens: its first layer ('{}') is not a token embedding",
                    layers[0].name()
                ),
            });
        }
        let vocabulary = model.inputs();
        if model.classes() != vocabulary {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "the model cannot generate tokens: it reads {vocabulary} tokens but gives a distribution over {} \
                     classes",
                    model.classes()
                ),
            });
        }
        let context = layers.iter().filter_map(|l| l.max_steps()).min().ok_or_else(|| Error::InvalidConfig {
            reason: "the model cannot generate tokens: no layer bounds its context (a position embedding does)".into(),
        })?;
        if context == 0 || context > MAX_CONTEXT {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "the model cannot generate tokens: a context of {context} steps (a stream holds 1 to {MAX_CONTEXT})"
                ),
            });
        }
        let mut regions = Vec::with_capacity(layers.len());
        let mut per_slot = 0usize;
        for (i, layer) in layers.iter().enumerate() {
            let len = match join_of(layers, i) {
                Some(_) => 0,
                // A layer with state of its own per stream runs its own `forward_stream`.
                None if !layer.runs_in_stream() && layer.stream_state_len(model.layer_inputs(i), context)? == 0 => {
                    return Err(Error::InvalidConfig {
                        reason: format!(
                            "the model cannot generate tokens: layer '{}' cannot run token by token (its steps \
                             depend on each other, or it pools them, and it implements no `Layer::forward_stream`)",
                            layer.name()
                        ),
                    })
                }
                None => layer.stream_state_len(model.layer_inputs(i), context)?,
            };
            let end = per_slot
                .checked_add(len)
                .ok_or_else(|| Error::InvalidConfig { reason: "the model's per-stream state overflows".into() })?;
            regions.push(per_slot..end);
            per_slot = end;
        }
        per_slot
            .checked_mul(size_of::<f32>())
            .ok_or_else(|| Error::InvalidConfig { reason: "the model's per-stream state overflows".into() })?;
        Ok(StatePlan { regions, per_slot, context, vocabulary })
    }

    /// Whether `prompt` (prompt `i`) can start a stream: at least one token, all in the
    /// vocabulary.
    fn check_prompt(&self, i: usize, prompt: &[u32]) -> Result<()> {
        self.check_prompt_named(&format_args!("prompt {i}"), prompt)
    }

    /// [`StatePlan::check_prompt`], the prompt called `what` in the error.
    fn check_prompt_named(&self, what: &dyn std::fmt::Display, prompt: &[u32]) -> Result<()> {
        if prompt.is_empty() {
            return Err(Error::InvalidInput(format!("{what} is empty: a stream starts from at least one token")));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= self.vocabulary) {
            return Err(Error::InvalidInput(format!(
                "{what} holds token {bad}, outside the model's vocabulary of {} tokens",
                self.vocabulary
            )));
        }
        Ok(())
    }

    /// The bytes of one stream's state.
    pub(crate) fn bytes(&self) -> usize {
        self.per_slot * size_of::<f32>()
    }
}

/// Where a stream's steps run: the calling thread's serving arena (the streams' buffers
/// their own), or an arena leased from a pool for the streams' life (the buffers the
/// arena's).
#[derive(Debug)]
enum Arena<'a> {
    Thread(StreamBuffers),
    Leased(StreamArena<'a>),
}

impl Arena<'_> {
    /// The streams' buffers, at least `values` and `tokens` long.
    fn buffers(&mut self, values: usize, tokens: usize) -> Result<&mut StreamBuffers> {
        match self {
            Arena::Thread(buffers) => {
                buffers.fit(values, tokens)?;
                Ok(buffers)
            }
            Arena::Leased(guard) => guard.stream_buffers(values, tokens),
        }
    }

    /// The streams' buffers as they are.
    fn held(&self) -> &StreamBuffers {
        match self {
            Arena::Thread(buffers) => buffers,
            Arena::Leased(guard) => guard.streams(),
        }
    }

    /// The streams' buffers as they are, to write (fitted when the streams started).
    fn held_mut(&mut self) -> &mut StreamBuffers {
        match self {
            Arena::Thread(buffers) => buffers,
            Arena::Leased(guard) => guard.streams_mut(),
        }
    }

    /// Whether a step can run in the arena now (see [`thread_arena_ready`]; a leased
    /// arena always can).
    fn ready(&self) -> Result<()> {
        match self {
            Arena::Thread(_) => thread_arena_ready(),
            Arena::Leased(_) => Ok(()),
        }
    }

    /// Runs `f` in the arena with the buffers; `f` returns whether the step ran on its
    /// plan. A panic in `f` is [`Error::Panicked`].
    fn run(&mut self, f: &mut dyn FnMut(&LayerWorkspaceMgr, &mut StreamBuffers) -> Result<bool>) -> Result<()> {
        match self {
            Arena::Thread(buffers) => in_thread_arena(|mgr| f(mgr, buffers).map(|_| ())),
            Arena::Leased(guard) => guard.run_with_streams(|mgr, buffers| f(mgr, buffers).map(|on_plan| ((), on_plan))),
        }
    }
}

/// Where the streams' parts lie in their buffers: in `values`, every stream's cache,
/// then every stream's logits, then the weights each one's draws use; in `tokens`,
/// each stream's window (room for `context + 1`).
#[derive(Clone, Copy, Debug)]
struct Places {
    streams: usize,
    per_slot: usize,
    vocabulary: usize,
    window: usize,
}

/// Bytes a stream's bookkeeping takes beside its buffers, at most (its sampling and
/// generator, its slot in a batch): for the machine's bound in [`Places::of`].
const STREAM_BOOKKEEPING: u128 = 512;

impl Places {
    fn of(plan: &StatePlan, streams: usize) -> Result<Places> {
        let places = Places { streams, per_slot: plan.per_slot, vocabulary: plan.vocabulary, window: plan.context + 1 };
        let values = places.per_slot.checked_add(2 * places.vocabulary).and_then(|v| v.checked_mul(streams));
        let tokens = places.window.checked_mul(streams);
        let (v, t) = match (values, tokens) {
            (Some(v), Some(t)) if v.checked_mul(size_of::<f32>()).is_some() && t.checked_mul(4).is_some() => (v, t),
            _ => return Err(Error::InvalidInput(format!("the caches of {streams} streams overflow"))),
        };
        // An overcommitting kernel grants buffers beyond the machine, and kills the
        // process once their pages are written (they are zeroed at each start): refused
        // here, with each stream's bookkeeping beside its buffers.
        let bytes = (v as u128 + t as u128) * 4 + streams as u128 * STREAM_BOOKKEEPING;
        match crate::nn::limits::beyond_machine(bytes) {
            Some(machine) => Err(Error::InvalidInput(format!(
                "the caches, windows and logits of {streams} streams take {bytes} bytes, more than this machine's \
                 memory and swap ({machine} bytes)"
            ))),
            None => Ok(places),
        }
    }

    fn caches(&self) -> usize {
        self.streams * self.per_slot
    }

    fn values(&self) -> usize {
        self.caches() + 2 * self.streams * self.vocabulary
    }

    fn tokens(&self) -> usize {
        self.streams * self.window
    }

    fn logits(&self, s: usize) -> std::ops::Range<usize> {
        let at = self.caches() + s * self.vocabulary;
        at..at + self.vocabulary
    }

    fn window(&self, s: usize, len: usize) -> std::ops::Range<usize> {
        s * self.window..s * self.window + len
    }
}

/// Whether `prompts` drawn as `sampling` say can start streams of `model`: at least one
/// prompt, one sampling each, every prompt one that can start a stream, and their
/// buffers' sizes in range. Checked before an arena is taken, so that a call that
/// cannot start is refused at once rather than after a wait.
fn check_start(model: &Model, prompts: &[&[u32]], sampling: &[Sampling]) -> Result<()> {
    let plan = StatePlan::of(model)?;
    if prompts.is_empty() || prompts.len() != sampling.len() {
        return Err(Error::InvalidInput(format!(
            "{} prompts and {} samplings: give at least one prompt, and one sampling per prompt",
            prompts.len(),
            sampling.len()
        )));
    }
    for (i, prompt) in prompts.iter().enumerate() {
        plan.check_prompt(i, prompt)?;
    }
    Places::of(&plan, prompts.len()).map(|_| ())
}

/// One stream's state besides its buffers.
#[derive(Debug)]
struct Stream {
    /// Tokens in its window (the cache holds their keys and values).
    len: usize,
    /// The token drawn last, not yet run through the model.
    pending: Option<u32>,
    sampling: Sampling,
    rng: Rng,
    /// A value of its last step's logits that is not finite: the stream is over (its
    /// neighbours in the step are not).
    non_finite: Option<f32>,
}

impl Stream {
    fn new(len: usize, sampling: Sampling) -> Stream {
        Stream { len, pending: None, sampling, rng: Rng::new(sampling.seed), non_finite: None }
    }
}

/// The error of a stream whose logits hold `bad`.
fn non_finite_logits(bad: f32) -> Error {
    Error::InvalidInput(format!(
        "the model's logits hold {bad}: its weights or a layer give values that are not finite"
    ))
}

/// The next token from `logits`, as `sampling` says (`weights`: working space as long).
fn draw(sampling: Sampling, rng: &mut Rng, logits: &[f32], weights: &mut [f32]) -> u32 {
    let s = sampling;
    if s.temperature == 0.0 || s.top_k == 1 {
        return argmax(logits) as u32;
    }
    // Tokens below the k-th largest logit are not drawn (ties with it are).
    let floor = match s.top_k {
        k if k == 0 || k >= logits.len() => f32::NEG_INFINITY,
        k => kth_largest(logits, k, weights),
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for (w, &v) in weights.iter_mut().zip(logits) {
        let p = if v >= floor { (f64::from(v - max) / f64::from(s.temperature)).exp() } else { 0.0 };
        *w = p as f32;
        sum += f64::from(*w);
    }
    let mut u = f64::from(rng.next_f32()) * sum;
    let mut last = argmax(logits);
    for (i, &p) in weights.iter().enumerate() {
        if p > 0.0 {
            last = i;
            if u < f64::from(p) {
                return i as u32;
            }
            u -= f64::from(p);
        }
    }
    last as u32
}

/// The index of the largest value (the first of equals).
fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

/// The `k`-th largest of `values` (`1 <= k < values.len()`, counting equal values
/// apart; finite values), found in `scratch` (as long as `values`) in time linear in
/// their number, whatever `k`, without allocating.
fn kth_largest(values: &[f32], k: usize, scratch: &mut [f32]) -> f32 {
    let scratch = &mut scratch[..values.len()];
    scratch.copy_from_slice(values);
    // Largest first: position `k - 1` holds the k-th largest (equal values, `0.0` and
    // `-0.0` among them, compare equal in the draw's `>=`, so which of them lands
    // there does not matter).
    let (_, kth, _) = scratch.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    *kth
}

/// One or more streams of tokens from a language model ([`Model::stream`],
/// [`Model::streams`], [`InferencePool::stream`]), stepped together: each stream's
/// keys and values in its own slot of a cache of exactly [`Model::kv_cache_bytes`] per
/// stream, known before the first token, and every step run in a planned arena keyed by
/// the model and the step's shape, so that a token allocates nothing once its step's
/// shape has run in the arena. A pool's stream keeps its cache, window and logits in its leased arena,
/// which the arena's next streams reuse (the pool holds K of them, whatever the number
/// of callers); a stream of [`Model::stream`] holds its own. Dropping it ends the
/// streams (and gives back a leased arena).
///
/// **The window.** A stream holds at most the model's context of tokens (its position
/// embedding's). When the cache is full, the stream keeps its last `context / 2` tokens
/// (at least one), runs them again from position 0, and goes on: every token is drawn
/// from at least `context / 2` tokens of history, and a slide costs a pass over half a
/// context every half a context of tokens. (Shifting the cache in place is not an
/// option with learned positions: a kept token's keys depend on its position.)
///
/// A step that fails (a panic in a layer, a workspace error) fails the streams: their
/// caches may be half written, so every later call says so instead of drawing from
/// them.
///
/// ```
/// use carve::nn::{serve::Sampling, Network, NetworkConfig};
///
/// let config = NetworkConfig::builder(10)
///     .embedding(8)
///     .position_embedding(6)
///     .residual(|b| b.layer_norm().attention(2))
///     .layer_norm()
///     .dense(10)
///     .seed(3)
///     .build()?;
/// let model = Network::new(config)?.freeze()?;
/// let mut stream = model.stream(&[1, 2, 3], Sampling::greedy())?;
/// let tokens: Vec<u32> = (0..8).map(|_| stream.next_token()).collect::<Result<_, _>>()?;
/// assert_eq!(tokens, model.generate(&[1, 2, 3], 8, Sampling::greedy())?);
/// assert_eq!(stream.kv_cache_bytes(), model.kv_cache_bytes()?);
/// # Ok::<(), carve::Error>(())
/// ```
///
/// A stream stays on the thread that started it:
///
/// ```compile_fail
/// fn send<T: Send>() {}
/// send::<carve::nn::serve::TokenStream<'static>>();
/// ```
pub struct TokenStream<'a> {
    engine: Engine<'a>,
    /// A stream stays on the thread that started it (it is not `Send`): a pool's stream
    /// holds its arena, and the pool's turns record that thread as the arena's holder, to
    /// refuse a wait of its own for it.
    on_its_thread: PhantomData<std::sync::MutexGuard<'static, ()>>,
}

/// The streams' state and their arena: a [`TokenStream`]'s, or a [`StreamBatch`]'s
/// (which runs it on whichever caller's thread combines a step).
struct Engine<'a> {
    model: &'a Model,
    arena: Arena<'a>,
    plan: StatePlan,
    places: Places,
    streams: Vec<Stream>,
    /// The rows of a step (room for every stream).
    rows: Vec<StreamRow>,
    /// Why an earlier step failed. Only a [`TokenStream`] reads it (its streams go
    /// together); stream batches and stream slots keep each stream's failure with the
    /// stream, and a step that failed as a whole with each slot.
    failed: Option<String>,
}

impl std::fmt::Debug for TokenStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.engine.fmt(f)
    }
}

impl std::fmt::Debug for Engine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStream")
            .field("streams", &self.streams.len())
            .field("context", &self.plan.context)
            .field("leased", &matches!(self.arena, Arena::Leased(_)))
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl<'a> TokenStream<'a> {
    fn of(engine: Engine<'a>) -> TokenStream<'a> {
        TokenStream { engine, on_its_thread: PhantomData }
    }

    /// The streams stepped together.
    pub fn streams(&self) -> usize {
        self.engine.streams()
    }

    /// The most tokens a stream's cache holds (the model's context).
    pub fn context(&self) -> usize {
        self.engine.context()
    }

    /// The bytes of one stream's cache ([`Model::kv_cache_bytes`]).
    pub fn kv_cache_bytes(&self) -> usize {
        self.engine.kv_cache_bytes()
    }

    /// The logits stream `s`'s last token was drawn from (before its first token: those
    /// its first token will be drawn from).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when there is no stream `s`, or after a failed step (what
    /// the buffers hold then is not the streams' state).
    pub fn logits(&self, s: usize) -> Result<&[f32]> {
        self.engine.logits(s)
    }

    /// The tokens stream `s`'s cache holds (the window its next token attends to,
    /// which ends with the token it drew last once that has run through the model).
    ///
    /// # Errors
    ///
    /// As [`TokenStream::logits`].
    pub fn window(&self, s: usize) -> Result<&[u32]> {
        self.engine.window(s)
    }

    /// The next token of the one stream.
    ///
    /// # Errors
    ///
    /// As [`TokenStream::next_tokens`]; [`Error::InvalidInput`] when there are several
    /// streams.
    pub fn next_token(&mut self) -> Result<u32> {
        self.engine.next_token()
    }

    /// The next token of every stream, into `out` (one per stream): the token drawn
    /// last is run through the model (the streams that need it sliding their window
    /// first, in one step; the others in one step, a row each), and a token drawn from
    /// each stream's distribution.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] when `out` does not hold one token per stream;
    /// [`Error::Panicked`] when a layer panics; workspace errors; [`Error::InvalidInput`]
    /// when a stream's logits are not finite (the error names the stream). These fail
    /// the streams: every later call is an [`Error::InvalidInput`] saying so. A step
    /// that cannot run at all changes nothing, and the streams go on at the next call:
    /// an [`Error::InvalidInput`] when the calling thread is inside another request of
    /// a model (a stream of [`Model::stream`] steps in the thread's serving arena) or
    /// ending.
    pub fn next_tokens(&mut self, out: &mut [u32]) -> Result<()> {
        self.engine.next_tokens(out)
    }
}

/// The most prompt lengths whose plans a stream arena keeps beside its token steps'
/// (a plan is a few KiB of bookkeeping; a model of a longer context plans its rarer
/// prompt lengths again).
const PROMPT_PLANS: usize = 512;

impl<'a> Engine<'a> {
    /// Streams of `model` from `prompts` (each cut to its last `context` tokens), each
    /// drawn as its `sampling` says, run in `arena`: their buffers fitted, and every
    /// prompt run through the model. The caller has checked them ([`check_start`]), before
    /// it took the arena.
    fn start(model: &'a Model, arena: Arena<'a>, prompts: &[&[u32]], sampling: &[Sampling]) -> Result<Engine<'a>> {
        let mut started = Engine::vacant(model, arena, prompts.len())?;
        for (s, (prompt, &sampling)) in prompts.iter().zip(sampling).enumerate() {
            started.start_slot(s, prompt, sampling)?;
        }
        Ok(started)
    }

    /// `slots` streams of `model` in `arena`, none started: their buffers fitted.
    fn vacant(model: &'a Model, arena: Arena<'a>, slots: usize) -> Result<Engine<'a>> {
        let plan = StatePlan::of(model)?;
        let places = Places::of(&plan, slots)?;
        let mut arena = arena;
        arena.buffers(places.values(), places.tokens())?;
        let streams = (0..slots).map(|_| Stream::new(0, Sampling::greedy()));
        Ok(Engine {
            model,
            arena,
            plan,
            places,
            streams: streams.collect(),
            rows: Vec::with_capacity(slots),
            failed: None,
        })
    }

    /// Starts stream `s` afresh from `prompt` (its last `context` tokens), drawn as
    /// `sampling` says: its cache zeroed (an arena's earlier streams leave their values,
    /// and no stream reads another's, whatever a layer reads), then the prompt run
    /// through the model.
    fn start_slot(&mut self, s: usize, prompt: &[u32], sampling: Sampling) -> Result<()> {
        self.plan.check_prompt(s, prompt)?;
        let (places, per_slot) = (self.places, self.plan.per_slot);
        let buffers = self.arena.held_mut();
        buffers.values[s * per_slot..(s + 1) * per_slot].fill(0.0);
        let kept = &prompt[prompt.len().saturating_sub(self.plan.context)..];
        buffers.tokens[places.window(s, kept.len())].copy_from_slice(kept);
        self.streams[s] = Stream::new(kept.len(), sampling);
        self.rows.clear();
        self.rows.push(StreamRow { slot: s, position: 0 });
        self.step(kept.len())?;
        match self.streams[s].non_finite {
            Some(bad) => Err(non_finite_logits(bad)),
            None => Ok(()),
        }
    }

    /// The streams stepped together.
    fn streams(&self) -> usize {
        self.streams.len()
    }

    /// The most tokens a stream's cache holds (the model's context).
    fn context(&self) -> usize {
        self.plan.context
    }

    /// The bytes of one stream's cache ([`Model::kv_cache_bytes`]).
    fn kv_cache_bytes(&self) -> usize {
        self.plan.bytes()
    }

    /// The logits stream `s`'s last token was drawn from (before its first token: those
    /// its first token will be drawn from).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when there is no stream `s`, or after a failed step (what
    /// the buffers hold then is not the streams' state).
    fn logits(&self, s: usize) -> Result<&[f32]> {
        self.check_stream(s)?;
        Ok(self.logits_of(s))
    }

    /// Stream `s`'s logits as the buffers hold them.
    fn logits_of(&self, s: usize) -> &[f32] {
        &self.arena.held().values[self.places.logits(s)]
    }

    /// The tokens stream `s`'s cache holds (the window its next token attends to,
    /// which ends with the token it drew last once that has run through the model).
    ///
    /// # Errors
    ///
    /// As [`TokenStream::logits`].
    fn window(&self, s: usize) -> Result<&[u32]> {
        self.check_stream(s)?;
        Ok(self.window_of(s))
    }

    /// Stream `s`'s window as the buffers hold it.
    fn window_of(&self, s: usize) -> &[u32] {
        &self.arena.held().tokens[self.places.window(s, self.streams[s].len)]
    }

    /// Whether stream `s` is there to read.
    fn check_stream(&self, s: usize) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(Error::InvalidInput(format!(
                "these streams failed at an earlier step ({why}); their buffers hold no stream's state"
            )));
        }
        if s >= self.streams.len() {
            return Err(Error::InvalidInput(format!("there is no stream {s} of {}", self.streams.len())));
        }
        Ok(())
    }

    /// The next token of the one stream.
    ///
    /// # Errors
    ///
    /// As [`TokenStream::next_tokens`]; [`Error::InvalidInput`] when there are several
    /// streams.
    fn next_token(&mut self) -> Result<u32> {
        let mut token = [0];
        if self.streams.len() != 1 {
            return Err(Error::InvalidInput(format!(
                "next_token steps one stream; these are {}: use next_tokens",
                self.streams.len()
            )));
        }
        self.next_tokens(&mut token)?;
        Ok(token[0])
    }

    /// The next token of every stream, into `out` (one per stream): the token drawn
    /// last is run through the model (the streams that need it sliding their window
    /// first, in one step; the others in one step, a row each), and a token drawn from
    /// each stream's distribution.
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] when `out` does not hold one token per stream;
    /// [`Error::Panicked`] when a layer panics; workspace errors; and, once a step has
    /// failed, [`Error::InvalidInput`] saying so.
    fn next_tokens(&mut self, out: &mut [u32]) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(Error::InvalidInput(format!(
                "these streams failed at an earlier step ({why}); their caches may be half written: start new streams"
            )));
        }
        if out.len() != self.streams.len() {
            return Err(Error::ShapeMismatch {
                context: "tokens out of a step of streams (one per stream)".into(),
                expected: vec![self.streams.len()],
                actual: vec![out.len()],
            });
        }
        // A step that cannot run (its thread inside another request, or ending) is
        // refused before any stream changes.
        self.arena.ready()?;
        // The streams go together: one's failure is theirs.
        let mut failure = None;
        self.advance(&|_| true, &mut |s, token| match token {
            Ok(token) => out[s] = token,
            Err(e) => {
                failure.get_or_insert_with(|| Error::InvalidInput(format!("stream {s}: {e}")));
            }
        })?;
        match failure {
            Some(e) => {
                self.failed = Some(e.to_string());
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// [`TokenStream::next_tokens`] of the streams `member` says (the others untouched),
    /// each stream's token to `out`, or its own failure: logits that are not finite
    /// (its neighbours in the step go on). A failed stream is not stepped again. The
    /// caller has asked [`Arena::ready`] (a leased arena always is): a step that fails
    /// as a whole here may have moved its streams on.
    fn advance(&mut self, member: &dyn Fn(usize) -> bool, out: &mut dyn FnMut(usize, Result<u32>)) -> Result<()> {
        // The streams asked for that have not failed run; every stream asked for gets
        // its token or its failure.
        let asked = member;
        let member = |s: usize, stream: &Stream| asked(s) && stream.non_finite.is_none();
        let (context, places) = (self.plan.context, self.places);
        let keep = (context / 2).max(1);
        // The drawn tokens into the windows: the streams whose cache is full slide their
        // window (one step together: every slide keeps as many tokens), the others take
        // one step together.
        let buffers = self.arena.held_mut();
        self.rows.clear();
        for (s, stream) in self.streams.iter_mut().enumerate().filter(|(s, stream)| member(*s, stream)) {
            let Some(token) = stream.pending.filter(|_| stream.len == context) else { continue };
            let window = &mut buffers.tokens[places.window(s, context + 1)];
            window[context] = token;
            window.copy_within(context + 1 - keep.., 0);
            stream.len = keep;
            stream.pending = None;
            self.rows.push(StreamRow { slot: s, position: 0 });
        }
        if !self.rows.is_empty() {
            self.step(keep)?;
        }
        let buffers = self.arena.held_mut();
        self.rows.clear();
        for (s, stream) in self.streams.iter_mut().enumerate().filter(|(s, stream)| member(*s, stream)) {
            if let Some(token) = stream.pending.take() {
                self.rows.push(StreamRow { slot: s, position: stream.len });
                buffers.tokens[places.window(s, context + 1)][stream.len] = token;
                stream.len += 1;
            }
        }
        if !self.rows.is_empty() {
            self.step(1)?;
        }
        let buffers = self.arena.held_mut();
        let (logits, weights) = buffers.values[places.caches()..].split_at_mut(places.streams * places.vocabulary);
        let per = places.vocabulary;
        for (s, stream) in self.streams.iter_mut().enumerate().filter(|&(s, _)| asked(s)) {
            if let Some(bad) = stream.non_finite {
                out(s, Err(non_finite_logits(bad)));
                continue;
            }
            let (logits, weights) = (&logits[s * per..(s + 1) * per], &mut weights[s * per..(s + 1) * per]);
            let token = draw(stream.sampling, &mut stream.rng, logits, weights);
            stream.pending = Some(token);
            out(s, Ok(token));
        }
        Ok(())
    }

    /// One step of the rows in `self.rows`, each taking the last `steps` tokens of its
    /// window: their caches and logits. A failure fails the streams; logits that are
    /// not finite fail their stream alone (its `non_finite`).
    fn step(&mut self, steps: usize) -> Result<()> {
        let Engine { model, arena, plan, places, streams, rows, failed } = self;
        let (n, places) = (rows.len(), *places);
        // The plan of a step is keyed by the model and the step's shape.
        let key =
            (model.id().wrapping_mul(0x0100_0000_01b3) ^ 0x5354_5245_414d_0000) ^ ((n as u64) << 24 | steps as u64);
        // Every shape of step the streams take keeps its plan (one a prompt length,
        // one a count of streams stepped together, one a count sliding together), beside
        // the arena's other requests': no token's step is planned again. (Prompt lengths
        // past `PROMPT_PLANS` share the room left: the least recently used plan goes.)
        let prompts = plan.context.min(PROMPT_PLANS);
        let plans = SERVING_PLANS.saturating_add(prompts).saturating_add(places.streams.saturating_mul(2));
        let mut f = |mgr: &LayerWorkspaceMgr, buffers: &mut StreamBuffers| {
            let group = mgr.plan_group().expect("serving arenas are planned");
            group.keep_plans(plans);
            let ((), on_plan) = group.iteration(key, || {
                let act = mgr.enter(ArrayType::Activations)?;
                let mut ids = act.zeros::<f32, _>((n, steps, 1))?;
                let (cache, rest) = buffers.values.split_at_mut(places.caches());
                for (row, mut ids) in rows.iter().zip(ids.outer_iter_mut()) {
                    let len = streams[row.slot].len;
                    let new = &buffers.tokens[places.window(row.slot, len)][len - steps..];
                    for (v, &id) in ids.iter_mut().zip(new) {
                        *v = id as f32;
                    }
                }
                let mut layers = StepLayers {
                    layers: model.layers(),
                    params: model.layout(),
                    values: model.params(),
                    grads: None,
                    tapes: None,
                    streams: Some(Streams {
                        values: cache,
                        per_slot: plan.per_slot,
                        regions: &plan.regions,
                        rows,
                        context: plan.context,
                    }),
                };
                let input = Activations::Sequence(workspace_core::freeze(ids));
                let out = step::forward(&mut layers, mgr, &act, input, None, (false, None), &mut 0, |_, _| Ok(()))?;
                let logits = out.sequence("the model's output")?;
                if logits.dim() != (n, steps, plan.vocabulary) {
                    return Err(Error::ShapeMismatch {
                        context: "a generation step's logits [streams, new steps, vocabulary]".into(),
                        expected: vec![n, steps, plan.vocabulary],
                        actual: logits.shape().to_vec(),
                    });
                }
                for (row, last) in rows.iter().zip(logits.index_axis(Axis(1), steps - 1).outer_iter()) {
                    let bad = last.iter().copied().find(|v| !v.is_finite());
                    streams[row.slot].non_finite = bad;
                    if bad.is_some() {
                        continue;
                    }
                    let at = places.logits(row.slot).start - places.caches();
                    rest[at..at + places.vocabulary].iter_mut().zip(last).for_each(|(o, &v)| *o = v);
                }
                Ok(())
            })?;
            Ok(on_plan)
        };
        let result = arena.run(&mut f);
        if let Err(e) = &result {
            *failed = Some(e.to_string());
        }
        result
    }
}

impl Model {
    /// The most tokens a stream of this model holds at once (its position embedding's
    /// context), when it can generate.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] saying why the model cannot generate tokens: its first
    /// layer is not a token embedding, its output is not a distribution over its
    /// vocabulary, or no layer bounds its context (or the bound is 0 or past
    /// [`MAX_CONTEXT`]).
    pub fn context(&self) -> Result<usize> {
        StatePlan::of(self).map(|plan| plan.context)
    }

    /// The bytes of one stream's cache (every attention layer's keys and values for
    /// [`Model::context`] tokens), known before the first token: a stream's cache is
    /// exactly this (besides it, a stream keeps its logits and the weights its draws use,
    /// two floats per token of the vocabulary, and its window, `context + 1` tokens).
    ///
    /// # Errors
    ///
    /// As [`Model::context`].
    pub fn kv_cache_bytes(&self) -> Result<usize> {
        StatePlan::of(self).map(|plan| plan.bytes())
    }

    /// A stream of tokens from `prompt`, drawn as `sampling` says, its steps run in the
    /// calling thread's serving arena (see [`TokenStream`]).
    ///
    /// # Errors
    ///
    /// As [`Model::context`]; [`Error::InvalidInput`] for an empty prompt or a token
    /// outside the vocabulary; the errors of the prompt's pass.
    pub fn stream(&self, prompt: &[u32], sampling: Sampling) -> Result<TokenStream<'_>> {
        self.streams(&[prompt], &[sampling])
    }

    /// Streams from several prompts, stepped together (each product's rows are the
    /// streams); each stream's tokens are those it draws alone.
    ///
    /// # Errors
    ///
    /// As [`Model::stream`]; [`Error::InvalidInput`] when `sampling` does not hold one
    /// sampling per prompt.
    pub fn streams(&self, prompts: &[&[u32]], sampling: &[Sampling]) -> Result<TokenStream<'_>> {
        check_start(self, prompts, sampling)?;
        Engine::start(self, Arena::Thread(StreamBuffers::default()), prompts, sampling).map(TokenStream::of)
    }

    /// `tokens` tokens generated from `prompt` (a [`Model::stream`] stepped `tokens`
    /// times).
    ///
    /// # Errors
    ///
    /// As [`Model::stream`]; [`Error::InvalidInput`] for 0 tokens, or more than memory
    /// can hold the tokens of (refused before the prompt runs).
    pub fn generate(&self, prompt: &[u32], tokens: usize, sampling: Sampling) -> Result<Vec<u32>> {
        if tokens == 0 {
            return Err(Error::InvalidInput("0 tokens to generate: ask for at least 1".into()));
        }
        // Room for every token before the prompt runs: a count no memory holds is an
        // error now, not an abort once the stream has run that far.
        let mut out = Vec::new();
        out.try_reserve_exact(tokens).map_err(|_| {
            Error::InvalidInput(format!(
                "{tokens} tokens to generate: more than memory holds ({} bytes)",
                tokens.saturating_mul(4)
            ))
        })?;
        let mut stream = self.stream(prompt, sampling)?;
        for _ in 0..tokens {
            out.push(stream.next_token()?);
        }
        Ok(out)
    }
}

impl Model {
    /// The model with the text symbol of each of its tokens (`symbols`' characters, in
    /// token order; a character-level model's vocabulary), so that it reads and writes
    /// text ([`Model::encode`], [`Model::decode`]); [`Model::save`] keeps them in the
    /// file's metadata (`carve.symbols`) and [`Model::load`] gives them back.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when `symbols` does not hold one character per input
    /// token, or holds a character twice.
    pub fn with_symbols(mut self, symbols: &str) -> Result<Model> {
        let chars: Vec<char> = symbols.chars().collect();
        if chars.len() != self.inputs() {
            return Err(Error::InvalidConfig {
                reason: format!("{} symbols for a model of {} input tokens", chars.len(), self.inputs()),
            });
        }
        let mut sorted: Vec<(char, u32)> = chars.iter().zip(0u32..).map(|(&c, t)| (c, t)).collect();
        sorted.sort_unstable();
        if let Some(pair) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::InvalidConfig { reason: format!("the symbol {:?} stands for two tokens", pair[0].0) });
        }
        self.symbols = Some(chars.into());
        self.symbol_tokens = Some(sorted.into());
        Ok(self)
    }

    /// The text symbol of each token, when the model has them ([`Model::with_symbols`]).
    pub fn symbols(&self) -> Option<&[char]> {
        self.symbols.as_deref()
    }

    /// The tokens of `text`, one per character.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] naming the first character that is not a symbol of the
    /// model, or when the model has no symbols.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let symbols = self.symbols_or_error()?;
        let tokens = self.symbol_tokens.as_deref().unwrap_or_default();
        text.chars()
            .enumerate()
            .map(|(i, c)| {
                tokens.binary_search_by_key(&c, |&(s, _)| s).map(|at| tokens[at].1).map_err(|_| {
                    Error::InvalidInput(format!(
                        "character {i} of the text, {c:?}, is not one of the model's {} symbols",
                        symbols.len()
                    ))
                })
            })
            .collect()
    }

    /// The text of `tokens`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for a token outside the vocabulary, or when the model has
    /// no symbols.
    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        let symbols = self.symbols_or_error()?;
        tokens
            .iter()
            .map(|&t| {
                symbols.get(t as usize).copied().ok_or_else(|| {
                    Error::InvalidInput(format!("token {t} is outside the model's vocabulary of {}", symbols.len()))
                })
            })
            .collect()
    }

    fn symbols_or_error(&self) -> Result<&[char]> {
        self.symbols().ok_or_else(|| {
            Error::InvalidInput(
                "the model has no text symbols (Model::with_symbols; a model trained by train_gpt --save has them)"
                    .into(),
            )
        })
    }
}

impl InferencePool {
    /// A stream of tokens of the pool's model from `prompt` (see [`Model::stream`]),
    /// its steps run in an arena leased for the stream's life (waiting while every
    /// arena is in use): K arenas serve K streams at once, whatever the number of
    /// callers, in the weights plus K × (an arena's plans and a stream's cache). In a
    /// batched pool too: the stream's arena is then leased away from the batch workers
    /// for the stream's life (its steps are its own, not coalesced with other callers').
    ///
    /// # Errors
    ///
    /// As [`Model::stream`] and [`InferencePool::lease`].
    pub fn stream(&self, prompt: &[u32], sampling: Sampling) -> Result<TokenStream<'_>> {
        self.streams(&[prompt], &[sampling])
    }

    /// Streams from several prompts stepped together (see [`Model::streams`]) in one
    /// leased arena. An arena keeps the largest stream buffers it has held (as its
    /// workspaces keep their plans), for its next streams: many streams in one arena
    /// hold their caches' bytes there for the pool's life
    /// ([`PoolStats::stream_bytes`](super::PoolStats::stream_bytes) says how many).
    ///
    /// # Errors
    ///
    /// As [`Model::streams`] and [`InferencePool::lease`].
    pub fn streams(&self, prompts: &[&[u32]], sampling: &[Sampling]) -> Result<TokenStream<'_>> {
        let model: &Model = self.model();
        // A call that cannot start is refused before it waits for an arena.
        check_start(model, prompts, sampling)?;
        Engine::start(model, Arena::Leased(self.lease()?.into_streams()), prompts, sampling).map(TokenStream::of)
    }

    /// [`InferencePool::stream`], waiting at most `timeout` for an arena.
    ///
    /// # Errors
    ///
    /// As [`InferencePool::stream`]; [`Error::Timeout`] when no arena came free in
    /// time.
    pub fn stream_timeout(&self, prompt: &[u32], sampling: Sampling, timeout: Duration) -> Result<TokenStream<'_>> {
        let model: &Model = self.model();
        check_start(model, &[prompt], &[sampling])?;
        let lease = self.lease_timeout(timeout)?.into_streams();
        Engine::start(model, Arena::Leased(lease), &[prompt], &[sampling]).map(TokenStream::of)
    }
}

/// The longest a stream batch's step may wait for the streams that have not queued
/// theirs ([`InferencePool::stream_batch`]'s `max_wait`): a stream whose caller is slow
/// (or gone, its stream forgotten) delays every step of the batch by as much.
pub const MAX_BATCH_WAIT: Duration = Duration::from_secs(1);

/// Streams of independent callers stepped together: one arena leased from an
/// [`InferencePool`] for the batch's life, holding `slots` streams' caches, which any
/// thread [joins](StreamBatch::join) with a prompt of its own. Each
/// [`BatchedStream::next_token`] queues its stream's step; once every stream has queued
/// (or a while after the first did: see [`InferencePool::stream_batch`]), the caller
/// that finds the arena idle runs every queued stream's step as one batch (each product's rows are the
/// streams, as [`Model::streams`] steps them) and hands each caller its token, so that
/// callers that arrive while a step runs share the next one (flat combining: no thread
/// of the pool's own, no allocation per token). Each stream draws the tokens it draws
/// alone, bit for bit, whoever it is batched with.
///
/// Memory: the weights, plus the arena's plans for batches of up to `slots` streams,
/// plus `slots` caches ([`Model::kv_cache_bytes`] each), whatever the number of
/// callers. A stream that is dropped frees its slot for the next caller; a failed step
/// fails the streams of its batch (each says why at its next call) and the batch goes
/// on.
///
/// Each stream is best stepped from a thread of its own: a step waits (at most
/// `max_wait`) for every stream of the batch to queue its step, but for the streams of
/// a thread that is itself waiting for a step (the thread that joined with a stream, or
/// last stepped it). One thread stepping several streams of a batch in turn so runs each
/// step at once, each alone ([`Model::streams`] steps one caller's streams together, in
/// one batch). A batch is `Sync`, not
/// `Send`: it stays with the thread that made it, and its callers share it by reference
/// (scoped threads, as below).
///
/// ```compile_fail
/// fn send<T: Send>() {}
/// send::<carve::nn::serve::StreamBatch<'static>>(); // a batch is not Send
/// ```
///
/// ```
/// use carve::nn::serve::{InferencePool, PoolConfig, Sampling};
/// use carve::nn::{Network, NetworkConfig};
/// use std::sync::Arc;
/// use std::time::Duration;
///
/// let config = NetworkConfig::builder(10)
///     .embedding(8)
///     .position_embedding(16)
///     .residual(|b| b.layer_norm().attention(2))
///     .layer_norm()
///     .dense(10)
///     .seed(3)
///     .build()?;
/// let model = Arc::new(Network::new(config)?.freeze()?);
/// let pool = InferencePool::new(model.clone(), PoolConfig::direct(1))?;
/// let batch = pool.stream_batch(4, Duration::from_millis(1))?;
/// // Four callers, each with its own prompt, stepped together.
/// let tokens: Vec<Vec<u32>> = std::thread::scope(|scope| {
///     let callers: Vec<_> = (0..4u32)
///         .map(|i| {
///             let batch = &batch;
///             scope.spawn(move || {
///                 let mut stream = batch.join(&[i, 1, 2], Sampling::greedy())?;
///                 (0..8).map(|_| stream.next_token()).collect::<carve::Result<Vec<u32>>>()
///             })
///         })
///         .collect();
///     callers.into_iter().map(|c| c.join().unwrap()).collect::<carve::Result<_>>()
/// })?;
/// for (i, tokens) in (0..4u32).zip(&tokens) {
///     assert_eq!(tokens, &model.generate(&[i, 1, 2], 8, Sampling::greedy())?);
/// }
/// # Ok::<(), carve::Error>(())
/// ```
pub struct StreamBatch<'p> {
    combiner: Combiner<Engine<'p>>,
    plan: StatePlan,
    /// A batch stays on the thread that made it (it is `Sync`, not `Send`: its callers
    /// share it by reference): the pool's turns record that thread as its arena's
    /// holder, to refuse a wait of its own for it.
    on_its_thread: PhantomData<std::sync::MutexGuard<'static, ()>>,
}

impl std::fmt::Debug for StreamBatch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamBatch")
            .field("slots", &self.slots())
            .field("streams", &self.streams())
            .field("context", &self.plan.context)
            .finish_non_exhaustive()
    }
}

impl InferencePool {
    /// A batch of `slots` streams that independent callers join (see [`StreamBatch`]),
    /// in an arena leased for the batch's life (waiting while every arena is in use). A
    /// step of the batch runs once every stream it holds has queued its step, or
    /// `max_wait` after the first was queued, whichever comes first: a caller that is
    /// slow to ask for its next token delays the others by about `max_wait`, and steps
    /// the batch without it (`Duration::ZERO`: a step runs whenever the arena is idle,
    /// with whatever is queued then). A step queued while the arena does other work (a
    /// join's prompt, a read of a stream's window) past its `max_wait` waits for the
    /// others `max_wait` more from then, once, so that the batch does not split: a
    /// step waits at most twice `max_wait` and that work. A step does not wait for the
    /// streams of a thread that is waiting for a step itself (see [`StreamBatch`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for 0 slots, slots whose caches cannot be held, or a
    /// `max_wait` beyond [`MAX_BATCH_WAIT`]; as
    /// [`Model::stream`] for a model that cannot generate; as [`InferencePool::lease`].
    pub fn stream_batch(&self, slots: usize, max_wait: Duration) -> Result<StreamBatch<'_>> {
        if slots == 0 {
            return Err(Error::InvalidInput("a stream batch of 0 slots holds no stream: give at least 1".into()));
        }
        if max_wait > MAX_BATCH_WAIT {
            return Err(Error::InvalidInput(format!(
                "a stream batch's step waits at most {MAX_BATCH_WAIT:?} for streams that have not asked for their next \
                 token, not {max_wait:?}"
            )));
        }
        let model: &Model = self.model();
        let plan = StatePlan::of(model)?;
        Places::of(&plan, slots)?;
        let engine = Engine::vacant(model, Arena::Leased(self.lease()?.into_streams()), slots)?;
        Ok(StreamBatch { combiner: Combiner::new(engine, slots, max_wait), plan, on_its_thread: PhantomData })
    }
}

impl<'p> StreamBatch<'p> {
    /// A stream from `prompt` in a free slot (waiting while every slot is in use), its
    /// prompt run through the model: see [`Model::stream`].
    ///
    /// # Errors
    ///
    /// As [`Model::stream`]; [`Error::InvalidInput`] when every slot holds a stream
    /// this thread joined with or last stepped (its own, or forgotten ones) and none
    /// came free in a second, rather than waiting for good for a slot only this thread
    /// could free (a stream handed to another thread is that thread's once it steps
    /// there; [`StreamBatch::join_timeout`] waits its timeout whoever holds them).
    pub fn join(&self, prompt: &[u32], sampling: Sampling) -> Result<BatchedStream<'_, 'p>> {
        self.join_by(prompt, sampling, None)
    }

    /// [`StreamBatch::join`], waiting at most `timeout` for a free slot.
    ///
    /// # Errors
    ///
    /// As [`StreamBatch::join`]; [`Error::BatchFull`] when no slot came free in time.
    pub fn join_timeout(&self, prompt: &[u32], sampling: Sampling, timeout: Duration) -> Result<BatchedStream<'_, 'p>> {
        self.join_by(prompt, sampling, Some(timeout))
    }

    fn join_by(&self, prompt: &[u32], sampling: Sampling, timeout: Option<Duration>) -> Result<BatchedStream<'_, 'p>> {
        // A prompt that cannot start a stream is refused before it waits for a slot.
        self.plan.check_prompt_named(&"the prompt", prompt)?;
        let waited = async_iter::sync::Stopwatch::start();
        let deadline = timeout.map(async_iter::sync::Deadline::after);
        let Some(slot) = self.combiner.reserve(deadline)? else {
            return Err(Error::BatchFull { slots: self.slots(), waited: waited.elapsed() });
        };
        // From here the slot is the stream's: dropped, it is free again. It is this
        // thread's until another steps it: this thread's steps do not wait for it.
        let stream = BatchedStream { batch: self, slot };
        self.combiner.claim(slot);
        // A failure is this stream's alone: the others' caches are as they were.
        self.combiner.with_engine(|engine| engine.start_slot(slot, prompt, sampling))?;
        Ok(stream)
    }

    /// The streams the batch holds at most.
    pub fn slots(&self) -> usize {
        self.combiner.slots()
    }

    /// The streams it holds now.
    pub fn streams(&self) -> usize {
        self.combiner.in_use()
    }

    /// The most tokens a stream's cache holds (the model's context).
    pub fn context(&self) -> usize {
        self.plan.context
    }

    /// The bytes of one stream's cache ([`Model::kv_cache_bytes`]).
    pub fn kv_cache_bytes(&self) -> usize {
        self.plan.bytes()
    }
}

/// One caller's stream in a [`StreamBatch`]; its slot is free again once it is
/// dropped.
pub struct BatchedStream<'b, 'p> {
    batch: &'b StreamBatch<'p>,
    slot: usize,
}

impl std::fmt::Debug for BatchedStream<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchedStream").field("slot", &self.slot).finish_non_exhaustive()
    }
}

impl BatchedStream<'_, '_> {
    /// The stream's next token: its step queued, and run with every other stream's
    /// that is queued when the batch's arena is free (by this caller or another).
    ///
    /// # Errors
    ///
    /// [`Error::Panicked`] when a layer panicked in a step of its batch, or
    /// [`Error::InvalidInput`] saying which step failed, or that the stream's logits were
    /// not finite (its failure alone: the other streams of the step go on): then and at
    /// every later call (the stream's cache may be half written: join again).
    pub fn next_token(&mut self) -> Result<u32> {
        self.batch.combiner.next(self.slot, &mut |engine, members, tokens| {
            // The batch's streams fail with it (the combiner says so at each one's next
            // call), and a stream whose logits are not finite alone; the others' caches
            // are as they were, so the engine goes on.
            engine.advance(&|s| members[s], &mut |s, token| tokens[s] = Some(token))
        })
    }

    /// The tokens the stream's cache holds (see [`TokenStream::window`]). Copied out,
    /// once the batch's step that runs (if one does) is over.
    ///
    /// # Errors
    ///
    /// As [`BatchedStream::next_token`], once a step has failed.
    pub fn window(&self) -> Result<Vec<u32>> {
        // A failed batch's streams are refused by the combiner; the others' state is
        // theirs whatever failed beside them.
        self.batch.combiner.with_slot(self.slot, |engine| Ok(engine.window_of(self.slot).to_vec()))
    }

    /// The logits the stream's last token was drawn from (see [`TokenStream::logits`]),
    /// copied out as [`BatchedStream::window`] is.
    ///
    /// # Errors
    ///
    /// As [`BatchedStream::window`].
    pub fn logits(&self) -> Result<Vec<f32>> {
        self.batch.combiner.with_slot(self.slot, |engine| Ok(engine.logits_of(self.slot).to_vec()))
    }
}

impl Drop for BatchedStream<'_, '_> {
    fn drop(&mut self) {
        self.batch.combiner.leave(self.slot);
    }
}

/// Streams that start and end at any step, all stepped together by one caller
/// (continuous batching, as serving stacks schedule generation): a fixed number of
/// slots in one arena, each slot's cache planned before its first token, and one
/// [`StreamSlots::next_tokens`] running every started stream's next step as one batch,
/// whatever position each is at. A server's one thread can so keep an arena busy with
/// every request it holds, with no thread per stream and no wake-up per token (a
/// [`StreamBatch`] serves callers that each step their own stream).
///
/// Each stream draws the bits it draws alone ([`Model::stream`]). A stream whose logits
/// are not finite fails alone; a step that fails as a whole (a panicking layer) fails
/// every stream the slots hold (a step may run as two passes, the streams that slide
/// their window and the others: a stream's cache is not trusted after either failed).
/// A failed stream answers its error until it is ended; its slot then starts the next
/// stream.
///
/// Like [`TokenStream`], it stays on the thread that made it (it is not `Send`):
///
/// ```compile_fail
/// fn send<T: Send>() {}
/// send::<carve::nn::serve::StreamSlots<'static>>();
/// ```
///
/// ```
/// use carve::nn::serve::Sampling;
/// use carve::nn::{Network, NetworkConfig};
///
/// let config = NetworkConfig::builder(10)
///     .embedding(8)
///     .position_embedding(16)
///     .residual(|b| b.layer_norm().attention(2))
///     .layer_norm()
///     .dense(10)
///     .seed(3)
///     .build()?;
/// let model = Network::new(config)?.freeze()?;
/// let mut slots = model.stream_slots(2)?;
/// let first = slots.start(&[1, 2, 3], Sampling::greedy())?;
/// let mut out = slots.buffer();
/// slots.next_tokens(&mut out)?;
/// // A second stream joins at the next step, the first goes on.
/// let second = slots.start(&[4], Sampling::greedy())?;
/// let mut drawn = (vec![out[first].take().unwrap()?], Vec::new());
/// for _ in 0..5 {
///     slots.next_tokens(&mut out)?;
///     drawn.0.push(out[first].take().unwrap()?);
///     drawn.1.push(out[second].take().unwrap()?);
/// }
/// assert_eq!(drawn.0, model.generate(&[1, 2, 3], 6, Sampling::greedy())?);
/// assert_eq!(drawn.1, model.generate(&[4], 5, Sampling::greedy())?);
/// slots.end(first)?; // its slot is free for the next stream
/// # Ok::<(), carve::Error>(())
/// ```
pub struct StreamSlots<'a> {
    engine: Engine<'a>,
    slots: Vec<SlotState>,
    on_its_thread: PhantomData<std::sync::MutexGuard<'static, ()>>,
}

/// Where a slot of [`StreamSlots`] stands.
#[derive(Debug)]
enum SlotState {
    Vacant,
    Active,
    /// Why its stream failed.
    Failed(String),
}

impl std::fmt::Debug for StreamSlots<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSlots")
            .field("slots", &self.slots.len())
            .field("streams", &self.streams())
            .field("context", &self.engine.context())
            .finish_non_exhaustive()
    }
}

impl Model {
    /// [`StreamSlots`] of `slots` slots in this thread's serving arena.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for 0 slots or slots whose caches cannot be held; as
    /// [`Model::stream`] for a model that cannot generate.
    pub fn stream_slots(&self, slots: usize) -> Result<StreamSlots<'_>> {
        StreamSlots::check(self, slots)?;
        StreamSlots::new(self, Arena::Thread(StreamBuffers::default()), slots)
    }
}

impl InferencePool {
    /// [`StreamSlots`] of `slots` slots in an arena leased for their life (waiting
    /// while every arena is in use).
    ///
    /// # Errors
    ///
    /// As [`Model::stream_slots`] and [`InferencePool::lease`].
    pub fn stream_slots(&self, slots: usize) -> Result<StreamSlots<'_>> {
        let model: &Model = self.model();
        StreamSlots::check(model, slots)?;
        StreamSlots::new(model, Arena::Leased(self.lease()?.into_streams()), slots)
    }
}

impl<'a> StreamSlots<'a> {
    /// The slots' count and the model checked before an arena is taken.
    fn check(model: &Model, slots: usize) -> Result<()> {
        if slots == 0 {
            return Err(Error::InvalidInput("stream slots of 0 slots hold no stream: give at least 1".into()));
        }
        Places::of(&StatePlan::of(model)?, slots).map(|_| ())
    }

    /// Slots in `arena`, [`StreamSlots::check`]ed by the caller.
    fn new(model: &'a Model, arena: Arena<'a>, slots: usize) -> Result<StreamSlots<'a>> {
        let engine = Engine::vacant(model, arena, slots)?;
        Ok(StreamSlots { engine, slots: (0..slots).map(|_| SlotState::Vacant).collect(), on_its_thread: PhantomData })
    }

    /// The slots.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// A buffer for [`StreamSlots::next_tokens`]: an entry per slot, all `None`.
    pub fn buffer(&self) -> Vec<Option<Result<u32>>> {
        std::iter::repeat_with(|| None).take(self.slots.len()).collect()
    }

    /// The streams started and not ended (failed ones included).
    pub fn streams(&self) -> usize {
        self.slots.iter().filter(|s| !matches!(s, SlotState::Vacant)).count()
    }

    /// The most tokens a stream's cache holds (the model's context).
    pub fn context(&self) -> usize {
        self.engine.context()
    }

    /// The bytes of one stream's cache ([`Model::kv_cache_bytes`]).
    pub fn kv_cache_bytes(&self) -> usize {
        self.engine.kv_cache_bytes()
    }

    /// Starts a stream from `prompt` (its last `context` tokens), drawn as `sampling`
    /// says, in a free slot: its prompt run through the model now, its first token
    /// drawn at the next [`StreamSlots::next_tokens`]. Returns the slot.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when every slot holds a stream; as [`Model::stream`] for
    /// the prompt (the slot stays free).
    pub fn start(&mut self, prompt: &[u32], sampling: Sampling) -> Result<usize> {
        let Some(slot) = self.slots.iter().position(|s| matches!(s, SlotState::Vacant)) else {
            return Err(Error::InvalidInput(format!(
                "all {} slots hold a stream: end one before starting another",
                self.slots.len()
            )));
        };
        self.engine.start_slot(slot, prompt, sampling)?;
        self.slots[slot] = SlotState::Active;
        Ok(slot)
    }

    /// Ends the stream in `slot` (failed or not): the slot is free for the next.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when the slot holds no stream.
    pub fn end(&mut self, slot: usize) -> Result<()> {
        match self.slots.get(slot) {
            Some(SlotState::Active | SlotState::Failed(_)) => {
                self.slots[slot] = SlotState::Vacant;
                Ok(())
            }
            _ => Err(self.no_stream(slot)),
        }
    }

    /// The next token of every started stream, as one step: `out[slot]` gets
    /// `Some(Ok(token))`, `Some(Err(why))` for a stream that failed (at this step or
    /// before), and `None` for a free slot. Nothing is allocated but an error's message,
    /// once the step's shape has been planned (how many streams step together, one
    /// token or a slide: the first step of each shape plans it).
    ///
    /// # Errors
    ///
    /// [`Error::ShapeMismatch`] when `out` does not hold one entry per slot; a failure
    /// of the whole step ([`Error::Panicked`] for a panicking layer, workspace errors),
    /// which fails every stream the slots hold (each one's `out` entry says so too, a
    /// panic as [`Error::Panicked`]). A step that cannot run at all (slots of
    /// [`Model::stream_slots`] stepped from inside another request of a model on the
    /// same thread, or while it ends) is an [`Error::InvalidInput`] that changes
    /// nothing: the started streams' entries are `None`, and they go on at the next
    /// call.
    pub fn next_tokens(&mut self, out: &mut [Option<Result<u32>>]) -> Result<()> {
        if out.len() != self.slots.len() {
            return Err(Error::ShapeMismatch {
                context: "tokens out of a step of stream slots (one entry per slot)".into(),
                expected: vec![self.slots.len()],
                actual: vec![out.len()],
            });
        }
        let StreamSlots { engine, slots, .. } = self;
        for (s, (out, slot)) in out.iter_mut().zip(slots.iter()).enumerate() {
            *out = match slot {
                SlotState::Failed(why) => Some(Err(failed_earlier(s, why))),
                SlotState::Vacant | SlotState::Active => None,
            };
        }
        // A step that cannot run changes nothing: the streams go on at the next call.
        engine.arena.ready()?;
        // (The engine's `failed`, which `Engine::next_tokens` reads, is not read here: each
        // slot keeps its own failure.)
        let active = |s: usize| matches!(slots[s], SlotState::Active);
        let stepped = engine.advance(&active, &mut |s, token| out[s] = Some(token));
        if let Err(e) = stepped {
            let why = e.to_string();
            for (s, (out, slot)) in out.iter_mut().zip(slots.iter_mut()).enumerate() {
                if matches!(slot, SlotState::Active) {
                    // The step's own error for each of its streams: a panic stays one.
                    *out = Some(Err(match &e {
                        Error::Panicked { message } => Error::Panicked { message: message.clone() },
                        _ => failed_earlier(s, &why),
                    }));
                    *slot = SlotState::Failed(why.clone());
                }
            }
            return Err(e);
        }
        for (out, slot) in out.iter().zip(slots.iter_mut()) {
            if let (Some(Err(e)), SlotState::Active) = (out, &slot) {
                *slot = SlotState::Failed(e.to_string());
            }
        }
        Ok(())
    }

    /// The tokens the cache of the stream in `slot` holds (see [`TokenStream::window`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when the slot holds no stream, or one that failed.
    pub fn window(&self, slot: usize) -> Result<&[u32]> {
        self.check_active(slot)?;
        Ok(self.engine.window_of(slot))
    }

    /// The logits the last token of the stream in `slot` was drawn from (see
    /// [`TokenStream::logits`]).
    ///
    /// # Errors
    ///
    /// As [`StreamSlots::window`].
    pub fn logits(&self, slot: usize) -> Result<&[f32]> {
        self.check_active(slot)?;
        Ok(self.engine.logits_of(slot))
    }

    fn check_active(&self, slot: usize) -> Result<()> {
        match self.slots.get(slot) {
            Some(SlotState::Active) => Ok(()),
            Some(SlotState::Failed(why)) => Err(failed_earlier(slot, why)),
            _ => Err(self.no_stream(slot)),
        }
    }

    fn no_stream(&self, slot: usize) -> Error {
        Error::InvalidInput(format!("slot {slot} of {} holds no stream", self.slots.len()))
    }
}

/// The error of the stream in `slot`, which failed as `why` says.
fn failed_earlier(slot: usize, why: &str) -> Error {
    Error::InvalidInput(format!("the stream in slot {slot} failed ({why}); end it and start a new one"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kth_largest_is_the_sorted_values_kth_with_ties_counted_apart() {
        let mut rng = Rng::new(7);
        for n in [2usize, 3, 10, 77, 1000] {
            // Few distinct values, so that ties (and both zeros) are common.
            let values: Vec<f32> = (0..n)
                .map(|_| match (rng.next_f32() * 9.0) as i32 - 4 {
                    0 if rng.next_f32() < 0.5 => -0.0,
                    v => v as f32 * 0.5,
                })
                .collect();
            let mut sorted = values.clone();
            sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
            let mut scratch = vec![f32::NAN; n];
            for k in 1..n {
                let kth = kth_largest(&values, k, &mut scratch);
                assert_eq!(kth, sorted[k - 1], "n {n}, k {k}");
                // As many values at or above it as the draw keeps.
                let kept = values.iter().filter(|&&v| v >= kth).count();
                assert_eq!(kept, sorted.iter().filter(|&&v| v >= sorted[k - 1]).count(), "n {n}, k {k}");
                assert!(kept >= k, "n {n}, k {k}");
            }
        }
    }
}
