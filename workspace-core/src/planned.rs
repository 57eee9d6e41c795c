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

use std::cell::{Cell, RefCell, RefMut};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::backend::host::HostBackend;
use crate::backend::{ArenaBackend, Block};
use crate::config::WorkspaceConfig;
use crate::error::{Error, Result};
use crate::plan::{Event, Plan, Trace};
use crate::refusals::Refusals;
use crate::workspace::Workspace;

/// Plans a group keeps unless told otherwise ([`PlanGroup::with_plans`]).
pub const DEFAULT_PLANS: usize = 8;

/// Events a recording may hold; a longer iteration is not planned (its members keep
/// allocating as unplanned workspaces), so that a group whose iterations are never
/// finished does not grow without bound.
pub const MAX_RECORDED_EVENTS: usize = 1 << 20;

thread_local! {
    /// The calling thread's [`thread_token`]; 0 until it first asks.
    static TOKEN: Cell<u64> = const { Cell::new(0) };
}

/// A number for the calling thread, unique over the process's life.
#[inline(always)]
pub(crate) fn thread_token() -> u64 {
    match TOKEN.get() {
        0 => fresh_thread_token(),
        known => known,
    }
}

/// The calling thread's first [`thread_token`].
#[cold]
#[inline(never)]
fn fresh_thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let fresh = NEXT.fetch_add(1, Ordering::Relaxed);
    TOKEN.set(fresh);
    fresh
}

/// One step of a plan's replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// A run of allocations of `owner`, laid out in `[start, end)` of the arena.
    Run { owner: u64, start: usize, end: usize },
    /// The end of a cycle of `owner`.
    Close { owner: u64 },
}

/// A plan as replay reads it, with what it was made from.
#[derive(Debug)]
pub(crate) struct Script {
    key: u64,
    pub(crate) steps: Arc<[Step]>,
    bytes: usize,
    /// The largest alignment of any allocation: the arena's base alignment.
    align: usize,
    lower_bound: usize,
    per_role_bytes: usize,
    allocations: usize,
    planning: Duration,
    /// Diverged in a replay: the next iteration of the key is recorded again.
    stale: bool,
    last_used: u64,
}

impl Script {
    /// Plans the recorded `events`: runs (consecutive allocations of one owner) become
    /// one block each, laid out as the owner's bump allocation lays them out. `None`
    /// when no plan fits in the address space (sizes no allocation that succeeded
    /// reaches; the iteration then stays unplanned).
    fn new(key: u64, events: &[Event]) -> Option<Script> {
        let recorded = Trace::from_events(events.to_vec());
        let allocations = events.iter().filter(|e| matches!(e, Event::Alloc { .. })).count();
        let runs = recorded.runs();
        let align_max = runs.events().iter().fold(1, |max, e| match *e {
            Event::Alloc { align, .. } => max.max(align),
            Event::Close { .. } => max,
        });
        let plan = Plan::new(&runs);
        let steps = plan
            .events()
            .iter()
            .enumerate()
            .map(|(i, event)| match *event {
                Event::Alloc { owner, bytes, .. } => {
                    let start = plan.offset(i)?;
                    Some(Step::Run { owner, start, end: start.checked_add(bytes)? })
                }
                Event::Close { owner } => Some(Step::Close { owner }),
            })
            .collect::<Option<Arc<[Step]>>>()?;
        if plan.bytes() == usize::MAX {
            return None;
        }
        Some(Script {
            key,
            steps,
            bytes: plan.bytes(),
            align: align_max,
            lower_bound: recorded.lower_bound(),
            per_role_bytes: recorded.per_owner_bytes(),
            allocations,
            planning: plan.planning_time(),
            stale: false,
            last_used: 0,
        })
    }
}

/// What the group is doing in the current iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Between iterations: members allocate as unplanned workspaces.
    Idle,
    /// Recording the iteration.
    Recording,
    /// Replaying `plans[index]`.
    Replaying { index: usize },
    /// Off the plan for the rest of the iteration.
    OffPlan,
}

