//! `alloc_check` with the counting allocator installed: what a guard counts (a `Vec`,
//! an owned ndarray result, nothing for a workspace step), on which thread, the first
//! allocations it describes, nesting, the error's message, `assert_no_alloc` and the
//! opt-in stack of the first allocation.

use std::sync::{Arc, Barrier};

use ndarray::Array2;
use workspace_core::alloc_check::{assert_no_alloc, AllocationError, AllocationGuard, CountingAllocator};
use workspace_core::alloc_check::{
    is_installed, process_counts, reset_thread_peak, thread_counts, AllocationKind, Threads, SAMPLES, TRACE_FRAMES,
};
use workspace_core::{Error, Workspace, WorkspaceConfig};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

#[test]
fn the_allocator_knows_it_is_installed() {
    assert!(is_installed());
}

#[test]
fn a_vec_is_one_allocation_of_its_bytes() {
    let guard = AllocationGuard::begin().unwrap();
    let v: Vec<u64> = Vec::with_capacity(100);
    let report = guard.finish();
    assert_eq!((report.allocations(), report.bytes()), (1, 800));
    let first = report.samples()[0];
    assert_eq!((first.size, first.align, first.kind), (800, 8, AllocationKind::Alloc));
    assert!(!report.is_none());
    assert!(report.check().is_err());
    drop(v);
}

#[test]
fn an_owned_ndarray_result_is_an_allocation() {
    let a = Array2::<f32>::ones((16, 16));
    let b = Array2::<f32>::ones((16, 16));
    let guard = AllocationGuard::begin().unwrap();
    let sum = &a + &b;
    let report = guard.finish();
    assert_eq!((report.allocations(), report.bytes()), (1, 16 * 16 * 4), "{report:?}");
    assert_eq!(report.samples()[0].size, 1024);
    assert_eq!(sum[[3, 4]], 2.0);
}

/// One training-like step whose every array comes from the workspace.
fn workspace_step(ws: &Workspace, input: &Array2<f32>) -> workspace_core::Result<f32> {
    let scope = ws.enter()?;
    let mut h = scope.zeros::<f32, _>(input.raw_dim())?;
    h.assign(input);
    h.mapv_inplace(|x| x.max(0.0) * 0.5);
    let mut col = scope.zeros::<f32, _>(input.ncols())?;
    for row in h.rows() {
        col += &row;
    }
    Ok(col.sum())
}

#[test]
fn a_workspace_step_makes_none_after_its_first_cycle() {
    let ws = Workspace::new("ALLOC_CHECK", WorkspaceConfig::default()).unwrap();
    let input = Array2::from_shape_fn((32, 24), |(i, j)| (i as f32 - j as f32) / 8.0);
    let first = workspace_step(&ws, &input).unwrap(); // learns the size

    let guard = AllocationGuard::begin().unwrap();
    let mut total = 0.0;
    for _ in 0..100 {
        total += workspace_step(&ws, &input).unwrap();
    }
    let report = guard.finish();
    assert!(report.is_none(), "{report}");
    report.check().unwrap();
    report.assert_none();
    assert_eq!(total, 100.0 * first);
    assert!(report.to_string().starts_with("no heap allocation"), "{report}");

    // The helper gives back what the closure returned.
    assert_eq!(assert_no_alloc(|| workspace_step(&ws, &input)).unwrap(), first);
}

#[test]
fn a_guard_counts_only_its_own_thread() {
    let start = Arc::new(Barrier::new(2));
    let done = Arc::new(Barrier::new(2));
    let worker = {
        let (start, done) = (Arc::clone(&start), Arc::clone(&done));
        std::thread::spawn(move || {
            start.wait();
            let guard = AllocationGuard::begin().unwrap();
            let buffer = std::hint::black_box(vec![1_u8; 1 << 20]);
            let report = guard.finish();
            done.wait();
            (report.allocations(), report.bytes(), buffer.len())
        })
    };
    let everyone_before = process_counts(Threads::All);
    let guard = AllocationGuard::begin().unwrap();
    start.wait(); // the worker allocates while this thread's guard is alive
    done.wait();
    let report = guard.finish();
    let everyone_after = process_counts(Threads::All);
    assert!(report.is_none(), "another thread's allocation was counted: {report}");
    assert_eq!(worker.join().unwrap(), (1, 1 << 20, 1 << 20), "the worker's own guard counts it");
    assert!(everyone_after.bytes - everyone_before.bytes >= 1 << 20, "process-wide counts see it");
}

