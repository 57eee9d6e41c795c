//! What a hostile user tries from safe code: alignments beyond a page, two workspaces
//! on one file, zero-sized elements by the `usize::MAX`, requests the machine cannot
//! back, configurations with absurd values, budgets at the edge, cycles that spill in
//! one cycle and fit in the next, and a default configuration fed varying sizes.

use std::panic::{catch_unwind, AssertUnwindSafe};

use bytemuck::{Pod, Zeroable};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use workspace_core::backend::Placement;
use workspace_core::{
    AllocationPolicy, BackendError, DebugMode, Error, LearningPolicy, Location, SpillPolicy, Workspace,
    WorkspaceConfig, MAX_CYCLE_HISTORY,
};

const MODES: [DebugMode; 3] = [DebugMode::Disabled, DebugMode::SpillEverything, DebugMode::BypassEverything];

fn ws(config: WorkspaceConfig, mode: DebugMode) -> Workspace {
    Workspace::with_debug_mode("H", config, mode).unwrap()
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).map_or(default, |n: u32| n.min(default))
}

/// A plain-data type aligned to 8 KiB.
#[derive(Clone, Copy)]
#[repr(C, align(8192))]
struct Page8k([u8; 8192]);
// SAFETY: one byte array, no padding (size 8192 = alignment): all zeros is valid.
unsafe impl Zeroable for Page8k {}
// SAFETY: as above; every bit pattern is valid and there is no padding.
unsafe impl Pod for Page8k {}

#[test]
fn every_allocation_is_aligned_to_the_configured_alignment_above_a_page() {
    for align in [8192usize, 1 << 16, 1 << 21] {
        for location in [Location::Ram, Location::MmapAnonymous] {
            let mapped = location == Location::MmapAnonymous;
            let mut b = WorkspaceConfig::builder().alignment(align).location(location.clone());
            if mapped {
                b = b.learning(LearningPolicy::None).initial_size(8 * align);
            }
            let w = ws(b.build().unwrap(), DebugMode::Disabled);
            // Cycle 1 learns (RAM) or uses the map; cycles 2-4 run in the arena.
            for cycle in 0..4 {
                let s = w.enter().unwrap();
                for n in [1usize, 3, 100, 5000] {
                    let v = s.zeros::<u8, _>(n).unwrap();
                    assert_eq!(v.as_ptr() as usize % align, 0, "{align} {location:?} cycle {cycle}: u8 x {n}");
                    let f = s.zeros::<f64, _>((n, 2)).unwrap();
                    assert_eq!(f.as_ptr() as usize % align, 0, "{align} {location:?} cycle {cycle}: f64 x {n}");
                }
                let b = allocator_api2::boxed::Box::new_in(7u32, &s);
                assert_eq!(&*b as *const u32 as usize % align, 0, "{align} {location:?}: allocator-api2 box");
                if cycle > 0 && !mapped {
                    let probe = s.zeros::<u8, _>(1).unwrap();
                    assert!(matches!(s.placement(probe.as_ptr()), Placement::Arena(_)), "served by the arena");
                }
            }
        }
    }
    // A fixed arena from the heap allocator (no learning, so no huge-page-aligned
    // reservation to be lucky with): every allocation aligned in every cycle.
    for align in [8192usize, 1 << 16] {
        let config =
            WorkspaceConfig::builder().alignment(align).learning(LearningPolicy::None).initial_size(1 << 20).build();
        let w = ws(config.unwrap(), DebugMode::Disabled);
        for _ in 0..3 {
            let s = w.enter().unwrap();
            for n in [1usize, 3, 100, 5000] {
                let v = s.zeros::<u8, _>(n).unwrap();
                assert_eq!(v.as_ptr() as usize % align, 0, "fixed arena, {align}: u8 x {n}");
                assert!(matches!(s.placement(v.as_ptr()), Placement::Arena(_)));
            }
        }
    }
    // An element type aligned beyond the configuration, and beyond a page.
    let w = ws(WorkspaceConfig::default(), DebugMode::Disabled);
    for _ in 0..3 {
        let s = w.enter().unwrap();
        for n in [1usize, 2, 3] {
            let v = s.zeros::<Page8k, _>(n).unwrap();
            assert_eq!(v.as_ptr() as usize % 8192, 0, "Page8k x {n}");
            assert!(v.iter().all(|p| p.0.iter().all(|&b| b == 0)));
        }
    }
}