/// A group's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PlannedStats {
    /// The group's name.
    pub name: String,
    /// Bytes of the planned arena (the largest plan made so far).
    pub arena_bytes: usize,
    /// The lower bound of the recording whose plan sized the arena (the largest).
    pub arena_lower_bound_bytes: usize,
    /// Bytes of the plan of the current (or last) iteration.
    pub plan_bytes: usize,
    /// The most bytes live at one moment in that plan's recording: no plan can be
    /// smaller.
    pub lower_bound_bytes: usize,
    /// `plan_bytes / lower_bound_bytes`.
    pub plan_to_bound: f64,
    /// What the recording takes laid out per workspace (each member an arena of its own,
    /// sized to its peak): the unplanned layout.
    pub per_role_bytes: usize,
    /// Allocations in that recording.
    pub allocations: usize,
    /// How long making that plan took, in microseconds.
    pub planning_us: u64,
    /// Plans made.
    pub plans: u64,
    /// Plans made again for a key whose plan diverged.
    pub replans: u64,
    /// Iterations that left their plan (each is recorded again next time).
    pub divergences: u64,
    /// Iterations replayed to their end on their plan.
    pub planned_iterations: u64,
    /// Iterations recorded.
    pub recorded_iterations: u64,
    /// Plans kept now.
    pub cached_plans: usize,
    /// Plans dropped to keep the cache bounded.
    pub evictions: u64,
    /// Iterations run off the plan from their start because a member's cycle still
    /// held a window of the iteration before (the plan stays good).
    pub blocked_iterations: u64,
    /// Iterations run off the plan from their start because the arena could not grow
    /// to their plan (the next start of the key tries again).
    pub failed_growths: u64,
    /// Iterations given up ([`PlanGroup::abandon_iteration`]: the work they did failed)
    /// while recorded or on their plan: neither planned nor counted as on or off their
    /// plan.
    pub abandoned_iterations: u64,
}

/// The group's state. Reached only on the group's thread ([`GroupShared::state`]).
pub(crate) struct GroupState<B: ArenaBackend> {
    backend: B,
    arena: Option<B::Block>,
    pub(crate) base: Option<<B::Block as Block>::Base>,
    /// Alignment of `base`.
    pub(crate) base_align: usize,
    arena_bytes: usize,
    pub(crate) mode: Mode,
    key: u64,
    /// Next step of the plan replayed.
    pub(crate) pos: usize,
    /// Members that hold a window of the arena in their open cycle.
    pub(crate) live: usize,
    events: Vec<Event>,
    truncated: bool,
    pub(crate) plans: Vec<Script>,
    capacity: usize,
    clock: u64,
    /// Arena growths the backend refused, in starts that needed a growth (see
    /// [`crate::refusals`]).
    refusals: Refusals,
    /// Starts on the general path so far: the back-off's clock.
    general_starts: u64,
    /// A refusal when a plan was made, which no start has reported yet.
    unreported: Option<crate::error::BackendError>,
    /// The plan whose figures the statistics show: the one used last.
    shown: Option<usize>,
    /// The steps of plan `shown` (the one a replay follows), at hand.
    pub(crate) steps: Arc<[Step]>,
    stats: PlannedStats,
}

impl<B: ArenaBackend> GroupState<B> {
    /// Records an event of a recording iteration.
    pub(crate) fn record(&mut self, event: Event) {
        if self.events.len() < MAX_RECORDED_EVENTS {
            self.events.push(event);
        } else {
            self.truncated = true;
        }
    }

    /// Leaves the plan for the rest of the iteration.
    pub(crate) fn diverge(&mut self) {
        if let Mode::Replaying { index } = self.mode {
            self.plans[index].stale = true;
            self.stats.divergences += 1;
            self.mode = Mode::OffPlan;
        }
    }

    /// Ends the current iteration: plans a recording, counts a replay. Returns whether
    /// the iteration was replayed to its end on its plan.
    #[inline]
    fn finish(&mut self) -> bool {
        if let Mode::Replaying { index } = self.mode {
            // The common case first (a replay records no events).
            debug_assert!(self.shown == Some(index));
            if self.pos == self.steps.len() {
                self.stats.planned_iterations += 1;
                self.mode = Mode::Idle;
                return true;
            }
        }
        self.finish_general()
    }

