//! Plan groups against random programs run on real workspaces: a program of opens,
//! nested opens, frames (closed in any order, or forgotten), allocations from scopes and
//! frames, and closes over up to four member workspaces is recorded, planned and
//! replayed, as it was and diverging from the recording at every position (an
//! allocation larger than recorded, one left out, one added, two swapped). Whatever the
//! replay does, no two live allocations ever share a byte (an interval checker over the
//! addresses handed out), and every allocation keeps the pattern written into it until
//! its frame closes or its cycle ends (`tests/common/program.rs`). 10,000 programs per run (`PROPTEST_CASES` scales it, as under
//! valgrind).

use std::rc::Rc;

use workspace_core::planned::PlanGroup;
use workspace_core::{Error, LearningPolicy, SpillPolicy, Workspace, WorkspaceConfig};

use crate::common::program::{program, run, variants};
use crate::common::random::{cases, Rng};

/// Every other member has an arena of its own (which serves it between iterations).
fn member_config(i: usize) -> WorkspaceConfig {
    let builder = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External);
    match i % 2 {
        0 => builder.build().unwrap(),
        _ => builder.initial_size(64 << 10).build().unwrap(),
    }
}

fn config() -> WorkspaceConfig {
    WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build().unwrap()
}

#[test]
fn replaying_a_plan_never_hands_out_bytes_a_live_allocation_holds() {
    let mut rng = Rng(0x005E_ED0F_91A4);
    let (mut exact, mut planned, mut diverged) = (0u64, 0u64, 0u64);
    for case in 0..cases() {
        let count = 1 + rng.below(4) as usize;
        let group = PlanGroup::new("G");
        let members: Vec<Rc<Workspace>> =
            (0..count).map(|i| group.workspace(&format!("M{i}"), &member_config(i)).unwrap()).collect();
        let ops = program(&mut rng, 4.min(count), true);
        // Record, then replay as recorded: on the plan, to the end.
        let made = run(Some(&group), &members, &ops, 7, case);
        let before = group.stats();
        run(Some(&group), &members, &ops, 7, case ^ 1);
        let after = group.stats();
        if made > 0 {
            assert_eq!(after.divergences, 0, "an exact replay diverged: {ops:?}");
            assert_eq!(after.planned_iterations, before.planned_iterations + 1, "{ops:?}");
            assert!(after.plan_bytes >= after.lower_bound_bytes && after.plan_bytes <= after.per_role_bytes);
            exact += 1;
        }
        // Diverge at one position (every position over the run of cases), replay the
        // variant, then the original again (which was recorded again if the variant
        // diverged).
        let k = rng.below(ops.len() as u64) as usize;
        for variant in variants(&ops, k, count) {
            run(Some(&group), &members, &variant, 7, case ^ 2);
            run(Some(&group), &members, &ops, 7, case ^ 3);
            run(Some(&group), &members, &ops, 7, case ^ 4);
        }
        let stats = group.stats();
        planned += stats.planned_iterations;
        diverged += stats.divergences;
        // Stress the threads rule once in a while: a member moved to another thread
        // allocates there as an unplanned workspace.
        if case % 1000 == 0 {
            group.start_iteration(7).unwrap();
            let ws = Workspace::new("moved", config()).unwrap();
            group.join(&ws).unwrap();
            let ws = std::thread::spawn(move || {
                {
                    let s = ws.enter().unwrap();
                    let _ = s.zeros::<f32, _>(100).unwrap();
                }
                ws
            })
            .join()
            .unwrap();
            group.leave(&ws).unwrap();
            group.finish_iteration().unwrap();
        }
    }
    // The test can fail: most replays ran on their plan, and divergences happened.
    assert!(exact > cases() / 2, "{exact} exact replays of {} programs", cases());
    assert!(planned > exact && diverged > 0, "planned {planned}, diverged {diverged}");
}

