//! Planned memory: offsets in one arena for every allocation of an iteration, planned
//! from the lifetimes one recorded iteration shows.
//!
//! An iteration is a sequence of [`Event`]s: allocations, each made in an *owner* (the
//! cycle of a role workspace, or a frame inside it), and closes of owners. Everything an
//! owner allocated since it opened is dead once it closes: the compiler proves it for
//! views (they borrow the scope) and the generation check for handles. So one recorded
//! iteration is an exact lifetime trace, and two allocations may share bytes when their
//! lifetimes do not overlap.
//!
//! - [`Trace`] records the events and derives the lifetimes.
//! - [`Trace::lower_bound`] is the physical minimum: the most bytes live at one moment.
//! - [`Plan::new`] places every allocation at an offset (greedy best fit over a few
//!   orders, as TensorFlow Lite's arena planner and XLA's heap simulator do) and keeps
//!   the smallest result; [`Plan::check`] verifies that no two allocations live at the
//!   same time share a byte.
//! - [`crate::planned::PlanGroup`] serves later iterations from plans: each allocation at
//!   its planned offset while the iteration matches its recording, and off the plan from
//!   the first event that does not, so an iteration that differs from the recording can
//!   never be handed bytes that a live allocation holds.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::figures::PlannedStats;

/// `value` rounded up to a multiple of `align` (any alignment, 0 taken as 1), saturating.
#[inline]
fn align_up(value: usize, align: usize) -> Option<usize> {
    if align.is_power_of_two() {
        // The usual case, without a division.
        return value.checked_add(align - 1).map(|v| v & !(align - 1));
    }
    let align = align.max(1);
    value.div_ceil(align).checked_mul(align)
}

/// The bits of an owner above which a frame's level is kept: owner `id | level << 48`
/// is the frame of that level in the cycle `id` (level 0: the cycle itself; see
/// `Engine::owner_at`). The close of a cycle closes its frames too: a frame lives
/// inside its cycle, so whatever it allocated is dead once the cycle has ended, even
/// if the frame itself never closed.
pub const FRAME_LEVEL_SHIFT: u32 = 48;

/// The cycle an owner belongs to (itself for a cycle; a frame's cycle).
pub(crate) fn cycle_of(owner: u64) -> u64 {
    owner & ((1 << FRAME_LEVEL_SHIFT) - 1)
}

/// Whether `owner` is a cycle (not a frame).
pub(crate) fn is_cycle(owner: u64) -> bool {
    owner >> FRAME_LEVEL_SHIFT == 0
}

/// What is still open, per owner: the close of an owner ends its own items, and the
/// close of a cycle those of its frames as well. Each close takes exactly the lists it
/// ends, so a trace costs O(its events) whatever it holds.
struct Open<T> {
    /// Every item added, with the index of the next item of its owner (`usize::MAX`
    /// after the last): one list per owner, threaded through one vector.
    items: Vec<(T, usize)>,
    /// Per owner with items open, its list's first item, plus one.
    heads: OwnerMap<usize>,
    /// Per cycle, the frames that held something open since it last closed (a frame may
    /// be listed again after its own close; its list is gone by then).
    frames: OwnerMap<Vec<u64>>,
}

impl<T> Default for Open<T> {
    fn default() -> Open<T> {
        Open { items: Vec::new(), heads: OwnerMap::default(), frames: OwnerMap::default() }
    }
}

impl<T: Copy> Open<T> {
    fn add(&mut self, owner: u64, item: T) {
        let head = self.heads.entry(owner);
        let first = *head == 0;
        self.items.push((item, head.wrapping_sub(1)));
        *head = self.items.len();
        if first && !is_cycle(owner) {
            self.frames.entry(cycle_of(owner)).push(owner);
        }
    }

    /// Hands every item that the close of `closed` ends to `end`.
    fn close(&mut self, closed: u64, mut end: impl FnMut(T)) {
        let Open { items, heads, frames } = self;
        let mut take = |owner: u64| {
            let mut at = heads.remove(owner).map_or(usize::MAX, |head| head.wrapping_sub(1));
            while let Some(&(item, next)) = items.get(at) {
                end(item);
                at = next;
            }
        };
        take(closed);
        if is_cycle(closed) {
            // The list stays (empty), so that the cycle's next frames reuse its room.
            if let Some(list) = frames.get_mut(closed) {
                list.drain(..).for_each(&mut take);
            }
        }
    }

    /// Forgets every item, keeping the room the lists have grown to.
    fn clear(&mut self) {
        self.items.clear();
        self.heads.clear();
        self.frames.values_mut(Vec::clear);
    }
}

/// A map from owners: a list searched in order while small (an iteration has a few
/// owners, and a scan of a few beats hashing), a hash map once it is not.
enum OwnerMap<V> {
    Small(Vec<(u64, V)>),
    Large(HashMap<u64, V>),
}

impl<V> Default for OwnerMap<V> {
    fn default() -> OwnerMap<V> {
        OwnerMap::Small(Vec::new())
    }
}

/// Owners a small map holds before it hashes.
const SMALL_MAP: usize = 16;

impl<V: Default> OwnerMap<V> {
    /// The value of `owner`, made if it has none.
    fn entry(&mut self, owner: u64) -> &mut V {
        if let OwnerMap::Small(list) = self {
            if list.len() >= SMALL_MAP && !list.iter().any(|(o, _)| *o == owner) {
                *self = OwnerMap::Large(std::mem::take(list).into_iter().collect());
            }
        }
        match self {
            OwnerMap::Small(list) => match list.iter().position(|(o, _)| *o == owner) {
                Some(at) => &mut list[at].1,
                None => {
                    list.push((owner, V::default()));
                    &mut list.last_mut().expect("just pushed").1
                }
            },
            OwnerMap::Large(map) => map.entry(owner).or_default(),
        }
    }

