#![doc = include_str!("../README.md")]
//!
//! # Crate map
//!
//! | what | where |
//! |---|---|
//! | host workspaces: config, scopes, views, handles, the per-thread manager | the top level, from [`workspace_core`] |
//! | the DL4J layer API: [`WorkspaceMode`], [`ArrayType`], [`LayerWorkspaceMgr`] | the top level, from [`workspace_core`] |
//! | what backends are built from ([`Engine`](workspace_core::backend::Engine), [`ArenaBackend`](workspace_core::backend::ArenaBackend), ...) | [`workspace_core::backend`] |
//! | plans and plan groups | [`workspace_core::plan`], [`workspace_core::planned`] |
//! | prefetching batches ahead of the loop into a ring workspace | [`Prefetcher`], and the rest of [`async_iter`] |
//! | a whole run's allocations, role by role and layer by layer (Chrome traces, memory reports) | [`Timeline`], and the rest of [`workspace_core::timeline`] |
//! | device workspaces on CUDA (and a simulated device for tests), pinned staging | [`workspace_cuda`] |
//! | networks: dense, ReLU, GELU, layer norm, embeddings, causal attention, LSTM and residual layers, softmax cross-entropy, SGD/Adam/AdamW; serving, text generation, data-parallel and device training | [`nn`] |
//! | checking a layer's gradients against central differences (DL4J's `GradientCheckUtil`) | [`nn::gradcheck`] |
//! | arrays: the `ndarray` crate carve's views and owned arrays come from | [`ndarray`] |
//! | errors: the crates' errors and the network's own | [`Error`] |
//! | proving a step allocation-free: a counting allocator and a guard | [`alloc_check`]: [`CountingAllocator`](alloc_check::CountingAllocator), [`AllocationGuard`](alloc_check::AllocationGuard), [`assert_no_alloc`](alloc_check::assert_no_alloc) |
//! | element types, for code generic over them | [`Pod`] (`bytemuck`'s, re-exported: no `bytemuck` dependency of your own needed) |

//!
//! # Code generic over element types
//!
//! Workspaces hold any [`Pod`] element type; the bound is named from carve alone:
//!
//! ```
//! use carve::{Pod, Workspace, WorkspaceConfig};
//!
//! /// Copies `values` into the cycle's arena and sums them there, for any element type.
//! fn summed<T: Pod + std::iter::Sum<T>>(ws: &Workspace, values: &[T]) -> carve::workspace_core::Result<T> {
//!     let scope = ws.enter()?;
//!     let copy = scope.copy_of(&carve::ndarray::ArrayView1::from(values))?;
//!     Ok(copy.iter().copied().sum())
//! }
//!
//! let ws = Workspace::new("SUM", WorkspaceConfig::default())?;
//! assert_eq!(summed(&ws, &[1_u32, 2, 3])?, 6);
//! assert_eq!(summed(&ws, &[0.5_f64, 0.25])?, 0.75);
//! # Ok::<(), carve::workspace_core::Error>(())
//! ```
#![deny(unsafe_code)]
// A link that does not resolve renders as literal brackets: an error, in private docs too.
#![deny(rustdoc::broken_intra_doc_links, rustdoc::private_intra_doc_links)]

mod error;
pub mod nn;

pub use async_iter;
pub use async_iter::Prefetcher;
pub use error::{Error, Result};
pub use ndarray;
pub use workspace_core;
pub use workspace_core::alloc_check;
pub use workspace_core::timeline::Timeline;
/// The former name of [`MAX_CYCLE_HISTORY`] (deprecated).
#[allow(deprecated)]
pub use workspace_core::MAX_TIMELINE_LEN;
pub use workspace_core::{
    freeze, stats_table, AllocationPolicy, ArrayType, DebugMode, Handle, LayerWorkspaceMgr, LayerWorkspaceMgrBuilder,
    LearningPolicy, Location, MappedFile, Pod, ResetPolicy, Scope, SpillPolicy, TypedScope, Workspace,
    WorkspaceArrayExt, WorkspaceConfig, WorkspaceConfigBuilder, WorkspaceManager, WorkspaceMode, WorkspaceStats,
    Zeroable, DEBUG_ENV, DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_CYCLE_HISTORY,
};
pub use workspace_cuda;
