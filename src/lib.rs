#![doc = include_str!("../README.md")]
//!
//! # Crate map
//!
//! | what | where |
//! |---|---|
//! | host workspaces: config, scopes, views, handles, the per-thread manager | the top level, from [`workspace_core`] |
//! | the DL4J layer API: [`WorkspaceMode`], [`ArrayType`], [`LayerWorkspaceMgr`] | the top level, from [`workspace_core`] |
//! | what backends are built from ([`workspace_core::Engine`], [`workspace_core::ArenaBackend`], ...) | [`workspace_core`] |
//! | prefetching batches ahead of the loop into a ring workspace | [`async_iter`] |
//! | device workspaces on CUDA (and a simulated device for tests), pinned staging | [`workspace_cuda`] |
//! | the reference network (dense, ReLU, softmax cross-entropy, SGD/Adam) | [`nn`] |
//! | arrays: the `ndarray` crate carve's views and owned arrays come from | [`ndarray`] |
//! | errors: the crates' errors and the network's own | [`Error`] |
//! | proving a step allocation-free: a counting allocator and a guard | [`CountingAllocator`], [`AllocationGuard`], [`assert_no_alloc`] |

#![deny(unsafe_code)]

mod error;
pub mod nn;

pub use async_iter;
pub use error::{Error, Result};
pub use ndarray;
pub use workspace_core;
pub use workspace_core::alloc_check;
pub use workspace_core::{
    assert_no_alloc, freeze, stats_table, AllocationError, AllocationGuard, AllocationPolicy, AllocationReport,
    ArrayType, CountingAllocator, DebugMode, Handle, LayerWorkspaceMgr, LayerWorkspaceMgrBuilder, LearningPolicy,
    Location, MappedFile, ResetPolicy, Scope, SpillPolicy, TypedScope, Workspace, WorkspaceArrayExt, WorkspaceConfig,
    WorkspaceConfigBuilder, WorkspaceManager, WorkspaceMode, WorkspaceStats, DEBUG_ENV, DEFAULT_ALIGNMENT,
    MAX_ALIGNMENT, MAX_TIMELINE_LEN,
};
pub use workspace_cuda;