    /// Takes `owner`'s value out.
    fn remove(&mut self, owner: u64) -> Option<V> {
        match self {
            OwnerMap::Small(list) => list.iter().position(|(o, _)| *o == owner).map(|at| list.swap_remove(at).1),
            OwnerMap::Large(map) => map.remove(&owner),
        }
    }

    /// `owner`'s value, mutable, if it has one.
    fn get_mut(&mut self, owner: u64) -> Option<&mut V> {
        match self {
            OwnerMap::Small(list) => list.iter_mut().find(|(o, _)| *o == owner).map(|(_, v)| v),
            OwnerMap::Large(map) => map.get_mut(&owner),
        }
    }

    /// Applies `f` to every value.
    fn values_mut(&mut self, f: impl FnMut(&mut V)) {
        match self {
            OwnerMap::Small(list) => list.iter_mut().map(|(_, v)| v).for_each(f),
            OwnerMap::Large(map) => map.values_mut().for_each(f),
        }
    }

    /// Forgets every owner, keeping the room the map has grown to.
    fn clear(&mut self) {
        match self {
            OwnerMap::Small(list) => list.clear(),
            OwnerMap::Large(map) => map.clear(),
        }
    }

    /// `owner`'s value, if it has one.
    fn get(&self, owner: u64) -> Option<&V> {
        match self {
            OwnerMap::Small(list) => list.iter().find(|(o, _)| *o == owner).map(|(_, v)| v),
            OwnerMap::Large(map) => map.get(&owner),
        }
    }
}

/// One event of an iteration, in the order it happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// `bytes` bytes aligned to `align` (a power of two), allocated in `owner`.
    Alloc {
        /// The cycle or frame the allocation belongs to.
        owner: u64,
        /// Bytes.
        bytes: usize,
        /// Alignment of the offset (a power of two).
        align: usize,
    },
    /// `owner` closed: everything it allocated since it opened is dead.
    Close {
        /// The cycle or frame that closed.
        owner: u64,
    },
}

/// One allocation of a trace and its lifetime `[start, end)` in event positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    /// Position of the allocation's event.
    pub start: usize,
    /// Position of the close that ends it (the trace's length if none does).
    pub end: usize,
    /// Bytes.
    pub bytes: usize,
    /// Alignment of its offset.
    pub align: usize,
}

/// The events of one recorded iteration.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    events: Vec<Event>,
    /// When each event happened (a process-wide sequence): an event that reaches the
    /// trace late (a workspace that found it locked) still takes its place.
    stamps: Vec<u64>,
}

impl PartialEq for Trace {
    fn eq(&self, other: &Trace) -> bool {
        self.events == other.events
    }
}

impl Eq for Trace {}

/// Reserves `n` consecutive numbers of the process-wide sequence of recorded events;
/// returns the first.
pub(crate) fn stamps(n: usize) -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed)
}

impl Trace {
    /// An empty trace.
    pub fn new() -> Trace {
        Trace::default()
    }

    /// A trace of `events`, in the order they happened.
    pub fn from_events(events: Vec<Event>) -> Trace {
        let first = stamps(events.len());
        let stamps = (first..).take(events.len()).collect();
        Trace { events, stamps }
    }

    /// Records an event (as happening now, after every event the trace holds).
    pub fn push(&mut self, event: Event) {
        self.events.push(event);
        self.stamps.push(stamps(1));
    }

    /// Records events that happened at the stamps they carry (from [`stamps`], in
    /// increasing order), each after every event of the trace that happened before it:
    /// a merge of two ordered lists, O(the events after the first of them).
    pub(crate) fn push_all_stamped(&mut self, batch: Vec<(u64, Event)>) {
        let Some(&(first, _)) = batch.first() else { return };
        let at = self.stamps.partition_point(|&s| s < first);
        let later_events = self.events.split_off(at);
        let later_stamps = self.stamps.split_off(at);
        let mut later = later_stamps.into_iter().zip(later_events).peekable();
        for (stamp, event) in batch {
            while let Some((s, e)) = later.next_if(|&(s, _)| s < stamp) {
                self.stamps.push(s);
                self.events.push(e);
            }
            self.stamps.push(stamp);
            self.events.push(event);
        }
        for (s, e) in later {
            self.stamps.push(s);
            self.events.push(e);
        }
    }

    /// The events.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// The allocations' lifetimes, in the order they were allocated: each lives from
    /// its event to the first close of its owner after it.
    pub fn lifetimes(&self) -> Vec<Lifetime> {
        let mut out = Vec::new();
        lifetimes_into(&self.events, &mut Open::default(), &mut out);
        out
    }

    /// The most bytes live at one moment: no placement can use fewer (computed by a
    /// sweep over the events, independently of any plan).
    pub fn lower_bound(&self) -> usize {
        lower_bound_of(self.events.iter().copied(), &mut Open::default())
    }

    /// The trace with each *run* as one allocation: consecutive allocations of one
    /// owner (no other event between them) live and die together, so a plan may place
    /// them as one block, laid out inside it as the owner's bump arena lays them out
    /// (a run's first allocation is its most aligned: a more aligned one starts a run of
    /// its own, so the run takes exactly the bytes its allocations take in the owner's
    /// arena). What [`planned`](crate::planned) plans.
    pub fn runs(&self) -> Trace {
        let mut runs = Vec::new();
        runs_into(&self.events, &mut runs);
        Trace::from_events(runs)
    }

