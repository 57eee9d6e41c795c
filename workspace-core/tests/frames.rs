//! Frames: release points inside a scope. Random programs (frames closed in any order
//! or forgotten, allocations from the scope and from frames below the top, nested
//! scopes) on workspaces of every kind never hand out bytes a live allocation holds;
//! a frame's bytes are reused once it closes; statistics and learning see the most
//! bytes held at once; debug modes change where memory comes from, never what
//! succeeds.

#![allow(clippy::drop_non_drop)] // the drops show where each view's life ends

use std::rc::Rc;

use workspace_core::backend::Placement;
use workspace_core::planned::PlanGroup;
use workspace_core::{DebugMode, Error, LearningPolicy, ResetPolicy, SpillPolicy, Workspace, WorkspaceConfig};

#[global_allocator]
static GLOBAL: workspace_core::alloc_check::CountingAllocator =
    workspace_core::alloc_check::CountingAllocator::system();

mod common {
    pub(crate) mod program;
    pub(crate) mod random;
}
use common::program::{program, run};
use common::random::{cases, Rng};

fn configs() -> Vec<(&'static str, WorkspaceConfig, DebugMode)> {
    let learned = WorkspaceConfig::default();
    let small = WorkspaceConfig::builder()
        .initial_size(4096)
        .learning(LearningPolicy::None)
        .spill(SpillPolicy::External)
        .build()
        .unwrap();
    let circular = WorkspaceConfig::builder()
        .initial_size(64 << 10)
        .learning(LearningPolicy::None)
        .reset(ResetPolicy::EndOfBuffer)
        .spill(SpillPolicy::External)
        .build()
        .unwrap();
    let over_time = WorkspaceConfig::builder().learning(LearningPolicy::OverTime { cycles: 3 }).build().unwrap();
    vec![
        ("learned", learned.clone(), DebugMode::Disabled),
        ("small arena, spilling", small.clone(), DebugMode::Disabled),
        ("circular", circular, DebugMode::Disabled),
        ("learning over time", over_time, DebugMode::Disabled),
        ("spill everything", learned, DebugMode::SpillEverything),
        ("small, spill everything", small, DebugMode::SpillEverything),
    ]
}

#[test]
fn random_programs_with_frames_never_hand_out_live_bytes() {
    let mut rng = Rng(0x00F4_A3E5);
    let configs = configs();
    let mut made = 0;
    for case in 0..cases() {
        let (_, config, mode) = &configs[case as usize % configs.len()];
        let count = 1 + rng.below(3) as usize;
        let members: Vec<Rc<Workspace>> = (0..count)
            .map(|i| Rc::new(Workspace::with_debug_mode(&format!("W{i}"), config.clone(), *mode).unwrap()))
            .collect();
        let ops = program(&mut rng, count, true);
        // The same program twice: the second runs on what the first taught the arena.
        made += run(None, &members, &ops, 0, case);
        made += run(None, &members, &ops, 0, case ^ 1);
    }
    assert!(made as u64 > cases() * 4, "{made} allocations in {} programs", cases());
}

#[test]
fn a_frames_bytes_are_handed_out_again_when_it_closes() {
    let ws = Workspace::new("W", WorkspaceConfig::builder().initial_size(1 << 20).build().unwrap()).unwrap();
    let scope = ws.enter().unwrap();
    let kept = scope.filled::<u8, _>(100, 7).unwrap();
    let first = {
        let frame = scope.frame().unwrap();
        assert_eq!(frame.level(), 1);
        let t = frame.filled::<f32, _>(1000, 1.0).unwrap();
        t.as_ptr() as usize
    };
    // The next allocation, from the scope or from a new frame, reuses those bytes.
    let frame = scope.frame().unwrap();
    let again = frame.zeros::<f32, _>(1000).unwrap();
    assert_eq!(again.as_ptr() as usize, first);
    assert!(again.iter().all(|&v| v == 0.0), "zeros are zero in reused bytes");
    drop(again);
    drop(frame);
    let from_scope = scope.zeros::<u8, _>(16).unwrap();
    assert_eq!(from_scope.as_ptr() as usize, first);
    assert!(kept.iter().all(|&v| v == 7));
    drop((kept, from_scope));
    drop(scope);
    // The cycle held at most the kept array and one frame's 4,000 bytes (each padded
    // to 64 bytes): that is its peak and what it needed, not the sum.
    let stats = ws.stats();
    assert_eq!(stats.peak_bytes, 128 + 4032);
    assert_eq!(stats.last_cycle_bytes, 128 + 4032);
}