#[test]
fn a_file_backed_workspace_refuses_an_alignment_it_cannot_give() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: a file in a fresh temporary directory that nothing else touches.
    let location = unsafe { Location::mmap(dir.path().join("a.ws")) };
    let err = WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .initial_size(1 << 16)
        .alignment(8192)
        .location(location)
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }) && err.to_string().contains("page"), "{err}");
}

fn file_config(path: &std::path::Path) -> WorkspaceConfig {
    WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .initial_size(1 << 16)
        // SAFETY: each test's file lies in a fresh temporary directory that nothing but
        // the workspaces under test touches.
        .location(unsafe { Location::mmap(path) })
        .build()
        .unwrap()
}

#[test]
fn two_workspaces_on_one_file_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.ws");
    let first = ws(file_config(&path), DebugMode::Disabled);
    let err = Workspace::new("SECOND", file_config(&path)).unwrap_err();
    assert!(matches!(err, Error::Backend { source: BackendError::FileInUse { .. }, .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&path.display().to_string()) && text.contains("already in use"), "{text}");
    // Another thread, owning its own workspace on the same file: the same error.
    let (p, c) = (path.clone(), file_config(&path));
    let other = std::thread::spawn(move || Workspace::new("THREAD", c).map(|_| ()).unwrap_err().to_string());
    let text = other.join().unwrap();
    assert!(text.contains(&p.display().to_string()), "{text}");
    // The first is untouched and usable; once it is gone the file is free again.
    {
        let s = first.enter().unwrap();
        s.filled::<u32, _>(100, 9).unwrap();
    }
    drop(first);
    let again = ws(file_config(&path), DebugMode::Disabled);
    let s = again.enter().unwrap();
    // SAFETY: the previous workspace wrote 100 initialised u32s there.
    let kept = unsafe { s.retained::<u32, _>(100) }.unwrap();
    assert!(kept.iter().all(|&x| x == 9));
}

