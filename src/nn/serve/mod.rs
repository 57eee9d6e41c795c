//! Serving: a trained [`Network`](super::Network) frozen into a [`Model`] (weights held
//! once, `Send + Sync`, inference through `&self`), and an [`InferencePool`] of K
//! planned arenas that serves it to any number of threads, each request alone
//! ([`PoolMode::Direct`]) or coalesced with others ([`PoolMode::Batched`]).

mod arenas;
mod batcher;
mod model;
mod pool;

pub use model::Model;
pub use pool::{InferencePool, PoolConfig, PoolLease, PoolMode, PoolStats};