#[test]
fn identical_iterations_run_on_one_plan_with_the_arena_at_the_lower_bound() {
    let group = PlanGroup::new("G");
    let act = group.workspace("ACT", &config()).unwrap();
    let work = group.workspace("WORK", &config()).unwrap();
    let grad = group.workspace("GRAD", &config()).unwrap();
    for _ in 0..10 {
        group.start_iteration(1).unwrap();
        {
            let a = act.enter().unwrap();
            let mut x = a.zeros::<f32, _>(1000).unwrap();
            for layer in 0..3 {
                let w = work.enter().unwrap();
                let t = w.filled::<f32, _>(5000 * (layer + 1), 1.0).unwrap();
                x[layer] = t.sum();
            }
            let g = grad.enter().unwrap();
            let mut dx = g.zeros::<f32, _>(1000).unwrap();
            dx.assign(&x);
            assert_eq!(dx[2], 15000.0);
        }
        group.finish_iteration().unwrap();
    }
    let stats = group.stats();
    assert_eq!((stats.plans, stats.replans, stats.divergences, stats.planned_iterations), (1, 0, 0, 9));
    // Per role: 4,032 + 60,032 + 4,032 B; live at once at most 4,032 + 60,032.
    assert_eq!(stats.per_role_bytes, 4032 + 60032 + 4032);
    assert_eq!(stats.lower_bound_bytes, 4032 + 60032);
    assert_eq!(stats.plan_bytes, stats.lower_bound_bytes);
    assert_eq!(group.capacity(), stats.plan_bytes);
    // The members' statistics carry the group's figures.
    assert_eq!(act.stats().planned.unwrap().plan_bytes, stats.plan_bytes);
    assert_eq!(act.capacity(), 0);
}

#[test]
fn a_divergence_is_counted_served_off_the_plan_and_recorded_again() {
    let group = PlanGroup::new("G");
    let a = group.workspace("A", &config()).unwrap();
    let b = group.workspace("B", &config()).unwrap();
    let iteration = |bigger: bool| {
        group.start_iteration(0).unwrap();
        {
            let sa = a.enter().unwrap();
            let x = sa.filled::<u8, _>(1000, 1).unwrap();
            {
                let sb = b.enter().unwrap();
                let y = sb.filled::<u8, _>(if bigger { 3000 } else { 1000 }, 2).unwrap();
                assert!(y.iter().all(|&v| v == 2));
            }
            let z = sa.filled::<u8, _>(500, 3).unwrap();
            assert!(x.iter().all(|&v| v == 1) && z.iter().all(|&v| v == 3));
        }
        group.finish_iteration().unwrap();
    };
    iteration(false);
    iteration(false);
    assert_eq!(group.stats().divergences, 0);
    iteration(true); // larger than planned: off the plan
    let stats = group.stats();
    assert_eq!((stats.divergences, stats.planned_iterations), (1, 1));
    iteration(true); // recorded again
    iteration(true); // on the new plan
    let stats = group.stats();
    assert_eq!((stats.plans, stats.replans, stats.divergences, stats.planned_iterations), (2, 1, 1, 2));
}

#[test]
fn plans_of_different_shapes_are_cached_bounded_and_share_one_arena() {
    let group = PlanGroup::with_plans("G", 3);
    let ws = group.workspace("W", &config()).unwrap();
    let iteration = |steps: usize| {
        group.start_iteration(steps as u64).unwrap();
        {
            let s = ws.enter().unwrap();
            for t in 0..steps {
                let _ = s.filled::<f32, _>(16 * (t + 1), 0.5).unwrap();
            }
        }
        group.finish_iteration().unwrap();
    };
    // A stream of shapes, the longest seen early: the arena stops growing there.
    for round in 0..6 {
        for steps in [3, 9, 5] {
            iteration(steps);
        }
        if round == 0 {
            assert_eq!(group.stats().plans, 3);
        }
    }
    let stats = group.stats();
    assert_eq!((stats.plans, stats.evictions, stats.divergences), (3, 0, 0));
    assert_eq!(stats.planned_iterations, 15);
    let largest = group.capacity();
    // A fourth shape evicts the least recently used plan; it comes back recorded.
    iteration(2);
    iteration(3);
    iteration(3);
    let stats = group.stats();
    assert_eq!(stats.cached_plans, 3);
    assert_eq!(stats.evictions, 2);
    assert_eq!(stats.plans, 5);
    assert_eq!(group.capacity(), largest, "the arena does not grow for smaller shapes");
}

#[test]
fn a_key_shared_by_two_shapes_never_shares_a_plan_by_accident() {
    let group = PlanGroup::new("G");
    let ws = group.workspace("W", &config()).unwrap();
    let other = group.workspace("V", &config()).unwrap();
    for round in 0..20 {
        group.start_iteration(42).unwrap();
        {
            let s = ws.enter().unwrap();
            let x = s.filled::<u32, _>(if round % 2 == 0 { 64 } else { 4096 }, 9).unwrap();
            let t = other.enter().unwrap();
            let y = t.filled::<u32, _>(64, 7).unwrap();
            assert!(x.iter().all(|&v| v == 9) && y.iter().all(|&v| v == 7));
        }
        group.finish_iteration().unwrap();
    }
    // Every other iteration diverges (the key lies) but never corrupts.
    assert!(group.stats().divergences >= 9);
}

