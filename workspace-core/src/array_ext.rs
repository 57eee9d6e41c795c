//! `detach()` and `leverage_to()` for any ndarray array or view.

use bytemuck::Pod;
use ndarray::{Array, ArrayBase, ArrayViewMut, Data, Dimension};

use crate::error::Result;
use crate::scope::Scope;

/// Moving data out of a cycle: into an owned array, or into another open workspace.
///
/// ```
/// use workspace_core::{Workspace, WorkspaceConfig, WorkspaceArrayExt};
///
/// let outer = Workspace::new("OUTER", WorkspaceConfig::default())?;
/// let inner = Workspace::new("INNER", WorkspaceConfig::default())?;
/// let outer_scope = outer.enter()?;
/// let (kept, owned) = {
///     let scope = inner.enter()?;
///     let x = scope.filled::<f32, _>((2, 3), 1.5)?;
///     (x.leverage_to(&outer_scope)?, x.detach())
/// }; // INNER resets here; both copies survive
/// assert_eq!(kept.sum(), 9.0);
/// assert_eq!(owned.sum(), 9.0);
/// # Ok::<(), workspace_core::Error>(())
/// ```
///
/// A leveraged view lives as long as its target scope, no longer:
///
/// ```compile_fail,E0597
/// use workspace_core::{Workspace, WorkspaceConfig, WorkspaceArrayExt};
/// let outer = Workspace::new("OUTER", WorkspaceConfig::default()).unwrap();
/// let source = ndarray::Array1::<f32>::zeros(4);
/// let kept = {
///     let outer_scope = outer.enter().unwrap();
///     source.leverage_to(&outer_scope).unwrap()
/// };
/// kept.sum();
/// ```
pub trait WorkspaceArrayExt<T, Dim> {
    /// Copies into an owned array (standard layout) that outlives every reset.
    fn detach(&self) -> Array<T, Dim>;

    /// Copies into the open `target` scope. There is no way to name a closed
    /// workspace here: a [`Scope`] is open by construction; by id, use
    /// [`WorkspaceManager::borrow_open`](crate::WorkspaceManager::borrow_open), which
    /// fails for unknown or closed workspaces.
    ///
    /// # Errors
    ///
    /// The target's allocation errors.
    fn leverage_to<'t>(&self, target: &'t Scope<'_>) -> Result<ArrayViewMut<'t, T, Dim>>;
}

impl<T: Pod, S: Data<Elem = T>, Dim: Dimension> WorkspaceArrayExt<T, Dim> for ArrayBase<S, Dim> {
    fn detach(&self) -> Array<T, Dim> {
        self.to_owned()
    }

    fn leverage_to<'t>(&self, target: &'t Scope<'_>) -> Result<ArrayViewMut<'t, T, Dim>> {
        target.copy_of(self)
    }
}