#[test]
fn the_first_allocations_are_described_in_order() {
    let guard = AllocationGuard::begin().unwrap();
    let zeroed = vec![0_u8; 64]; // alloc_zeroed
    let mut grown: Vec<u32> = Vec::with_capacity(1);
    grown.reserve_exact(100); // realloc to 400 bytes
    let small: Vec<Box<u16>> = (0..20).map(Box::new).collect();
    let report = guard.finish();
    assert_eq!(report.allocations(), 4 + 20, "{report:?}"); // the boxes and their Vec
    assert_eq!(report.bytes(), 64 + 4 + 400 + 20 * 8 + 20 * 2);
    let kinds: Vec<_> = report.samples().iter().map(|s| (s.size, s.kind)).collect();
    assert_eq!(report.samples().len(), SAMPLES);
    assert_eq!(
        kinds[..5],
        [
            (64, AllocationKind::AllocZeroed),
            (4, AllocationKind::Alloc),
            (400, AllocationKind::Realloc),
            (160, AllocationKind::Alloc),
            (2, AllocationKind::Alloc)
        ]
    );
    drop((zeroed, grown, small));
}

#[test]
fn guards_nest() {
    let outer = AllocationGuard::begin().unwrap();
    let a = std::hint::black_box(Box::new(1_u64));
    let inner = AllocationGuard::begin().unwrap();
    let b = std::hint::black_box(vec![0_u32; 10]);
    let inner = inner.finish();
    let c = std::hint::black_box(Box::new(2_u32));
    let outer = outer.finish();
    assert_eq!((inner.allocations(), inner.bytes()), (1, 40));
    assert_eq!(inner.samples()[0].size, 40);
    assert_eq!((outer.allocations(), outer.bytes()), (3, 8 + 40 + 4));
    // The inner guard described its allocation in the slots the outer one was using: the
    // outer report keeps what is still its own, and stops there.
    assert_eq!(outer.samples().len(), 0, "{outer:?}");
    drop((a, b, c));

    // A guard begun after another ended describes its own allocations.
    let after = AllocationGuard::begin().unwrap();
    let d = std::hint::black_box(Box::new(3_u16));
    let after = after.finish();
    assert_eq!(after.samples()[0].size, 2);
    drop(d);
}

#[test]
fn the_error_says_how_many_how_much_where_and_what_to_do() {
    let guard = AllocationGuard::begin().unwrap();
    let line = line!() - 1;
    let v = std::hint::black_box(vec![0.5_f32; 256]);
    let w = std::hint::black_box(v.iter().map(|x| x * 2.0).collect::<Vec<f32>>());
    let report = guard.finish();
    let error = report.check().unwrap_err();
    match &error {
        Error::AllocationCheck(AllocationError::HeapAllocation { allocations, bytes, location, first, trace }) => {
            assert_eq!((*allocations, *bytes), (2, 2048));
            assert_eq!(location, &format!("{}:{line}:17", file!()));
            assert_eq!(first.len(), 2);
            assert!(trace.is_none());
        }
        other => panic!("wrong error: {other}"),
    }
    let message = error.to_string();
    for part in [
        "2 heap allocations (2048 bytes) on this thread",
        &format!("begun at {}:{line}", file!()),
        "the first: 1024 bytes (alloc, align 4), 1024 bytes (alloc, align 4)",
        "from its workspace scope",
        "`sum_axis`",
    ] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(format!("{error:?}"), message, "Debug prints the message");
    assert_eq!(report.to_string(), message);
    drop((v, w));
}

#[test]
fn assert_no_alloc_panics_with_the_message() {
    let caught = std::panic::catch_unwind(|| assert_no_alloc(|| std::hint::black_box(vec![1_u64; 4]).len()));
    let payload = caught.expect_err("an allocation must panic");
    let message = payload.downcast_ref::<String>().expect("a formatted message");
    assert!(message.contains("1 heap allocation (32 bytes)"), "{message}");
    assert!(message.contains(file!()), "{message}");
}

#[test]
fn a_dropped_guard_stops_describing() {
    {
        let _guard = AllocationGuard::begin().unwrap();
    }
    let guard = AllocationGuard::begin().unwrap();
    let first = std::hint::black_box(Box::new([0_u8; 24]));
    assert_eq!(guard.counts().allocations, 1);
    let report = guard.finish();
    assert_eq!(report.samples()[0].size, 24);
    drop(first);
    // Outside any guard the thread still counts.
    let before = thread_counts();
    let v = std::hint::black_box(vec![0_u8; 10]);
    assert_eq!(thread_counts().allocations - before.allocations, 1);
    drop(v);
}