/// One iteration of shape `key` over the members: each member's cycle allocates what the
/// key says, part of it in a frame (whose bytes later ones reuse); `odd` makes the
/// iteration differ from the key's usual (a divergence). Returns whether it ran on its
/// plan; the members' peaks are the iteration's.
fn shaped_iteration(group: &PlanGroup, members: &[Rc<Workspace>], key: u64, odd: bool) -> bool {
    members.iter().for_each(|ws| ws.reset_peak());
    let ((), on_plan) = group
        .iteration(key, || -> workspace_core::Result<()> {
            for (i, ws) in members.iter().enumerate() {
                let scope = ws.enter()?;
                let _kept = scope.zeros::<u8, _>(64 * (1 + key as usize + i))?;
                {
                    let frame = scope.frame()?;
                    let _scratch = frame.zeros::<u8, _>(100 * (1 + key as usize % 3) + usize::from(odd) * 4096)?;
                }
                let _after = scope.zeros::<u8, _>(32 * (1 + i))?;
            }
            Ok(())
        })
        .unwrap();
    on_plan
}

/// A twin starts where its group is and then records, replays, diverges, evicts and
/// grows alike, iteration for iteration: random streams of shapes over a cache of 3
/// plans, the twin made at a random point between iterations.
#[test]
fn a_shape_only_twin_plans_as_its_group_does() {
    for seed in 0..cases().min(500) {
        let mut rng = Rng(seed);
        let group = PlanGroup::with_plans("G", 3);
        let members: Vec<Rc<Workspace>> = (0..1 + rng.below(3) as usize)
            .map(|i| group.workspace(&format!("M{i}"), &member_config(i)).unwrap())
            .collect();
        let next = |rng: &mut Rng| (rng.below(5), rng.below(8) == 0);
        for _ in 0..rng.below(12) {
            let (key, odd) = next(&mut rng);
            shaped_iteration(&group, &members, key, odd);
        }
        let twin = group.shape_only_twin().unwrap();
        let twins = twin.workspaces();
        assert!(twins.iter().all(|ws| ws.is_shape_only()) && twins.len() == members.len());
        // The figures but how long planning took, which is the clock's.
        let figures = |group: &PlanGroup| {
            let mut stats = group.stats();
            stats.planning_us = 0;
            (group.capacity(), group.plan_bytes(), stats)
        };
        assert_eq!(figures(&twin), figures(&group), "seed {seed}");
        for step in 0..rng.below(16) {
            let (key, odd) = next(&mut rng);
            let real = shaped_iteration(&group, &members, key, odd);
            let dry = shaped_iteration(&twin, &twins, key, odd);
            let what = format!("seed {seed}, iteration {step} after the twin: key {key}, odd {odd}");
            assert_eq!(real, dry, "{what}");
            assert_eq!(figures(&group), figures(&twin), "{what}");
            let peaks = |ws: &[Rc<Workspace>]| ws.iter().map(|w| w.stats().peak_bytes).collect::<Vec<_>>();
            assert_eq!(peaks(&members), peaks(&twins), "{what}");
        }
    }
    // Between iterations only.
    let group = PlanGroup::new("G");
    let ws = group.workspace("W", &config()).unwrap();
    group.start_iteration(1).unwrap();
    let err = group.shape_only_twin().unwrap_err();
    assert!(err.to_string().contains("between iterations"), "{err}");
    group.finish_iteration().unwrap();
    // A plan of a workspace that joined (not one of the group's own) has no twin.
    let joined = Workspace::new("J", config()).unwrap();
    group.join(&joined).unwrap();
    group.iteration(2, || joined.enter().and_then(|s| s.zeros::<u8, _>(8).map(|_| ()))).unwrap();
    let err = group.shape_only_twin().unwrap_err();
    assert!(err.to_string().contains("only the members it made"), "{err}");
    drop(ws);
}

