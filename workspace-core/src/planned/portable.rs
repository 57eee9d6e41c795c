//! A planned layer workspace manager that moves between threads: what a pool of
//! inference arenas hands from caller to caller.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use super::PlanGroup;
use crate::error::{Error, Result};
use crate::layer::{LayerWorkspaceMgr, LayerWorkspaceMgrBuilder};

/// A [`LayerWorkspaceMgr`] planned over a [`PlanGroup`] of its own, owned by one value
/// that may move from thread to thread (`Send`), used by one thread at a time.
///
/// A manager and its workspaces belong to the thread that made them: they are shared
/// by reference-counted handles, so a clone left on one thread while another uses the
/// manager would race. A `PortableMgr` holds the only handles: it builds its manager
/// and group itself, lends the manager to a closure ([`PortableMgr::with`]) on the
/// calling thread, and checks afterwards that the closure kept nothing (no clone of the
/// manager, its group or a workspace, strong or weak). A closure that did keep one
/// leaves the manager on that thread for good: the `PortableMgr` lets go of it there
/// (what the kept references hold stays alive on that thread only), and every later
/// [`PortableMgr::with`] fails with an error saying so.
///
/// ```
/// use std::sync::Mutex;
/// use workspace_core::planned::PortableMgr;
/// use workspace_core::{ArrayType, LayerWorkspaceMgr, LearningPolicy, SpillPolicy, WorkspaceConfig};
///
/// // Members of a plan group need no arena of their own: the plan's arena serves them.
/// let config = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build()?;
/// let builder = LayerWorkspaceMgr::builder().default_workspace("WS_ALL", config);
/// let arena = Mutex::new(PortableMgr::build("SERVE", 4, builder)?);
/// std::thread::scope(|s| {
///     for t in 0..3 {
///         let arena = &arena;
///         s.spawn(move || {
///             let mut arena = arena.lock().unwrap();
///             let sum = arena.with(|mgr| {
///                 let group = mgr.plan_group().expect("planned").clone();
///                 group.iteration(16, || {
///                     let act = mgr.enter(ArrayType::Activations)?;
///                     Ok::<_, workspace_core::Error>(act.filled::<f32, _>(16, t as f32)?.sum())
///                 })
///             });
///             assert_eq!(sum.unwrap().unwrap().0, 16.0 * t as f32);
///         });
///     }
/// });
/// # Ok::<(), workspace_core::Error>(())
/// ```
///
/// It is `Send` but not `Sync`: one thread uses it at a time.
///
/// ```compile_fail,E0277
/// fn needs_sync<T: Sync>() {}
/// needs_sync::<workspace_core::planned::PortableMgr>();
/// ```
///
/// Nothing the closure returns can borrow the manager:
///
/// ```compile_fail
/// # use workspace_core::planned::PortableMgr;
/// # use workspace_core::{LayerWorkspaceMgr, WorkspaceConfig};
/// # let builder = LayerWorkspaceMgr::builder().default_workspace("WS", WorkspaceConfig::default());
/// let mut arena = PortableMgr::build("SERVE", 1, builder)?;
/// let kept = arena.with(|mgr| mgr)?;
/// # Ok::<(), workspace_core::Error>(())
/// ```
#[derive(Debug)]
pub struct PortableMgr {
    /// Planned; nothing but this value reaches its group and workspaces
    /// (`LayerWorkspaceMgr::reached_only_here`), unless `kept`.
    mgr: LayerWorkspaceMgr,
    /// A closure kept a reference: `mgr` was let go of on that thread and replaced by a
    /// manager with no workspaces.
    kept: Option<String>,
}

// SAFETY: what is not `Send` in a manager is its reference counts (the `Rc`s of its
// group, member list and workspaces) and its group's binding to a thread. The counts
// are only touched by the thread that holds the `PortableMgr` (or a `&mut` of it): no
// other handle exists, as `build` and every `with` check (`reached_only_here`) before
// the value can move again, and a manager that fails the check is dropped on its thread
// instead. The group is bound to the using thread at the start of every `with`
// (`PlanGroup::rebind`), under that same exclusivity. Workspaces themselves are `Send`.
// A role scoped out is a heap workspace of the manager's own (`scoped_out`: never one
// of `WorkspaceManager::heaps`), checked by the same `reached_only_here`; the manager
// `keep_here` leaves in its place is a new `no_workspaces()`, whose heap workspaces
// nothing else reaches, and which no later call lends out.
unsafe impl Send for PortableMgr {}

impl PortableMgr {
    /// Builds `builder`'s manager planned over a new group named `group` (in
    /// statistics) that keeps up to `plans` plans (one per shape of iteration).
    ///
    /// # Errors
    ///
    /// Those of [`LayerWorkspaceMgrBuilder::build`].
    pub fn build(group: &str, plans: usize, builder: LayerWorkspaceMgrBuilder) -> Result<PortableMgr> {
        let mgr = builder.planned(&PlanGroup::with_plans(group, plans)).build()?;
        if !mgr.reached_only_here() {
            // Cannot happen: the builder's group and workspaces are all new and only the
            // manager holds them. Checked all the same, since `Send` rests on it.
            return Err(Error::InvalidInput(format!(
                "plan group '{group}': the manager's workspaces are reachable from elsewhere"
            )));
        }
        Ok(PortableMgr { mgr, kept: None })
    }

    /// Runs `f` with the manager on the calling thread and returns what it returns.
    /// The group's iterations are `f`'s to mark (for example with
    /// [`PlanGroup::iteration`] on `mgr.plan_group()`).
    ///
    /// A panic in `f` is resumed once the manager has been checked. If `f` kept a
    /// reference to the manager, its group or a workspace (a clone, strong or weak,
    /// still alive when it returns), its value is returned all the same, the manager is
    /// let go of on this thread, and later calls fail.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when an earlier call's closure kept a reference.
    pub fn with<R>(&mut self, f: impl FnOnce(&LayerWorkspaceMgr) -> R) -> Result<R> {
        if let Some(what) = &self.kept {
            return Err(Error::InvalidInput(what.clone()));
        }
        let group = self.mgr.plan_group().expect("a portable manager is planned");
        // SAFETY: nothing but `self` reaches the group or its members (checked when
        // `self` was built and at the end of every call, see `Send`), and `self` came to
        // this thread by a move or a `&mut` borrow, each handed over with the ordering
        // the contract asks for.
        unsafe { group.rebind() };
        let result = catch_unwind(AssertUnwindSafe(|| f(&self.mgr)));
        if !self.mgr.reached_only_here() {
            self.keep_here();
        }
        match result {
            Ok(value) => Ok(value),
            Err(payload) => resume_unwind(payload),
        }
    }

    /// Whether a closure kept a reference (see [`PortableMgr::with`]).
    pub fn is_kept(&self) -> bool {
        self.kept.is_some()
    }

    /// Gives up the manager on this thread, where something still reaches it.
    #[cold]
    fn keep_here(&mut self) {
        let name = self.mgr.plan_group().map_or_else(String::new, |g| g.stats().name);
        // Dropped here, on the thread that holds the kept references: whatever they keep
        // alive stays on this thread.
        drop(std::mem::replace(&mut self.mgr, LayerWorkspaceMgr::no_workspaces()));
        self.kept = Some(format!(
            "plan group '{name}': a call kept a reference to the manager, its group or one of its workspaces (a \
             clone still alive when the call returned), so they stay on the thread of that call; build a new manager"
        ));
    }
}
