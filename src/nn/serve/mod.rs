//! Serving: a trained [`Network`](super::Network) frozen into a [`Model`] (weights held
//! once, `Send + Sync`, inference through `&self` in the calling thread's serving
//! workspaces), and an [`InferencePool`] of K planned arenas that serves it to any
//! number of threads, each request alone ([`PoolMode::Direct`]) or coalesced with
//! others ([`PoolMode::Batched`]); a language model's streams of generated tokens
//! ([`TokenStream`]: [`Model::stream`], [`InferencePool::stream`]), each with a
//! key/value cache sized before its first token, and independent callers' streams
//! stepped together ([`StreamBatch`]: [`InferencePool::stream_batch`]).
//!
//! The files, each depending only on those listed before it: `turns` (whose turn it is
//! with each of K arenas), `stack` (an arena's own call stack, opt-in), `arenas` (the K
//! planned arenas and their leases, and what their generation streams keep), `config`
//! (the pool's settings), `model` (the frozen model), `batcher` (batched mode's queue,
//! over the arenas and the model), `pool` (the pool and its leases), `combine` (flat
//! combining: independent callers' steps over one engine), `generate` (generation
//! streams, in the thread's arena or a pool's, and stream batches).

mod arenas;
pub(crate) mod combine;
// The batched mode's tickets live on their callers' stacks (see its module).
#[allow(unsafe_code)]
pub(crate) mod batcher;
mod config;
mod generate;
mod model;
mod pool;
// With `PoolConfig::arena_stacks`, requests run on their arena's own stack (see its module).
#[allow(unsafe_code)]
mod stack;
pub(crate) mod turns;

pub use config::{PoolConfig, PoolMode};
pub use generate::{BatchedStream, Sampling, StreamBatch, StreamSlots, TokenStream, MAX_BATCH_WAIT, MAX_CONTEXT};
pub use model::Model;
pub use pool::{InferencePool, PoolLease, PoolStats};