    /// The bytes the per-owner layout takes: each owner bump-allocating in an arena of
    /// its own, sized to its peak, as the per-role workspaces do (the arenas laid end
    /// to end, each aligned for its allocations).
    pub fn per_owner_bytes(&self) -> usize {
        Layout::default().lay_out(&self.events)
    }
}

/// The lifetimes of the allocations of `events` into `out` (see [`Trace::lifetimes`]),
/// with `open` as scratch.
fn lifetimes_into(events: &[Event], open: &mut Open<usize>, out: &mut Vec<Lifetime>) {
    out.clear();
    out.reserve(events.len());
    open.clear();
    for (i, event) in events.iter().enumerate() {
        match *event {
            Event::Alloc { owner, bytes, align } => {
                open.add(owner, out.len());
                out.push(Lifetime { start: i, end: events.len(), bytes, align });
            }
            Event::Close { owner } => open.close(owner, |index| out[index].end = i),
        }
    }
}

/// [`Trace::lower_bound`] of events as they come, from whatever records them (a
/// timeline keeps its own compact records and gives their events here): the one
/// computation of the most bytes live at one moment.
pub(crate) fn lower_bound(events: impl IntoIterator<Item = Event>) -> usize {
    lower_bound_of(events, &mut Open::default())
}

/// The lower bound of `events` (see [`Trace::lower_bound`]), with `live` as scratch.
fn lower_bound_of(events: impl IntoIterator<Item = Event>, live: &mut Open<usize>) -> usize {
    live.clear();
    let (mut total, mut peak) = (0usize, 0usize);
    for event in events {
        match event {
            Event::Alloc { owner, bytes, .. } => {
                live.add(owner, bytes);
                total = total.saturating_add(bytes);
                peak = peak.max(total);
            }
            Event::Close { owner } => live.close(owner, |bytes| total = total.saturating_sub(bytes)),
        }
    }
    peak
}

/// The runs of `events` into `runs` (see [`Trace::runs`]).
fn runs_into(events: &[Event], runs: &mut Vec<Event>) {
    runs.clear();
    runs.reserve(events.len());
    for &event in events {
        match (event, runs.last_mut()) {
            (
                Event::Alloc { owner, bytes, align },
                Some(Event::Alloc { owner: last, bytes: run, align: run_align }),
            ) if owner == *last && (*run_align).max(1).is_multiple_of(align.max(1)) => {
                *run = align_up(*run, align).unwrap_or(usize::MAX).saturating_add(bytes);
            }
            _ => runs.push(event),
        }
    }
}

/// A cycle's arena in the per-owner layout: its allocations in address order (end,
/// dead) up to the last live one, its peak and its alignment.
struct Arena {
    stack: Vec<(usize, bool)>,
    peak: usize,
    align: usize,
}

/// The per-owner layout of a list of events, with the room it needs kept for the next:
/// each cycle bump-allocates in an arena of its own, sized to its peak, as a workspace
/// does; its frames share that arena, and a frame's close gives back the bytes at the
/// top of it that are dead (as the engine's rewind does: never below an allocation
/// still live).
#[derive(Default)]
struct Layout {
    /// The arenas, first use first (the first `used` are this layout's).
    arenas: Vec<Arena>,
    used: usize,
    index: OwnerMap<Option<usize>>,
    /// The live allocations, as (arena, position in its stack).
    open: Open<(usize, usize)>,
    relative: Vec<usize>,
    bases: Vec<usize>,
    /// The offset of each allocation (by event position; `usize::MAX` for closes).
    offsets: Vec<usize>,
}

impl Layout {
    /// Lays `events` out; returns the size (the offsets are in `self.offsets`).
    fn lay_out(&mut self, events: &[Event]) -> usize {
        self.used = 0;
        self.index.clear();
        self.open.clear();
        self.relative.clear();
        self.relative.resize(events.len(), usize::MAX);
        // Pass 1: each allocation's offset in its cycle's arena.
        for (i, event) in events.iter().enumerate() {
            match *event {
                Event::Alloc { owner, bytes, align } => {
                    let cycle = cycle_of(owner);
                    let (arenas, used) = (&mut self.arenas, &mut self.used);
                    let at = *self.index.entry(cycle).get_or_insert_with(|| {
                        if *used == arenas.len() {
                            arenas.push(Arena { stack: Vec::new(), peak: 0, align: 1 });
                        }
                        let arena = &mut arenas[*used];
                        arena.stack.clear();
                        (arena.peak, arena.align) = (0, 1);
                        *used += 1;
                        *used - 1
                    });
                    let arena = &mut self.arenas[at];
                    let top = arena.stack.last().map_or(0, |&(end, _)| end);
                    let start = align_up(top, align.max(1)).unwrap_or(usize::MAX);
                    let end = start.saturating_add(bytes);
                    self.open.add(owner, (at, arena.stack.len()));
                    arena.stack.push((end, false));
                    arena.peak = arena.peak.max(end);
                    arena.align = lcm(arena.align, align.max(1));
                    self.relative[i] = start;
                }
                Event::Close { owner } => {
                    let arenas = &mut self.arenas;
                    self.open.close(owner, |(at, position)| arenas[at].stack[position].1 = true);
                    if let Some(&Some(at)) = self.index.get(cycle_of(owner)) {
                        // Dead allocations give their bytes back from the top only: one
                        // below a live allocation keeps them until that one dies, as in
                        // the engine. (A live allocation is never popped, so the positions
                        // above stay right.)
                        let stack = &mut self.arenas[at].stack;
                        while stack.last().is_some_and(|&(_, dead)| dead) {
                            stack.pop();
                        }
                    }
                }
            }
        }
        // Pass 2: the arenas end to end.
        self.bases.clear();
        let mut total = 0usize;
        for arena in &self.arenas[..self.used] {
            let base = align_up(total, arena.align).unwrap_or(usize::MAX);
            self.bases.push(base);
            total = base.saturating_add(arena.peak);
        }
        self.offsets.clear();
        for (event, &at) in events.iter().zip(&self.relative) {
            self.offsets.push(match *event {
                Event::Alloc { owner, .. } => {
                    let arena = self
                        .index
                        .get(cycle_of(owner))
                        .copied()
                        .flatten()
                        .expect("every allocation's cycle has an arena");
                    self.bases[arena].saturating_add(at)
                }
                Event::Close { .. } => usize::MAX,
            });
        }
        total
    }
}