    /// [`GroupState::finish`] but for a replay that reached the end of its plan.
    #[cold]
    #[inline(never)]
    fn finish_general(&mut self) -> bool {
        let mut on_plan = false;
        match self.mode {
            Mode::Recording if !self.truncated && !self.events.is_empty() => {
                let Some(script) = Script::new(self.key, &self.events) else {
                    self.stats.recorded_iterations += 1;
                    self.events.clear();
                    self.mode = Mode::Idle;
                    return false;
                };
                self.stats.plans += 1;
                self.stats.recorded_iterations += 1;
                let index = match self.plans.iter().position(|p| p.key == self.key) {
                    Some(index) => {
                        if self.plans[index].stale {
                            self.stats.replans += 1;
                        }
                        self.plans[index] = script;
                        index
                    }
                    None if self.plans.len() < self.capacity => {
                        self.plans.push(script);
                        self.plans.len() - 1
                    }
                    None => {
                        let oldest = (0..self.plans.len()).min_by_key(|&i| self.plans[i].last_used).unwrap_or(0);
                        self.plans[oldest] = script;
                        self.stats.evictions += 1;
                        oldest
                    }
                };
                self.clock += 1;
                self.plans[index].last_used = self.clock;
                self.show(index);
                // The memory is there once the shape has been seen (a failure is
                // reported by the start that needs it; after a refusal, that start
                // decides whether to ask again).
                if !self.refusals.stand() {
                    if let Err(source) = self.fit_arena(index) {
                        // Counted as refused now, reported by the start that needs it.
                        self.refusals.refused(self.plans[index].bytes, self.general_starts);
                        self.unreported = Some(source);
                    }
                }
            }
            Mode::Recording => self.stats.recorded_iterations += 1,
            Mode::Replaying { .. } => {
                if self.pos == self.steps.len() {
                    self.stats.planned_iterations += 1;
                    on_plan = true;
                } else {
                    // Ended early: a step of the plan never came.
                    self.diverge();
                }
            }
            Mode::OffPlan | Mode::Idle => {}
        }
        self.events.clear();
        self.truncated = false;
        self.mode = Mode::Idle;
        on_plan
    }

    /// Ends the current iteration without planning or judging it.
    fn abandon(&mut self) {
        // One already off its plan was counted when it left it.
        if matches!(self.mode, Mode::Recording | Mode::Replaying { .. }) {
            self.stats.abandoned_iterations += 1;
        }
        self.events.clear();
        self.truncated = false;
        self.mode = Mode::Idle;
    }

    /// Makes `plans[index]` the plan shown and replayed.
    fn show(&mut self, index: usize) {
        self.shown = Some(index);
        self.steps = self.plans[index].steps.clone();
    }

    /// Grows the arena to hold `plans[index]`, if it does not. Only while no member
    /// holds a window (`live == 0`): then nothing refers to the arena.
    #[inline]
    fn fit_arena(&mut self, index: usize) -> std::result::Result<(), crate::error::BackendError> {
        if self.live > 0 || self.arena_holds(index) {
            return Ok(());
        }
        self.grow_arena(index)
    }

    /// [`GroupState::fit_arena`] for a start, which runs off the plan when it fails: a
    /// size the backend refused (or a larger one) is asked for again only after a
    /// back-off, and only the first refusal since the last growth is returned, to be
    /// reported; `Err(None)` for the others.
    #[cold]
    fn fit_arena_or_back_off(&mut self, index: usize) -> std::result::Result<(), Option<crate::error::BackendError>> {
        if self.live > 0 || self.arena_holds(index) {
            return Ok(());
        }
        let bytes = self.plans[index].bytes;
        if self.refusals.defers(bytes, self.general_starts) {
            // A refusal when the plan was made is reported by the first start it fails.
            return Err(self.unreported.take());
        }
        match self.grow_arena(index) {
            Ok(()) => {
                self.refusals.granted(bytes);
                Ok(())
            }
            Err(source) => {
                let unreported = self.unreported.take().is_some();
                let first = self.refusals.refused(bytes, self.general_starts) || unreported;
                Err(first.then_some(source))
            }
        }
    }

    /// Whether the arena holds `plans[index]`: long enough, its base aligned enough.
    #[inline]
    fn arena_holds(&self, index: usize) -> bool {
        let plan = &self.plans[index];
        plan.bytes <= self.arena_bytes && plan.align <= self.base_align
    }

    /// Replaces the arena with one that holds `plans[index]`.
    #[cold]
    fn grow_arena(&mut self, index: usize) -> std::result::Result<(), crate::error::BackendError> {
        let (bytes, align) = (self.plans[index].bytes, self.plans[index].align);
        self.grow_to(bytes, align)?;
        self.stats.arena_lower_bound_bytes = self.plans[index].lower_bound;
        Ok(())
    }

