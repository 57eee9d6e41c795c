//! The host workspace policy table (`workspace-core/tests/policies.rs`), re-run on a
//! device: every function is generic over `D: Device` and runs on the simulator and, where
//! there is one, on a real GPU (see `main.rs`). Expected numbers follow from the device
//! alignment: every allocation occupies a multiple of 256 bytes.

use std::panic::{catch_unwind, AssertUnwindSafe};

use ndarray::{arr1, Array1, Array2};
use workspace_core::{
    AllocationPolicy, Error as CoreError, LearningPolicy, Location, Placement, ResetPolicy, ScopeKind, SpillPolicy,
    Workspace, WorkspaceConfig, WorkspaceConfigBuilder,
};
use workspace_cuda::{Device, DeviceArray, DeviceWorkspace, Error, PinnedWorkspace};

pub(crate) fn named<D: Device>(dev: &D, name: &str, config: WorkspaceConfig) -> DeviceWorkspace<D> {
    DeviceWorkspace::new(name, config, dev, &dev.default_stream()).unwrap()
}

fn ws<D: Device>(dev: &D, config: WorkspaceConfig) -> DeviceWorkspace<D> {
    named(dev, "T", config)
}

fn strict() -> WorkspaceConfigBuilder {
    WorkspaceConfig::builder().allocation(AllocationPolicy::Strict)
}

pub(crate) fn fixed(bytes: usize) -> WorkspaceConfig {
    strict().learning(LearningPolicy::None).initial_size(bytes).build().unwrap()
}

/// Runs one cycle allocating `sizes` bytes (as zeroed u8 arrays) and returns where they went.
fn cycle<D: Device>(ws: &DeviceWorkspace<D>, sizes: &[usize]) -> Vec<Placement> {
    let scope = ws.enter().unwrap();
    sizes
        .iter()
        .map(|&n| {
            let v = scope.zeros::<u8, _>(n).unwrap();
            assert_eq!(v.device_ptr() % 256, 0, "device offsets are 256-aligned");
            scope.placement(&v)
        })
        .collect()
}

fn learning_case<D: Device>(
    dev: &D,
    config: WorkspaceConfig,
    cycles: &[&[usize]],
    capacities: &[usize],
) -> Option<usize> {
    let w = ws(dev, config);
    for (i, sizes) in cycles.iter().enumerate() {
        cycle(&w, sizes);
        assert_eq!(w.capacity(), capacities[i], "capacity after cycle {}", i + 1);
    }
    w.stats().learned_size
}

pub(crate) fn learning_first_loop_strict<D: Device>(dev: &D) {
    // Spilled while learning: 100 at 0, 200 at 256, 64 at 512, each counted in whole
    // 256-byte units as the arena would hold them → 768.
    let learned =
        learning_case(dev, strict().build().unwrap(), &[&[100, 200, 64], &[100, 200, 64], &[10]], &[768, 768, 768]);
    assert_eq!(learned, Some(768));
}

pub(crate) fn learning_overallocate<D: Device>(dev: &D) {
    let config = WorkspaceConfig::builder().allocation(AllocationPolicy::Overallocate(0.5)).build().unwrap();
    // A cycle counts whole 256-byte units wherever it ran (here in spill blocks).
    assert_eq!(learning_case(dev, config, &[&[1000], &[1000]], &[1536, 1536]), Some(1024));
}

pub(crate) fn learning_over_time_takes_the_largest<D: Device>(dev: &D) {
    let config =
        strict().learning(LearningPolicy::OverTime { cycles: 3 }).spill(SpillPolicy::External).build().unwrap();
    let learned = learning_case(dev, config, &[&[100], &[5000], &[300], &[9000]], &[0, 0, 5120, 5120]);
    assert_eq!(learned, Some(5120));
}

pub(crate) fn learning_is_clamped_by_min_and_max<D: Device>(dev: &D) {
    let config = strict().min_size(4096).max_size(1 << 20).build().unwrap();
    assert_eq!(learning_case(dev, config, &[&[10], &[10]], &[4096, 4096]), Some(256));
}

pub(crate) fn no_learning_keeps_initial_size<D: Device>(dev: &D) {
    let config =
        strict().learning(LearningPolicy::None).initial_size(1000).spill(SpillPolicy::External).build().unwrap();
    assert_eq!(learning_case(dev, config, &[&[500], &[5000]], &[1024, 1024]), None);
}

