//! Host workspaces for carve: reusable bump arenas for the temporary arrays of deep
//! learning loops.
//!
//! # A tour
//!
//! A [`Workspace`] is one arena plus its policies ([`WorkspaceConfig`]). Each training
//! iteration is a *cycle*: [`Workspace::enter`] opens it and returns a [`Scope`];
//! arrays allocated from the scope are ndarray views that borrow it; when the last
//! scope closes the arena is reset in O(1) and the next cycle reuses the memory.
//!
//! ```
//! use workspace_core::{Workspace, WorkspaceConfig, WorkspaceArrayExt};
//!
//! let ws = Workspace::new("ITERATION", WorkspaceConfig::default())?;
//! let mut losses = Vec::new();
//! for step in 0..10 {
//!     let scope = ws.enter()?;                       // a new cycle
//!     let x = scope.filled::<f32, _>((32, 64), step as f32)?;
//!     let mut h = scope.zeros::<f32, _>((32, 16))?;  // views tied to the cycle
//!     h.fill(x.mean().unwrap());
//!     losses.push(h.detach());                       // copy out what must survive
//! }                                                  // reset: O(1), no free
//! let stats = ws.stats();
//! assert_eq!(stats.cycles, 10);
//! assert_eq!(stats.learned_size, Some(10_240));      // learned in the first cycle
//! assert_eq!(stats.growth_events, 1);                // sized once, then reused
//! # Ok::<(), workspace_core::Error>(())
//! ```
//!
//! | concept | type |
//! |---|---|
//! | policies, validated once | [`WorkspaceConfig`], [`AllocationPolicy`], [`LearningPolicy`], [`SpillPolicy`], [`ResetPolicy`], [`Location`] |
//! | an arena and its cycles | [`Workspace`], [`Scope`] |
//! | arrays tied to the cycle | `ndarray::ArrayViewMut<'scope, T, D>` from [`Scope::zeros`] and friends |
//! | release points inside a cycle | [`Frame`] from [`Scope::frame`]: its bytes are reused once it closes |
//! | one arena planned for an iteration | [`planned::PlanGroup`], [`plan`] (`WorkspaceMode::Planned`) |
//! | arrays you can store | [`Handle`], checked against the generation on every access |
//! | copying out | [`WorkspaceArrayExt::detach`], [`WorkspaceArrayExt::leverage_to`] |
//! | per-thread registry | [`WorkspaceManager`], [`DebugMode`] |
//! | layers, as in DL4J | [`WorkspaceMode`], [`ArrayType`], [`LayerWorkspaceMgr`], [`TypedScope`] |
//! | where memory comes from | [`ArenaBackend`], [`HostBackend`]; the logic is [`Engine`] |
//! | std containers in a workspace | `allocator_api2::alloc::Allocator` for `&Scope` and `&Frame` |
//!
//! Use after reset does not compile for views; for handles it is an
//! [`Error::StaleHandle`] that names the workspace, both generations and the fix.

#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod alloc_api;
#[allow(unsafe_code)]
pub mod alloc_check;
mod array_ext;
#[allow(unsafe_code)]
pub mod backend;
mod config;
#[allow(unsafe_code)]
mod engine;
mod error;
mod figures;
#[allow(unsafe_code)]
mod handle;
pub mod layer;
mod manager;
pub mod plan;
#[allow(unsafe_code)]
pub mod planned;
mod refusals;
mod roles;
#[allow(unsafe_code)]
mod scope;
#[allow(unsafe_code)]
pub mod shell;
#[allow(unsafe_code)]
mod workspace;

pub use alloc_check::{assert_no_alloc, AllocationError, AllocationGuard, AllocationReport, CountingAllocator};
pub use array_ext::WorkspaceArrayExt;
pub use backend::host::{HostBackend, HostBlock};
pub use backend::{Address, ArenaBackend, Block};
pub use config::{
    AllocationPolicy, LearningPolicy, Location, MappedFile, ResetPolicy, SpillPolicy, WorkspaceConfig,
    WorkspaceConfigBuilder, DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_TIMELINE_LEN,
};
pub use engine::{Engine, Entered, FrameMark, WorkspaceStats};
pub use error::{BackendError, Error, Result};
pub use handle::Handle;
pub use layer::{ArrayType, LayerWorkspaceMgr, LayerWorkspaceMgrBuilder, TypedScope, WorkspaceMode};
pub use manager::{stats_table, WorkspaceManager};
pub use scope::{freeze, Frame, Scope};
pub use shell::{CycleHooks, Open, Placement, ScopeKind, Shell};
pub use workspace::{DebugMode, Workspace, DEBUG_ENV};