#[test]
fn a_traced_guard_keeps_the_stack_of_its_first_allocation() {
    let guard = AllocationGuard::begin_traced().unwrap();
    let v = std::hint::black_box(vec![7_u16; 100]);
    let w = std::hint::black_box(vec![8_u16; 100]);
    let report = guard.finish();
    assert_eq!(report.allocations(), 2);
    let message = report.check().unwrap_err().to_string();
    if cfg!(all(target_os = "linux", target_env = "gnu")) {
        let trace = report.trace().expect("a stack on Linux with glibc");
        assert!(trace.len() > 3 && trace.len() <= TRACE_FRAMES, "{trace:x?}");
        // The frames name this test binary (the test's own code is on the stack).
        let exe = std::env::current_exe().unwrap();
        assert!(message.contains(&format!("{} +0x", exe.display())), "{message}");
        assert!(message.contains(&format!("`addr2line -Cfipe {} 0x", exe.display())), "{message}");
    } else {
        assert!(report.trace().is_none());
        assert!(message.contains("No stack of the first allocation"), "{message}");
    }
    drop((v, w));

    // Untraced guards, and traced ones that saw nothing, keep none.
    let guard = AllocationGuard::begin().unwrap();
    let v = std::hint::black_box(vec![7_u16; 100]);
    assert!(guard.finish().trace().is_none());
    drop(v);
    let guard = AllocationGuard::begin_traced().unwrap();
    assert!(guard.finish().trace().is_none());
}

#[test]
fn a_thread_knows_its_live_bytes_and_their_peak() {
    let start = reset_thread_peak();
    assert_eq!(start.peak_live_bytes, start.live_bytes);
    let big = std::hint::black_box(vec![0_u8; 10_000]);
    let mut small = std::hint::black_box(Vec::<u8>::with_capacity(100));
    drop(big);
    small.reserve_exact(500); // realloc: 100 → 500 bytes live
    let now = thread_counts();
    assert_eq!(now.live_bytes - start.live_bytes, 500);
    assert_eq!(now.peak_live_bytes - start.live_bytes, 10_100, "the peak was the big vector and the small one");
    assert_eq!((now.allocations - start.allocations, now.bytes - start.bytes), (3, 10_000 + 100 + 500));
    let reset = reset_thread_peak();
    assert_eq!(reset.peak_live_bytes, reset.live_bytes);
    drop(small);
    assert_eq!(thread_counts().live_bytes - start.live_bytes, 0);
}

/// A plan group whose arena holds its iterations records a shape it has not seen in the
/// arena (nothing spills) and plans it with the room its planner kept: the new plan's
/// storage is the only heap allocation of that iteration.
#[test]
fn a_new_shape_is_recorded_and_planned_with_one_heap_allocation_once_warm() {
    let group = workspace_core::planned::PlanGroup::new("G");
    let config = WorkspaceConfig::builder()
        .learning(workspace_core::LearningPolicy::None)
        .spill(workspace_core::SpillPolicy::External)
        .build()
        .unwrap();
    let (act, scratch) = (group.workspace("ACT", &config).unwrap(), group.workspace("SCRATCH", &config).unwrap());
    group.reserve(1 << 20).unwrap();
    // An iteration of `steps` steps: activations kept, a scratch cycle per step, and a
    // frame of scratch inside each.
    let iteration = |key: u64, steps: usize| {
        group.start_iteration(key).unwrap();
        {
            let a = act.enter().unwrap();
            let mut kept = 0.0;
            for step in 0..steps {
                let x = a.filled::<f32, _>(64 + step, 1.0).unwrap();
                let s = scratch.enter().unwrap();
                let t = s.filled::<f32, _>(512, 2.0).unwrap();
                let f = s.frame().unwrap();
                let u = f.filled::<f32, _>(128, 3.0).unwrap();
                kept += x.sum() + t[0] + u[0];
            }
            assert!(kept > 0.0);
        }
        group.finish_iteration().unwrap()
    };
    // Warm-up: the planner's room grows to iterations of up to 40 steps.
    for steps in [40, 40] {
        iteration(steps as u64, steps);
    }
    for steps in [7, 23, 31] {
        let guard = AllocationGuard::begin().unwrap();
        let replayed = iteration(steps as u64, steps);
        let report = guard.finish();
        assert!(!replayed, "a new shape is recorded");
        assert!(report.allocations() <= 1, "{report:?}");
        assert!(iteration(steps as u64, steps), "and replayed next time");
    }
    let stats = group.stats();
    assert_eq!((stats.plans, stats.divergences), (4, 0));
}
