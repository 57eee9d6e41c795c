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
//! | where memory comes from (for backend authors) | [`backend`]: [`ArenaBackend`](backend::ArenaBackend), [`HostBackend`](backend::HostBackend); the logic is [`Engine`](backend::Engine) |
//! | proving a step allocation-free | [`alloc_check`]: [`CountingAllocator`](alloc_check::CountingAllocator), [`AllocationGuard`](alloc_check::AllocationGuard) |
//! | element types | any [`Pod`] (`bytemuck`'s, re-exported) |
//! | std containers in a workspace | `allocator_api2::alloc::Allocator` for `&Scope` and `&Frame` |
//!
//! Use after reset does not compile for views; for handles it is an
//! [`Error::StaleHandle`] that names the workspace, both generations and the fix.
//!
//! # Two tiers
//!
//! The root holds what a user of workspaces needs. What a backend author needs (the
//! [`Engine`](backend::Engine), the [`Shell`](backend::Shell), [`ArenaBackend`](backend::ArenaBackend) and
//! the host backend) is in [`backend`]; the planner's internals (events, lifetimes,
//! traces) in [`plan`]; plan groups in [`planned`]; the counting allocator that proves
//! a step allocation-free in [`alloc_check`]. Each item has one path.
//!
//! # Layers, as DL4J users know them
//!
//! A network maps each role an array can play ([`ArrayType`]) to a named workspace,
//! or to no workspace at all, in a [`LayerWorkspaceMgr`]. It opens the workspaces as
//! the roles require ([`LayerWorkspaceMgr::enter`] gives a [`TypedScope`]) and hands
//! the open scopes to its layers. A layer allocates from the scope of the role the
//! array plays; views borrow that scope, so an array cannot outlive the cycle of its
//! role, and a function signature can say which role it returns:
//!
//! ```
//! use ndarray::ArrayView2;
//! use workspace_core::{freeze, ArrayType, LayerWorkspaceMgr, Result, TypedScope, WorkspaceConfig};
//!
//! /// A layer's forward pass: the output must outlive the working memory.
//! fn forward<'a>(x: ArrayView2<'a, f32>, out: &'a TypedScope, working: &TypedScope) -> Result<ArrayView2<'a, f32>> {
//!     let mut tmp = working.zeros::<f32, _>(x.raw_dim())?; // reset after this layer
//!     tmp.assign(&x);
//!     tmp.mapv_inplace(|v| v.max(0.0));
//!     Ok(freeze(out.copy_of(&tmp)?))                        // activations: kept for backprop
//! }
//!
//! let mgr = LayerWorkspaceMgr::builder()
//!     .with(ArrayType::Activations, "WS_ACT", WorkspaceConfig::default())
//!     .default_workspace("WS_WORKING_MEM", WorkspaceConfig::default())
//!     .build()?;
//! let activations = mgr.enter(ArrayType::Activations)?;
//! let input = freeze(activations.zeros::<f32, _>((4, 3))?);
//! let y = {
//!     let working = mgr.enter(ArrayType::FfWorkingMem)?;
//!     forward(input, &activations, &working)?
//! }; // working memory reset here; `y` lives on
//! mgr.validate(ArrayType::Activations, "relu", &y)?;
//! assert_eq!(y.shape(), &[4, 3]);
//! # Ok::<(), workspace_core::Error>(())
//! ```
//!
//! Returning working memory as activations does not compile:
//!
//! ```compile_fail,E0621
//! use ndarray::ArrayView2;
//! use workspace_core::{freeze, Result, TypedScope};
//!
//! fn forward<'a>(x: ArrayView2<'a, f32>, out: &'a TypedScope, working: &TypedScope) -> Result<ArrayView2<'a, f32>> {
//!     let tmp = working.copy_of(&x)?;
//!     Ok(freeze(tmp)) // error: `working` does not live for 'a
//! }
//! ```
//!
//! Allocating the output in the wrong long-lived workspace compiles, and
//! [`LayerWorkspaceMgr::validate`] reports it with an [`Error::WrongLocation`] that
//! names the layer, the array type, the expected and the actual workspace.

#![deny(unsafe_code)]
// A link that does not resolve renders as literal brackets: an error, in private docs too.
#![deny(rustdoc::broken_intra_doc_links, rustdoc::private_intra_doc_links)]

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
mod layer;
mod manager;
mod memory_report;
pub mod plan;
#[allow(unsafe_code)]
pub mod planned;
mod refusals;
mod roles;
#[allow(unsafe_code)]
mod scope;
#[allow(unsafe_code)]
mod shell;
pub mod timeline;
#[allow(unsafe_code)]
mod workspace;

pub use array_ext::WorkspaceArrayExt;
pub use bytemuck::{Pod, Zeroable};
/// The former name of [`MAX_CYCLE_HISTORY`] (deprecated).
#[allow(deprecated)]
pub use config::MAX_TIMELINE_LEN;
pub use config::{
    AllocationPolicy, LearningPolicy, Location, MappedFile, ResetPolicy, SpillPolicy, WorkspaceConfig,
    WorkspaceConfigBuilder, DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_CYCLE_HISTORY,
};
pub use engine::{Sizing, WorkspaceStats};
pub use error::{BackendError, Error, Result};
pub use handle::Handle;
pub use layer::{LayerWorkspaceMgr, LayerWorkspaceMgrBuilder, TypedScope};
pub use manager::{stats_table, WorkspaceManager};
pub use roles::{ArrayType, WorkspaceMode};
pub use scope::{freeze, Frame, Scope};
pub use workspace::{DebugMode, Workspace, DEBUG_ENV};