#[test]
fn validation_still_tells_the_roles_apart() {
    use workspace_core::{ArrayType, LayerWorkspaceMgr};
    let group = PlanGroup::new("G");
    let mgr = LayerWorkspaceMgr::builder()
        .with(ArrayType::Activations, "WS_ACT", config())
        .default_workspace("WS_WORK", config())
        .planned(&group)
        .build()
        .unwrap();
    for _ in 0..3 {
        group.start_iteration(0).unwrap();
        {
            let act = mgr.enter(ArrayType::Activations).unwrap();
            let y = act.zeros::<f32, _>(64).unwrap();
            let work = mgr.enter(ArrayType::FfWorkingMem).unwrap();
            let t = work.zeros::<f32, _>(64).unwrap();
            mgr.validate(ArrayType::Activations, "dense", &y).unwrap();
            let err = mgr.validate(ArrayType::Activations, "dense", &t).unwrap_err();
            assert!(matches!(err, Error::WrongLocation { .. }), "{err}");
            assert!(err.to_string().contains("WS_WORK"), "{err}");
        }
        group.finish_iteration().unwrap();
    }
    assert_eq!(group.stats().planned_iterations, 2);
}

#[test]
fn members_are_the_groups_own_and_circular_workspaces_cannot_join() {
    let group = PlanGroup::new("G");
    let a = group.workspace("SAME", &config()).unwrap();
    let other = PlanGroup::new("H");
    let b = other.workspace("SAME", &config()).unwrap();
    assert!(!Rc::ptr_eq(&a, &b));
    assert!(matches!(other.join(&a), Err(Error::InvalidConfig { .. })));
    let circular = Workspace::new(
        "C",
        WorkspaceConfig::builder().reset(workspace_core::ResetPolicy::EndOfBuffer).initial_size(4096).build().unwrap(),
    )
    .unwrap();
    let err = group.join(&circular).unwrap_err();
    assert!(err.to_string().contains("circular"), "{err}");
    let open = a.enter().unwrap();
    assert!(matches!(group.leave(&a), Err(Error::StillOpen { .. })));
    drop(open);
    group.leave(&a).unwrap();
    assert!(matches!(group.leave(&a), Err(Error::InvalidInput(_))));
}

/// An iteration of `key` in which `ws` alone allocates once; whether it ran on its plan.
fn iteration_of(group: &PlanGroup, ws: &Workspace, key: u64) -> bool {
    group.start_iteration(key).unwrap();
    {
        let s = ws.enter().unwrap();
        let _x = s.filled::<u8, _>(256, 1).unwrap();
    }
    group.finish_iteration().unwrap()
}

#[test]
fn a_cycle_open_across_iterations_blocks_the_next_plan_without_spoiling_it() {
    let group = PlanGroup::new("G");
    let a = group.workspace("A", &config()).unwrap();
    let b = group.workspace("B", &config()).unwrap();
    let only = |ws: &Workspace, key: u64| iteration_of(&group, ws, key);
    only(&a, 0); // recorded
    only(&b, 1); // recorded

    // A's cycle holds its window over the end of its iteration (which therefore left its
    // plan), into an iteration of B's shape.
    group.start_iteration(0).unwrap();
    let s = a.enter().unwrap();
    let x = s.filled::<u8, _>(256, 2).unwrap();
    assert!(!group.finish_iteration().unwrap());
    group.start_iteration(1).unwrap(); // blocked: a window of the last one is held
    assert!(x.iter().all(|&v| v == 2));
    drop(s);
    assert!(!group.finish_iteration().unwrap());
    assert_eq!(group.stats().blocked_iterations, 1);
    // B's plan is still good: its next iteration replays it, nothing recorded again.
    let plans = group.stats().plans;
    assert!(only(&b, 1), "replayed after the block");
    assert_eq!(group.stats().plans, plans);
}

#[test]
fn a_member_dropped_with_its_window_held_does_not_block_the_group_for_good() {
    let group = PlanGroup::new("G");
    let a = Workspace::new("A", config()).unwrap();
    group.join(&a).unwrap();
    let b = group.workspace("B", &config()).unwrap();
    let only = |ws: &Workspace, key: u64| iteration_of(&group, ws, key);
    only(&a, 0); // recorded: a run of A
    only(&b, 1); // recorded: a run of B

    // A's cycle opens raw (no scope, never closed), takes its window, and A goes.
    group.start_iteration(0).unwrap();
    a.engine().enter().unwrap();
    drop(a);
    group.finish_iteration().unwrap();
    // B's plan replays: nothing holds a window any more.
    assert!(only(&b, 1), "B's iteration replayed on its plan");
    assert_eq!(group.stats().blocked_iterations, 0);
}