/// `Location` is not deserializable as a file mapping: only the `unsafe` constructor
/// makes one. A deserialized configuration is validated like a built one.
#[test]
fn deserialized_configurations_are_validated_and_cannot_map_files() {
    let dir = tempfile::tempdir().unwrap();
    let json = serde_json::to_string(&file_config(&dir.path().join("x.ws"))).unwrap();
    assert!(json.contains("x.ws"), "serialises for the record: {json}");
    assert!(serde_json::from_str::<WorkspaceConfig>(&json).is_err(), "a file mapping from data");
    assert!(serde_json::from_str::<Location>(r#"{"Mmap":"/tmp/y.ws"}"#).is_err());
    let good = serde_json::to_string(&WorkspaceConfig::default()).unwrap();
    for (from, to) in [
        ("\"timeline_len\":0", "\"timeline_len\":18446744073709551615"),
        ("\"alignment\":64", "\"alignment\":0"),
        ("\"learning\":\"FirstLoop\"", "\"learning\":{\"OverTime\":{\"cycles\":0}}"),
    ] {
        let bad = good.replace(from, to);
        assert_ne!(bad, good, "{from}");
        let err = serde_json::from_str::<WorkspaceConfig>(&bad).unwrap_err();
        assert!(!err.to_string().is_empty());
    }
}

#[test]
fn zero_sized_elements_beyond_isize_max_are_a_shape_overflow() {
    for mode in MODES {
        let w = ws(WorkspaceConfig::default(), mode);
        let s = w.enter().unwrap();
        for shape in [usize::MAX, isize::MAX as usize + 1] {
            let err = s.zeros::<(), _>(shape).unwrap_err();
            assert!(matches!(err, Error::ShapeOverflow { element_size: 0, .. }), "{mode:?} {shape}: {err:?}");
            assert!(matches!(s.uninit::<(), _>(shape).unwrap_err(), Error::ShapeOverflow { .. }));
            assert!(matches!(s.slice_zeroed::<()>(shape).unwrap_err(), Error::ShapeOverflow { .. }));
        }
        let err = s.zeros::<(), _>((1usize << 40, 1usize << 40)).unwrap_err();
        assert!(matches!(err, Error::ShapeOverflow { .. }), "{err:?}");
        // Up to isize::MAX is fine (and takes no memory).
        assert_eq!(s.zeros::<(), _>(isize::MAX as usize).unwrap().len(), isize::MAX as usize);
        // Every other element type: the byte size must fit in isize.
        assert!(matches!(s.zeros::<u64, _>(usize::MAX / 8 + 1).unwrap_err(), Error::ShapeOverflow { .. }));
        assert!(matches!(s.zeros::<u8, _>(isize::MAX as usize + 1).unwrap_err(), Error::ShapeOverflow { .. }));
    }
}

/// Far more than any machine this runs on has, memory and swap together.
const HUGE: usize = 1 << 46; // 64 TiB

#[test]
fn a_request_the_machine_cannot_back_is_a_typed_error_in_every_policy() {
    let policies = [LearningPolicy::FirstLoop, LearningPolicy::OverTime { cycles: 2 }, LearningPolicy::None];
    for learning in policies {
        for mode in MODES {
            let w = ws(WorkspaceConfig::builder().learning(learning).build().unwrap(), mode);
            for cycle in 0..2 {
                let s = w.enter().unwrap();
                // Uninitialised: a wrongly granted request would not even be touched here.
                let err = s.uninit::<u8, _>(HUGE).unwrap_err();
                assert!(matches!(err, Error::Backend { .. }), "{learning:?} {mode:?} cycle {cycle}: {err:?}");
                assert!(err.to_string().contains("out of memory"), "{err}");
                // The workspace is unchanged and usable.
                assert_eq!(s.filled::<u32, _>(1000, 3).unwrap().sum(), 3000);
            }
        }
    }
}

#[test]
fn a_growth_the_machine_cannot_back_is_reported_once_and_every_later_cycle_runs() {
    // Each learns a size whose arena no machine backs; each cycle itself runs fine from
    // spill blocks. The refusal is reported by one `enter`, never again.
    let configs = [
        WorkspaceConfig::builder().allocation(AllocationPolicy::Overallocate(1e300)).build().unwrap(),
        WorkspaceConfig::builder()
            .allocation(AllocationPolicy::Overallocate(1e300))
            .learning(LearningPolicy::OverTime { cycles: 3 })
            .build()
            .unwrap(),
        WorkspaceConfig::builder()
            .allocation(AllocationPolicy::Overallocate(1e300))
            .spill(SpillPolicy::External)
            .build()
            .unwrap(),
    ];
    for config in configs {
        for mode in [DebugMode::Disabled, DebugMode::SpillEverything] {
            let w = ws(config.clone(), mode);
            let mut outcomes = String::new();
            for cycle in 0..40u32 {
                match w.enter() {
                    Ok(s) => {
                        let a = s.filled::<u32, _>(1000, cycle).unwrap();
                        let b = s.filled::<u32, _>(3000, 1).unwrap();
                        assert_eq!((a.sum(), b.sum()), (1000 * cycle, 3000));
                        outcomes.push('o');
                    }
                    Err(err) => {
                        assert!(matches!(err, Error::Backend { .. }), "{err:?}");
                        assert!(err.to_string().contains("out of memory"), "{err}");
                        outcomes.push('E');
                    }
                }
            }
            assert_eq!(outcomes.matches('E').count(), 1, "{config:?} {mode:?}: {outcomes}");
            let stats = w.stats();
            assert_eq!(stats.capacity, 0, "{mode:?}");
            assert!((1..=6).contains(&stats.failed_growths), "{mode:?}: retried with a back-off: {stats:?}");
        }
    }
}

#[test]
fn absurd_configurations_are_errors_and_new_never_panics() {
    let err = WorkspaceConfig::builder().cycle_history_len(usize::MAX).build().unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }) && err.to_string().contains("timeline_len"), "{err}");
    assert!(WorkspaceConfig::builder().cycle_history_len(1 << 40).build().is_err());
    let c = WorkspaceConfig::builder().cycle_history_len(MAX_CYCLE_HISTORY).build().unwrap();
    let w = Workspace::new("TL", c).unwrap();
    drop(w.enter().unwrap());
    assert_eq!(w.cycle_history(), [0], "an empty cycle, recorded");

    // Extreme sizes: a workspace or an error, never a panic or an abort.
    for initial in [usize::MAX, isize::MAX as usize, HUGE, 1 << 30] {
        for location in [Location::Ram, Location::MmapAnonymous] {
            let built = WorkspaceConfig::builder()
                .learning(LearningPolicy::None)
                .initial_size(initial)
                .location(location)
                .build();
            if let Ok(config) = built {
                let made = catch_unwind(|| Workspace::new("BIG", config).map(|_| ()));
                assert!(made.is_ok(), "Workspace::new panicked for initial_size {initial}");
            }
        }
    }

    let strategy = (
        (any::<usize>(), any::<usize>(), any::<usize>(), any::<u32>()),
        (prop_oneof![Just(0usize), 0usize..1 << 21, Just(usize::MAX)], any::<f64>(), 0u32..4, 0u32..3),
        (0usize..3, prop_oneof![Just(0usize), 0usize..1 << 21, any::<usize>()], any::<bool>()),
    );
    let mut runner = TestRunner::new(Config { cases: cases(2000), failure_persistence: None, ..Config::default() });
    runner
        .run(&strategy, |((initial, min, max, align_pow), (timeline, factor, learning, spill), (loc, cap, over))| {
            let mut b = WorkspaceConfig::builder()
                // Sizes the machine could back in part, so that `new` really reserves.
                .initial_size(initial % (cap.max(1)))
                .min_size(min % (cap.max(1)))
                .max_size(if over { max } else { usize::MAX })
                .alignment(1usize.checked_shl(align_pow % 40).unwrap_or(3))
                .cycle_history_len(timeline)
                .allocation(if factor.is_sign_negative() {
                    AllocationPolicy::Strict
                } else {
                    AllocationPolicy::Overallocate(factor)
                })
                .learning(match learning {
                    0 => LearningPolicy::None,
                    1 => LearningPolicy::FirstLoop,
                    n => LearningPolicy::OverTime { cycles: n - 2 },
                })
                .location(if loc == 0 { Location::Ram } else { Location::MmapAnonymous });
            if spill < 3 {
                b = b.spill([SpillPolicy::External, SpillPolicy::Reallocate, SpillPolicy::Fail][spill as usize]);
            }
            let built = catch_unwind(AssertUnwindSafe(|| b.build()));
            prop_assert!(built.is_ok(), "build panicked");
            match built.unwrap() {
                Ok(config) => {
                    prop_assert!(config.alignment().is_power_of_two());
                    prop_assert!(config.cycle_history_len() <= MAX_CYCLE_HISTORY);
                    let made = catch_unwind(AssertUnwindSafe(|| Workspace::new("P", config).map(|_| ())));
                    prop_assert!(made.is_ok(), "Workspace::new panicked");
                    if let Err(err) = made.unwrap() {
                        prop_assert!(matches!(err, Error::Backend { .. }), "{:?}", err);
                    }
                }
                Err(err) => prop_assert!(matches!(err, Error::InvalidConfig { .. }), "{:?}", err),
            }
            Ok(())
        })
        .unwrap();
}

