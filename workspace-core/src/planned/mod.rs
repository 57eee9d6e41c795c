//! Planned workspaces: the workspaces of one iteration (a network's role workspaces)
//! served from one arena, at offsets planned from the lifetimes of a recorded
//! iteration.
//!
//! A [`PlanGroup`] holds workspaces that make up one iteration. The caller marks the
//! iterations ([`PlanGroup::start_iteration`], with a key that tells iterations of
//! different shapes apart, and [`PlanGroup::finish_iteration`]):
//!
//! 1. The first iteration of a key is **recorded**: every allocation of every member
//!    (its size, alignment and workspace, or the [`Frame`](crate::Frame) of it that
//!    made it) and every end of a member's cycle or close of a frame, in order. A frame
//!    is an owner of its own: what it allocated dies at its close, so later arrays of
//!    any member may be planned into its bytes.
//!    Its memory comes from the members themselves, as without a group.
//! 2. At its end a **plan** is made ([`crate::plan`]): an offset in the group's one
//!    arena for every allocation, such that no two allocations that were live at the
//!    same moment share a byte. Allocations of one workspace with no other event
//!    between them (a *run*) live and die together, so they are planned as one block
//!    and laid out inside it as a bump arena lays them out.
//! 3. Later iterations of the key **replay** the plan. Each run is a *window* of the
//!    arena that the member's allocation fast path bumps through (no cost over an
//!    unplanned workspace); every step between windows (the start of the next run, the
//!    end of a cycle) is checked in O(1) against the plan: the same workspace, at the
//!    same position in the order of events, fitting the planned bytes.
//! 4. On any **divergence** (an allocation the plan does not hold at that position, or
//!    larger than planned, a cycle ending out of order) the rest of the iteration is
//!    served *off the plan*: from spill blocks of the member's own, never from planned
//!    bytes that a live allocation may hold. The plan is marked stale and the next
//!    iteration of its key is recorded again. Divergences and plans are counted
//!    ([`PlannedStats`]).
//!
//! Why replay is safe: a window is handed to a member only when every earlier event of
//! the recording happened, in order; so every allocation that the plan lets share the
//! window's bytes either died before (its cycle's end was one of those events) or is
//! planned after the member's cycle ends, which its own step will check. A new
//! iteration starts from the top of the plan only when no member holds a window of the
//! last one (a member whose cycle is still open keeps its window, and the group then
//! runs off the plan).
//!
//! Keys give each shape of iteration (variable-length sequences) a plan of its own, in a
//! bounded cache; all plans share the one arena, sized to the largest, which grows only
//! when a larger plan is made. A key is only a hint: replay verifies every step, so two
//! iterations of different shapes that share a key can never share a plan by accident
//! (the second diverges and is recorded again).
//!
//! A group belongs to the thread that made it: its members may move to other threads
//! (a workspace is `Send`), but there they allocate as unplanned workspaces.
//!
//! ```
//! use workspace_core::{planned::PlanGroup, LearningPolicy, SpillPolicy, WorkspaceConfig};
//!
//! let config = WorkspaceConfig::builder()
//!     .learning(LearningPolicy::None)
//!     .spill(SpillPolicy::External)
//!     .build()?;
//! let group = PlanGroup::new("ITERATION");
//! let act = group.workspace("ACT", &config)?;
//! let scratch = group.workspace("SCRATCH", &config)?;
//! for _ in 0..4 {
//!     group.start_iteration(0)?;
//!     {
//!         let a = act.enter()?;
//!         let x = a.filled::<f32, _>(1024, 1.0)?;
//!         for _ in 0..3 {
//!             let s = scratch.enter()?; // each cycle's scratch dies at its end
//!             let mut t = s.zeros::<f32, _>(4096)?;
//!             t.fill(x[0]);
//!         }
//!     }
//!     group.finish_iteration()?;
//! }
//! let stats = group.stats();
//! assert_eq!((stats.plans, stats.divergences, stats.planned_iterations), (1, 0, 3));
//! // The activations and one scratch cycle are live at once: 4 KiB + 16 KiB.
//! assert_eq!(stats.plan_bytes, 4096 + 16384);
//! assert_eq!(stats.plan_bytes, stats.lower_bound_bytes);
//! # Ok::<(), workspace_core::Error>(())
//! ```