#[test]
fn a_reserved_arena_serves_plans_up_to_its_size_without_growing() {
    let group = PlanGroup::new("G");
    let ws = group.workspace("A", &config()).unwrap();
    group.reserve(0).unwrap();
    assert_eq!(group.capacity(), 0, "nothing to reserve");
    group.reserve(1 << 20).unwrap();
    let reserved = group.capacity();
    assert!(reserved >= 1 << 20, "{reserved}");
    for _ in 0..3 {
        iteration_of(&group, &ws, 0);
    }
    let stats = group.stats();
    assert_eq!((stats.plans, stats.planned_iterations), (1, 2));
    assert_eq!(stats.arena_bytes, reserved, "the plan fits: the arena stayed");
    assert_eq!(stats.plan_bytes, 256);
    // The arena never shrinks; a request that cannot be had is a typed error and
    // changes nothing.
    group.reserve(4096).unwrap();
    assert_eq!(group.capacity(), reserved);
    assert!(matches!(group.reserve(usize::MAX), Err(Error::Backend { .. })));
    assert_eq!(group.capacity(), reserved);
    assert!(iteration_of(&group, &ws, 0), "still replays");
    // Not while a member's cycle holds part of the arena.
    group.start_iteration(0).unwrap();
    let s = ws.enter().unwrap();
    let x = s.filled::<u8, _>(256, 3).unwrap();
    let held = group.reserve(8 << 20).unwrap_err();
    assert!(matches!(held, Error::InvalidInput(_)), "{held}");
    assert!(held.to_string().contains("holds part of it"), "{held}");
    assert!(x.iter().all(|&v| v == 3));
    drop(s);
    group.finish_iteration().unwrap();
    group.reserve(8 << 20).unwrap();
    assert!(group.capacity() >= 8 << 20);
    assert!(iteration_of(&group, &ws, 0), "the plan replays in the new arena");
}

#[test]
fn a_replayed_cycle_is_counted_alike_on_the_short_and_the_general_close() {
    // A timeline sends a member's close down the general path; without one, a replayed
    // cycle closes on the short path. Both count the cycle the same way.
    let counted = |timeline: usize| {
        let group = PlanGroup::new("G");
        let config = WorkspaceConfig::builder()
            .learning(LearningPolicy::None)
            .spill(SpillPolicy::External)
            .initial_size(4096)
            .cycle_history_len(timeline)
            .build()
            .unwrap();
        let ws = group.workspace("A", &config).unwrap();
        for round in 0..4 {
            group.start_iteration(0).unwrap();
            {
                let s = ws.enter().unwrap();
                let _a = s.filled::<u8, _>(100 + round, 1).unwrap();
                let _b = s.filled::<f64, _>(30, 2.0).unwrap();
            }
            group.finish_iteration().unwrap();
            if round == 0 {
                // What the replays count, without the recorded round's figures.
                ws.reset_peak();
            }
        }
        let stats = ws.stats();
        (
            stats.peak_bytes,
            stats.last_cycle_bytes,
            stats.bytes_in_use,
            stats.cycles,
            ws.engine().cursor(),
            group.stats().planned_iterations,
        )
    };
    let short = counted(0);
    assert_eq!(short, counted(8));
    // Rounds 1..3 replay the plan (100..103 B fit the 128 B planned for 100 B: sizes
    // are padded to the 64 B alignment unit).
    assert_eq!(short.5, 3);
    assert_eq!((short.1, short.2, short.4), (128 + 256, 0, 0));
    assert_eq!(short.0, 128 + 256);
}

#[test]
fn trimming_the_arena_between_two_cycles_of_a_replay_sends_the_rest_off_the_plan() {
    let group = PlanGroup::new("G");
    let a = group.workspace("A", &config()).unwrap();
    let b = group.workspace("B", &config()).unwrap();
    let cycle = |ws: &Workspace, value: u8| {
        let s = ws.enter().unwrap();
        let x = s.filled::<u8, _>(4096, value).unwrap();
        assert!(x.iter().all(|&v| v == value));
    };
    for _ in 0..2 {
        group.start_iteration(0).unwrap();
        cycle(&a, 1);
        cycle(&b, 2);
        group.finish_iteration().unwrap();
    }
    assert_eq!(group.stats().planned_iterations, 1);
    group.start_iteration(0).unwrap();
    cycle(&a, 3);
    // No member holds a window now: the arena may go, and B's run must not be served
    // from it.
    group.trim().unwrap();
    assert_eq!(group.capacity(), 0);
    cycle(&b, 4);
    assert!(!group.finish_iteration().unwrap(), "off the plan after the trim");
    // The plan is still good: the next iteration replays it in a new arena.
    group.start_iteration(0).unwrap();
    cycle(&a, 5);
    cycle(&b, 6);
    assert!(group.finish_iteration().unwrap());
    assert!(group.capacity() > 0);
    assert_eq!(group.stats().divergences, 0);
}

