//! Planned memory against random programs of allocations and closes: every plan is
//! sound (no two live allocations share a byte), at least the lower bound computed
//! independently here, at most the per-owner layout. 10,000 programs per run
//! (`PROPTEST_CASES` scales it, as under valgrind). Replaying plans, as recorded and
//! diverging, is tested on real plan groups (`planned.rs`).

use std::collections::HashMap;

use workspace_core::plan::{Event, Plan, Trace};

use crate::common::random::{cases, Rng};

/// A random iteration: allocations in up to 5 owners (role cycles) and closes of
/// owners, every owner closed by the end.
fn program(rng: &mut Rng) -> Vec<Event> {
    let owners = 1 + rng.below(5);
    // A quarter of the programs align everything to 64 bytes, as the network's do.
    let uniform = rng.below(4) == 0;
    let len = 4 + rng.below(56) as usize;
    let mut events = Vec::with_capacity(len + owners as usize);
    let mut open = vec![false; owners as usize];
    for _ in 0..len {
        let owner = rng.below(owners);
        if open[owner as usize] && rng.below(4) == 0 {
            events.push(Event::Close { owner });
            open[owner as usize] = false;
        } else {
            let units = if rng.below(8) == 0 { 256 } else { 16 };
            let bytes = 64 * (1 + rng.below(units) as usize);
            let align = if uniform { 64 } else { [16, 64, 64, 256, 4096][rng.below(5) as usize] };
            events.push(Event::Alloc { owner, bytes, align });
            open[owner as usize] = true;
        }
    }
    for (owner, &is_open) in (0..).zip(&open) {
        if is_open {
            events.push(Event::Close { owner });
        }
    }
    events
}

/// The most bytes live at once, computed here independently of the crate.
fn peak_live(events: &[Event]) -> usize {
    let mut live: HashMap<u64, Vec<usize>> = HashMap::new();
    let mut peak = 0;
    for event in events {
        match *event {
            Event::Alloc { owner, bytes, .. } => {
                live.entry(owner).or_default().push(bytes);
                peak = peak.max(live.values().flatten().sum::<usize>());
            }
            Event::Close { owner } => {
                live.remove(&owner);
            }
        }
    }
    peak
}

#[test]
fn plans_of_random_programs_are_sound_and_bounded() {
    let mut rng = Rng(0x5EED);
    let mut at_bound = 0u64;
    let (mut planned_total, mut bound_total) = (0usize, 0usize);
    for case in 0..cases() {
        let events = program(&mut rng);
        let mut trace = Trace::new();
        events.iter().for_each(|&e| trace.push(e));
        let plan = Plan::new(&trace);
        plan.check().unwrap_or_else(|e| panic!("case {case}: {e}; events {events:?}"));
        let bound = peak_live(&events);
        assert_eq!(trace.lower_bound(), bound, "case {case}: the lower bound, computed two ways");
        assert!(plan.bytes() >= bound, "case {case}: below the lower bound?");
        assert!(plan.bytes() <= trace.per_owner_bytes(), "case {case}: more than the per-owner layout");
        // Quality, where padding cannot make the bound unreachable: every size is a
        // multiple of 64 and no alignment is larger.
        if events.iter().all(|e| !matches!(e, Event::Alloc { align, .. } if *align > 64)) {
            at_bound += u64::from(plan.bytes() == bound);
            planned_total += plan.bytes();
            bound_total += bound;
        }
    }
    // The greedy planner is close to the bound on average (a guard against a planner
    // that degrades to the per-owner layout).
    let ratio = planned_total as f64 / bound_total as f64;
    eprintln!("planned / lower bound: {ratio:.4} ({at_bound} cases at the bound)");
    assert!(ratio < 1.02, "planned / lower bound over all cases: {ratio:.3} ({at_bound} cases at the bound)");
}