/// What a cycle's outcome is, for comparing cycles: the figures in an error's message
/// may differ (the arena learned meanwhile), which call fails may not.
fn kind(result: &Result<(), (Error, usize)>) -> String {
    match result {
        Ok(()) => "ok".into(),
        Err((Error::BudgetExceeded { .. }, at)) => format!("budget exceeded at array {at}"),
        Err((other, at)) => format!("{other:?} at array {at}"),
    }
}

/// One cycle of arrays of `sizes` bytes; the first error and how many arrays were
/// handed out before it, if any.
fn try_cycle(w: &Workspace, sizes: &[usize]) -> Result<(), (Error, usize)> {
    let s = w.enter().map_err(|e| (e, 0))?;
    for (i, &n) in sizes.iter().enumerate() {
        s.filled::<u8, _>(n, 1).map_err(|e| (e, i))?;
    }
    Ok(())
}

#[test]
fn a_cycle_that_fits_the_budget_once_keeps_fitting() {
    let cases: [(usize, &[usize]); 6] = [
        (1000, &[1000]),
        (1024, &[340, 340, 340]),
        (1024, &[340, 340, 300]),
        (4096, &[1, 2000, 1, 1000]),
        (5000, &[100; 40]),
        (100_000, &[30_000, 30_000, 30_000]),
    ];
    for (max, sizes) in cases {
        for mode in MODES {
            for allocation in [AllocationPolicy::Strict, AllocationPolicy::Overallocate(0.3)] {
                let config = WorkspaceConfig::builder().max_size(max).allocation(allocation).build().unwrap();
                let w = ws(config, mode);
                let first = try_cycle(&w, sizes);
                for cycle in 2..=5 {
                    let later = try_cycle(&w, sizes);
                    assert_eq!(
                        kind(&later),
                        kind(&first),
                        "max {max}, {sizes:?}, {mode:?}, {allocation:?}: cycle {cycle} differs from cycle 1"
                    );
                }
                assert!(w.capacity() <= max, "the arena stays within the budget");
                if let Err((err, at)) = first {
                    // The error reports what is really in use this cycle, not the arena.
                    let Error::BudgetExceeded { in_use, requested, .. } = err else { panic!("{err:?}") };
                    let before: usize = sizes[..at].iter().map(|n| n.next_multiple_of(64)).sum();
                    assert_eq!((in_use, requested), (before, sizes[at]), "{sizes:?} under {max}");
                }
            }
        }
    }
    // Nothing in use: the error says so (an arena of 960 bytes is not "960 in use").
    let w = ws(WorkspaceConfig::builder().max_size(1000).build().unwrap(), DebugMode::Disabled);
    try_cycle(&w, &[900]).unwrap();
    let (err, _) = try_cycle(&w, &[1001]).unwrap_err();
    assert!(matches!(err, Error::BudgetExceeded { in_use: 0, requested: 1001, .. }), "{err:?}");
}