/// One iteration of `key` in which `ws` allocates arrays of `sizes` bytes in one cycle;
/// each allocation's outcome: `Ok` or the error's kind.
fn outcomes(group: Option<&PlanGroup>, ws: &Workspace, key: u64, sizes: &[usize]) -> Vec<Result<(), String>> {
    outcomes_framed(group, ws, key, sizes, 0)
}

/// The outcome of one allocation, keeping the array (with the value written into it).
fn try_filled<'s>(
    scope: &'s workspace_core::Scope<'_>,
    frame: Option<&'s workspace_core::Frame<'_>>,
    n: usize,
    value: u8,
    arrays: &mut Vec<(u8, ndarray::ArrayViewMut1<'s, u8>)>,
) -> Result<(), String> {
    let array = match frame {
        Some(frame) => frame.filled::<u8, _>(n, value),
        None => scope.filled::<u8, _>(n, value),
    };
    match array {
        Ok(array) => {
            arrays.push((value, array));
            Ok(())
        }
        Err(Error::Exhausted { .. }) => Err("exhausted".into()),
        Err(Error::BudgetExceeded { .. }) => Err("budget exceeded".into()),
        Err(other) => Err(format!("{other:?}")),
    }
}

/// As [`outcomes`], the first `framed` arrays in a frame that closes before the others.
fn outcomes_framed(
    group: Option<&PlanGroup>,
    ws: &Workspace,
    key: u64,
    sizes: &[usize],
    framed: usize,
) -> Vec<Result<(), String>> {
    if let Some(group) = group {
        group.start_iteration(key).unwrap();
    }
    let kinds = {
        let s = ws.enter().unwrap();
        let mut kinds = Vec::new();
        if framed > 0 {
            let f = s.frame().unwrap();
            let mut arrays = Vec::new();
            for (i, &n) in sizes[..framed].iter().enumerate() {
                kinds.push(try_filled(&s, Some(&f), n, i as u8 + 1, &mut arrays));
            }
            for (value, array) in &arrays {
                assert!(array.iter().all(|v| v == value), "array {value} kept its contents");
            }
        }
        let mut arrays = Vec::new();
        for (i, &n) in sizes.iter().enumerate().skip(framed) {
            kinds.push(try_filled(&s, None, n, i as u8 + 1, &mut arrays));
        }
        for (value, array) in &arrays {
            assert!(array.iter().all(|v| v == value), "array {value} kept its contents");
        }
        kinds
    };
    if let Some(group) = group {
        group.finish_iteration().unwrap();
    }
    kinds
}

/// A member's configuration that never spills: a fixed arena of `bytes`.
fn fail_config(bytes: usize) -> WorkspaceConfig {
    WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .spill(SpillPolicy::Fail)
        .initial_size(bytes)
        .build()
        .unwrap()
}

/// Runs the iterations of `program` (the sizes each allocates) on an unplanned workspace
/// and on a plan group's member of the same configuration, all under one key (so each
/// iteration replays the plan of the one before where there is one): both give the same
/// outcome for every allocation.
fn same_outcomes_planned_and_unplanned(
    config: &WorkspaceConfig,
    program: &[&[usize]],
) -> workspace_core::planned::PlannedStats {
    same_outcomes_framed(config, &program.iter().map(|&sizes| (sizes, 0)).collect::<Vec<_>>())
}

/// As [`same_outcomes_planned_and_unplanned`], each iteration's first arrays (as many
/// as it says) in a frame.
fn same_outcomes_framed(
    config: &WorkspaceConfig,
    program: &[(&[usize], usize)],
) -> workspace_core::planned::PlannedStats {
    let alone = Workspace::new("ALONE", config.clone()).unwrap();
    let group = PlanGroup::new("G");
    let member = group.workspace("MEMBER", config).unwrap();
    for (i, &(sizes, framed)) in program.iter().enumerate() {
        let expected = outcomes_framed(None, &alone, 0, sizes, framed);
        let got = outcomes_framed(Some(&group), &member, 0, sizes, framed);
        assert_eq!(got, expected, "iteration {i} ({sizes:?}) of {program:?} with {config:?}");
    }
    group.stats()
}