mod group;
mod member;
mod portable;
mod script;

use std::cell::{RefCell, RefMut};
use std::rc::Rc;
use std::sync::Arc;

use crate::backend::{ArenaBackend, Block, CycleHooks, HostBackend, Shell};
use crate::config::WorkspaceConfig;
use crate::error::{Error, Result};
pub use crate::figures::PlannedStats;
use crate::refusals::Refusals;
use crate::workspace::Workspace;
use group::{GroupShared, GroupState, Mode};
pub use portable::PortableMgr;

/// Plans a group keeps unless told otherwise ([`PlanGroup::with_plans`]).
pub const DEFAULT_PLANS: usize = 8;

/// Events a recording may hold; a longer iteration is not planned (its members keep
/// allocating as unplanned workspaces), so that a group whose iterations are never
/// finished does not grow without bound.
pub const MAX_RECORDED_EVENTS: usize = 1 << 20;

/// The report of a backend's refusal to hold a plan (`plan`: the arena it outgrew, its
/// bytes and its lower bound): the plan's request, the arena, the plan's lower bound and
/// what its layout takes above it (no allocation is live: its iteration has not begun).
fn plan_report(
    source: &crate::error::BackendError,
    plan: Option<(usize, usize, usize)>,
) -> crate::memory_report::MemoryReport {
    let requested = match source {
        crate::error::BackendError::OutOfMemory { bytes, .. } => *bytes,
        _ => 0,
    };
    let mut report = crate::memory_report::MemoryReport { requested, ..Default::default() };
    if let Some((arena, plan_bytes, lower_bound)) = plan {
        report.requested = plan_bytes;
        report.capacity = arena;
        report.lower_bound = Some(lower_bound as u64);
        report.fragmentation_bytes = Some(plan_bytes.saturating_sub(lower_bound) as u64);
    }
    report
}

/// A plan group over any backend `B`: the iteration protocol, the plan cache and the
/// arena, for members of every kind of workspace ([`Shell`]s over `B`). The host's
/// [`PlanGroup`] is one over [`HostBackend`] with its member list; a device plan group
/// (in `workspace-cuda`) is one over device memory. The replay and its checks are
/// these, whatever the backend (see the [module documentation](self)).
///
/// Cloning gives another handle to the same group. A group belongs to the thread that
/// made it (its members allocate from it on that thread only).
///
/// Joining is `unsafe` ([`Group::join`]): the group reuses a window's bytes as soon as
/// its owner closes, which is sound only for a workspace whose use of them is over (or
/// ordered) by then. The safe ways in are [`PlanGroup::join`] and a device plan group's.
///
/// ```compile_fail,E0133
/// use workspace_core::backend::HostBackend;
/// use workspace_core::planned::Group;
/// let group = Group::new("G", HostBackend::Ram, 8);
/// let ws = workspace_core::Workspace::new("W", Default::default()).unwrap();
/// group.join(&*ws).unwrap(); // needs `unsafe`
/// ```
pub struct Group<B: ArenaBackend> {
    shared: Arc<GroupShared<B>>,
}

impl<B: ArenaBackend> Clone for Group<B> {
    fn clone(&self) -> Self {
        Group { shared: self.shared.clone() }
    }
}

impl<B: ArenaBackend> std::fmt::Debug for Group<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.shared, f)
    }
}

