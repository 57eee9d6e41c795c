//! Serving: a trained [`Network`](super::Network) frozen into a [`Model`] (weights held
//! once, `Send + Sync`, inference through `&self`), and an [`InferencePool`] of K
//! planned arenas that serves it to any number of threads, each request alone
//! ([`PoolMode::Direct`]) or coalesced with others ([`PoolMode::Batched`]).

mod arenas;
// The batched mode's tickets live on their callers' stacks (see its module).
#[allow(unsafe_code)]
pub(crate) mod batcher;
mod model;
mod pool;
// Requests run on their arena's own stack (see its module).
#[allow(unsafe_code)]
mod stack;
pub(crate) mod turns;

pub use model::Model;
pub use pool::{InferencePool, PoolConfig, PoolLease, PoolMode, PoolStats};