#[test]
fn off_its_plan_a_member_applies_its_spill_policy_fail() {
    let config = fail_config(4096);
    // The third iteration replays the plan of the second and diverges at its second array,
    // which an unplanned workspace of 4,096 bytes refuses; so does the member.
    let stats = same_outcomes_planned_and_unplanned(&config, &[&[3000], &[3000], &[3000, 3000], &[3000, 3000]]);
    assert!(stats.planned_iterations >= 1, "{stats:?}");
}

#[test]
fn off_its_plan_a_member_counts_its_windows_in_its_budget() {
    let config = WorkspaceConfig::builder().max_size(4096).spill(SpillPolicy::External).build().unwrap();
    let stats = same_outcomes_planned_and_unplanned(&config, &[&[4000], &[4000], &[4000, 4000], &[4000, 4000]]);
    assert!(stats.planned_iterations >= 1, "{stats:?}");
    // Without an arena of its own, all in spill blocks: the budget still counts the window.
    let config = WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .max_size(4096)
        .spill(SpillPolicy::External)
        .build()
        .unwrap();
    let stats = same_outcomes_planned_and_unplanned(&config, &[&[4000], &[4000], &[4000, 4000], &[1000, 3000, 64]]);
    assert!(stats.planned_iterations >= 1, "{stats:?}");
}

#[test]
fn a_closed_frames_window_bytes_count_no_more_off_the_plan() {
    // The frame's bytes are given back at its close, planned or not: the cycle's
    // allocation after it fits the member's 256-byte arena as it fits an unplanned one.
    let config = fail_config(256);
    let alone = Workspace::new("ALONE", config.clone()).unwrap();
    let group = PlanGroup::new("G");
    let member = group.workspace("MEMBER", &config).unwrap();
    for after in [128, 128, 256, 256] {
        // 256 bytes in a frame that closes, then `after` in the cycle.
        let expected = outcomes_framed(None, &alone, 1, &[256, after], 1);
        assert_eq!(expected, [Ok(()), Ok(())]);
        assert_eq!(outcomes_framed(Some(&group), &member, 1, &[256, after], 1), expected, "then {after} bytes");
    }
    assert!(group.stats().planned_iterations >= 1);
}

#[test]
fn an_allocation_refused_in_a_planned_iteration_leaves_the_plan_good() {
    let config = fail_config(4096);
    let group = PlanGroup::new("G");
    let member = group.workspace("MEMBER", &config).unwrap();
    // Each iteration asks for one array too many, then goes on with a small one.
    for _ in 0..5 {
        let got = outcomes(Some(&group), &member, 7, &[3000, 3000, 500]);
        assert_eq!(got, vec![Ok(()), Err("exhausted".into()), Ok(())]);
    }
    let stats = group.stats();
    // Recorded once, then on its plan: the refusal is no divergence.
    assert_eq!((stats.plans, stats.divergences, stats.planned_iterations), (1, 0, 4), "{stats:?}");
}

/// The policies of the policy table (`common/policy_suite.rs`) as a member's
/// configuration: learning, spill policy, arena and budget.
fn policy_configs() -> Vec<WorkspaceConfig> {
    use workspace_core::AllocationPolicy;
    let mut configs = Vec::new();
    for learning in [LearningPolicy::None, LearningPolicy::FirstLoop, LearningPolicy::OverTime { cycles: 2 }] {
        for spill in [SpillPolicy::Fail, SpillPolicy::External, SpillPolicy::Reallocate] {
            for initial in [0, 1024, 4096] {
                for max in [4096, 8192, usize::MAX] {
                    let config = WorkspaceConfig::builder()
                        .allocation(AllocationPolicy::Strict)
                        .learning(learning)
                        .spill(spill)
                        .initial_size(initial)
                        .max_size(max)
                        .build();
                    // Contradictions (a Fail workspace with no arena and no learning) are
                    // refused at construction, for members as for others.
                    configs.extend(config.ok());
                }
            }
        }
    }
    configs
}