#[test]
fn what_the_scope_allocates_while_a_frame_is_open_outlives_the_frame() {
    let ws = Workspace::new("W", WorkspaceConfig::builder().initial_size(1 << 20).build().unwrap()).unwrap();
    let scope = ws.enter().unwrap();
    let frame = scope.frame().unwrap();
    let a = frame.filled::<u8, _>(64, 1).unwrap();
    let b = scope.filled::<u8, _>(64, 2).unwrap(); // above the frame's bytes
    assert!(a.iter().all(|&v| v == 1));
    drop(a);
    drop(frame);
    // The frame gave back nothing below `b`, so the next bytes come after it.
    let c = scope.filled::<u8, _>(64, 3).unwrap();
    assert!(c.as_ptr() as usize > b.as_ptr() as usize);
    assert!(b.iter().all(|&v| v == 2));
}

#[test]
fn frames_closed_out_of_order_give_back_nothing_still_used() {
    let ws = Workspace::new("W", WorkspaceConfig::builder().initial_size(1 << 20).build().unwrap()).unwrap();
    let scope = ws.enter().unwrap();
    let outer = scope.frame().unwrap();
    let inner = scope.frame().unwrap();
    assert_eq!((outer.level(), inner.level()), (1, 2));
    let x = inner.filled::<u8, _>(256, 5).unwrap();
    let y = outer.filled::<u8, _>(256, 6).unwrap(); // the outer frame, below the top
    drop(y);
    drop(outer); // not the top: gives nothing back
    let z = scope.filled::<u8, _>(256, 9).unwrap();
    assert!(x.iter().all(|&v| v == 5));
    assert!(z.as_ptr() as usize > x.as_ptr() as usize);
    drop(x);
    drop(inner); // the top: back to its start, but not below `z`
    let w = scope.filled::<u8, _>(64, 1).unwrap();
    assert!(w.as_ptr() as usize > z.as_ptr() as usize);
    assert!(z.iter().all(|&v| v == 9));
}

#[test]
fn a_forgotten_frame_keeps_its_bytes_to_the_end_of_the_cycle() {
    let ws = Workspace::new("W", WorkspaceConfig::builder().initial_size(1 << 20).build().unwrap()).unwrap();
    {
        let scope = ws.enter().unwrap();
        let frame = scope.frame().unwrap();
        let p = frame.filled::<u8, _>(128, 4).unwrap().as_ptr() as usize;
        std::mem::forget(frame);
        let next = scope.frame().unwrap();
        assert_eq!(next.level(), 2, "the forgotten frame keeps its level");
        let q = next.filled::<u8, _>(128, 5).unwrap();
        assert!(q.as_ptr() as usize >= p + 128, "the forgotten frame's bytes are not handed out again");
        drop(q);
        drop(next);
        let r = scope.filled::<u8, _>(128, 6).unwrap();
        assert!(r.as_ptr() as usize >= p + 128);
        // The scope's fast path is off while a frame counts as open, and still correct.
        assert!(matches!(scope.placement(r.as_ptr()), Placement::Arena(_)));
    }
    // The next cycle forgets the frame: level 1 again, from the arena's start.
    let scope = ws.enter().unwrap();
    let frame = scope.frame().unwrap();
    assert_eq!(frame.level(), 1);
    let t = frame.zeros::<u8, _>(16).unwrap();
    assert_eq!(scope.placement(t.as_ptr()), Placement::Arena(0));
}

#[test]
fn learning_sizes_the_arena_to_the_most_bytes_held_at_once() {
    let ws = Workspace::new("W", WorkspaceConfig::default()).unwrap();
    for _ in 0..3 {
        let scope = ws.enter().unwrap();
        let _kept = scope.zeros::<f32, _>(1024).unwrap();
        for _ in 0..8 {
            let frame = scope.frame().unwrap();
            let _t = frame.zeros::<f32, _>(16 * 1024).unwrap();
        }
    }
    // Eight frames of 64 KiB, one at a time: the arena is learned as for 4 KiB + 64 KiB
    // (with the configuration's headroom), as a cycle of those two arrays teaches.
    let plain = Workspace::new("P", WorkspaceConfig::default()).unwrap();
    {
        let scope = plain.enter().unwrap();
        let _a = scope.zeros::<f32, _>(1024).unwrap();
        let _b = scope.zeros::<f32, _>(16 * 1024).unwrap();
    }
    assert_eq!(ws.capacity(), plain.capacity());
    assert!(ws.capacity() < 2 * (4096 + 65536));
    assert_eq!(ws.stats().cycles_spilled_after_learning, 0);
    assert_eq!(ws.stats().last_cycle_bytes, 4096 + 65536);
}