pub(crate) fn learning_never_shrinks_a_larger_arena<D: Device>(dev: &D) {
    let config = strict().initial_size(8192).build().unwrap();
    // Served from the arena, where an allocation occupies whole 256-byte units.
    assert_eq!(learning_case(dev, config, &[&[100]], &[8192]), Some(256));
}

pub(crate) fn offsets_are_aligned_and_packed<D: Device>(dev: &D) {
    let w = ws(dev, fixed(4096));
    assert_eq!(w.config().alignment(), 256, "raised from the default 64");
    let expected = [Placement::Arena(0), Placement::Arena(256), Placement::Arena(512), Placement::Arena(768)];
    assert_eq!(cycle(&w, &[1, 64, 65, 10]), expected);
    let w = ws(dev, strict().learning(LearningPolicy::None).initial_size(4096).alignment(512).build().unwrap());
    assert_eq!(cycle(&w, &[1, 1, 300]), vec![Placement::Arena(0), Placement::Arena(512), Placement::Arena(1024)]);
    assert_eq!(cycle(&w, &[8]), vec![Placement::Arena(0)], "the arena resets");
}

fn spill_case<D: Device>(dev: &D, spill: SpillPolicy, capacity_after: usize, growths: u64) {
    let w = ws(dev, strict().learning(LearningPolicy::None).initial_size(1024).spill(spill).build().unwrap());
    {
        let scope = w.enter().unwrap();
        let a = scope.htod(&Array1::from_elem(1000, 1u8)).unwrap();
        assert_eq!(scope.placement(&a), Placement::Arena(0));
        let b = scope.htod(&Array1::from_elem(2000, 2u8)).unwrap();
        assert_eq!(scope.placement(&b), Placement::Elsewhere, "{spill:?}");
        let s = w.stats();
        assert_eq!((s.spilled_in_use, s.external_allocations, s.bytes_spilled), (2000, 1, 2000));
        assert_eq!(s.bytes_in_use, 1024);
        // Both hold their data: the spill is a separate device allocation.
        assert_eq!(a.detach_to_host().unwrap().iter().map(|&x| x as u32).sum::<u32>(), 1000);
        assert_eq!(b.detach_to_host().unwrap().iter().map(|&x| x as u32).sum::<u32>(), 4000);
    }
    let s = w.stats();
    assert_eq!(s.spilled_in_use, 0, "spill freed at the reset");
    // The spilled 2000 bytes count as the arena would hold them: 2048.
    assert_eq!(s.last_cycle_bytes, 1024 + 2048);
    assert_eq!((w.capacity(), s.growth_events), (capacity_after, growths), "{spill:?}");
    let placements = cycle(&w, &[1000, 2000]);
    let fits = placements == vec![Placement::Arena(0), Placement::Arena(1024)];
    assert_eq!(fits, spill == SpillPolicy::Reallocate, "{spill:?}: {placements:?}");
    assert_eq!(w.stats().external_allocations, if fits { 1 } else { 2 });
}

pub(crate) fn spill_external_goes_to_separate_allocations<D: Device>(dev: &D) {
    spill_case(dev, SpillPolicy::External, 1024, 0);
}

pub(crate) fn spill_reallocate_grows_at_the_end_of_the_cycle<D: Device>(dev: &D) {
    spill_case(dev, SpillPolicy::Reallocate, 3072, 1);
}