#[test]
fn members_give_the_outcomes_of_unplanned_workspaces_recorded_replayed_and_diverging_with_frames() {
    let configs = policy_configs();
    let mut rng = Rng(0x9011_C1E5);
    let (mut planned, mut diverged, mut recorded) = (0u64, 0u64, 0u64);
    let arrays = |rng: &mut Rng| -> Vec<usize> {
        (0..1 + rng.below(4)).map(|_| [100, 1000, 2000, 3000, 4000][rng.below(5) as usize]).collect()
    };
    for case in 0..cases().div_ceil(20) {
        let config = &configs[(case % configs.len() as u64) as usize];
        // An iteration repeated (recorded, then replayed), then another (diverging from
        // its plan). The repeated one is never recorded while the member spills past an
        // arena of its own: it fits the member's initial arena if it has one, and its
        // budget otherwise (so that the arena learned or grown from it holds it). A plan
        // recorded past an own arena is replayed with its windows counted as if packed
        // into that arena (see `Engine::budget_arena`), which may differ from an
        // unplanned workspace's layout by the arena's unused tail.
        let fits = |sizes: &[usize]| {
            let total = sizes.iter().map(|n| n.next_multiple_of(64)).sum::<usize>();
            match config.initial_size() {
                0 => total <= config.max_size(),
                initial => total <= initial,
            }
        };
        let repeated = loop {
            let sizes = arrays(&mut rng);
            if fits(&sizes) {
                break sizes;
            }
        };
        let last = arrays(&mut rng);
        // Some arrays in a frame that closes before the others are made.
        let framed = (rng.below(repeated.len() as u64 + 1) as usize, rng.below(last.len() as u64 + 1) as usize);
        let mut program: Vec<(&[usize], usize)> = vec![(&repeated, framed.0); 1 + rng.below(3) as usize];
        program.push((&last, framed.1));
        let stats = same_outcomes_framed(config, &program);
        planned += stats.planned_iterations;
        diverged += stats.divergences;
        recorded += stats.recorded_iterations;
    }
    // Every phase was exercised.
    assert!(planned > 0 && diverged > 0 && recorded > 0, "{planned} {diverged} {recorded}");
}

/// The stats table shows a plan group's figures on each member's row (the plan, its
/// bound, the iteration per role, re-plans and divergences), "-" on a workspace of no
/// group, and no such columns when no workspace is planned.
#[test]
fn the_stats_table_gives_each_member_its_groups_plan_figures() {
    let group = PlanGroup::new("G");
    let act = group.workspace("ACT", &config()).unwrap();
    let work = group.workspace("WORK", &config()).unwrap();
    let alone = Workspace::new("ALONE", WorkspaceConfig::default()).unwrap();
    for i in 0..4 {
        group.start_iteration(1).unwrap();
        {
            let a = act.enter().unwrap();
            a.zeros::<f32, _>(1000).unwrap();
            let w = work.enter().unwrap();
            // The last iteration leaves its plan: a larger allocation than recorded.
            w.zeros::<f32, _>(if i == 3 { 9000 } else { 5000 }).unwrap();
        }
        group.finish_iteration().unwrap();
        drop(alone.enter().unwrap());
    }
    let stats = group.stats();
    assert_eq!((stats.plans, stats.divergences), (1, 1));
    let table = workspace_core::stats_table(&[act.stats(), work.stats(), alone.stats()]);
    let lines: Vec<&str> = table.lines().collect();
    for column in ["plan", "bound", "per role", "replans", "diverged"] {
        assert!(lines[0].contains(column), "{column}: {table}");
    }
    let cells =
        |line: &str| line.split("  ").map(str::trim).filter(|c| !c.is_empty()).map(String::from).collect::<Vec<_>>();
    let human = |bytes: usize| format!("{:.1} KiB", bytes as f64 / 1024.0);
    for member in [&lines[2], &lines[3]] {
        let row = cells(member);
        let tail = &row[row.len() - 5..];
        assert_eq!(tail[0], human(stats.plan_bytes), "{table}");
        assert_eq!(tail[1], human(stats.lower_bound_bytes), "{table}");
        assert_eq!(tail[2], human(stats.per_role_bytes), "{table}");
        assert_eq!((tail[3].as_str(), tail[4].as_str()), ("0", "1"), "{table}");
    }
    let row = cells(lines[4]);
    assert!(row[0] == "ALONE" && row[row.len() - 5..].iter().all(|c| c == "-"), "{table}");
    // No member: the table as before, without the plan columns.
    let plain = workspace_core::stats_table(&[alone.stats()]);
    assert!(!plain.contains("per role") && plain.contains("late spills"), "{plain}");
}