/// The least common multiple of two alignments (saturating): the arena's base must suit
/// every allocation's, whatever they are.
fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    (a / x.max(1)).saturating_mul(b)
}

/// Offsets for every allocation of a trace in one arena.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    events: Vec<Event>,
    /// Per event: the allocation's offset (`usize::MAX` for closes).
    offsets: Vec<usize>,
    bytes: usize,
    lower_bound: usize,
    planning: Duration,
}

/// Orders the greedy placement tries, each a key to sort allocations by.
const ORDERS: usize = 6;

/// The most allocations [`Plan::new`] places one by one (each order about 15 ms at this
/// size); larger iterations get the per-owner layout.
pub const GREEDY_LIMIT: usize = 2048;

impl Plan {
    /// Plans `trace`: the smallest of greedy best-fit placements over a few orders of the
    /// allocations (largest first; longest-lived first; largest area first; earliest
    /// first; latest-ending first; largest first with later-ending first on ties), then,
    /// for small iterations, a short local search of swaps in the best order, and of
    /// the per-owner layout, so that a plan never takes more than the per-owner layout.
    /// It stops as soon as a placement reaches the lower bound. A placement costs
    /// O(n²) in the allocations: above [`GREEDY_LIMIT`] of them the per-owner layout
    /// (O(n)) is the plan, so that planning stays bounded whatever a recording holds.
    /// In the search, a candidate takes over the best placement up to its first swap,
    /// and stops as soon as it is no smaller: the same plans, in less time.
    pub fn new(trace: &Trace) -> Plan {
        let started = Instant::now();
        let mut planner = Planner::default();
        let (bytes, lower_bound) = planner.plan(&trace.events);
        let offsets = std::mem::take(&mut planner.offsets);
        Plan { events: trace.events.clone(), offsets, bytes, lower_bound, planning: started.elapsed() }
    }

    /// Bytes of the arena the plan needs.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The trace's lower bound (see [`Trace::lower_bound`]).
    pub fn lower_bound(&self) -> usize {
        self.lower_bound
    }

    /// How long planning took.
    pub fn planning_time(&self) -> Duration {
        self.planning
    }

    /// The events planned.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// The plan's figures, as a plan group reports its plans ([`PlannedStats`]): one
    /// recording, one plan, named `name`. What a network reports for an iteration it
    /// recorded without training planned.
    pub fn stats(&self, name: &str) -> PlannedStats {
        PlannedStats {
            name: name.to_string(),
            arena_bytes: self.bytes,
            arena_lower_bound_bytes: self.lower_bound,
            plan_bytes: self.bytes,
            lower_bound_bytes: self.lower_bound,
            plan_to_bound: self.bytes as f64 / self.lower_bound.max(1) as f64,
            per_role_bytes: Layout::default().lay_out(&self.events),
            allocations: self.events.iter().filter(|e| matches!(e, Event::Alloc { .. })).count(),
            planning_us: self.planning.as_micros() as u64,
            plans: 1,
            recorded_iterations: 1,
            ..PlannedStats::default()
        }
    }

    /// The offset planned for the allocation at event position `index`.
    pub fn offset(&self, index: usize) -> Option<usize> {
        self.offsets.get(index).copied().filter(|&o| o != usize::MAX)
    }

    /// Checks the plan against its trace's lifetimes: every offset aligned, inside
    /// [`Plan::bytes`], and no two allocations live at the same time sharing a byte.
    ///
    /// # Errors
    ///
    /// A description of the first violation.
    pub fn check(&self) -> Result<(), String> {
        let trace = Trace::from_events(self.events.clone());
        let placed: Vec<(Lifetime, usize)> =
            trace.lifetimes().into_iter().map(|l| (l, self.offsets[l.start])).collect();
        for (l, offset) in &placed {
            let inside = offset.checked_add(l.bytes).is_some_and(|end| end <= self.bytes);
            if *offset == usize::MAX || offset % l.align.max(1) != 0 || !inside {
                return Err(format!("allocation at event {} placed at {offset}: {l:?}", l.start));
            }
        }
        check_overlaps(placed.iter().map(|&(l, offset)| (l.start, l.end, offset, offset.saturating_add(l.bytes))))
    }
}

/// Checks intervals `(start, end, low, high)`, live during `[start, end)` and holding
/// bytes `[low, high)`: an error names the first two that are live at once and share a
/// byte.
pub fn check_overlaps(intervals: impl Iterator<Item = (usize, usize, usize, usize)>) -> Result<(), String> {
    use std::cmp::Reverse;
    use std::collections::{BTreeMap, BinaryHeap};
    let mut all: Vec<(usize, usize, usize, usize)> = intervals.filter(|&(s, e, lo, hi)| s < e && lo < hi).collect();
    all.sort_unstable();
    // Sweep over time. The live intervals, checked disjoint, by their low byte: a new one
    // can only meet the live one that starts closest below its high byte. They leave in
    // the order of their ends. O(n log n) whatever the number live at once.
    let mut live: BTreeMap<usize, (usize, usize, usize, usize)> = BTreeMap::new();
    let mut ends: BinaryHeap<Reverse<(usize, usize)>> = BinaryHeap::new();
    for a in all {
        while let Some(&Reverse((end, low))) = ends.peek() {
            if end > a.0 {
                break;
            }
            ends.pop();
            live.remove(&low);
        }
        if let Some((_, b)) = live.range(..a.3).next_back() {
            if a.2 < b.3 {
                return Err(format!("{a:?} and {b:?} are live at once and share bytes"));
            }
        }
        live.insert(a.2, a);
        ends.push(Reverse((a.1, a.2)));
    }
    Ok(())
}