    /// Replaces the arena with one of at least `bytes` (and of the bytes it has now),
    /// its base aligned to `align` (and to what it is aligned to now). Only while no
    /// member holds a window.
    fn grow_to(&mut self, bytes: usize, align: usize) -> std::result::Result<(), crate::error::BackendError> {
        debug_assert_eq!(self.live, 0);
        let align = align.max(self.base_align);
        let block = self.backend.allocate_arena(bytes.max(self.arena_bytes).max(1), align)?;
        self.base = Some(block.base());
        // Aligned as asked, and as the backend aligns every arena (its `unsafe`
        // contract): a plan aligned to no more than that fits without a new arena.
        self.base_align = align.max(self.backend.base_alignment());
        self.arena_bytes = block.len();
        if let Some(old) = self.arena.replace(block) {
            self.backend.release(old);
        }
        Ok(())
    }

    /// Starts an iteration of `key`: replays its plan when there is a fresh one (and no
    /// member holds a window of the last iteration), records it otherwise.
    #[inline]
    fn start(&mut self, key: u64) -> std::result::Result<(), Option<crate::error::BackendError>> {
        // The common case first: after a finished iteration, the same key again. (The
        // plan shown is the one used last, so the cache's order of use stays as it is.)
        if let (Mode::Idle, 0, Some(index)) = (self.mode, self.live, self.shown) {
            let plan = &self.plans[index];
            if plan.key == key && !plan.stale && self.arena_holds(index) {
                self.key = key;
                self.pos = 0;
                self.mode = Mode::Replaying { index };
                return Ok(());
            }
        }
        self.start_general(key)
    }

    /// [`GroupState::start`] in every case.
    #[cold]
    #[inline(never)]
    fn start_general(&mut self, key: u64) -> std::result::Result<(), Option<crate::error::BackendError>> {
        self.general_starts += 1;
        if self.mode != Mode::Idle {
            let _ = self.finish();
        }
        self.key = key;
        self.pos = 0;
        let found = match self.shown {
            // Most iterations have the shape of the one before.
            Some(index) if self.plans[index].key == key => Some(index),
            _ => self.plans.iter().position(|p| p.key == key),
        };
        match found {
            Some(_) if self.live > 0 => {
                // A member's cycle still holds a window of the last iteration: planned
                // bytes may be live, so this iteration cannot use the plan. Nothing
                // diverged: the plan stays good for the next iteration of the key.
                self.mode = Mode::OffPlan;
                self.stats.blocked_iterations += 1;
            }
            Some(index) if !self.plans[index].stale => {
                self.fit_arena_or_back_off(index)?;
                self.clock += 1;
                self.plans[index].last_used = self.clock;
                self.show(index);
                self.mode = Mode::Replaying { index };
            }
            _ => self.mode = Mode::Recording,
        }
        Ok(())
    }

    fn stats(&self, name: &str) -> PlannedStats {
        let mut stats = self.stats.clone();
        stats.name = name.to_string();
        stats.arena_bytes = self.arena_bytes;
        stats.cached_plans = self.plans.len();
        if let Some(plan) = self.shown.and_then(|i| self.plans.get(i)) {
            stats.plan_bytes = plan.bytes;
            stats.lower_bound_bytes = plan.lower_bound;
            stats.plan_to_bound = plan.bytes as f64 / plan.lower_bound.max(1) as f64;
            stats.per_role_bytes = plan.per_role_bytes;
            stats.allocations = plan.allocations;
            stats.planning_us = plan.planning.as_micros() as u64;
        }
        stats
    }
}

/// What a group's members share: the group's state, reachable on the group's thread
/// only.
pub(crate) struct GroupShared<B: ArenaBackend> {
    id: u64,
    name: Arc<str>,
    thread: u64,
    state: RefCell<GroupState<B>>,
}

// SAFETY: `state` (the only field that is not `Sync` by itself) is borrowed only in
// `GroupShared::state`, which returns nothing on any thread but `thread`: so it is only
// ever touched by one thread, the one that made the group. The other fields are
// immutable. The state is dropped with the last `Arc`, on whichever thread drops it:
// then no other reference exists, and the `Arc`'s count orders that drop after every
// earlier use; dropping moves the backend and its blocks, which are `Send`.
unsafe impl<B: ArenaBackend> Sync for GroupShared<B> where B::Block: Send {}
// SAFETY: as for `Sync`: sending the group sends its backend and blocks, which are
// `Send`, and the state stays reachable from the group's thread only.
unsafe impl<B: ArenaBackend> Send for GroupShared<B> where B::Block: Send {}