#[test]
fn debug_modes_change_where_memory_comes_from_not_what_succeeds() {
    // A fixed budget that frames stay within only because they give bytes back.
    let config = WorkspaceConfig::builder()
        .initial_size(8192)
        .max_size(8192)
        .learning(LearningPolicy::None)
        .spill(SpillPolicy::Fail)
        .build()
        .unwrap();
    for mode in [DebugMode::Disabled, DebugMode::SpillEverything] {
        let ws = Workspace::with_debug_mode("W", config.clone(), mode).unwrap();
        let scope = ws.enter().unwrap();
        for round in 0..10 {
            let frame = scope.frame().unwrap();
            let t = frame.filled::<u8, _>(6000, round).unwrap();
            assert!(t.iter().all(|&v| v == round), "{mode:?}");
        }
        let frame = scope.frame().unwrap();
        let _t = frame.zeros::<u8, _>(6000).unwrap();
        let err = frame.zeros::<u8, _>(6000).unwrap_err();
        assert!(matches!(err, Error::Exhausted { .. }), "{mode:?}: {err}");
    }
}

#[test]
fn a_closed_workspace_has_no_frames_and_views_die_with_their_frame() {
    let ws = Workspace::new("W", WorkspaceConfig::default()).unwrap();
    let engine_err = ws.engine().open_frame().unwrap_err();
    assert!(matches!(engine_err, Error::NotOpen { .. }), "{engine_err}");
    // A heap scope has frames too (each array its own block).
    let heap = workspace_core::Scope::heap();
    let frame = heap.frame().unwrap();
    let x = frame.filled::<f64, _>(3, 2.0).unwrap();
    assert_eq!(x.sum(), 6.0);
    assert!(frame.holds(&x));
}

#[test]
fn a_panic_inside_a_frame_leaves_the_workspace_usable() {
    let ws = Workspace::new("W", WorkspaceConfig::builder().initial_size(1 << 16).build().unwrap()).unwrap();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let scope = ws.enter().unwrap();
        let frame = scope.frame().unwrap();
        let _t = frame.zeros::<u8, _>(100).unwrap();
        panic!("inside a frame");
    }));
    assert!(result.is_err());
    assert!(!ws.is_open());
    let scope = ws.enter().unwrap();
    let frame = scope.frame().unwrap();
    assert_eq!(frame.level(), 1);
    let t = frame.zeros::<u8, _>(100).unwrap();
    assert_eq!(scope.placement(t.as_ptr()), Placement::Arena(0));
}

#[test]
fn a_plan_reuses_a_closed_frames_bytes_across_workspaces() {
    let config =
        WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build().unwrap();
    let group = PlanGroup::new("G");
    let updater = group.workspace("UPDATER", &config).unwrap();
    let grads = group.workspace("GRADS", &config).unwrap();
    for _ in 0..5 {
        group.start_iteration(0).unwrap();
        {
            let g = grads.enter().unwrap();
            let grad = g.filled::<f32, _>(1024, 0.5).unwrap();
            let u = updater.enter().unwrap();
            for _ in 0..4 {
                let frame = u.frame().unwrap();
                let mut update = frame.zeros::<f32, _>(16 * 1024).unwrap();
                update.iter_mut().zip(grad.iter().cycle()).for_each(|(u, g)| *u = -g);
                assert_eq!(update.sum(), -8192.0);
            }
        }
        group.finish_iteration().unwrap();
    }
    let stats = group.stats();
    assert_eq!((stats.plans, stats.divergences, stats.planned_iterations), (1, 0, 4));
    // One update at a time besides the gradient: 4 KiB + 64 KiB, not 4 KiB + 256 KiB.
    assert_eq!(stats.lower_bound_bytes, 4096 + 65536);
    assert_eq!(stats.plan_bytes, stats.lower_bound_bytes);
}

