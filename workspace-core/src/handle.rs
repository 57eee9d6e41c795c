//! Storable handles: arrays that may outlive a borrow, checked on every access.
//!
//! A [`Handle`] remembers the workspace it was allocated in and that workspace's
//! generation. Reading it needs a [`Scope`](crate::Scope) of the same workspace and generation, and
//! the view it gives borrows that scope, so it cannot outlive the cycle either:
//!
//! ```compile_fail,E0505
//! use workspace_core::{Workspace, WorkspaceConfig};
//! let ws = Workspace::new("W", WorkspaceConfig::default()).unwrap();
//! let scope = ws.enter().unwrap();
//! let handle = scope.zeros_handle::<f32, _>(4).unwrap();
//! let view = handle.view(&scope).unwrap();
//! drop(scope); // the cycle ends here...
//! println!("{}", view[0]); // ...so the view may not be used
//! ```

use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::Pod;
use ndarray::Dimension;

/// An array in workspace memory that can be stored across borrows; see the module docs.
///
/// ```
/// use workspace_core::{Workspace, WorkspaceConfig, Error};
///
/// let ws = Workspace::new("CACHE", WorkspaceConfig::default())?;
/// let mut cached = {
///     let scope = ws.enter()?;
///     let mut h = scope.zeros_handle::<f32, _>((2, 2))?;
///     h.view_mut(&scope)?.fill(3.0);
///     assert_eq!(h.detach(&scope)?.sum(), 12.0);
///     h
/// }; // the cycle ends: the handle's memory is reset
/// let scope = ws.enter()?;
/// let err = cached.view(&scope).unwrap_err();
/// assert!(matches!(err, Error::StaleHandle { array_generation: 1, workspace_generation: 2, .. }));
/// # Ok::<(), workspace_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Handle<T, Dim> {
    /// Invariant: `dim.size()` initialised elements, valid while the owner is at
    /// `generation`.
    pub(crate) ptr: NonNull<T>,
    pub(crate) dim: Dim,
    pub(crate) owner: u64,
    pub(crate) generation: u64,
    pub(crate) workspace: Arc<str>,
}

// SAFETY: a handle is a token: its memory is only reached through `view`/`view_mut`,
// which need a `Scope` of the owning workspace, and scopes are `!Send`, so the access
// happens on the thread that has the workspace open. `&Handle` gives shared views
// only; `view_mut` takes `&mut self`. With `T: Send + Sync`, moving or sharing the
// token cannot create a data race.
unsafe impl<T: Send + Sync, Dim: Send> Send for Handle<T, Dim> {}
// SAFETY: see `Send`.
unsafe impl<T: Send + Sync, Dim: Sync> Sync for Handle<T, Dim> {}

impl<T: Pod, Dim: Dimension> Handle<T, Dim> {
    /// # Safety
    ///
    /// `ptr` must hold `dim.size()` initialised elements that stay valid while the
    /// target `owner` is at `generation`, reachable through no other path.
    pub(crate) unsafe fn new(ptr: NonNull<T>, dim: Dim, owner: u64, generation: u64, workspace: Arc<str>) -> Self {
        Handle { ptr, dim, owner, generation, workspace }
    }

    /// The generation the handle was allocated in.
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// The name of the workspace it lives in.
    pub fn workspace_name(&self) -> &Arc<str> {
        &self.workspace
    }
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.dim.slice()
    }
}