impl<B: ArenaBackend> GroupShared<B> {
    fn new(name: &str, backend: B, capacity: usize) -> GroupShared<B> {
        GroupShared {
            id: crate::engine::next_id(),
            name: Arc::from(name),
            thread: thread_token(),
            state: RefCell::new(GroupState {
                backend,
                arena: None,
                base: None,
                base_align: 1,
                arena_bytes: 0,
                mode: Mode::Idle,
                key: 0,
                pos: 0,
                live: 0,
                events: Vec::new(),
                truncated: false,
                plans: Vec::new(),
                capacity: capacity.max(1),
                clock: 0,
                refusals: Refusals::default(),
                general_starts: 0,
                unreported: None,
                shown: None,
                steps: Arc::from([]),
                stats: PlannedStats::default(),
            }),
        }
    }

    /// The group's state, on the group's thread and when nothing else borrows it.
    #[inline]
    pub(crate) fn state(&self) -> Option<RefMut<'_, GroupState<B>>> {
        if thread_token() != self.thread {
            return None;
        }
        self.state.try_borrow_mut().ok()
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn stats(&self) -> Option<PlannedStats> {
        self.state().map(|state| state.stats(&self.name))
    }
}

impl<B: ArenaBackend> std::fmt::Debug for GroupShared<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupShared").field("name", &self.name).field("id", &self.id).finish_non_exhaustive()
    }
}