/// Plans with buffers it keeps ([`Plan::new`] is one use of a fresh planner): once they
/// have grown to the largest iteration planned, planning makes no heap allocation.
#[derive(Default)]
pub(crate) struct Planner {
    open: Open<usize>,
    lifetimes: Vec<Lifetime>,
    placer: PlacerBuffers,
    best: Best,
    indices: Vec<usize>,
    order: Vec<usize>,
    /// The offsets of the last plan, by event position (`usize::MAX` for closes).
    offsets: Vec<usize>,
    layout: Layout,
    runs: Vec<Event>,
}

impl Planner {
    /// The offsets of the last plan, by event position (`usize::MAX` for closes).
    pub(crate) fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// [`Trace::lower_bound`] of `events`.
    pub(crate) fn lower_bound(&mut self, events: &[Event]) -> usize {
        lower_bound_of(events.iter().copied(), &mut self.open)
    }

    /// [`Trace::per_owner_bytes`] of `events`.
    pub(crate) fn per_owner_bytes(&mut self, events: &[Event]) -> usize {
        self.layout.lay_out(events)
    }

    /// [`Trace::runs`] of `events`, in a list of the planner's: give it back with
    /// [`Planner::keep_runs`] for the next time.
    pub(crate) fn take_runs(&mut self, events: &[Event]) -> Vec<Event> {
        let mut runs = std::mem::take(&mut self.runs);
        runs_into(events, &mut runs);
        runs
    }

    /// Keeps `runs`'s room for the next [`Planner::take_runs`].
    pub(crate) fn keep_runs(&mut self, runs: Vec<Event>) {
        self.runs = runs;
    }

    /// Plans `events` as [`Plan::new`] does: returns the plan's bytes and the lower
    /// bound; the offsets are in [`Planner::offsets`].
    pub(crate) fn plan(&mut self, events: &[Event]) -> (usize, usize) {
        lifetimes_into(events, &mut self.open, &mut self.lifetimes);
        let lifetimes = &self.lifetimes[..];
        let lower_bound = lower_bound_of(events.iter().copied(), &mut self.open);
        let best = &mut self.best;
        best.clear();
        let orders = if lifetimes.len() > GREEDY_LIMIT { 0 } else { ORDERS };
        let mut placer = Placer::with_buffers(lifetimes, std::mem::take(&mut self.placer));
        let indices = &mut self.indices;
        indices.clear();
        indices.reserve(lifetimes.len());
        for order in 0..orders {
            if best.is_some() && best.bytes <= lower_bound {
                break; // nothing can do better
            }
            indices.clear();
            indices.extend(0..lifetimes.len());
            let key = |l: &Lifetime| -> (usize, usize, usize) {
                let life = l.end - l.start;
                match order {
                    0 => (usize::MAX - l.bytes, l.start, 0),
                    1 => (usize::MAX - life, usize::MAX - l.bytes, l.start),
                    2 => (usize::MAX - l.bytes.saturating_mul(life), l.start, 0),
                    3 => (l.start, usize::MAX - l.bytes, 0),
                    4 => (usize::MAX - l.end, usize::MAX - l.bytes, l.start),
                    _ => (usize::MAX - l.bytes, usize::MAX - l.end, l.start),
                }
            };
            indices.sort_by_key(|&i| key(&lifetimes[i]));
            let bytes = placer.place(indices, 0, best);
            best.keep(bytes, &placer, indices);
        }
        // A short local search for small iterations: a few swaps in the best order,
        // kept when they do better (deterministic: the swaps come from a fixed seed).
        // A candidate takes over the placement of the best order up to its first swap.
        let n = lifetimes.len();
        // Small iterations (a few dozen allocations, as a layer-by-layer network with
        // its runs collapsed has) get enough rounds to find the bound where a greedy
        // order misses it by a few percent; larger ones a few, within the time goals.
        let rounds = if n > GREEDY_LIMIT {
            0
        } else if n <= 48 {
            64
        } else {
            (20_000 / n.saturating_mul(n).max(1)).min(16)
        };
        let mut state = 0x9E37_79B9_7F4A_7C15_u64 ^ n as u64;
        let mut random = |below: usize| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (state ^ (state >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((z ^ (z >> 29)) % below.max(1) as u64) as usize
        };
        let order = &mut self.order;
        order.clear();
        order.reserve(n);
        for _ in 0..rounds {
            if n < 2 || !best.is_some() || best.bytes <= lower_bound {
                break;
            }
            order.clear();
            order.extend_from_slice(&best.order);
            let mut from = n;
            for _ in 0..1 + random(3) {
                let (a, b) = (random(n), random(n));
                order.swap(a, b);
                from = from.min(a).min(b);
            }
            let bytes = placer.place(order, from, best);
            best.keep(bytes, &placer, order);
        }
        self.placer = placer.into_buffers();
        // No placement (above the limit): the per-owner layout below is the plan.
        let best_is_none = !best.is_some();
        self.offsets.clear();
        self.offsets.resize(events.len(), usize::MAX);
        let bytes = if best_is_none { usize::MAX } else { best.bytes };
        if !best_is_none {
            for (l, &offset) in lifetimes.iter().zip(&best.offsets) {
                self.offsets[l.start] = offset;
            }
        }
        let per_owner = self.layout.lay_out(events);
        if best_is_none || per_owner < bytes {
            self.offsets.clone_from(&self.layout.offsets);
            return (per_owner, lower_bound);
        }
        (bytes, lower_bound)
    }
}

/// Greedy best fit ([`Placer::place`]), with scratch space that its calls share.
struct Placer<'l> {
    lifetimes: &'l [Lifetime],
    /// Offsets of the last placement, indexed as `lifetimes`.
    offsets: Vec<usize>,
    /// The allocations placed so far, by offset.
    by_offset: Vec<Span>,
    /// Scratch: the bytes of those live at the same time as the one being placed.
    live: Vec<(usize, usize)>,
}