impl<B: ArenaBackend + 'static> Group<B>
where
    B::Block: Send,
{
    /// A group named `name` (in statistics and errors) whose arena comes from `backend`,
    /// keeping up to `plans` plans (at least one).
    pub fn new(name: &str, backend: B, plans: usize) -> Group<B> {
        Group { shared: Arc::new(GroupShared::new(name, backend, plans)) }
    }

    /// The group's name.
    pub fn name(&self) -> &Arc<str> {
        &self.shared.name
    }

    /// A process-unique id of the group.
    pub fn id(&self) -> u64 {
        self.shared.id()
    }

    /// Makes the workspace of `shell` a member: from the next iteration its allocations
    /// and cycles are recorded and planned with the others'.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while it is open; [`Error::InvalidConfig`] when it is
    /// circular ([`ResetPolicy::EndOfBuffer`](crate::ResetPolicy)) or a member of another
    /// group.
    ///
    /// # Safety
    ///
    /// The group hands the bytes of a window to the next owner the plan puts there as
    /// soon as the engine tells it the window's owner closed (its cycle ended or its
    /// frame closed), and the backend frees or replaces the arena as soon as no open
    /// cycle holds a window. So every use of the arena's memory by the workspace (and by
    /// any work it issued, on any queue) must be complete, or ordered before whatever
    /// uses those bytes next and before the backend's free, by the time its owner
    /// closes. Host workspaces meet this: their memory is used by the thread, through
    /// borrows of the scope or frame that handed it out, which end before it closes
    /// ([`PlanGroup::join`]). A device workspace meets it only with the ordering a
    /// device plan group keeps (`workspace_cuda::DevicePlanGroup::join`).
    pub unsafe fn join<H: CycleHooks>(&self, shell: &Shell<B, H>) -> Result<()> {
        shell.engine_ref().join(Some(Box::new(member::GroupMember(self.shared.clone()))))
    }

    /// Makes the workspace of `shell` an unplanned workspace again.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while it is open; [`Error::InvalidInput`] when it is not a
    /// member of this group.
    pub fn leave<H: CycleHooks>(&self, shell: &Shell<B, H>) -> Result<()> {
        if !self.has_member(shell) {
            return Err(Error::InvalidInput(format!(
                "workspace '{}' is not a member of plan group '{}'",
                shell.name(),
                self.shared.name
            )));
        }
        shell.engine_ref().join(None)
    }

    /// Whether the workspace of `shell` is a member of this group.
    pub fn has_member<H: CycleHooks>(&self, shell: &Shell<B, H>) -> bool {
        shell.engine_ref().group_id() == Some(self.shared.id())
    }

    /// `f` of the group's backend, on the group's thread when nothing else uses the
    /// group; `None` otherwise.
    pub fn with_backend<R>(&self, f: impl FnOnce(&B) -> R) -> Option<R> {
        self.shared.state().map(|state| f(&state.backend))
    }

    #[inline]
    fn state(&self) -> Result<RefMut<'_, GroupState<B>>> {
        match self.shared.state() {
            Some(state) => Ok(state),
            None => Err(self.busy()),
        }
    }

    #[cold]
    #[inline(never)]
    fn busy(&self) -> Error {
        Error::InvalidInput(format!(
            "plan group '{}' is busy (used from inside a member's allocation, or off the thread that made it)",
            self.shared.name
        ))
    }

    #[cold]
    #[inline(never)]
    fn held(&self) -> Error {
        Error::InvalidInput(format!(
            "plan group '{}' cannot replace its arena while a member's open cycle holds part of it: close the \
             members' scopes first (a cycle whose scope was forgotten, with `mem::forget`, holds its part for good)",
            self.shared.name
        ))
    }

    #[cold]
    #[inline(never)]
    fn backend_error(&self, source: crate::error::BackendError) -> Error {
        self.plan_error(source, None)
    }

    /// The backend's refusal to hold a plan: its report names the request, the arena,
    /// and the plan's lower bound and the bytes its layout loses above it.
    #[cold]
    #[inline(never)]
    fn plan_error(&self, source: crate::error::BackendError, plan: Option<(usize, usize, usize)>) -> Error {
        let report = Box::new(plan_report(&source, plan));
        Error::Backend { workspace: self.shared.name.clone(), source, report }
    }

    /// As [`PlanGroup::start_iteration`].
    ///
    /// # Errors
    ///
    /// As [`PlanGroup::start_iteration`].
    pub fn start_iteration(&self, key: u64) -> Result<()> {
        let mut state = self.state()?;
        match state.start(key) {
            Ok(()) => Ok(()),
            Err(refused) => {
                state.mode = Mode::OffPlan;
                state.stats.failed_growths += 1;
                match refused {
                    Some(source) => {
                        let plan = state.plan_of_key().map(|(bytes, bound)| (state.arena_bytes, bytes, bound));
                        Err(self.plan_error(source, plan))
                    }
                    None => Ok(()),
                }
            }
        }
    }

    /// As [`PlanGroup::finish_iteration`].
    ///
    /// # Errors
    ///
    /// As [`PlanGroup::finish_iteration`].
    pub fn finish_iteration(&self) -> Result<bool> {
        Ok(self.state()?.finish())
    }

    /// As [`PlanGroup::abandon_iteration`].
    ///
    /// # Errors
    ///
    /// As [`PlanGroup::abandon_iteration`].
    pub fn abandon_iteration(&self) -> Result<()> {
        self.state()?.abandon();
        Ok(())
    }

    /// As [`PlanGroup::iteration`].
    ///
    /// # Errors
    ///
    /// As [`PlanGroup::iteration`].
    pub fn iteration<R, E: From<Error>>(
        &self,
        key: u64,
        work: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<(R, bool), E> {
        match self.start_iteration(key) {
            Ok(()) | Err(Error::Backend { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        /// Abandons the iteration unless it finished (work that failed or panicked).
        struct Open<'g, B: ArenaBackend + 'static>(Option<&'g Group<B>>)
        where
            B::Block: Send;
        impl<B: ArenaBackend + 'static> Drop for Open<'_, B>
        where
            B::Block: Send,
        {
            fn drop(&mut self) {
                if let Some(group) = self.0 {
                    let _ = group.abandon_iteration();
                }
            }
        }
        let mut open = Open(Some(self));
        let value = work()?;
        open.0 = None;
        Ok((value, self.finish_iteration()?))
    }

    /// As [`PlanGroup::reserve`].
    ///
    /// # Errors
    ///
    /// As [`PlanGroup::reserve`].
    pub fn reserve(&self, bytes: usize) -> Result<()> {
        let mut state = self.state()?;
        if state.live > 0 {
            return Err(self.held());
        }
        if bytes <= state.arena_bytes {
            return Ok(());
        }
        // No alignment beyond the arena's own: `grow_to` keeps that.
        state.grow_to(bytes, 1).map_err(|source| self.backend_error(source))
    }

    /// As [`PlanGroup::trim`].
    ///
    /// # Errors
    ///
    /// As [`PlanGroup::trim`].
    pub fn trim(&self) -> Result<()> {
        let mut state = self.state()?;
        if state.live > 0 {
            return Err(self.held());
        }
        if let Mode::Replaying { .. } = state.mode {
            // Later runs of this iteration would open windows of the arena given back.
            state.mode = Mode::OffPlan;
        }
        if let Some(old) = state.arena.take() {
            state.backend.release(old);
        }
        state.base = None;
        state.base_align = 1;
        state.arena_bytes = 0;
        state.stats.arena_lower_bound_bytes = 0;
        // Memory was given back on request: a size refused before may be had now.
        state.refusals = Refusals::default();
        state.unreported = None;
        Ok(())
    }

    /// Bytes of the plan of the current (or last) iteration (0 before the first plan).
    pub fn plan_bytes(&self) -> usize {
        self.shared.state().and_then(|s| s.shown.map(|i| s.plans[i].bytes)).unwrap_or(0)
    }

    /// As [`PlanGroup::keep_plans`].
    pub fn keep_plans(&self, plans: usize) {
        if let Some(mut state) = self.shared.state() {
            state.capacity = state.capacity.max(plans);
        }
    }

    /// As [`PlanGroup::plans_kept`].
    pub fn plans_kept(&self) -> usize {
        self.shared.state().map_or(0, |state| state.capacity)
    }

    /// The group's figures.
    pub fn stats(&self) -> PlannedStats {
        self.shared.stats().unwrap_or_default()
    }

    /// Bytes of the planned arena (0 off the group's thread, or from inside a member's
    /// allocation). Allocates nothing.
    pub fn capacity(&self) -> usize {
        self.shared.state().map_or(0, |state| state.arena_bytes)
    }

    /// Where the arena lies: its base and its bytes (`None` without one, off the
    /// group's thread, or from inside a member's allocation).
    pub fn arena_extent(&self) -> Option<(<B::Block as Block>::Base, usize)> {
        self.shared.state().and_then(|state| state.base.map(|base| (base, state.arena_bytes)))
    }
}

/// A group of host workspaces planned together; see the [module documentation](self).
///
/// Cloning gives another handle to the same group. `!Send`: a group belongs to the
/// thread that made it.
#[derive(Clone, Debug)]
pub struct PlanGroup {
    group: Group<HostBackend>,
    members: Rc<RefCell<Vec<Rc<Workspace>>>>,
    /// Its members are shape-only (see [`PlanGroup::shape_only`]).
    shape_only: bool,
}

impl PlanGroup {
    /// A group named `name` (in statistics) whose arena is host RAM, keeping up to
    /// [`DEFAULT_PLANS`] plans.
    pub fn new(name: &str) -> PlanGroup {
        PlanGroup::with_plans(name, DEFAULT_PLANS)
    }

    /// A group keeping up to `plans` plans (at least one): the number of shapes of
    /// iteration it serves from a plan at once.
    pub fn with_plans(name: &str, plans: usize) -> PlanGroup {
        PlanGroup {
            group: Group::new(name, HostBackend::Ram, plans),
            members: Rc::new(RefCell::new(Vec::new())),
            shape_only: false,
        }
    }

    /// A group like [`PlanGroup::with_plans`] whose members
    /// ([`PlanGroup::workspace`]) are shape-only
    /// ([`Workspace::is_shape_only`](crate::Workspace::is_shape_only)): for a dry run
    /// of a planned iteration, which records, plans and replays as the real group would.
    pub fn shape_only(name: &str, plans: usize) -> PlanGroup {
        PlanGroup {
            group: Group::new(name, HostBackend::ShapeOnly, plans),
            members: Rc::new(RefCell::new(Vec::new())),
            shape_only: true,
        }
    }

    /// Whether its members are shape-only (see [`PlanGroup::shape_only`]).
    pub fn is_shape_only(&self) -> bool {
        self.shape_only
    }

    /// A shape-only group ([`PlanGroup::shape_only`]) that starts where this one is: a
    /// shape-only member of the same name and configuration for each of its members, its
    /// plans for the same keys in the same order of use, an arena of the same size, and
    /// its figures. From there the twin records, replays and grows its arena as this
    /// group would, iteration for iteration: a dry run's copy of a group that has
    /// planned already.
    ///
    /// ```
    /// use workspace_core::{planned::PlanGroup, LearningPolicy, SpillPolicy, WorkspaceConfig};
    ///
    /// let config = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build()?;
    /// let group = PlanGroup::new("STEP");
    /// let act = group.workspace("ACT", &config)?;
    /// let step = |act: &workspace_core::Workspace| -> workspace_core::Result<()> {
    ///     act.enter()?.zeros::<f32, _>(256)?;
    ///     Ok(())
    /// };
    /// group.iteration(1, || step(&act))?; // recorded and planned
    /// let twin = group.shape_only_twin()?;
    /// let twin_act = &twin.workspaces()[0];
    /// let ((), on_plan) = twin.iteration(1, || step(twin_act))?;
    /// assert!(on_plan, "the twin replays the plan it took");
    /// assert_eq!((twin.capacity(), twin.stats().plans), (group.capacity(), 1));
    /// # Ok::<(), workspace_core::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] during an iteration, off the group's thread, or when a
    /// plan names a workspace that joined with [`PlanGroup::join`] (only the members
    /// [`PlanGroup::workspace`] made have twins); those of [`PlanGroup::workspace`];
    /// [`Error::Backend`] when the arena cannot be had.
    pub fn shape_only_twin(&self) -> Result<PlanGroup> {
        let from = self.group.state()?;
        let name = &self.group.shared.name;
        if from.mode != Mode::Idle || from.live > 0 {
            return Err(Error::InvalidInput(format!(
                "plan group '{name}' is in an iteration: its twin is made between iterations"
            )));
        }
        let twin = PlanGroup::shape_only(name, from.capacity);
        // Each member's cycles, and the twin member that stands for it.
        let mut members: Vec<(u64, Rc<Workspace>)> = Vec::new();
        for member in self.members.borrow().iter() {
            members.push((member.engine().owner(), twin.workspace(member.name(), member.config())?));
        }
        let owner = |owner: u64| {
            let (cycle, level) = (crate::plan::cycle_of(owner), owner >> crate::plan::FRAME_LEVEL_SHIFT);
            let (_, twin) = members.iter().find(|(of, _)| *of == cycle)?;
            Some(twin.engine().owner_at(u32::try_from(level).ok()?))
        };
        let copied = twin.group.state()?.copy_from(&from, owner);
        match copied {
            Ok(()) => Ok(twin),
            Err(group::CopyError::Owner) => Err(Error::InvalidInput(format!(
                "plan group '{name}' has a plan for a workspace that joined it (PlanGroup::join): only the members it \
                 made (PlanGroup::workspace) have twins"
            ))),
            Err(group::CopyError::Backend(source)) => Err(self.group.backend_error(source)),
        }
    }

    /// The member workspace `name`, created with `config` and joined to the group if
    /// the group has none of that name. Members are the group's own: they are not in
    /// the thread's [`WorkspaceManager`](crate::WorkspaceManager), so two groups may
    /// each have a member of the same name.
    ///
    /// # Errors
    ///
    /// [`Error::ConfigMismatch`] when the member exists with another configuration;
    /// those of [`Workspace::new`] and [`PlanGroup::join`].
    pub fn workspace(&self, name: &str, config: &WorkspaceConfig) -> Result<Rc<Workspace>> {
        crate::manager::find_or_create(&self.members, name, config, || {
            let ws = Workspace::create(name, config.clone(), crate::DebugMode::from_env()?, self.shape_only)?;
            self.join(&ws)?;
            Ok(ws)
        })
    }

    /// Makes `ws` a member: from the next iteration its allocations and cycles are
    /// recorded and planned with the others'.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while `ws` is open; [`Error::InvalidConfig`] when it is
    /// circular ([`ResetPolicy::EndOfBuffer`](crate::ResetPolicy)) or a member of another
    /// group.
    pub fn join(&self, ws: &Workspace) -> Result<()> {
        // SAFETY: a host workspace's memory is used only by the thread, through borrows
        // of the scope or frame that handed it out, which have ended when it closes;
        // the host backend frees the arena only when the group replaces or drops it,
        // which needs no member to hold a window.
        unsafe { self.group.join(&ws.shell) }
    }

    /// Makes `ws` an unplanned workspace again.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while `ws` is open; [`Error::InvalidInput`] when it is not
    /// a member of this group.
    pub fn leave(&self, ws: &Workspace) -> Result<()> {
        self.group.leave(&ws.shell)?;
        self.members.borrow_mut().retain(|m| !std::ptr::eq(&**m, ws));
        Ok(())
    }

    /// The members made by [`PlanGroup::workspace`].
    pub fn workspaces(&self) -> Vec<Rc<Workspace>> {
        self.members.borrow().clone()
    }

    /// Whether nothing reaches this group but `handles` of its handles (clones of it,
    /// counted by the caller) and its members' memberships, and nothing reaches each
    /// member but the group's list and `uses(member)` references the caller counts:
    /// every strong count is what those explain, no weak reference exists, and every
    /// member is still joined to this group. Allocates nothing.
    pub(crate) fn reached_only_through(&self, handles: usize, uses: impl Fn(&Workspace) -> usize) -> bool {
        if Rc::strong_count(&self.members) != handles
            || Rc::weak_count(&self.members) != 0
            || Arc::weak_count(&self.group.shared) != 0
        {
            return false;
        }
        let Ok(members) = self.members.try_borrow() else { return false };
        Arc::strong_count(&self.group.shared) == handles + members.len()
            && members.iter().all(|ws| {
                Rc::weak_count(ws) == 0 && Rc::strong_count(ws) == 1 + uses(ws) && self.group.has_member(&ws.shell)
            })
    }

    /// `f` of the member workspaces, without cloning their list.
    pub(crate) fn workspaces_with<R>(&self, f: impl FnOnce(&[Rc<Workspace>]) -> R) -> R {
        f(&self.members.borrow())
    }

    /// Makes the calling thread the group's thread (see `GroupShared::rebind`).
    ///
    /// # Safety
    ///
    /// No other thread may reach the group or any of its members, and the calling
    /// thread got its references through a hand-over that orders the earlier thread's
    /// uses before its own.
    pub(crate) unsafe fn rebind(&self) {
        // SAFETY: the caller's contract is `GroupShared::rebind`'s.
        unsafe { self.group.shared.rebind() }
    }

    /// Ends the current iteration (as [`PlanGroup::finish_iteration`]) and starts one
    /// of shape `key`: it replays the key's plan when there is one that has not
    /// diverged, and is recorded otherwise.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] when the arena cannot grow to the plan's size: the iteration
    /// has started all the same, off the plan (its members allocate from their own
    /// blocks), so the caller may go on with it. Reported once: until the backend gives
    /// that size, later starts that need it run off the plan without an error, asking
    /// again only after a back-off that doubles with each refusal
    /// ([`PlannedStats::failed_growths`] counts them all).
    pub fn start_iteration(&self, key: u64) -> Result<()> {
        self.group.start_iteration(key)
    }

    /// Ends the current iteration: a recording is planned (and the arena grown to hold
    /// the plan), a replay that reached the end of its plan is counted as planned (one
    /// that did not, as a divergence). Returns whether the iteration was replayed on its
    /// plan to the end. Members allocate as unplanned workspaces until the next start.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when called from inside a member's allocation.
    pub fn finish_iteration(&self) -> Result<bool> {
        self.group.finish_iteration()
    }

    /// Ends the current iteration without a verdict, for an iteration whose work failed
    /// part-way (an error returned from inside it): a recording is dropped rather than
    /// planned, and a replay cut short does not mark its plan stale (one that had left
    /// its plan was counted when it left, and only there). Counted in
    /// [`PlannedStats::abandoned_iterations`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when called from inside a member's allocation.
    pub fn abandon_iteration(&self) -> Result<()> {
        self.group.abandon_iteration()
    }

    /// Runs `work` as one iteration of shape `key`: started ([`PlanGroup::start_iteration`]),
    /// then finished when `work` returns `Ok` ([`PlanGroup::finish_iteration`]), and
    /// abandoned when it returns `Err` or panics ([`PlanGroup::abandon_iteration`]: no
    /// plan is made from failed work, and it spoils none). Returns the work's value and
    /// whether the iteration ran on its plan to the end.
    ///
    /// An arena that cannot grow to the key's plan does not stop the work: the iteration
    /// runs off the plan, from the members' own blocks, the refusal counted in
    /// [`PlannedStats::failed_growths`]; a later iteration of the key asks again.
    ///
    /// ```
    /// use workspace_core::{planned::PlanGroup, LearningPolicy, SpillPolicy, WorkspaceConfig};
    ///
    /// let config = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build()?;
    /// let group = PlanGroup::new("STEP");
    /// let act = group.workspace("ACT", &config)?;
    /// for _ in 0..3 {
    ///     let (sum, _on_plan) = group.iteration(16, || {
    ///         let scope = act.enter()?;
    ///         let x = scope.filled::<f32, _>(16, 0.5)?;
    ///         Ok::<_, workspace_core::Error>(x.sum())
    ///     })?;
    ///     assert_eq!(sum, 8.0);
    /// }
    /// assert_eq!((group.stats().recorded_iterations, group.stats().planned_iterations), (1, 2));
    /// # Ok::<(), workspace_core::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// `work`'s error; [`Error::InvalidInput`] when called from inside a member's
    /// allocation.
    pub fn iteration<R, E: From<Error>>(
        &self,
        key: u64,
        work: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<(R, bool), E> {
        self.group.iteration(key, work)
    }

    /// Makes the group's arena at least `bytes` long now, as
    /// [`WorkspaceConfig`]'s initial size does for a workspace: plans up to that size
    /// then need no growth, and an arena of a huge page or more is backed by huge pages
    /// (see [`HostBackend`]). The arena never shrinks; plans larger than it still grow it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] while a member's open cycle holds a window of the arena
    /// (close it first), or when called from inside a member's allocation;
    /// [`Error::Backend`] when the memory cannot be had (the arena is then unchanged).
    pub fn reserve(&self, bytes: usize) -> Result<()> {
        self.group.reserve(bytes)
    }

    /// Gives the group's arena back now, as a workspace's `trim` gives back its arena: the
    /// plans are kept, and the next iteration that replays one allocates an arena for
    /// it again. Called in the middle of a replayed iteration, the rest of that
    /// iteration runs off the plan (no window of the arena is handed out after it).
    ///
    /// # Errors
    ///
    /// As [`PlanGroup::reserve`]: not while a member's open cycle holds part of the
    /// arena.
    pub fn trim(&self) -> Result<()> {
        self.group.trim()
    }

    /// Bytes of the plan of the current (or last) iteration (0 before the first plan).
    pub fn plan_bytes(&self) -> usize {
        self.group.plan_bytes()
    }

    /// Keeps at least `plans` plans from now on (never fewer than it kept): for a user
    /// that knows how many shapes of iteration it runs, so that none of them is evicted
    /// by the others and planned again (an iteration off its plan allocates). Allocates
    /// nothing: the plans are made as their shapes are first seen. Off the group's
    /// thread, or from inside a member's allocation, it does nothing.
    pub fn keep_plans(&self, plans: usize) {
        self.group.keep_plans(plans);
    }

    /// How many plans the group keeps at most ([`PlanGroup::with_plans`],
    /// [`PlanGroup::keep_plans`]; 0 off the group's thread).
    pub fn plans_kept(&self) -> usize {
        self.group.plans_kept()
    }

    /// The group's figures.
    pub fn stats(&self) -> PlannedStats {
        self.group.stats()
    }

    /// Bytes of the planned arena (0 off the group's thread, or from inside a member's
    /// allocation). Allocates nothing.
    pub fn capacity(&self) -> usize {
        self.group.capacity()
    }
}

#[cfg(test)]
mod tests;