#[test]
fn frames_closed_out_of_order_in_a_loop_do_not_pile_up() {
    // A fixed arena that fails rather than spills: any bytes kept per round would run
    // it out long before the loop ends.
    let config = WorkspaceConfig::builder()
        .initial_size(1 << 20)
        .max_size(1 << 20)
        .learning(LearningPolicy::None)
        .spill(SpillPolicy::Fail)
        .build()
        .unwrap();
    let ws = Workspace::new("W", config).unwrap();
    let scope = ws.enter().unwrap();
    let outer = scope.frame().unwrap(); // stays open throughout
    let kept = outer.filled::<u8, _>(64, 1).unwrap();
    for round in 0..1_000u32 {
        let b = scope.frame().unwrap();
        let x = b.filled::<u8, _>(64, round as u8).unwrap();
        let c = scope.frame().unwrap();
        assert_eq!((b.level(), c.level()), (2, 3), "round {round}");
        assert_eq!(x[63], round as u8);
        drop(x);
        drop(b); // not the top: waits for `c`
        drop(c); // the top: both go
    }
    assert!(kept.iter().all(|&v| v == 1));
    let after = outer.filled::<u8, _>(64, 2).unwrap();
    assert_eq!(scope.placement(after.as_ptr()), Placement::Arena(64), "nothing was kept by the loop");
}

#[test]
fn under_spill_everything_a_closed_frames_blocks_are_freed() {
    use workspace_core::alloc_check::thread_counts;
    let ws = Workspace::with_debug_mode(
        "W",
        WorkspaceConfig::builder().initial_size(1 << 20).build().unwrap(),
        DebugMode::SpillEverything,
    )
    .unwrap();
    let scope = ws.enter().unwrap();
    let kept = scope.filled::<u8, _>(1000, 3).unwrap();
    let before = thread_counts().live_bytes;
    for round in 0..50u32 {
        let frame = scope.frame().unwrap();
        // One request the arena's accounting holds, one that spills.
        let small = frame.filled::<u8, _>(100 << 10, round as u8).unwrap();
        let large = frame.filled::<u8, _>(2 << 20, !round as u8).unwrap();
        assert_eq!((small[12345], large[12345]), (round as u8, !round as u8));
    }
    let grown = thread_counts().live_bytes - before;
    assert!(grown < 4 << 20, "{grown} bytes still held after 50 frames of 2.1 MiB");
    assert!(kept.iter().all(|&v| v == 3));
}

#[test]
fn a_window_of_another_owner_turns_off_the_top_frames_fast_path() {
    // A cycle opened between iterations serves its own arena on the fast path; a replay
    // that starts while it is open must not let a frame go on bumping the own arena once
    // the cycle's allocations have moved into a window of the group's arena.
    let config = WorkspaceConfig::builder().initial_size(1 << 16).learning(LearningPolicy::None).build().unwrap();
    let group = PlanGroup::new("G");
    let a = Workspace::with_debug_mode("A", config, DebugMode::Disabled).unwrap();
    group.join(&a).unwrap();
    group.start_iteration(0).unwrap(); // recorded: one run of the cycle, its close
    {
        let s = a.enter().unwrap();
        let _x = s.zeros::<u8, _>(16).unwrap();
    }
    group.finish_iteration().unwrap();

    let s = a.enter().unwrap(); // between iterations: the own arena
    let kept = s.filled::<u8, _>(1024, 1).unwrap();
    group.start_iteration(0).unwrap(); // a replay starts while the cycle is open
    let f = s.frame().unwrap();
    let x = s.filled::<u8, _>(16, 2).unwrap(); // the cycle's run: a window of the group's arena
    let y = f.filled::<u8, _>(64, 3).unwrap();
    let (k, p) = (kept.as_ptr() as usize, y.as_ptr() as usize);
    assert!(p + 64 <= k || k + 1024 <= p, "the frame's array lies in a live one");
    assert!(kept.iter().all(|&v| v == 1));
    assert!(x.iter().all(|&v| v == 2) && y.iter().all(|&v| v == 3));
    drop((x, y));
    drop(f);
    let z = s.filled::<u8, _>(64, 4).unwrap();
    let q = z.as_ptr() as usize;
    assert!(q + 64 <= k || k + 1024 <= q, "the cycle's array lies in a live one");
    assert!(kept.iter().all(|&v| v == 1));
    drop((kept, z));
    drop(s);
    group.finish_iteration().unwrap();
}