/// A placed allocation: its bytes `[low, high)`, its lifetime `[start, end)`, its index.
#[derive(Clone, Copy, Debug)]
struct Span {
    low: usize,
    high: usize,
    start: usize,
    end: usize,
    index: usize,
}

/// The smallest placement found so far, with what a placement that starts as it does
/// needs to take its beginning over.
#[derive(Default)]
struct Best {
    bytes: usize,
    offsets: Vec<usize>,
    order: Vec<usize>,
    /// The allocations by offset.
    by_offset: Vec<Span>,
    /// Each allocation's position in `order`.
    position: Vec<usize>,
}

impl Best {
    /// Forgets the placement kept, keeping the room.
    fn clear(&mut self) {
        self.bytes = 0;
        self.offsets.clear();
        self.order.clear();
        self.by_offset.clear();
        self.position.clear();
    }

    /// Whether a placement was kept.
    fn is_some(&self) -> bool {
        !self.order.is_empty()
    }

    /// Keeps the placement of `order` in `placer` if it takes fewer than `self.bytes`.
    fn keep(&mut self, bytes: usize, placer: &Placer<'_>, order: &[usize]) {
        if self.is_some() && bytes >= self.bytes {
            return;
        }
        self.bytes = bytes;
        self.offsets.clone_from(&placer.offsets);
        self.order.clear();
        self.order.extend_from_slice(order);
        self.by_offset.clone_from(&placer.by_offset);
        self.position.resize(order.len(), 0);
        for (k, &i) in order.iter().enumerate() {
            self.position[i] = k;
        }
    }
}

/// A [`Placer`]'s room, kept between plans.
#[derive(Default)]
struct PlacerBuffers {
    offsets: Vec<usize>,
    by_offset: Vec<Span>,
    live: Vec<(usize, usize)>,
}

