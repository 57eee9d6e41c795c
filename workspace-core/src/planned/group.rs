//! The group's state and the iteration protocol: start, finish and abandon; the plan
//! cache; the arena, grown to hold the largest plan.

use std::cell::{Cell, RefCell, RefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::script::{Script, Step};
use super::MAX_RECORDED_EVENTS;
use crate::backend::{ArenaBackend, Block};
use crate::engine::Lent;
use crate::figures::PlannedStats;
use crate::plan::{Event, Planner};
use crate::refusals::Refusals;

thread_local! {
    /// The calling thread's [`thread_token`]; 0 until it first asks.
    static TOKEN: Cell<u64> = const { Cell::new(0) };
}

/// A number for the calling thread, unique over the process's life.
#[inline(always)]
pub(super) fn thread_token() -> u64 {
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

/// Why a group could not become another's twin ([`GroupState::copy_from`]).
#[derive(Debug)]
pub(super) enum CopyError {
    /// A plan's step names a workspace the twin has no member for.
    Owner,
    /// The backend refused the arena.
    Backend(crate::error::BackendError),
}

/// What the group is doing in the current iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Between iterations: members allocate as unplanned workspaces.
    Idle,
    /// Recording the iteration.
    Recording,
    /// Replaying `plans[index]`.
    Replaying { index: usize },
    /// Off the plan for the rest of the iteration.
    OffPlan,
}

/// The group's state. Reached only on the group's thread ([`GroupShared::state`]).
pub(super) struct GroupState<B: ArenaBackend> {
    pub(super) backend: B,
    pub(super) arena: Option<B::Block>,
    pub(super) base: Option<<B::Block as Block>::Base>,
    /// Alignment of `base`.
    pub(super) base_align: usize,
    pub(super) arena_bytes: usize,
    pub(super) mode: Mode,
    pub(super) key: u64,
    /// Next step of the plan replayed.
    pub(super) pos: usize,
    /// Members that hold a window of the arena in their open cycle.
    pub(super) live: usize,
    pub(super) events: Vec<Event>,
    pub(super) truncated: bool,
    pub(super) plans: Vec<Script>,
    pub(super) capacity: usize,
    pub(super) clock: u64,
    /// Arena growths the backend refused, in starts that needed a growth (see
    /// [`crate::refusals`]).
    pub(super) refusals: Refusals,
    /// Starts that needed the arena to grow: the back-off's clock.
    pub(super) starts: u64,
    /// A refusal when a plan was made, which no start has reported yet.
    pub(super) unreported: Option<crate::error::BackendError>,
    /// The plan whose figures the statistics show: the one used last.
    pub(super) shown: Option<usize>,
    /// The steps of plan `shown` (the one a replay follows), at hand.
    pub(super) steps: Arc<[Step]>,
    pub(super) stats: PlannedStats,
    /// Whether the recording in progress lends the arena to its members' requests that
    /// would spill: only when it started with no member holding a window.
    pub(super) lending: bool,
    /// The planner, whose room is kept between plans.
    pub(super) planner: Planner,
    /// Where a plan's steps are built.
    pub(super) building: Vec<Step>,
    /// What the recording in progress has lent and is live: `(start, end, owner)`,
    /// sorted by start.
    pub(super) extents: Vec<(usize, usize, u64)>,
}

impl<B: ArenaBackend> GroupState<B> {
    /// Records an event of a recording iteration.
    pub(super) fn record(&mut self, event: Event) {
        if self.events.len() < MAX_RECORDED_EVENTS {
            self.events.push(event);
        } else {
            self.truncated = true;
        }
    }

    /// An event of a member: recorded while recording; while replaying, a close is
    /// checked against the plan's next step (an allocation's run was checked when its
    /// window was lent).
    #[inline(always)]
    pub(super) fn step(&mut self, event: Event) {
        match self.mode {
            Mode::Recording => {
                if let (true, Event::Close { owner }) = (self.lending, event) {
                    // What the owner allocated dies here (a cycle's close ends its
                    // frames too).
                    let cycle = crate::plan::is_cycle(owner);
                    self.extents.retain(|&(_, _, o)| !(o == owner || cycle && crate::plan::cycle_of(o) == owner));
                }
                self.record(event)
            }
            Mode::Replaying { .. } => {
                if let Event::Close { owner } = event {
                    if !self.takes_close(owner) {
                        self.diverge();
                    }
                }
            }
            Mode::Idle | Mode::OffPlan => {}
        }
    }

    /// While replaying: when the plan's next step is the close of `owner`, takes it.
    /// Whether it did.
    #[inline(always)]
    pub(super) fn takes_close(&mut self, owner: u64) -> bool {
        match self.steps.get(self.pos) {
            Some(&Step::Close { owner: planned }) if planned == owner => {
                self.pos += 1;
                true
            }
            _ => false,
        }
    }

    /// While replaying: when the plan's next step is a run of `owner`, takes it and
    /// returns its window. A cycle that holds no window yet (`holds`) holds the arena
    /// from now until its members' `release`.
    pub(super) fn take_run(&mut self, owner: u64, holds: bool) -> Option<Lent<B>> {
        let Mode::Replaying { .. } = self.mode else { return None };
        match self.steps.get(self.pos).copied() {
            // (An arena is there whenever a replay runs: the start grew it, and `trim`
            // ends the replay. Checked all the same: a window must lie in an arena.)
            Some(Step::Run { owner: planned, start, end }) if planned == owner => {
                let base = self.base?;
                self.pos += 1;
                if !holds {
                    self.live += 1;
                }
                Some(Lent { base, base_align: self.base_align, start, end })
            }
            _ => None,
        }
    }

    /// While a recording lends: `size` bytes for the cycle `owner` at `align`, in the
    /// lowest gap of the arena that holds them where no live lent chunk is (first fit).
    /// A cycle that holds no window yet (`holds`) holds the arena until its release.
    pub(super) fn lend(&mut self, owner: u64, size: usize, align: usize, holds: bool) -> Option<Lent<B>> {
        if self.mode != Mode::Recording || !self.lending || align > self.base_align {
            return None;
        }
        let base = self.base?;
        // The gaps between the live chunks (by start), and the one above the last.
        let mut from = 0usize;
        let mut found = None;
        for (i, &(start, end, _)) in self.extents.iter().chain([&(self.arena_bytes, self.arena_bytes, 0)]).enumerate() {
            if let Some(at) = from.checked_next_multiple_of(align) {
                if at.checked_add(size).is_some_and(|e| e <= start) {
                    found = Some((i, at, at + size));
                    break;
                }
            }
            from = from.max(end);
        }
        let (index, start, end) = found?;
        self.extents.insert(index, (start, end, owner));
        if !holds {
            self.live += 1;
        }
        Some(Lent { base, base_align: self.base_align, start, end })
    }

    /// Leaves the plan for the rest of the iteration.
    pub(super) fn diverge(&mut self) {
        if let Mode::Replaying { index } = self.mode {
            self.plans[index].stale = true;
            self.stats.divergences += 1;
            self.mode = Mode::OffPlan;
        }
    }

    /// Ends the current iteration: plans a recording, counts a replay. Returns whether
    /// the iteration was replayed to its end on its plan.
    pub(super) fn finish(&mut self) -> bool {
        let mut on_plan = false;
        match self.mode {
            Mode::Recording if !self.truncated && !self.events.is_empty() => {
                let Some(script) = Script::new(self.key, &self.events, &mut self.planner, &mut self.building) else {
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
                        self.refusals.refused(self.plans[index].bytes, self.starts);
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
    pub(super) fn abandon(&mut self) {
        // One already off its plan was counted when it left it.
        if matches!(self.mode, Mode::Recording | Mode::Replaying { .. }) {
            self.stats.abandoned_iterations += 1;
        }
        self.events.clear();
        self.truncated = false;
        self.mode = Mode::Idle;
    }

    /// Makes `plans[index]` the plan shown and replayed.
    pub(super) fn show(&mut self, index: usize) {
        self.shown = Some(index);
        self.steps = self.plans[index].steps.clone();
    }

    /// Grows the arena to hold `plans[index]`, if it does not. Only while no member
    /// holds a window (`live == 0`): then nothing refers to the arena.
    #[inline]
    pub(super) fn fit_arena(&mut self, index: usize) -> std::result::Result<(), crate::error::BackendError> {
        if self.live > 0 || self.arena_holds(index) {
            return Ok(());
        }
        self.grow_arena(index)
    }

    /// The bytes and the lower bound of the plan of the key started last, if it has one.
    pub(super) fn plan_of_key(&self) -> Option<(usize, usize)> {
        self.plans.iter().find(|p| p.key == self.key).map(|p| (p.bytes, p.lower_bound))
    }

    /// [`GroupState::fit_arena`] for a start, which runs off the plan when it fails: a
    /// size the backend refused (or a larger one) is asked for again only after a
    /// back-off, and only the first refusal since the last growth is returned, to be
    /// reported; `Err(None)` for the others. A start that needs a growth is a tick of
    /// the back-off's clock.
    #[inline]
    pub(super) fn fit_arena_or_back_off(
        &mut self,
        index: usize,
    ) -> std::result::Result<(), Option<crate::error::BackendError>> {
        if self.live > 0 || self.arena_holds(index) {
            return Ok(());
        }
        self.starts += 1;
        self.grow_arena_or_back_off(index)
    }

    /// [`GroupState::fit_arena_or_back_off`] once a growth is needed.
    #[cold]
    fn grow_arena_or_back_off(&mut self, index: usize) -> std::result::Result<(), Option<crate::error::BackendError>> {
        let bytes = self.plans[index].bytes;
        if self.refusals.defers(bytes, self.starts) {
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
                let first = self.refusals.refused(bytes, self.starts) || unreported;
                Err(first.then_some(source))
            }
        }
    }

    /// Whether the arena holds `plans[index]`: long enough, its base aligned enough.
    #[inline]
    pub(super) fn arena_holds(&self, index: usize) -> bool {
        let plan = &self.plans[index];
        plan.bytes <= self.arena_bytes && plan.align <= self.base_align
    }

    /// Replaces the arena with one that holds `plans[index]`.
    #[cold]
    pub(super) fn grow_arena(&mut self, index: usize) -> std::result::Result<(), crate::error::BackendError> {
        let (bytes, align) = (self.plans[index].bytes, self.plans[index].align);
        self.grow_to(bytes, align)?;
        self.stats.arena_lower_bound_bytes = self.plans[index].lower_bound;
        Ok(())
    }

    /// Replaces the arena with one of at least `bytes` (and of the bytes it has now),
    /// its base aligned to `align` (and to what it is aligned to now). Only while no
    /// member holds a window.
    pub(super) fn grow_to(
        &mut self,
        bytes: usize,
        align: usize,
    ) -> std::result::Result<(), crate::error::BackendError> {
        debug_assert_eq!(self.live, 0);
        let align = align.max(self.base_align);
        let block = self.backend.allocate_arena(bytes.max(self.arena_bytes).max(1), align)?;
        // Nothing lent is live while no member holds a window.
        self.extents.clear();
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
    /// member holds a window of the last iteration), records it otherwise. One path for
    /// every case: the common one (the key of the iteration before, its plan fresh and
    /// held by the arena) costs a few compares more than a copy of its own would.
    #[inline]
    pub(super) fn start(&mut self, key: u64) -> std::result::Result<(), Option<crate::error::BackendError>> {
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
                if self.shown != Some(index) {
                    self.show(index);
                }
                self.mode = Mode::Replaying { index };
            }
            _ => {
                // The recording lends the arena only where nothing of it is held.
                self.lending = self.live == 0 && self.base.is_some();
                if self.live == 0 {
                    self.extents.clear();
                }
                self.mode = Mode::Recording;
            }
        }
        Ok(())
    }

    /// Takes `from`'s plans (each step's owner mapped by `owner`), their cache's size and
    /// order of use, its arena's size and alignment and its figures as its own: a
    /// new group becomes a twin of `from` (see `PlanGroup::shape_only_twin`). Only while
    /// both are idle and this one is new.
    ///
    /// # Errors
    ///
    /// The owner `owner` could not map, or the backend's refusal of the arena.
    pub(super) fn copy_from(
        &mut self,
        from: &GroupState<B>,
        owner: impl Fn(u64) -> Option<u64>,
    ) -> std::result::Result<(), CopyError> {
        debug_assert!(self.plans.is_empty() && self.mode == Mode::Idle && from.mode == Mode::Idle);
        let mut plans = Vec::with_capacity(from.plans.len());
        for plan in &from.plans {
            let steps = plan
                .steps
                .iter()
                .map(|&step| match step {
                    Step::Run { owner: o, start, end } => owner(o).map(|o| Step::Run { owner: o, start, end }),
                    Step::Close { owner: o } => owner(o).map(|o| Step::Close { owner: o }),
                })
                .collect::<Option<Vec<Step>>>()
                .ok_or(CopyError::Owner)?;
            plans.push(Script { steps: Arc::from(steps), ..plan.clone_figures() });
        }
        if from.arena_bytes > 0 {
            self.grow_to(from.arena_bytes, from.base_align).map_err(CopyError::Backend)?;
        }
        self.plans = plans;
        self.capacity = from.capacity;
        self.clock = from.clock;
        self.starts = from.starts;
        self.stats = from.stats.clone();
        self.key = from.key;
        if let Some(index) = from.shown {
            self.show(index);
        }
        Ok(())
    }

    pub(super) fn stats(&self, name: &str) -> PlannedStats {
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

/// The arena goes back through the backend's `release`, as a replaced one does (a
/// backend may order the free after work that still uses it: a device group's does).
impl<B: ArenaBackend> Drop for GroupState<B> {
    fn drop(&mut self) {
        if let Some(arena) = self.arena.take() {
            self.backend.release(arena);
        }
    }
}

/// What a group's members share: the group's state, reachable on the group's thread
/// only.
pub(super) struct GroupShared<B: ArenaBackend> {
    pub(super) id: u64,
    pub(super) name: Arc<str>,
    /// The thread whose calls reach `state` ([`thread_token`]): the one that made the
    /// group, or the one [`GroupShared::rebind`] handed it to.
    pub(super) thread: AtomicU64,
    pub(super) state: RefCell<GroupState<B>>,
}

// SAFETY: `state` (the only field that is not `Sync` by itself) is borrowed only in
// `GroupShared::state`, which returns nothing on any thread but `thread`: so it is only
// ever touched by one thread, the one that made the group or the one `rebind` (an
// `unsafe fn`, whose callers guarantee that no other thread can reach the group) handed
// it to. The other fields are immutable. The state is dropped with the last `Arc`, on whichever thread drops it:
// then no other reference exists, and the `Arc`'s count orders that drop after every
// earlier use; dropping moves the backend and its blocks, which are `Send`.
unsafe impl<B: ArenaBackend> Sync for GroupShared<B> where B::Block: Send {}
// SAFETY: as for `Sync`: sending the group sends its backend and blocks, which are
// `Send`, and the state stays reachable from the group's thread only.
unsafe impl<B: ArenaBackend> Send for GroupShared<B> where B::Block: Send {}

impl<B: ArenaBackend> GroupShared<B> {
    pub(super) fn new(name: &str, backend: B, capacity: usize) -> GroupShared<B> {
        GroupShared {
            id: crate::engine::next_id(),
            name: Arc::from(name),
            thread: AtomicU64::new(thread_token()),
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
                starts: 0,
                unreported: None,
                shown: None,
                steps: Arc::from([]),
                stats: PlannedStats::default(),
                lending: false,
                planner: Planner::default(),
                building: Vec::new(),
                extents: Vec::new(),
            }),
        }
    }

    /// The group's state, on the group's thread and when nothing else borrows it.
    #[inline]
    pub(super) fn state(&self) -> Option<RefMut<'_, GroupState<B>>> {
        if thread_token() != self.thread.load(Ordering::Relaxed) {
            return None;
        }
        self.state.try_borrow_mut().ok()
    }

    /// Makes the calling thread the group's thread: from now on its calls reach the
    /// state, and those of the thread that had it do not.
    ///
    /// # Safety
    ///
    /// No other thread may reach this group now (hold an `Arc` of it, or a member
    /// workspace that does), and the calling thread got every reference it holds
    /// through a hand-over that orders the earlier thread's uses before its own (a
    /// mutex, a channel, a join). Then the state's last user is ordered before this
    /// thread's first, and relaxed ordering suffices.
    pub(super) unsafe fn rebind(&self) {
        self.thread.store(thread_token(), Ordering::Relaxed);
    }

    pub(super) fn id(&self) -> u64 {
        self.id
    }

    pub(super) fn stats(&self) -> Option<PlannedStats> {
        self.state().map(|state| state.stats(&self.name))
    }
}

impl<B: ArenaBackend> std::fmt::Debug for GroupShared<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupShared").field("name", &self.name).field("id", &self.id).finish_non_exhaustive()
    }
}