#[test]
fn workspaces_record_their_allocations_and_closes_into_one_trace_in_order() {
    use std::sync::{Arc, Mutex};
    use workspace_core::{Workspace, WorkspaceConfig};

    let (a, b) = (
        Workspace::new("REC_A", WorkspaceConfig::default()).unwrap(),
        Workspace::new("REC_B", WorkspaceConfig::default()).unwrap(),
    );
    let trace = Arc::new(Mutex::new(Trace::new()));
    for ws in [&a, &b] {
        ws.engine().record_into(Some(trace.clone())).unwrap();
    }
    for _ in 0..2 {
        let outer = a.enter().unwrap();
        let x = outer.zeros::<f32, _>(100).unwrap(); // 400 B, padded to 448
        {
            let inner = b.enter().unwrap();
            let y = inner.zeros::<u8, _>(1).unwrap();
            assert_eq!(y.len() + x.len(), 101);
        }
        let _z = outer.zeros::<f64, _>(8).unwrap();
    }
    let (oa, ob) = (a.engine().owner(), b.engine().owner());
    let alloc = |owner, bytes| Event::Alloc { owner, bytes, align: 64 };
    let one = [alloc(oa, 448), alloc(ob, 64), Event::Close { owner: ob }, alloc(oa, 64), Event::Close { owner: oa }];
    let expected: Vec<Event> = one.iter().chain(one.iter()).copied().collect();
    assert_eq!(trace.lock().unwrap().events(), &expected[..]);
    // Recording changes only where memory comes from, and stops on request.
    let open = a.enter().unwrap();
    assert!(a.engine().record_into(None).is_err(), "not while a scope is open");
    drop(open);
    for ws in [&a, &b] {
        ws.engine().record_into(None).unwrap();
    }
    {
        let scope = a.enter().unwrap();
        assert_eq!(scope.zeros::<f32, _>(4).unwrap().len(), 4);
    }
    // The scope opened before the refused stop closed while recording (an empty cycle).
    assert_eq!(trace.lock().unwrap().events().len(), 11, "nothing recorded after it stopped");
    let plan = Plan::new(&trace.lock().unwrap());
    plan.check().unwrap();
    assert_eq!(plan.lower_bound(), 448 + 64, "B's 64 bytes are gone before A's second allocation");
}

#[test]
fn recording_while_the_caller_holds_the_traces_lock_waits_for_it_and_never_hangs() {
    use std::sync::{Arc, Mutex};
    use workspace_core::{Error, Workspace, WorkspaceConfig};
    let ws = Workspace::new("W", WorkspaceConfig::builder().initial_size(1 << 16).build().unwrap()).unwrap();
    let trace = Arc::new(Mutex::new(Trace::new()));
    ws.record_into(Some(trace.clone())).unwrap();
    {
        let scope = ws.enter().unwrap();
        let held = trace.lock().unwrap();
        let _a = scope.zeros::<u8, _>(100).unwrap(); // would wait for itself with a blocking lock
        assert!(held.events().is_empty());
        drop(held);
        let _b = scope.zeros::<u8, _>(200).unwrap(); // the first event goes in before it
    }
    let owner = ws.record_owner();
    let expected = [
        Event::Alloc { owner, bytes: 128, align: 64 },
        Event::Alloc { owner, bytes: 256, align: 64 },
        Event::Close { owner },
    ];
    assert_eq!(trace.lock().unwrap().events(), &expected[..]);
    // Events still waiting when the recording stops: an error while the lock is held.
    {
        let scope = ws.enter().unwrap();
        let held = trace.lock().unwrap();
        let _c = scope.zeros::<u8, _>(64).unwrap();
        drop(scope); // its close waits too
        let err = ws.record_into(None).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
        assert!(err.to_string().contains("locked"), "{err}");
        drop(held);
    }
    ws.record_into(None).unwrap();
    assert_eq!(trace.lock().unwrap().events().len(), 5);
}

#[test]
fn events_that_waited_for_the_traces_lock_keep_their_place_among_other_workspaces() {
    use std::sync::{Arc, Mutex};
    use workspace_core::{Workspace, WorkspaceConfig};
    let config = WorkspaceConfig::builder().initial_size(1 << 16).build().unwrap();
    let (a, b) = (Workspace::new("A", config.clone()).unwrap(), Workspace::new("B", config).unwrap());
    let trace = Arc::new(Mutex::new(Trace::new()));
    a.record_into(Some(trace.clone())).unwrap();
    b.record_into(Some(trace.clone())).unwrap();
    {
        let sb = b.enter().unwrap();
        let _y = sb.zeros::<u8, _>(64).unwrap(); // recorded at once
        let held = trace.lock().unwrap();
        let sa = a.enter().unwrap();
        let _x = sa.zeros::<u8, _>(64).unwrap(); // waits in A
        drop(held);
        drop(sb); // B's close goes in at once, after A's waiting allocation
        drop(sa);
    }
    let (oa, ob) = (a.record_owner(), b.record_owner());
    let expected = [
        Event::Alloc { owner: ob, bytes: 64, align: 64 },
        Event::Alloc { owner: oa, bytes: 64, align: 64 },
        Event::Close { owner: ob },
        Event::Close { owner: oa },
    ];
    assert_eq!(trace.lock().unwrap().events(), &expected[..]);
    // So the two allocations, live at the same time, never share bytes in a plan.
    let plan = Plan::new(&trace.lock().unwrap());
    assert_ne!(plan.offset(0), plan.offset(1));
    plan.check().unwrap();
}