impl<'l> Placer<'l> {
    #[cfg(test)]
    fn new(lifetimes: &'l [Lifetime]) -> Placer<'l> {
        Placer::with_buffers(lifetimes, PlacerBuffers::default())
    }

    /// A placer of `lifetimes` in the room of `buffers`.
    fn with_buffers(lifetimes: &'l [Lifetime], buffers: PlacerBuffers) -> Placer<'l> {
        let n = lifetimes.len();
        let PlacerBuffers { mut offsets, mut by_offset, mut live } = buffers;
        offsets.clear();
        offsets.resize(n, usize::MAX);
        by_offset.clear();
        by_offset.reserve(n);
        live.clear();
        live.resize(n, (0, 0));
        Placer { lifetimes, offsets, by_offset, live }
    }

    /// The room, for the next placer.
    fn into_buffers(self) -> PlacerBuffers {
        PlacerBuffers { offsets: self.offsets, by_offset: self.by_offset, live: self.live }
    }

    /// Places the allocations in `order`, each in the smallest gap (below the others
    /// live at the same time) that holds it aligned, else above them all. Returns the
    /// arena size; the offsets are in `self.offsets`.
    ///
    /// The first `from` allocations of `order` are those of `best.order` (so they are
    /// placed as there: their placement is taken over). The placement stops early once
    /// it takes `best.bytes` or more (it is then no better, and its offsets partial).
    /// The allocations placed are kept by offset, so the gaps come in order without a
    /// sort: O(n) per allocation.
    fn place(&mut self, order: &[usize], from: usize, best: &Best) -> usize {
        let lifetimes = self.lifetimes;
        self.offsets.fill(usize::MAX);
        self.by_offset.clear();
        let mut size = 0usize;
        if from > 0 {
            for span in &best.by_offset {
                if best.position[span.index] < from {
                    self.offsets[span.index] = span.low;
                    self.by_offset.push(*span);
                    size = size.max(span.high);
                }
            }
        }
        let limit = if best.is_some() { best.bytes } else { usize::MAX };
        for &i in &order[from..] {
            if size >= limit {
                return size;
            }
            let l = lifetimes[i];
            let align = l.align.max(1);
            // The bytes of the ones live at the same time, by offset, gathered without a
            // branch (which way the test goes is close to random). An empty allocation
            // holds no bytes, so it is in no one's way.
            let mut live = 0;
            for m in &self.by_offset {
                self.live[live] = (m.low, m.high);
                live += usize::from((m.start < l.end) & (l.start < m.end) & (m.low < m.high));
            }
            let (mut cursor, mut best): (usize, Option<(usize, usize)>) = (0, None);
            for &(low, high) in &self.live[..live] {
                let at = align_up(cursor, align).unwrap_or(usize::MAX);
                if at.saturating_add(l.bytes) <= low {
                    let gap = low - cursor;
                    if best.is_none_or(|(_, g)| gap < g) {
                        best = Some((at, gap));
                    }
                }
                cursor = cursor.max(high);
            }
            let offset = match best {
                Some((at, _)) => at,
                None => align_up(cursor, align).unwrap_or(usize::MAX),
            };
            self.offsets[i] = offset;
            let span = Span { low: offset, high: offset.saturating_add(l.bytes), start: l.start, end: l.end, index: i };
            let at = self.by_offset.partition_point(|m| m.low <= span.low);
            self.by_offset.insert(at, span);
            size = size.max(span.high);
        }
        size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(owner: u64, bytes: usize) -> Event {
        Event::Alloc { owner, bytes, align: 64 }
    }

    /// Two roles whose peaks come at different moments: a per-role layout takes the
    /// sum of the peaks, a plan their maximum.
    #[test]
    fn roles_that_peak_at_different_moments_share_one_arena() {
        let mut t = Trace::new();
        for e in [alloc(1, 1024), alloc(1, 1024), Event::Close { owner: 1 }, alloc(2, 2048), Event::Close { owner: 2 }]
        {
            t.push(e);
        }
        assert_eq!(t.lower_bound(), 2048);
        assert_eq!(t.per_owner_bytes(), 4096);
        let plan = Plan::new(&t);
        assert_eq!(plan.bytes(), 2048);
        plan.check().unwrap();
        let l = t.lifetimes();
        assert_eq!((l[0].start, l[0].end, l[2].start, l[2].end), (0, 2, 3, 4));
    }

    #[test]
    fn the_overlap_checker_finds_shared_live_bytes() {
        assert!(check_overlaps([(0, 5, 0, 64), (5, 9, 0, 64)].into_iter()).is_ok(), "one after the other");
        assert!(check_overlaps([(0, 5, 0, 64), (4, 9, 63, 128)].into_iter()).is_err());
        assert!(check_overlaps([(0, 5, 0, 64), (1, 2, 64, 128), (3, 9, 0, 1)].into_iter()).is_err());
    }

    #[test]
    fn runs_are_consecutive_allocations_of_one_owner_laid_out_as_a_bump_arena_does() {
        let t = Trace::from_events(vec![
            Event::Alloc { owner: 1, bytes: 100, align: 64 },
            Event::Alloc { owner: 1, bytes: 50, align: 16 }, // same run, at 112
            Event::Alloc { owner: 1, bytes: 8, align: 128 }, // more aligned: a run of its own
            Event::Alloc { owner: 2, bytes: 64, align: 64 },
            Event::Alloc { owner: 1, bytes: 64, align: 64 }, // another owner came between
            Event::Close { owner: 1 },
            Event::Close { owner: 2 },
        ]);
        let runs = t.runs();
        assert_eq!(
            runs.events(),
            &[
                Event::Alloc { owner: 1, bytes: 162, align: 64 },
                Event::Alloc { owner: 1, bytes: 8, align: 128 },
                Event::Alloc { owner: 2, bytes: 64, align: 64 },
                Event::Alloc { owner: 1, bytes: 64, align: 64 },
                Event::Close { owner: 1 },
                Event::Close { owner: 2 },
            ]
        );
        // Runs live and die together: the bytes live at once do not change.
        assert_eq!(runs.lower_bound(), 162 + 8 + 64 + 64);
        assert_eq!(t.lower_bound(), 100 + 50 + 8 + 64 + 64);
        Plan::new(&runs).check().unwrap();
        // An alignment of 0 is 1: a run that starts with one takes no more aligned
        // allocation in.
        let t = Trace::from_events(vec![
            Event::Alloc { owner: 1, bytes: 10, align: 0 },
            Event::Alloc { owner: 1, bytes: 64, align: 64 },
        ]);
        assert_eq!(t.runs().events().len(), 2);
        Plan::new(&t.runs()).check().unwrap();
    }

    #[test]
    fn a_cycles_close_ends_its_frames_and_frames_share_its_arena() {
        let frame = |level: u64| 7 | level << FRAME_LEVEL_SHIFT;
        let t = Trace::from_events(vec![
            Event::Alloc { owner: 7, bytes: 64, align: 64 },
            Event::Alloc { owner: frame(1), bytes: 128, align: 64 }, // a frame never closed
            Event::Close { owner: 7 },                               // the cycle's end ends it
            Event::Alloc { owner: frame(1), bytes: 256, align: 64 }, // the next cycle's frame
            Event::Close { owner: frame(1) },
            Event::Alloc { owner: frame(1), bytes: 256, align: 64 }, // and another one
            Event::Close { owner: 7 },
            Event::Alloc { owner: 8, bytes: 64, align: 64 },
            Event::Close { owner: 8 | 1 << FRAME_LEVEL_SHIFT }, // a frame's close ends nothing else
            Event::Close { owner: 8 },
        ]);
        let ends: Vec<usize> = t.lifetimes().iter().map(|l| l.end).collect();
        assert_eq!(ends, vec![2, 2, 4, 6, 9]);
        assert_eq!(t.lower_bound(), 256);
        // Per owner: the cycle's frames bump in its arena and give their bytes back.
        assert_eq!(t.per_owner_bytes(), 256 + 64);
        Plan::new(&t).check().unwrap();
    }

    #[test]
    fn planning_a_huge_iteration_stays_bounded() {
        // Allocations of two owners alternating, all live at once: no runs to merge.
        let n = GREEDY_LIMIT + 1;
        let mut events: Vec<Event> =
            (0..n).map(|i| Event::Alloc { owner: (i % 2) as u64, bytes: 64, align: 64 }).collect();
        events.extend([Event::Close { owner: 0 }, Event::Close { owner: 1 }]);
        let t = Trace::from_events(events);
        let plan = Plan::new(&t);
        // Above the limit the plan is the per-owner layout (no O(n²) placement).
        assert_eq!(plan.bytes(), t.per_owner_bytes());
        assert_eq!(plan.bytes(), 64 * n);
        plan.check().unwrap();
    }

    #[test]
    fn closes_cost_what_they_end_so_a_long_trace_plans_in_linear_time() {
        // Allocations that stay live, each followed by the close of a frame that holds
        // nothing: a scan of everything open at every close would take minutes (no clock
        // here: a regression shows as a test that does not end). Fewer under valgrind.
        let n: u64 = if std::env::var_os("PROPTEST_CASES").is_some() { 20_000 } else { 200_000 };
        let mut events = Vec::with_capacity(2 * n as usize + 1);
        for _ in 0..n {
            events.push(Event::Alloc { owner: 3, bytes: 16, align: 16 });
            events.push(Event::Close { owner: 3 | 1 << FRAME_LEVEL_SHIFT });
        }
        events.push(Event::Close { owner: 3 });
        let t = Trace::from_events(events);
        let plan = Plan::new(&t);
        assert_eq!(plan.bytes(), 16 * n as usize);
        assert_eq!(plan.lower_bound(), 16 * n as usize);
        plan.check().unwrap(); // every allocation live at once
    }

    #[test]
    fn a_plan_beyond_the_address_space_never_checks() {
        let t = Trace::from_events(vec![
            Event::Alloc { owner: 1, bytes: usize::MAX, align: 1 },
            Event::Alloc { owner: 1, bytes: 1, align: 1 },
            Event::Close { owner: 1 },
        ]);
        assert!(Plan::new(&t).check().is_err());
    }

    #[test]
    fn hostile_traces_give_plans_not_panics() {
        let mut t = Trace::new();
        for e in [
            Event::Alloc { owner: 1, bytes: usize::MAX, align: 3 },
            Event::Alloc { owner: 1, bytes: usize::MAX / 2, align: 0 },
            Event::Close { owner: 7 },
            Event::Alloc { owner: 2, bytes: 1, align: 1 << 40 },
            Event::Close { owner: 1 },
        ] {
            t.push(e);
        }
        let plan = Plan::new(&t);
        assert_eq!(t.lower_bound(), usize::MAX, "saturates");
        assert!(plan.bytes() >= 1);
        assert_eq!(Plan::new(&Trace::new()).bytes(), 0);
    }

    /// Greedy best fit as written plainly: every placement from the start, the busy
    /// intervals (those live at the same time, empty ones aside) sorted each time.
    fn plain_place(lifetimes: &[Lifetime], order: &[usize]) -> (usize, Vec<usize>) {
        let mut offsets = vec![usize::MAX; lifetimes.len()];
        let mut size = 0;
        for (k, &i) in order.iter().enumerate() {
            let l = lifetimes[i];
            let mut busy: Vec<(usize, usize)> = order[..k]
                .iter()
                .filter(|&&j| lifetimes[j].start < l.end && l.start < lifetimes[j].end && lifetimes[j].bytes > 0)
                .map(|&j| (offsets[j], offsets[j] + lifetimes[j].bytes))
                .collect();
            busy.sort_unstable();
            let (mut cursor, mut best): (usize, Option<(usize, usize)>) = (0, None);
            for (low, high) in busy {
                let at = align_up(cursor, l.align).unwrap();
                if at + l.bytes <= low && best.is_none_or(|(_, g)| low - cursor < g) {
                    best = Some((at, low - cursor));
                }
                cursor = cursor.max(high);
            }
            offsets[i] = best.map_or_else(|| align_up(cursor, l.align).unwrap(), |(at, _)| at);
            size = size.max(offsets[i] + l.bytes);
        }
        (size, offsets)
    }

    #[test]
    fn a_placement_that_takes_over_the_best_ones_beginning_or_stops_early_is_exact() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut random = |below: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % below.max(1)
        };
        let cases = if std::env::var_os("PROPTEST_CASES").is_some() { 100 } else { 1000 };
        for _ in 0..cases {
            // A random iteration: allocations of four owners, their cycles closing now
            // and then.
            let mut t = Trace::new();
            for _ in 0..2 + random(40) {
                let owner = random(4);
                if random(3) == 0 {
                    t.push(Event::Close { owner });
                } else {
                    // Empty allocations now and then (in no one's way).
                    let bytes = if random(3) == 0 { 0 } else { 64 * (1 + random(20) as usize) };
                    t.push(Event::Alloc { owner, bytes, align: 64 << random(3) });
                }
            }
            let lifetimes = t.lifetimes();
            let n = lifetimes.len();
            if n < 2 {
                continue;
            }
            let mut order: Vec<usize> = (0..n).collect();
            for k in (1..n).rev() {
                order.swap(k, random(k as u64 + 1) as usize);
            }
            let mut placer = Placer::new(&lifetimes);
            let mut best = Best::default();
            let bytes = placer.place(&order, 0, &best);
            assert_eq!((bytes, placer.offsets.clone()), plain_place(&lifetimes, &order));
            best.keep(bytes, &placer, &order);
            for _ in 0..8 {
                let mut candidate = best.order.clone();
                let mut from = n;
                for _ in 0..1 + random(3) {
                    let (a, b) = (random(n as u64) as usize, random(n as u64) as usize);
                    candidate.swap(a, b);
                    from = from.min(a).min(b);
                }
                let bytes = placer.place(&candidate, from, &best);
                let (plain, offsets) = plain_place(&lifetimes, &candidate);
                if bytes < best.bytes {
                    assert_eq!((bytes, &placer.offsets), (plain, &offsets), "{candidate:?} from {from}");
                } else {
                    assert!(plain >= best.bytes, "stopped early, yet the plain placement is smaller");
                }
                best.keep(bytes, &placer, &candidate);
            }
        }
    }
}
