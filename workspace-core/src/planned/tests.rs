//! The group against a backend that refuses arenas, and its arena's reuse.

use std::sync::atomic::Ordering;

use super::group::{GroupShared, GroupState, Mode};
use super::script::Script;
use super::*;
use crate::backend::Address;
use crate::error::BackendError;
use crate::plan::Event;
use crate::{LearningPolicy, SpillPolicy};

fn base(group: &PlanGroup) -> Option<u64> {
    group.group.shared.state().and_then(|state| state.base).map(|base| base.address())
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
    state.plans.push(Script::new(7, &events, &mut Default::default(), &mut Vec::new()).unwrap());
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
    // The report of the refusal: the plan's bytes against the arena it outgrew, its
    // lower bound and what its layout takes above it.
    let plan = state.plan_of_key().map(|(bytes, bound)| (state.arena_bytes, bytes, bound));
    let source = BackendError::OutOfMemory { bytes: 1 << 20, align: 64 };
    let report = plan_report(&source, plan);
    assert_eq!((report.requested, report.capacity, report.lower_bound), (1 << 20, 0, Some(1 << 20)), "{report:?}");
    assert_eq!(report.fragmentation_bytes, Some(0));
    let message = report.to_string();
    assert!(message.contains("request 1048576 bytes, capacity 0 bytes"), "{message}");
    assert!(message.contains("lower bound of the iteration so far 1048576 bytes"), "{message}");
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

#[test]
fn a_recording_lends_the_arena_to_what_would_spill_and_frees_it_at_each_close() {
    let group = PlanGroup::new("G");
    let config = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build();
    let config = config.unwrap();
    let (act, scratch) = (group.workspace("ACT", &config).unwrap(), group.workspace("SCRATCH", &config).unwrap());
    group.reserve(64 << 10).unwrap();
    let arena = base(&group).unwrap();
    let inside = |p: *const f32, n: usize| {
        let p = p as u64;
        p >= arena && p + 4 * n as u64 <= arena + group.capacity() as u64
    };
    // A new key: recorded, its requests (which would spill: the members have no arena
    // of their own) served from the group's arena.
    group.start_iteration(1).unwrap();
    let mut scratch_at = Vec::new();
    {
        let a = act.enter().unwrap();
        let mut kept = Vec::new();
        for step in 0..4 {
            let x = a.filled::<f32, _>(256, step as f32).unwrap();
            assert!(inside(x.as_ptr(), 256), "an activation in the arena");
            {
                let s = scratch.enter().unwrap();
                let t = s.filled::<f32, _>(1024, -1.0).unwrap();
                assert!(inside(t.as_ptr(), 1024), "a scratch array in the arena");
                scratch_at.push(t.as_ptr() as u64);
                assert_eq!(t.sum(), -1024.0);
            }
            kept.push(x);
        }
        // Every activation is intact: no later lend overlapped a live one.
        for (step, x) in kept.iter().enumerate() {
            assert_eq!(x.sum(), 256.0 * step as f32);
        }
        let stats = act.stats();
        assert_eq!((stats.external_allocations, stats.spilled_in_use), (4, 4 * 1024), "counted as spills");
    }
    assert!(!group.finish_iteration().unwrap(), "recorded, not replayed");
    // Each scratch cycle's bytes were free again once it closed: the next activation
    // (1 KiB) took the first of them, and the next scratch array the rest (first fit).
    assert!(scratch_at.windows(2).all(|w| w[1] - w[0] == 1024), "{scratch_at:?}");
    assert_eq!(group.stats().recorded_iterations, 1);
    // The plan replays.
    group.start_iteration(1).unwrap();
    {
        let a = act.enter().unwrap();
        for _ in 0..4 {
            let _x = a.zeros::<f32, _>(256).unwrap();
            let s = scratch.enter().unwrap();
            let _t = s.zeros::<f32, _>(1024).unwrap();
        }
    }
    assert!(group.finish_iteration().unwrap());
}

#[test]
fn a_recording_lends_nothing_while_a_cycle_holds_a_window_of_the_last_iteration() {
    let group = PlanGroup::new("G");
    let config = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build();
    let config = config.unwrap();
    let (a, b) = (group.workspace("A", &config).unwrap(), group.workspace("B", &config).unwrap());
    let iteration = |key| {
        group.start_iteration(key).unwrap();
        {
            let s = a.enter().unwrap();
            let _x = s.zeros::<f32, _>(512).unwrap();
        }
        group.finish_iteration().unwrap()
    };
    iteration(1);
    assert!(iteration(1), "replayed");
    // A cycle of A replayed and left open across the next start: its window is held.
    group.start_iteration(1).unwrap();
    let held = a.enter().unwrap();
    let x = held.filled::<f32, _>(512, 3.0).unwrap();
    group.finish_iteration().unwrap();
    // A new key records while A's window is live: B's requests must not land on it.
    group.start_iteration(2).unwrap();
    {
        let s = b.enter().unwrap();
        let y = s.filled::<f32, _>(512, 5.0).unwrap();
        assert!(!a.contains(y.as_ptr().cast::<u8>(), 4));
        let (xp, yp) = (x.as_ptr() as u64, y.as_ptr() as u64);
        assert!(yp + 2048 <= xp || xp + 2048 <= yp, "no overlap with the held window");
        assert_eq!(y.sum(), 2560.0);
    }
    assert_eq!(x.sum(), 1536.0, "the held window's data is intact");
    group.finish_iteration().unwrap();
    drop(held);
}

#[test]
fn an_iteration_whose_work_fails_or_panics_is_abandoned_and_plans_nothing() {
    let group = PlanGroup::new("G");
    let config = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build();
    let ws = group.workspace("A", &config.unwrap()).unwrap();
    let step = |n: usize| -> Result<f32> {
        let s = ws.enter()?;
        Ok(s.filled::<f32, _>(n, 1.0)?.sum())
    };
    // Work that fails after allocating: abandoned, so its partial recording is no plan.
    let failed = group.iteration(1, || {
        step(64)?;
        Err::<(), Error>(Error::InvalidInput("the work failed".into()))
    });
    assert!(matches!(failed, Err(Error::InvalidInput(_))));
    // Work that panics: abandoned as it unwinds.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = group.iteration(1, || -> Result<()> {
            step(64)?;
            panic!("the work panicked");
        });
    }));
    assert!(panicked.is_err());
    let stats = group.stats();
    assert_eq!((stats.abandoned_iterations, stats.plans, stats.recorded_iterations), (2, 0, 0));
    // The key's iterations then record once and replay.
    let runs: Vec<(f32, bool)> = (0..3).map(|_| group.iteration(1, || step(64)).unwrap()).collect();
    assert_eq!(runs, vec![(64.0, false), (64.0, true), (64.0, true)]);
    assert_eq!((group.stats().plans, group.stats().divergences), (1, 0));
}

#[test]
fn a_group_told_to_keep_more_plans_evicts_none_of_its_shapes() {
    let config = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build();
    let config = config.unwrap();
    // Four shapes in turn, twice over: a group of two plans evicts one at every new
    // shape; told to keep four (never fewer than it kept), none.
    for keep in [None, Some(4), Some(1)] {
        let group = PlanGroup::with_plans("G", 2);
        let ws = group.workspace("A", &config).unwrap();
        if let Some(keep) = keep {
            group.keep_plans(keep);
        }
        assert_eq!(group.plans_kept(), keep.unwrap_or(2).max(2));
        for _ in 0..3 {
            for shape in 1..=4u64 {
                group.start_iteration(shape).unwrap();
                {
                    let s = ws.enter().unwrap();
                    s.filled::<f64, _>(shape as usize * 10, 1.0).unwrap();
                }
                group.finish_iteration().unwrap();
            }
        }
        let stats = group.stats();
        match keep {
            Some(4) => assert_eq!((stats.evictions, stats.planned_iterations), (0, 8), "{stats:?}"),
            _ => assert!(stats.evictions >= 8, "{keep:?}: {stats:?}"),
        }
    }
}