#[test]
fn a_cycle_counts_the_same_bytes_wherever_it_runs() {
    // Alignment 16: a cycle of one n-byte array counts n rounded up to 16, whether it
    // ran in spill blocks (learning) or in the arena.
    for (n, counted) in [(8usize, 16usize), (16, 16), (24, 32), (32, 32), (40, 48)] {
        let config = WorkspaceConfig::builder().alignment(16).allocation(AllocationPolicy::Strict).build().unwrap();
        let w = ws(config, DebugMode::Disabled);
        try_cycle(&w, &[n]).unwrap();
        let learning = w.stats().last_cycle_bytes;
        try_cycle(&w, &[n]).unwrap();
        assert_eq!((learning, w.stats().last_cycle_bytes), (counted, counted), "{n}-byte cycle");
        assert_eq!(w.stats().learned_size, Some(counted));
    }
    // Over-allocation from a 40-byte array makes room for two of them.
    let config = WorkspaceConfig::builder()
        .alignment(16)
        .allocation(AllocationPolicy::Overallocate(1.0))
        .spill(SpillPolicy::External)
        .build()
        .unwrap();
    let w = ws(config, DebugMode::Disabled);
    try_cycle(&w, &[40]).unwrap();
    assert_eq!(w.capacity(), 96);
    try_cycle(&w, &[40, 40]).unwrap();
    assert_eq!(w.stats().external_allocations, 1, "only the learning cycle spilled");
}

#[test]
fn the_default_configuration_stops_spilling_once_the_largest_cycle_has_run() {
    for mode in MODES {
        let w = ws(WorkspaceConfig::default(), mode);
        // Sizes vary from cycle to cycle; the largest comes at cycle 30.
        let size = |c: usize| if c == 30 { 200_000 } else { 1000 + (c * 7919) % 100_000 };
        let mut spilled_after = Vec::new();
        for c in 0..100 {
            let before = w.stats().spilled_in_use;
            assert_eq!(before, 0);
            let spills = w.stats().cycles_spilled_after_learning;
            try_cycle(&w, &[size(c), size(c) / 3]).unwrap();
            if w.stats().cycles_spilled_after_learning > spills {
                spilled_after.push(c);
            }
        }
        assert!(spilled_after.iter().all(|&c| c <= 30), "{mode:?}: spilled after the largest cycle: {spilled_after:?}");
        let stats = w.stats();
        assert_eq!(stats.cycles_spilled_after_learning as usize, spilled_after.len());
        let table = workspace_core::stats_table(&[stats]);
        assert!(table.contains("late spills"), "{table}");
    }
}

#[test]
fn a_file_backed_workspace_keeps_its_file_and_lock_under_a_debug_mode() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("debug.ws");
    {
        let w = ws(file_config(&path), DebugMode::Disabled);
        let s = w.enter().unwrap();
        s.filled::<u32, _>(64, 5).unwrap();
    }
    for mode in [DebugMode::SpillEverything, DebugMode::BypassEverything] {
        let w = ws(file_config(&path), mode);
        assert!(Workspace::new("OTHER", file_config(&path)).is_err(), "{mode:?}: the file stays locked");
        let s = w.enter().unwrap();
        // SAFETY: the first workspace wrote 64 initialised u32s there.
        let kept = unsafe { s.retained::<u32, _>(64) }.unwrap();
        assert!(kept.iter().all(|&x| x == 5), "{mode:?}");
        // The file's memory keeps serving the arena: its contents are the program's data.
        let next = s.zeros::<u32, _>(64).unwrap();
        assert_eq!(s.placement(next.as_ptr()), Placement::Arena(256), "{mode:?}");
    }
}
