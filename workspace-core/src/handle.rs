//! Storable handles: arrays that may outlive a borrow, checked on every access.
//!
//! A [`Handle`] remembers the workspace it was allocated in and that workspace's
//! generation. Reading it needs a [`Scope`] of the same workspace and generation, and
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
use ndarray::{Array, ArrayView, ArrayViewMut, Dimension};

#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::scope::Scope;

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
    ptr: NonNull<T>,
    dim: Dim,
    owner: u64,
    generation: u64,
    workspace: Arc<str>,
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

    /// Checks that `scope` belongs to this handle's workspace, at its generation.
    ///
    /// # Errors
    ///
    /// [`Error::WrongWorkspace`] or [`Error::StaleHandle`].
    pub fn check(&self, scope: &Scope<'_>) -> Result<()> {
        crate::shell::check_identity(
            (self.owner, self.generation),
            &self.workspace,
            scope.identity(),
            scope.target_name(),
        )
    }

    /// A read-only view, borrowed from `scope`.
    ///
    /// # Errors
    ///
    /// As [`Handle::check`].
    pub fn view<'a>(&'a self, scope: &'a Scope<'_>) -> Result<ArrayView<'a, T, Dim>> {
        self.check(scope)?;
        // SAFETY: the check proves the memory is live and unchanged since allocation;
        // the view borrows `scope` (so the cycle cannot end) and `self` (so no mutable
        // view of this handle exists).
        Ok(unsafe { ArrayView::from_shape_ptr(self.dim.clone(), self.ptr.as_ptr()) })
    }

    /// A mutable view, borrowed from `scope`.
    ///
    /// # Errors
    ///
    /// As [`Handle::check`].
    pub fn view_mut<'a>(&'a mut self, scope: &'a Scope<'_>) -> Result<ArrayViewMut<'a, T, Dim>> {
        self.check(scope)?;
        // SAFETY: as in `view`; `&mut self` makes this the only view of the handle.
        Ok(unsafe { ArrayViewMut::from_shape_ptr(self.dim.clone(), self.ptr.as_ptr()) })
    }

    /// Copies the data out into an owned array that outlives every reset.
    ///
    /// # Errors
    ///
    /// As [`Handle::check`].
    pub fn detach(&self, scope: &Scope<'_>) -> Result<Array<T, Dim>> {
        Ok(self.view(scope)?.to_owned())
    }

    /// Copies the data into `target` (another open workspace, typically an outer one),
    /// returning a handle there.
    ///
    /// # Errors
    ///
    /// As [`Handle::check`] for `scope`, and `target`'s allocation errors.
    pub fn leverage_to(&self, scope: &Scope<'_>, target: &Scope<'_>) -> Result<Handle<T, Dim>> {
        target.copy_handle(&self.view(scope)?)
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
