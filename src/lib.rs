//! carve: workspace (arena) memory for deep-learning loops.
//!
//! Training loops allocate the same temporary arrays every iteration. carve carves
//! them out of reusable bump arenas ("workspaces"), resets the arena in O(1) at the
//! end of each iteration, and lets [`WorkspaceArrayExt::detach`] copy results out into
//! owned arrays. Misuse is a compile error where the API allows it, and a clear error
//! otherwise.
//!
//! | what | where |
//! |---|---|
//! | host workspaces: config, scopes, views, handles, the per-thread manager | re-exported from [`workspace_core`] |
//! | the DL4J layer API: [`WorkspaceMode`], [`ArrayType`], [`LayerWorkspaceMgr`] | re-exported from [`workspace_core`] |
//! | prefetching batches ahead of the loop into a ring workspace | re-exported as [`async_iter`] |
//! | device workspaces on CUDA (and a simulated device for tests), pinned staging | re-exported as [`workspace_cuda`] |
//! | the reference network (dense, ReLU, softmax cross-entropy, SGD/Adam) | [`nn`] |
//!
//! ```
//! use carve::{Workspace, WorkspaceConfig, WorkspaceArrayExt};
//!
//! let ws = Workspace::new("TRAIN", WorkspaceConfig::default())?;
//! let mut kept = Vec::new();
//! for step in 0..100 {
//!     let scope = ws.enter()?;
//!     let activations = scope.filled::<f32, _>((32, 128), step as f32)?;
//!     let grads = scope.zeros::<f32, _>((32, 128))?;
//!     if step % 50 == 0 {
//!         kept.push((&activations + &grads).detach());
//!     }
//! }
//! assert_eq!(kept.len(), 2);
//! assert_eq!(ws.stats().growth_events, 1); // sized once, from the first iteration
//! # Ok::<(), carve::Error>(())
//! ```

#![deny(unsafe_code)]

pub mod nn;

pub use async_iter;
pub use workspace_core;
pub use workspace_core::*;
pub use workspace_cuda;

/// The README's examples, compiled and run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