/// A group of host workspaces planned together; see the [module documentation](self).
///
/// Cloning gives another handle to the same group. `!Send`: a group belongs to the
/// thread that made it.
#[derive(Clone, Debug)]
pub struct PlanGroup {
    shared: Arc<GroupShared<HostBackend>>,
    members: Rc<RefCell<Vec<Rc<Workspace>>>>,
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
            shared: Arc::new(GroupShared::new(name, HostBackend::Ram, plans)),
            members: Rc::new(RefCell::new(Vec::new())),
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
            let ws = Workspace::new(name, config.clone())?;
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
        ws.engine().join_group(Some(self.shared.clone()))
    }

    /// Makes `ws` an unplanned workspace again.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while `ws` is open; [`Error::InvalidInput`] when it is not
    /// a member of this group.
    pub fn leave(&self, ws: &Workspace) -> Result<()> {
        if ws.engine().group_id() != Some(self.shared.id()) {
            return Err(Error::InvalidInput(format!(
                "workspace '{}' is not a member of plan group '{}'",
                ws.name(),
                self.shared.name
            )));
        }
        ws.engine().join_group(None)?;
        self.members.borrow_mut().retain(|m| !std::ptr::eq(&**m, ws));
        Ok(())
    }

    /// The members made by [`PlanGroup::workspace`].
    pub fn workspaces(&self) -> Vec<Rc<Workspace>> {
        self.members.borrow().clone()
    }

    #[inline]
    fn state(&self) -> Result<RefMut<'_, GroupState<HostBackend>>> {
        match self.shared.state() {
            Some(state) => Ok(state),
            None => Err(self.busy()),
        }
    }

    #[cold]
    #[inline(never)]
    fn busy(&self) -> Error {
        Error::InvalidInput(format!(
            "plan group '{}' is busy (used from inside a member's allocation)",
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
        Error::Backend { workspace: self.shared.name.clone(), source }
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
        let mut state = self.state()?;
        match state.start(key) {
            Ok(()) => Ok(()),
            Err(refused) => {
                state.mode = Mode::OffPlan;
                state.stats.failed_growths += 1;
                match refused {
                    Some(source) => Err(self.backend_error(source)),
                    None => Ok(()),
                }
            }
        }
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
        Ok(self.state()?.finish())
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
        self.state()?.abandon();
        Ok(())
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

    /// The group's figures.
    pub fn stats(&self) -> PlannedStats {
        self.shared.stats().unwrap_or_default()
    }

    /// Bytes of the planned arena (0 off the group's thread, or from inside a member's
    /// allocation). Allocates nothing.
    pub fn capacity(&self) -> usize {
        self.shared.state().map_or(0, |state| state.arena_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Address;
    use crate::error::BackendError;
    use crate::{LearningPolicy, SpillPolicy};

    fn base(group: &PlanGroup) -> Option<u64> {
        group.shared.state().and_then(|state| state.base).map(|base| base.address())
    }

    /// Host RAM that refuses arenas longer than `limit`, counting what it is asked for.
    struct Refusing {
        limit: Arc<std::sync::atomic::AtomicUsize>,
        asked: Arc<std::sync::atomic::AtomicUsize>,
    }

    // SAFETY: every block is host RAM's, as `HostBackend::Ram` hands it out; refusing
    // more often than it does breaks no promise.
    unsafe impl ArenaBackend for Refusing {
        type Block = <HostBackend as ArenaBackend>::Block;
        fn kind(&self) -> &'static str {
            "refusing"
        }
        fn base_alignment(&self) -> usize {
            HostBackend::Ram.base_alignment()
        }
        fn allocate_arena(&mut self, bytes: usize, align: usize) -> std::result::Result<Self::Block, BackendError> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            if bytes > self.limit.load(Ordering::Relaxed) {
                return Err(BackendError::OutOfMemory { bytes, align });
            }
            HostBackend::Ram.allocate_arena(bytes, align)
        }
        fn allocate_spill(&mut self, bytes: usize, align: usize) -> std::result::Result<Self::Block, BackendError> {
            HostBackend::Ram.allocate_spill(bytes, align)
        }
        fn release(&mut self, block: Self::Block) {
            HostBackend::Ram.release(block)
        }
    }

    #[test]
    fn a_refused_arena_is_reported_once_and_asked_for_again_after_a_back_off() {
        let limit = Arc::new(std::sync::atomic::AtomicUsize::new(1000));
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let shared = GroupShared::new("G", Refusing { limit: limit.clone(), asked: asked.clone() }, 8);
        let mut state = shared.state().unwrap();
        let events = [Event::Alloc { owner: 1, bytes: 1 << 20, align: 64 }, Event::Close { owner: 1 }];
        state.plans.push(Script::new(7, &events).unwrap());
        // As `PlanGroup::start_iteration` and an iteration whose work was given up.
        let iteration = |state: &mut GroupState<Refusing>| {
            let outcome = match state.start(7) {
                Ok(()) => 'p',
                Err(refused) => {
                    state.mode = Mode::OffPlan;
                    state.stats.failed_growths += 1;
                    if refused.is_some() {
                        'E'
                    } else {
                        'o'
                    }
                }
            };
            state.abandon();
            outcome
        };
        let outcomes: String = (0..40).map(|_| iteration(&mut state)).collect();
        assert_eq!(outcomes, format!("E{}", "o".repeat(39)), "reported once, then run off the plan");
        // Asked at the first start, then after back-offs of 2, 4, 8 and 16 starts.
        assert_eq!((asked.load(Ordering::Relaxed), state.stats.failed_growths), (5, 40));
        // Memory comes back: the next retry grows the arena, without an error.
        limit.store(usize::MAX, Ordering::Relaxed);
        let outcomes: String = (0..40).map(|_| iteration(&mut state)).collect();
        assert!(outcomes.starts_with('o') && outcomes.ends_with('p') && !outcomes.contains('E'), "{outcomes}");
        assert!(state.arena_bytes >= 1 << 20);
        assert!(!state.refusals.stand());
    }

    #[test]
    fn plans_are_replayed_in_the_reserved_arena_itself() {
        let group = PlanGroup::new("G");
        let config = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build();
        let ws = group.workspace("A", &config.unwrap()).unwrap();
        group.reserve(1 << 20).unwrap();
        let reserved = base(&group);
        assert!(reserved.is_some());
        for _ in 0..3 {
            group.start_iteration(0).unwrap();
            {
                let s = ws.enter().unwrap();
                let x = s.filled::<f64, _>(100, 1.0).unwrap();
                assert!(ws.contains(x.as_ptr().cast::<u8>(), 800));
            }
            group.finish_iteration().unwrap();
        }
        assert_eq!(group.stats().planned_iterations, 2);
        // Not replaced by a second arena of the same size when the first plan came.
        assert_eq!(base(&group), reserved);
    }
}
