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