pub(crate) fn fail_policy_errors_and_leaves_the_workspace_usable<D: Device>(dev: &D) {
    let w =
        ws(dev, strict().learning(LearningPolicy::None).initial_size(1024).spill(SpillPolicy::Fail).build().unwrap());
    let scope = w.enter().unwrap();
    let a = scope.htod(&Array1::from_elem(700, 7u8)).unwrap();
    let err = scope.zeros::<u8, _>(300).unwrap_err();
    match &err {
        Error::Workspace(CoreError::Exhausted { requested, available, capacity, .. }) => {
            assert_eq!((*requested, *available, *capacity), (300, 256, 1024));
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("'T'") && msg.contains("unchanged") && msg.contains("SpillPolicy::External"), "{msg}");
    let b = scope.zeros::<u8, _>(256).unwrap();
    assert_eq!(scope.placement(&b), Placement::Arena(768));
    assert_eq!(a.detach_to_host().unwrap().iter().map(|&x| x as usize).sum::<usize>(), 700 * 7);
    drop(scope);
    assert_eq!(w.stats().external_allocations, 0);
    assert_eq!(cycle(&w, &[1024]), vec![Placement::Arena(0)]);
}

pub(crate) fn budget_is_enforced_with_a_typed_error<D: Device>(dev: &D) {
    let w = ws(dev, strict().learning(LearningPolicy::None).initial_size(1024).max_size(4096).build().unwrap());
    let scope = w.enter().unwrap();
    scope.zeros::<u8, _>(1024).unwrap();
    scope.zeros::<u8, _>(3000).unwrap();
    let err = scope.zeros::<u8, _>(100).unwrap_err();
    let budget =
        CoreError::BudgetExceeded { requested: 100, in_use: 4096, arena: 1024, max_size: 4096, workspace: "T".into() };
    assert_eq!(err.to_string(), budget.to_string());
    assert!(err.to_string().contains("max_size"), "{err}");
    // Spills count as an arena would lay them out: 3000 bytes take 3072 (256-byte units),
    // so the budget is full (and in use is reported as laid out: 1024 + 3072).
    let err = scope.zeros::<u8, _>(1).unwrap_err();
    assert!(matches!(err, Error::Workspace(CoreError::BudgetExceeded { .. })), "{err:?}");
}

pub(crate) fn generations_and_nesting<D: Device>(dev: &D) {
    let w = ws(dev, WorkspaceConfig::default());
    assert_eq!(w.generation(), 0);
    let outer = w.enter().unwrap();
    assert_eq!((outer.kind(), w.generation()), (ScopeKind::Opened, 1));
    let a = outer.htod(&Array1::from_elem(16, 1.0f32)).unwrap();
    {
        let inner = w.enter().unwrap();
        assert_eq!((inner.kind(), w.generation()), (ScopeKind::Nested, 1), "nesting does not start a generation");
        inner.htod(&Array1::from_elem(16, 2.0f32)).unwrap();
    }
    assert_eq!(a.detach_to_host().unwrap().sum(), 16.0, "a nested exit does not reset");
    assert!(w.is_open());
    drop(outer);
    assert!(!w.is_open());
    for expected in 2..=5 {
        let _s = w.enter().unwrap();
        assert_eq!(w.generation(), expected);
    }
    assert_eq!(w.stats().cycles, 5);
}

pub(crate) fn reset_waits_for_the_last_scope_whatever_the_order<D: Device>(dev: &D) {
    let w = ws(dev, fixed(4096));
    let outer = w.enter().unwrap();
    let inner = w.enter().unwrap();
    let kept = inner.htod(&Array1::from_elem(8, 9u32)).unwrap();
    drop(outer); // closing the outer guard first must not reset under `kept`
    assert!(w.is_open());
    let again = inner.zeros::<u32, _>(8).unwrap();
    assert_ne!(inner.placement(&again), Placement::Arena(0));
    assert_eq!(kept.detach_to_host().unwrap().sum(), 72);
    drop(inner);
    assert!(!w.is_open());
    assert_eq!(cycle(&w, &[1]), vec![Placement::Arena(0)]);
}

pub(crate) fn borrowing_a_closed_workspace_is_an_error<D: Device>(dev: &D) {
    let w = ws(dev, WorkspaceConfig::default());
    let err = w.borrow_open().unwrap_err();
    assert!(matches!(err, Error::Workspace(CoreError::NotOpen { .. })), "{err:?}");
    assert!(err.to_string().contains("not open") && err.to_string().contains("never a silent no-op"), "{err}");
}

pub(crate) fn borrowing_an_open_workspace_does_not_reset_it<D: Device>(dev: &D) {
    let outer_ws = named(dev, "OUTER", WorkspaceConfig::default());
    let inner_ws = named(dev, "INNER", WorkspaceConfig::default());
    let outer = outer_ws.enter().unwrap();
    let generation = outer_ws.generation();
    let kept = {
        let inner = inner_ws.enter().unwrap();
        let x = inner.htod(&Array2::from_elem((3, 3), 2.0f64)).unwrap();
        let borrowed = outer_ws.borrow_open().unwrap();
        assert_eq!(borrowed.kind(), ScopeKind::Borrowed);
        let kept = borrowed.copy_handle(&x).unwrap();
        drop(borrowed);
        assert_eq!(outer_ws.generation(), generation, "borrowing opens no generation");
        kept
    }; // INNER resets here
    assert_eq!(kept.detach_to_host(&outer).unwrap().sum(), 18.0);
    assert_eq!(kept.workspace_name().as_ref(), "OUTER");
}

pub(crate) fn stale_handles_name_the_workspace_the_generations_and_the_fix<D: Device>(dev: &D) {
    let a = named(dev, "ALPHA", WorkspaceConfig::default());
    let mut h = {
        let s = a.enter().unwrap();
        let mut h = s.zeros_handle::<f32, _>((2, 3)).unwrap();
        h.view_mut(&s).unwrap().htod_from(&Array2::from_elem((2, 3), 1.0)).unwrap();
        assert_eq!(h.detach_to_host(&s).unwrap().sum(), 6.0);
        h
    };
    let s = a.enter().unwrap();
    let err = h.view_mut(&s).expect_err("stale");
    assert!(matches!(
        err,
        Error::Workspace(CoreError::StaleHandle { array_generation: 1, workspace_generation: 2, .. })
    ));
    let msg = err.to_string();
    for needle in ["'ALPHA'", "generation 1", "generation 2", "detach()", "leverage_to"] {
        assert!(msg.contains(needle), "message lacks {needle}: {msg}");
    }
    assert!(h.detach(&s).is_err() && h.detach_to_host(&s).is_err());
}

pub(crate) fn foreign_handles_are_refused_and_leverage_moves_them<D: Device>(dev: &D) {
    let a = named(dev, "ALPHA", WorkspaceConfig::default());
    let b = named(dev, "BETA", WorkspaceConfig::default());
    let (sa, sb) = (a.enter().unwrap(), b.enter().unwrap());
    let h = sa.htod_handle(&arr1(&[1.0f32, 2.0, 3.0, 4.0])).unwrap();
    let err = h.view(&sb).expect_err("foreign");
    assert!(matches!(err, Error::Workspace(CoreError::WrongWorkspace { .. })));
    assert!(err.to_string().contains("'ALPHA'") && err.to_string().contains("'BETA'"), "{err}");
    let moved = h.leverage_to(&sa, &sb).unwrap();
    assert_eq!(moved.view(&sb).unwrap().shape(), &[4]);
    assert_eq!(moved.workspace_name().as_ref(), "BETA");
    assert_eq!(moved.detach_to_host(&sb).unwrap(), arr1(&[1.0, 2.0, 3.0, 4.0]));
}

pub(crate) fn leverage_to_a_closed_workspace_is_an_error<D: Device>(dev: &D) {
    let source = named(dev, "SRC", WorkspaceConfig::default());
    let target = named(dev, "OUT", WorkspaceConfig::default());
    let s = source.enter().unwrap();
    let h = s.htod_handle(&arr1(&[5u16, 6, 7])).unwrap();
    let err = h.leverage_to_workspace(&s, &target).expect_err("closed target");
    assert!(matches!(err, Error::Workspace(CoreError::NotOpen { .. })), "{err:?}");
    assert!(err.to_string().contains("'OUT'"), "{err}");
    let open = target.enter().unwrap();
    let moved = h.leverage_to_workspace(&s, &target).unwrap();
    drop(s); // SRC resets; the copy in OUT survives
    assert_eq!(moved.detach_to_host(&open).unwrap(), arr1(&[5, 6, 7]));
}

pub(crate) fn detach_copies_exact_values_that_survive_the_reset<D: Device>(dev: &D) {
    let w = ws(dev, fixed(4096));
    let expected = Array2::from_shape_fn((3, 4), |(i, j)| (i * 10 + j) as f32);
    let (owned, first) = {
        let s = w.enter().unwrap();
        let x = s.htod(&expected).unwrap();
        (x.detach().unwrap(), s.placement(&x))
    };
    {
        // The next cycle overwrites the same arena bytes.
        let s = w.enter().unwrap();
        let y = s.htod(&Array2::from_elem((3, 4), -1.0f32)).unwrap();
        assert_eq!(s.placement(&y), first);
    }
    assert_eq!(owned.shape(), &[3, 4]);
    assert_eq!(owned.to_host().unwrap(), expected);
}

pub(crate) fn copies_follow_logical_order_for_any_host_layout<D: Device>(dev: &D) {
    let w = ws(dev, WorkspaceConfig::default());
    let s = w.enter().unwrap();
    let host = Array2::from_shape_fn((3, 4), |(i, j)| (i * 10 + j) as f32);
    let transposed = s.htod(&host.t()).unwrap(); // a non-contiguous source
    assert_eq!(transposed.shape(), &[4, 3]);
    assert_eq!(transposed.detach_to_host().unwrap(), host.t());
    let mut target = Array2::<f32>::zeros((3, 4));
    let mut target_t = target.view_mut().reversed_axes(); // a non-contiguous destination
    transposed.dtoh_into(&mut target_t).unwrap();
    assert_eq!(target, host);
    let err = transposed.dtoh_into(&mut Array2::<f32>::zeros((3, 4))).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    assert!(err.to_string().contains("[4, 3]") && err.to_string().contains("[3, 4]"), "{err}");
}

pub(crate) fn leverage_into_an_outer_workspace_survives_the_inner_reset<D: Device>(dev: &D) {
    let outer_ws = named(dev, "OUTER", WorkspaceConfig::default());
    let inner_ws = named(dev, "INNER", WorkspaceConfig::default());
    let outer = outer_ws.enter().unwrap();
    let kept = {
        let inner = inner_ws.enter().unwrap();
        let x = inner.htod(&Array1::from_shape_fn(100, |i| i as i32)).unwrap();
        x.leverage_to(&outer).unwrap()
    };
    assert_eq!(kept.workspace_name().as_ref(), "OUTER");
    assert_eq!(kept.detach_to_host().unwrap().sum(), 4950);
}

pub(crate) fn leverage_across_streams_orders_both_streams<D: Device>(dev: &D) {
    let other = dev.new_stream().unwrap();
    let source = named(dev, "SRC", WorkspaceConfig::default());
    let target = DeviceWorkspace::new("DST", WorkspaceConfig::default(), dev, &other).unwrap();
    let out = target.enter().unwrap();
    let mut copies = Vec::new();
    for round in 0..4 {
        let s = source.enter().unwrap();
        let x = s.htod(&Array1::from_elem(4096, round as f32)).unwrap();
        copies.push(x.leverage_to(&out).unwrap());
        // The source memory is reused next round, right after the copy was issued.
    }
    for (round, copy) in copies.iter().enumerate() {
        assert_eq!(copy.detach_to_host().unwrap().sum(), 4096.0 * round as f32);
    }
}

pub(crate) fn circular_workspace_wraps_without_overwriting_the_open_cycle<D: Device>(dev: &D) {
    let w = ws(
        dev,
        strict().learning(LearningPolicy::None).initial_size(1024).reset(ResetPolicy::EndOfBuffer).build().unwrap(),
    );
    assert_eq!(cycle(&w, &[256, 256]), vec![Placement::Arena(0), Placement::Arena(256)]);
    assert_eq!(w.bytes_in_use(), 512, "circular keeps the last cycle's bytes");
    assert_eq!(cycle(&w, &[256]), vec![Placement::Arena(512)]);
    assert_eq!(cycle(&w, &[512]), vec![Placement::Arena(0)], "wraps");
    assert_eq!(w.stats().wraps, 1);
    let placements = cycle(&w, &[256, 256, 256, 256]);
    assert_eq!(placements, [Placement::Arena(512), Placement::Arena(768), Placement::Arena(0), Placement::Arena(256)]);
    assert_eq!((w.stats().wraps, w.stats().external_allocations), (2, 0));
    let placements = cycle(&w, &[512, 512, 1]);
    assert_eq!(placements, vec![Placement::Arena(512), Placement::Arena(0), Placement::Elsewhere]);
    assert_eq!(w.stats().external_allocations, 1);
}

pub(crate) fn trim_gives_memory_back_and_relearns<D: Device>(dev: &D) {
    let w = ws(dev, strict().min_size(0).build().unwrap());
    cycle(&w, &[10_000]);
    assert_eq!(w.capacity(), 10_240);
    let s = w.enter().unwrap();
    assert!(matches!(w.trim().unwrap_err(), Error::Workspace(CoreError::StillOpen { depth: 1, .. })));
    drop(s);
    w.trim().unwrap();
    assert_eq!(w.capacity(), 0);
    cycle(&w, &[3000]);
    assert_eq!(w.capacity(), 3072, "learned again after trim");
    let w = ws(dev, strict().learning(LearningPolicy::None).initial_size(2048).min_size(1024).build().unwrap());
    w.trim().unwrap();
    assert_eq!(w.capacity(), 1024);
    cycle(&w, &[1]);
    assert_eq!(w.capacity(), 2048, "the configured size comes back");
}

pub(crate) fn a_panic_inside_a_scope_leaves_the_workspace_closed_and_usable<D: Device>(dev: &D) {
    let w = ws(dev, strict().build().unwrap());
    cycle(&w, &[512]);
    let result = catch_unwind(AssertUnwindSafe(|| {
        let s = w.enter().unwrap();
        let _a = s.zeros::<u8, _>(256).unwrap();
        let _b = s.zeros::<u8, _>(100_000).unwrap(); // spills
        let _inner = w.enter().unwrap();
        panic!("user code failed mid-iteration");
    }));
    assert!(result.is_err());
    assert!(!w.is_open());
    let s = w.stats();
    assert_eq!((s.open_scopes, s.spilled_in_use, s.bytes_in_use), (0, 0, 0));
    assert_eq!(cycle(&w, &[512]), vec![Placement::Arena(0)]);
    assert_eq!(w.generation(), 3);
}

pub(crate) fn bad_input_is_a_typed_error<D: Device>(dev: &D) {
    let w = ws(dev, WorkspaceConfig::default());
    let s = w.enter().unwrap();
    let err = s.zeros::<f32, _>((0, 5)).expect_err("zero length");
    assert!(matches!(err, Error::Workspace(CoreError::ZeroLength { ref shape, .. }) if shape == &[0, 5]), "{err:?}");
    let err = s.zeros::<f32, _>((usize::MAX / 2, 3)).expect_err("overflow");
    assert!(matches!(err, Error::Workspace(CoreError::ShapeOverflow { element_size: 4, .. })), "{err:?}");
    let err = s.uninit::<f64, _>(usize::MAX / 4).expect_err("overflow");
    assert!(matches!(err, Error::Workspace(CoreError::ShapeOverflow { .. })), "{err:?}");
    let mut v = s.zeros::<f32, _>(4).unwrap();
    let err = v.htod_from(&arr1(&[1.0f32; 5])).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    let err = DeviceArray::<D, f32>::zeros(dev, &dev.default_stream(), 0).unwrap_err();
    assert!(matches!(err, Error::Workspace(CoreError::ZeroLength { .. })), "{err:?}");
}

pub(crate) fn out_of_device_memory_is_an_error_and_the_workspace_stays_usable<D: Device>(dev: &D) {
    let w = ws(dev, WorkspaceConfig::default());
    let s = w.enter().unwrap();
    // A petabyte: representable, but no device (and no simulator) has it.
    let err = s.zeros::<u8, _>(1usize << 50).expect_err("out of memory");
    assert!(matches!(err, Error::Workspace(CoreError::Backend { .. })), "{err:?}");
    assert!(err.to_string().contains("'T'") && err.to_string().contains("out of memory"), "{err}");
    assert_eq!(s.htod(&arr1(&[3u8, 4])).unwrap().detach_to_host().unwrap(), arr1(&[3, 4]));
}

pub(crate) fn statistics_are_readable_while_views_live_and_peak_resets<D: Device>(dev: &D) {
    let w = ws(dev, strict().learning(LearningPolicy::None).initial_size(4096).timeline_len(3).build().unwrap());
    for n in [100usize, 2000, 300, 50] {
        let s = w.enter().unwrap();
        let _a = s.zeros::<u8, _>(n).unwrap();
        let live = w.stats();
        assert_eq!((live.bytes_in_use, live.open_scopes), (n.next_multiple_of(256), 1));
        assert_eq!(live.backend, D::ARENA_KIND);
    }
    assert_eq!(w.stats().peak_bytes, 2048);
    assert_eq!(w.timeline(), vec![2048, 512, 256], "bounded timeline keeps the last 3");
    w.reset_peak();
    cycle(&w, &[64]);
    assert_eq!(w.stats().peak_bytes, 256);
}

pub(crate) fn workspace_is_send_and_runs_on_another_thread<D: Device>(dev: &D) {
    fn is_send<T: Send>() {}
    is_send::<DeviceWorkspace<D>>();
    is_send::<workspace_cuda::DeviceHandle<f32, ndarray::Ix2>>();
    is_send::<DeviceArray<D, f32>>();
    let w = ws(dev, WorkspaceConfig::default());
    cycle(&w, &[128]);
    let moved = std::thread::spawn(move || {
        cycle(&w, &[128]);
        w
    })
    .join()
    .unwrap();
    assert_eq!(moved.stats().cycles, 2);
}

pub(crate) fn host_and_device_workspaces_copy_both_ways<D: Device>(dev: &D) {
    let host_ws = Workspace::new("HOST", WorkspaceConfig::default()).unwrap();
    let device_ws = named(dev, "DEV", WorkspaceConfig::default());
    let host = host_ws.enter().unwrap();
    let a = host.from_shape_fn((8, 16), |(i, j)| (i * 16 + j) as f32).unwrap();
    let scope = device_ws.enter().unwrap();
    let on_device = scope.htod(&a).unwrap();
    let back = on_device.dtoh_in(&host).unwrap();
    assert_eq!(back, a);
    assert!(host.holds(&back), "the copy lives in the host workspace");
    let mut into = host.zeros::<f32, _>((8, 16)).unwrap();
    on_device.dtoh_into(&mut into).unwrap();
    assert_eq!(into, a);
}

pub(crate) fn zeros_are_zero_even_over_memory_of_an_earlier_cycle<D: Device>(dev: &D) {
    let w = ws(dev, fixed(4096));
    let first = {
        let s = w.enter().unwrap();
        let x = s.htod(&Array1::from_elem(1024, u32::MAX)).unwrap();
        s.placement(&x)
    };
    let s = w.enter().unwrap();
    let z = s.zeros::<u32, _>(1024).unwrap();
    assert_eq!(s.placement(&z), first);
    assert_eq!(z.detach_to_host().unwrap().sum(), 0);
    let filled = s.uninit::<u32, _>(1024).unwrap().htod_from(&Array1::from_elem(1024, 3)).unwrap();
    let copied = s.uninit::<u32, _>(1024).unwrap().copy_from(&filled).unwrap();
    assert_eq!(copied.detach_to_host().unwrap().sum(), 3 * 1024);
}

pub(crate) fn on_stream_orders_work_both_ways<D: Device>(dev: &D) {
    let copy_stream = dev.new_stream().unwrap();
    let w = ws(dev, WorkspaceConfig::default());
    let mut kept = DeviceArray::<D, f32>::zeros(dev, &copy_stream, 512).unwrap();
    let mut host = Array1::<f32>::zeros(512);
    {
        let s = w.enter().unwrap();
        let mut x = s.htod(&Array1::from_elem(512, 1.5f32)).unwrap();
        let mut kept_view = kept.view_mut();
        let on = s.on_stream(&copy_stream).unwrap();
        on.dtod(&x, &mut kept_view).unwrap(); // sees the home stream's write
        on.dtoh(&x, &mut host).unwrap();
        on.finish().unwrap();
        x.htod_from(&Array1::from_elem(512, 9.0f32)).unwrap(); // after the copy, on the home stream
    }
    assert_eq!(host.sum(), 768.0);
    assert_eq!(kept.to_host().unwrap().sum(), 768.0);
}

pub(crate) fn on_stream_refuses_memory_it_cannot_order<D: Device>(dev: &D) {
    let copy_stream = dev.new_stream().unwrap();
    let w = named(dev, "MINE", WorkspaceConfig::default());
    let other = named(dev, "OTHER", WorkspaceConfig::default());
    let (s, t) = (w.enter().unwrap(), other.enter().unwrap());
    let foreign = t.htod(&Array1::from_elem(8, 1u8)).unwrap();
    let mut mine = s.zeros::<u8, _>(8).unwrap();
    let mut on_home = DeviceArray::<D, u8>::zeros(dev, &dev.default_stream(), 8).unwrap();
    let mut on_home_view = on_home.view_mut();
    let mine_view = s.zeros::<u8, _>(8).unwrap();
    let on = s.on_stream(&copy_stream).unwrap();
    let err = on.dtod(&foreign, &mut mine).unwrap_err();
    assert!(matches!(err, Error::StreamMismatch { .. }), "{err:?}");
    assert!(err.to_string().contains("'OTHER'") && err.to_string().contains("on_stream"), "{err}");
    let err = on.dtod(&mine_view, &mut on_home_view).unwrap_err();
    assert!(err.to_string().contains("owned device array"), "{err}");
}

pub(crate) fn owned_arrays_round_trip_and_detach_from_handles<D: Device>(dev: &D) {
    let host = Array2::from_shape_fn((5, 7), |(i, j)| (i as i64) - (j as i64));
    let owned = DeviceArray::htod(dev, &dev.default_stream(), &host).unwrap();
    assert_eq!((owned.len(), owned.shape()), (35, &[5usize, 7][..]));
    assert_eq!(owned.to_host().unwrap(), host);
    let w = ws(dev, WorkspaceConfig::default());
    let s = w.enter().unwrap();
    let in_ws = s.copy_of(&owned.view()).unwrap();
    let h = s.copy_handle(&in_ws).unwrap();
    let detached = h.detach(&s).unwrap();
    drop(s);
    assert_eq!(detached.to_host().unwrap(), host);
    let zeros = DeviceArray::<D, u16, _>::zeros(dev, &dev.default_stream(), (2, 2)).unwrap();
    assert_eq!(zeros.to_host().unwrap(), Array2::<u16>::zeros((2, 2)));
}

pub(crate) fn pinned_staging_round_trips_and_is_bounded<D: Device>(dev: &D) {
    let staging = PinnedWorkspace::for_transfers("STAGE", dev, 8192).unwrap();
    let w = ws(dev, WorkspaceConfig::default());
    let host = Array2::from_shape_fn((16, 32), |(i, j)| (i * 32 + j) as f32); // 2048 bytes
    for _ in 0..3 {
        let stage = staging.enter().unwrap();
        let up = stage.copy_of(&host).unwrap();
        let s = w.enter().unwrap();
        let on_device = s.htod_pinned(&up).unwrap();
        let mut down = stage.zeros::<f32, _>((16, 32)).unwrap();
        on_device.dtoh_pinned(&mut down).unwrap();
        assert_eq!(down.view().unwrap(), host);
        let err = stage.zeros::<u8, _>(8192).expect_err("bounded");
        assert!(matches!(err, Error::Workspace(CoreError::Exhausted { .. })), "{err:?}");
    }
    let stats = staging.stats();
    assert_eq!((stats.capacity, stats.pinned_allocations, stats.cycles), (8192, 1, 3));
    assert_eq!(stats.backend, D::PINNED_KIND);
}

pub(crate) fn pinned_workspaces_must_be_bounded<D: Device>(dev: &D) {
    let err = PinnedWorkspace::new("UNBOUNDED", WorkspaceConfig::default(), dev).unwrap_err();
    assert!(matches!(err, Error::Workspace(CoreError::InvalidConfig { .. })), "{err:?}");
    assert!(err.to_string().contains("max_size") && err.to_string().contains("for_transfers"), "{err}");
    let mapped = WorkspaceConfig::builder()
        .location(Location::MmapAnonymous)
        .learning(LearningPolicy::None)
        .initial_size(4096)
        .max_size(4096)
        .build()
        .unwrap();
    assert!(PinnedWorkspace::new("MAPPED", mapped.clone(), dev).is_err());
    let err = DeviceWorkspace::new("MAPPED", mapped, dev, &dev.default_stream()).unwrap_err();
    assert!(err.to_string().contains("Location::Ram"), "{err}");
}

pub(crate) fn pinned_learning_stays_flat_after_warm_up<D: Device>(dev: &D) {
    let config = strict().max_size(1 << 20).build().unwrap();
    let staging = PinnedWorkspace::new("LEARN", config, dev).unwrap();
    for _ in 0..5 {
        let stage = staging.enter().unwrap();
        stage.filled::<f32, _>(1000, 1.0).unwrap();
        stage.filled::<f32, _>(1000, 2.0).unwrap();
    }
    let stats = staging.stats();
    // One spill chunk while learning (4000 at 0, 4000 at 4032: 8032 bytes), then the learned
    // arena (8064, a multiple of 64); nothing after warm-up.
    assert_eq!((stats.pinned_allocations, stats.growth_events, stats.capacity), (2, 1, 8064));
}

/// Scales iteration counts down under valgrind (`CARVE_SOAK_SCALE=10` divides by 10).
fn scaled(n: usize) -> usize {
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (n / scale.max(1)).max(1)
}

pub(crate) fn a_fixed_shape_loop_keeps_device_memory_flat<D: Device>(dev: &D) {
    let w = ws(dev, WorkspaceConfig::default());
    let step = |w: &DeviceWorkspace<D>| {
        let scope = w.enter().unwrap();
        for n in [32 * 784, 32 * 256, 256 * 10, 32 * 10, 784 * 256] {
            let mut x = scope.uninit::<f32, _>(n).unwrap();
            assert_eq!(x.device_ptr_mut() % 256, 0);
        }
        scope.zeros::<f32, _>((32, 256)).unwrap();
    };
    for _ in 0..3 {
        step(&w);
    }
    let warm = w.stats();
    for _ in 0..scaled(10_000) {
        step(&w);
    }
    let end = w.stats();
    // Sized once, from the first cycle (whose six allocations spilled); nothing since.
    assert_eq!((warm.growth_events, warm.external_allocations), (1, 6));
    assert_eq!((end.capacity, end.growth_events, end.external_allocations), (warm.capacity, 1, 6));
    assert!(end.peak_bytes <= end.capacity);
    assert_eq!(end.cycles, warm.cycles + scaled(10_000) as u64);
}
