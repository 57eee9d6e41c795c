//! Table-driven tests of every policy with exact expected numbers, the array tiers,
//! error messages, panics inside scopes, and bad input.

use std::panic::{catch_unwind, AssertUnwindSafe};

use ndarray::{Array2, Ix1};
use workspace_core::{
    AllocationPolicy, DebugMode, Error, LearningPolicy, Location, Placement, ResetPolicy, Scope, ScopeKind,
    SpillPolicy, Workspace, WorkspaceArrayExt, WorkspaceConfig, WorkspaceManager,
};

fn ws(config: WorkspaceConfig) -> Workspace {
    Workspace::with_debug_mode("T", config, DebugMode::Disabled).unwrap()
}

fn strict() -> workspace_core::WorkspaceConfigBuilder {
    WorkspaceConfig::builder().allocation(AllocationPolicy::Strict)
}

/// Runs one cycle allocating `sizes` bytes (as u8 arrays) and returns their placements.
fn cycle(ws: &Workspace, sizes: &[usize]) -> Vec<Placement> {
    let scope = ws.enter().unwrap();
    sizes
        .iter()
        .map(|&n| {
            let v = scope.zeros::<u8, _>(n).unwrap();
            scope.placement(v.as_ptr())
        })
        .collect()
}

#[test]
fn learning_table() {
    struct Case {
        name: &'static str,
        config: WorkspaceConfig,
        cycles: Vec<Vec<usize>>,
        capacities: Vec<usize>,
        learned: Option<usize>,
    }
    let cases = [
        Case {
            name: "FirstLoop Strict learns the first cycle exactly",
            config: strict().build().unwrap(),
            cycles: vec![vec![100, 200, 64], vec![100, 200, 64], vec![10]],
            // 100→128, 200→256 (aligned starts): 128 + 256 + 64 = 448
            capacities: vec![448, 448, 448],
            learned: Some(448),
        },
        Case {
            name: "FirstLoop Overallocate(0.5)",
            config: WorkspaceConfig::builder().allocation(AllocationPolicy::Overallocate(0.5)).build().unwrap(),
            cycles: vec![vec![1000], vec![1000]],
            capacities: vec![1536, 1536],
            // A cycle counts whole alignment units wherever it ran (here in spill blocks).
            learned: Some(1024),
        },
        Case {
            name: "OverTime takes the largest of the first 3 cycles",
            config: strict()
                .learning(LearningPolicy::OverTime { cycles: 3 })
                .spill(SpillPolicy::External)
                .build()
                .unwrap(),
            cycles: vec![vec![100], vec![5000], vec![300], vec![9000]],
            capacities: vec![0, 0, 5056, 5056],
            learned: Some(5056),
        },
        Case {
            name: "min_size and max_size clamp the learned size",
            config: strict().min_size(4096).max_size(1 << 20).build().unwrap(),
            cycles: vec![vec![10], vec![10]],
            capacities: vec![4096, 4096],
            learned: Some(64),
        },
        Case {
            name: "no learning keeps initial_size",
            config: strict()
                .learning(LearningPolicy::None)
                .initial_size(1000)
                .spill(SpillPolicy::External)
                .build()
                .unwrap(),
            cycles: vec![vec![500], vec![5000]],
            capacities: vec![1024, 1024],
            learned: None,
        },
        Case {
            name: "learning never shrinks a larger initial arena",
            config: strict().initial_size(8192).build().unwrap(),
            cycles: vec![vec![100]],
            capacities: vec![8192],
            // Served from the arena, where each allocation occupies whole alignment units.
            learned: Some(128),
        },
    ];
    for case in cases {
        let w = ws(case.config);
        for (i, sizes) in case.cycles.iter().enumerate() {
            cycle(&w, sizes);
            assert_eq!(w.capacity(), case.capacities[i], "{}: capacity after cycle {}", case.name, i + 1);
        }
        assert_eq!(w.stats().learned_size, case.learned, "{}", case.name);
    }
}

#[test]
fn offsets_are_aligned_and_packed() {
    let w = ws(strict().learning(LearningPolicy::None).initial_size(4096).build().unwrap());
    let placements = cycle(&w, &[1, 64, 65, 10]);
    assert_eq!(
        placements,
        vec![Placement::Arena(0), Placement::Arena(64), Placement::Arena(128), Placement::Arena(256)]
    );
    let w = ws(strict().learning(LearningPolicy::None).initial_size(4096).alignment(256).build().unwrap());
    assert_eq!(cycle(&w, &[1, 1, 300]), vec![Placement::Arena(0), Placement::Arena(256), Placement::Arena(512)]);
    // The arena resets: the next cycle starts at 0 again.
    assert_eq!(cycle(&w, &[8]), vec![Placement::Arena(0)]);
}

#[test]
fn spill_table() {
    struct Case {
        name: &'static str,
        spill: SpillPolicy,
        expect_capacity_after: usize,
        expect_growths: u64,
    }
    for case in [
        Case { name: "External", spill: SpillPolicy::External, expect_capacity_after: 1024, expect_growths: 0 },
        Case { name: "Reallocate", spill: SpillPolicy::Reallocate, expect_capacity_after: 3072, expect_growths: 1 },
    ] {
        let w = ws(strict().learning(LearningPolicy::None).initial_size(1024).spill(case.spill).build().unwrap());
        {
            let scope = w.enter().unwrap();
            let a = scope.zeros::<u8, _>(1000).unwrap();
            assert_eq!(scope.placement(a.as_ptr()), Placement::Arena(0));
            let b = scope.zeros::<u8, _>(2000).unwrap();
            assert_eq!(scope.placement(b.as_ptr()), Placement::Elsewhere, "{}", case.name);
            let s = w.stats();
            assert_eq!((s.spilled_in_use, s.external_allocations, s.bytes_spilled), (2000, 1, 2000), "{}", case.name);
            assert_eq!(s.bytes_in_use, 1024, "allocations occupy whole alignment units");
        }
        let s = w.stats();
        assert_eq!(s.spilled_in_use, 0, "{}: spill freed at reset", case.name);
        // The spilled 2000 bytes count as the arena would hold them: 2048.
        assert_eq!(s.last_cycle_bytes, 1024 + 2048, "{}", case.name);
        assert_eq!(w.capacity(), case.expect_capacity_after, "{}", case.name);
        assert_eq!(s.growth_events, case.expect_growths, "{}", case.name);
        // The same cycle again: under Reallocate it now fits.
        let placements = cycle(&w, &[1000, 2000]);
        let fits = placements == vec![Placement::Arena(0), Placement::Arena(1024)];
        assert_eq!(fits, case.spill == SpillPolicy::Reallocate, "{}: {placements:?}", case.name);
        assert_eq!(w.stats().external_allocations, if fits { 1 } else { 2 });
    }
}

#[test]
fn fail_policy_errors_and_leaves_the_workspace_usable() {
    let w = ws(strict().learning(LearningPolicy::None).initial_size(1024).spill(SpillPolicy::Fail).build().unwrap());
    let scope = w.enter().unwrap();
    let mut a = scope.filled::<u8, _>(950, 7).unwrap();
    let err = scope.zeros::<u8, _>(100).unwrap_err();
    match &err {
        Error::Exhausted { requested, available, capacity, .. } => {
            assert_eq!((*requested, *available, *capacity), (100, 64, 1024));
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("'T'") && msg.contains("unchanged") && msg.contains("SpillPolicy::External"), "{msg}");
    // Unchanged: still 64 bytes free at 960, earlier data intact.
    let b = scope.zeros::<u8, _>(64).unwrap();
    assert_eq!(scope.placement(b.as_ptr()), Placement::Arena(960));
    a[0] = 1;
    assert_eq!(a.iter().map(|&x| x as usize).sum::<usize>(), 1 + 949 * 7);
    drop(scope);
    assert_eq!(w.stats().external_allocations, 0);
    assert_eq!(cycle(&w, &[1024]), vec![Placement::Arena(0)]);
}

#[test]
fn budget_is_enforced_with_a_typed_error() {
    let w = ws(strict().learning(LearningPolicy::None).initial_size(1024).max_size(4096).build().unwrap());
    let scope = w.enter().unwrap();
    scope.zeros::<u8, _>(1024).unwrap();
    scope.zeros::<u8, _>(3000).unwrap();
    let err = scope.zeros::<u8, _>(100).unwrap_err();
    assert!(
        matches!(err, Error::BudgetExceeded { requested: 100, in_use: 4032, arena: 1024, max_size: 4096, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("max_size"), "{err}");
    // Spills count as an arena would lay them out (3000 bytes take 3008): 64 more fit.
    assert!(matches!(scope.zeros::<u8, _>(65).unwrap_err(), Error::BudgetExceeded { .. }));
    scope.zeros::<u8, _>(64).unwrap();
}

#[test]
fn generations_and_nesting() {
    let w = ws(WorkspaceConfig::default());
    assert_eq!(w.generation(), 0);
    let outer = w.enter().unwrap();
    assert_eq!(outer.kind(), ScopeKind::Opened);
    assert_eq!(w.generation(), 1);
    let a = outer.filled::<f32, _>(16, 1.0).unwrap();
    {
        let inner = w.enter().unwrap();
        assert_eq!(inner.kind(), ScopeKind::Nested);
        assert_eq!(w.generation(), 1, "nesting does not start a generation");
        inner.filled::<f32, _>(16, 2.0).unwrap();
    }
    assert_eq!(a.sum(), 16.0, "nested exit did not reset");
    assert!(w.is_open());
    drop(outer);
    assert!(!w.is_open());
    for expected in 2..=5 {
        let _s = w.enter().unwrap();
        assert_eq!(w.generation(), expected);
    }
    assert_eq!(w.stats().cycles, 5);
}

#[test]
fn reset_waits_for_the_last_scope_whatever_the_order() {
    let w = ws(strict().learning(LearningPolicy::None).initial_size(4096).build().unwrap());
    let outer = w.enter().unwrap();
    let inner = w.enter().unwrap();
    let kept = inner.filled::<u32, _>(8, 9).unwrap();
    drop(outer); // closing the outer guard first must not reset under `kept`
    assert!(w.is_open());
    let again = inner.zeros::<u32, _>(8).unwrap();
    assert_ne!(inner.placement(again.as_ptr()), Placement::Arena(0));
    assert_eq!(kept.sum(), 72);
    drop(inner);
    assert!(!w.is_open());
    assert_eq!(cycle(&w, &[1]), vec![Placement::Arena(0)]);
}

#[test]
fn borrowing_an_open_workspace_and_scoping_out() {
    let outer_ws = ws(WorkspaceConfig::default());
    let inner_ws = Workspace::with_debug_mode("INNER", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    let err = outer_ws.borrow_open().unwrap_err();
    assert!(matches!(err, Error::NotOpen { .. }), "{err:?}");
    assert!(err.to_string().contains("not open"), "{err}");

    let outer = outer_ws.enter().unwrap();
    let generation = outer_ws.generation();
    let result = {
        let inner = inner_ws.enter().unwrap();
        let x = inner.filled::<f64, _>((3, 3), 2.0).unwrap();
        let borrowed = outer_ws.borrow_open().unwrap();
        assert_eq!(borrowed.kind(), ScopeKind::Borrowed);
        let kept = borrowed.copy_handle(&x).unwrap();
        drop(borrowed);
        assert_eq!(outer_ws.generation(), generation, "borrowing does not reset or open a generation");
        kept
    };
    assert_eq!(result.detach(&outer).unwrap().sum(), 18.0);

    let heap = Scope::heap();
    assert_eq!(heap.kind(), ScopeKind::Heap);
    let h = heap.filled::<i32, _>(4, 3).unwrap();
    assert_eq!(heap.placement(h.as_ptr()), Placement::Elsewhere);
    assert_eq!(h.sum(), 12);
    let before = outer_ws.bytes_in_use();
    let _ = WorkspaceManager::current().scope_out().zeros::<u8, _>(10).unwrap();
    assert_eq!(outer_ws.bytes_in_use(), before, "scoped-out allocations do not touch workspaces");
}

#[test]
fn stale_and_foreign_handles_name_the_fix() {
    let a = Workspace::with_debug_mode("ALPHA", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    let b = Workspace::with_debug_mode("BETA", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    let mut h = {
        let s = a.enter().unwrap();
        let mut h = s.zeros_handle::<f32, _>((2, 3)).unwrap();
        h.view_mut(&s).unwrap().fill(1.0);
        assert_eq!(h.view(&s).unwrap().sum(), 6.0);
        h
    };
    let s = a.enter().unwrap();
    let err = h.view_mut(&s).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::StaleHandle { array_generation: 1, workspace_generation: 2, .. }));
    for needle in ["'ALPHA'", "generation 1", "generation 2", "detach()", "leverage_to"] {
        assert!(msg.contains(needle), "message lacks {needle}: {msg}");
    }
    let sb = b.enter().unwrap();
    let h2 = s.zeros_handle::<f32, _>(4).unwrap();
    let err = h2.view(&sb).unwrap_err();
    assert!(matches!(err, Error::WrongWorkspace { .. }));
    assert!(err.to_string().contains("'ALPHA'") && err.to_string().contains("'BETA'"), "{err}");
    let moved = h2.leverage_to(&s, &sb).unwrap();
    assert_eq!(moved.view(&sb).unwrap().shape(), &[4]);
    assert_eq!(moved.workspace_name().as_ref(), "BETA");
}

#[test]
fn detach_and_leverage_copy_exact_values() {
    let w = ws(WorkspaceConfig::default());
    let target = Workspace::with_debug_mode("OUT", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    let out = target.enter().unwrap();
    let (owned, lev) = {
        let s = w.enter().unwrap();
        let x = s.from_shape_fn((3, 4), |(i, j)| (i * 10 + j) as f32).unwrap();
        let t = x.t(); // a non-contiguous view copies in logical order
        (t.detach(), t.leverage_to(&out).unwrap())
    };
    let expected = Array2::from_shape_fn((4, 3), |(i, j)| (j * 10 + i) as f32);
    assert_eq!(owned, expected);
    assert_eq!(lev, expected);
    assert!(lev.is_standard_layout());
}

#[test]
fn circular_workspace_wraps_without_overwriting_the_open_cycle() {
    let w =
        ws(strict().learning(LearningPolicy::None).initial_size(1024).reset(ResetPolicy::EndOfBuffer).build().unwrap());
    assert_eq!(cycle(&w, &[256, 256]), vec![Placement::Arena(0), Placement::Arena(256)]);
    assert_eq!(w.bytes_in_use(), 512, "circular keeps the last cycle's bytes");
    assert_eq!(cycle(&w, &[256]), vec![Placement::Arena(512)]);
    // 768 used; 512 does not fit at the end, and it wraps to 0 (nothing handed out in
    // this open period lies there).
    assert_eq!(cycle(&w, &[512]), vec![Placement::Arena(0)]);
    assert_eq!(w.stats().wraps, 1);
    // Now at 512: 256 fits at the end; the next 256 would wrap onto 0..256, which is
    // below this cycle's start (512), so it wraps; a third would overwrite this cycle
    // and spills instead.
    let placements = cycle(&w, &[256, 256, 256, 256]);
    assert_eq!(placements[..3], [Placement::Arena(512), Placement::Arena(768), Placement::Arena(0)]);
    assert_eq!(placements[3], Placement::Arena(256));
    let s = w.stats();
    assert_eq!((s.wraps, s.external_allocations), (2, 0));
    // Opened at 512: 512 fits at the end, the next 512 wraps onto the previous
    // cycle's memory, and a third would overwrite this cycle, so it spills.
    let placements = cycle(&w, &[512, 512, 1]);
    assert_eq!(placements, vec![Placement::Arena(512), Placement::Arena(0), Placement::Elsewhere]);
    assert_eq!(w.stats().external_allocations, 1);
}

#[test]
fn trim_gives_memory_back_and_relearns() {
    let w = ws(strict().min_size(0).build().unwrap());
    cycle(&w, &[10_000]);
    assert_eq!(w.capacity(), 10_048);
    let s = w.enter().unwrap();
    assert!(matches!(w.trim().unwrap_err(), Error::StillOpen { depth: 1, .. }));
    drop(s);
    w.trim().unwrap();
    assert_eq!(w.capacity(), 0);
    cycle(&w, &[3000]);
    assert_eq!(w.capacity(), 3008, "learned again after trim");
    let w = ws(strict().learning(LearningPolicy::None).initial_size(2048).min_size(1024).build().unwrap());
    w.trim().unwrap();
    assert_eq!(w.capacity(), 1024);
    cycle(&w, &[1]);
    assert_eq!(w.capacity(), 2048, "the configured size comes back");
}

#[test]
fn spill_everything_sends_each_allocation_to_its_own_block() {
    let w =
        Workspace::with_debug_mode("DBG", strict().initial_size(1 << 16).build().unwrap(), DebugMode::SpillEverything)
            .unwrap();
    {
        let s = w.enter().unwrap();
        let a = s.filled::<u8, _>(100, 1).unwrap();
        let b = s.filled::<u8, _>(100, 2).unwrap();
        assert_eq!(s.placement(a.as_ptr()), Placement::Elsewhere);
        assert_eq!(s.placement(b.as_ptr()), Placement::Elsewhere);
        assert_eq!(a.sum() as u32 + b.sum() as u32, 300);
        assert_eq!(w.stats().external_allocations, 2);
        assert!(matches!(w.set_debug_mode(DebugMode::Disabled), Err(Error::StillOpen { .. })));
    }
    w.set_debug_mode(DebugMode::Disabled).unwrap();
    assert_eq!(cycle(&w, &[100]), vec![Placement::Arena(0)]);
}

#[test]
fn bypass_everything_puts_every_array_on_the_heap_and_changes_nothing_else() {
    let w = Workspace::with_debug_mode("OFF", WorkspaceConfig::default(), DebugMode::BypassEverything).unwrap();
    let s = w.enter().unwrap();
    assert_eq!(s.kind(), ScopeKind::Opened, "the workspace still opens a cycle");
    let x = s.filled::<u16, _>(5, 2).unwrap();
    assert_eq!(x.sum(), 10);
    assert_eq!(s.placement(x.as_ptr()), Placement::Elsewhere, "on the heap, not in an arena");
    assert!(s.holds(&x), "yet it belongs to the workspace");
    drop(s);
    let stats = w.stats();
    assert_eq!((stats.cycles, stats.peak_bytes, stats.external_allocations), (1, 10, 1));
    assert_eq!(stats.learned_size, Some(64), "the size is learned as with the mode off");
    assert_eq!(w.capacity(), 128, "in the accounting only: no arena memory is held");
    w.set_debug_mode(DebugMode::Disabled).unwrap();
    assert_eq!(cycle(&w, &[10]), vec![Placement::Arena(0)], "the learned arena is made when the mode goes off");
}

#[test]
fn a_panic_inside_a_scope_leaves_the_workspace_closed_and_usable() {
    let w = ws(strict().build().unwrap());
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

#[test]
fn bad_input_is_a_typed_error() {
    let w = ws(WorkspaceConfig::default());
    let s = w.enter().unwrap();
    let err = s.zeros::<f32, _>((0, 5)).unwrap_err();
    assert!(matches!(err, Error::ZeroLength { ref shape, .. } if shape == &[0, 5]), "{err:?}");
    assert!(err.to_string().contains("no elements"));
    let err = s.zeros::<f32, _>((usize::MAX / 2, 3)).unwrap_err();
    assert!(matches!(err, Error::ShapeOverflow { element_size: 4, .. }), "{err:?}");
    let err = s.uninit::<f64, _>(usize::MAX / 4).unwrap_err();
    assert!(matches!(err, Error::ShapeOverflow { .. }), "{err:?}");
    let err = s.slice_zeroed::<u64>(0).unwrap_err();
    assert!(matches!(err, Error::ZeroLength { .. }));
    // Huge but representable: the backend says no, as an error.
    let err = s.zeros::<u8, _>(isize::MAX as usize).unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    // Zero-sized element types need no memory at all.
    assert_eq!(s.zeros::<(), _>(Ix1(10)).unwrap().len(), 10);
    drop(s);
    let err = Workspace::new(
        "FILE",
        WorkspaceConfig::builder()
            .learning(LearningPolicy::None)
            .initial_size(4096)
            // SAFETY: the file cannot be created, so nothing is ever mapped.
            .location(unsafe { Location::mmap("/nonexistent-dir/carve.ws") })
            .build()
            .unwrap(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    assert!(err.to_string().contains("/nonexistent-dir/carve.ws"), "{err}");
}

#[test]
fn file_backed_workspace_keeps_its_contents() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.ws");
    let config = WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .initial_size(1 << 16)
        // SAFETY: the file is in a fresh temporary directory nothing else touches.
        .location(unsafe { Location::mmap(&path) })
        .build()
        .unwrap();
    {
        let w = Workspace::with_debug_mode("FILE", config.clone(), DebugMode::Disabled).unwrap();
        assert_eq!(w.stats().backend, "mmap-file");
        let s = w.enter().unwrap();
        let mut v = s.zeros::<u32, _>(1000).unwrap();
        v.iter_mut().enumerate().for_each(|(i, x)| *x = i as u32 * 3);
        assert_eq!(s.placement(v.as_ptr()), Placement::Arena(0));
    }
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 16);
    let w = Workspace::with_debug_mode("FILE", config, DebugMode::Disabled).unwrap();
    let s = w.enter().unwrap();
    // SAFETY: the file's bytes were written above with initialised `u32`s.
    let restored = unsafe { s.retained::<u32, _>(1000) }.unwrap();
    assert!(restored.iter().enumerate().all(|(i, &x)| x == i as u32 * 3));
    let anon = ws(WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .initial_size(8192)
        .location(Location::MmapAnonymous)
        .build()
        .unwrap());
    assert_eq!(cycle(&anon, &[100, 100]), vec![Placement::Arena(0), Placement::Arena(128)]);
    let s = ws(WorkspaceConfig::default());
    let scope = s.enter().unwrap();
    // SAFETY: the call fails before handing out anything.
    assert!(matches!(unsafe { scope.retained::<u8, _>(4) }.unwrap_err(), Error::NotInitialised { .. }));
}

#[test]
fn manager_registry() {
    let m = WorkspaceManager::current();
    let config = strict().build().unwrap();
    let a = m.get_or_create("M1", &config).unwrap();
    let again = m.get_or_create("M1", &config).unwrap();
    assert!(std::rc::Rc::ptr_eq(&a, &again));
    let other = strict().spill(SpillPolicy::Fail).initial_size(64).build().unwrap();
    let err = m.get_or_create("M1", &other).unwrap_err();
    assert!(matches!(err, Error::ConfigMismatch { .. }));
    assert!(err.to_string().contains("Fail"), "{err}");
    let err = m.enter("NOPE").unwrap_err();
    assert!(matches!(err, Error::UnknownWorkspace { .. }));
    assert!(err.to_string().contains("get_or_create"));
    {
        let scope = m.enter("M1").unwrap();
        scope.zeros::<f32, _>(100).unwrap();
        let borrowed = m.borrow_open("M1").unwrap();
        borrowed.zeros::<f32, _>(1).unwrap();
        assert!(matches!(m.destroy("M1"), Err(Error::StillOpen { depth: 2, .. })));
        assert!(matches!(m.set_debug_mode(DebugMode::SpillEverything), Err(Error::StillOpen { .. })));
    }
    assert!(matches!(m.borrow_open("M1"), Err(Error::NotOpen { .. })));
    m.get_or_create("M2", &config).unwrap();
    let table = m.stats_table();
    assert!(table.contains("M1") && table.contains("M2") && table.contains("capacity"), "{table}");
    // Every value sits under its own header: cells are right-aligned, so a column's
    // value ends where its header ends.
    let lines: Vec<&str> = table.lines().collect();
    let row = lines.iter().find(|l| l.starts_with("M1")).expect("a row for M1");
    let cell = |name: &str| {
        let end = lines[0].find(name).expect("a header") + name.len();
        row[..end].rsplit(' ').next().expect("a cell").to_string()
    };
    let stats = m.get("M1").unwrap().stats();
    assert_eq!(cell("cycles"), stats.cycles.to_string(), "{table}");
    assert_eq!(cell("gen"), stats.generation.to_string(), "{table}");
    assert_eq!(cell("growths"), stats.growth_events.to_string(), "{table}");
    assert_eq!(cell("spills"), stats.external_allocations.to_string(), "{table}");
    assert_eq!(cell("pinned"), "0", "{table}");
    let json: serde_json::Value = serde_json::from_str(&m.stats_json()).unwrap();
    assert_eq!(json[0]["name"], "M1");
    assert_eq!(json[0]["cycles"], 1);
    // 400 bytes, then 4 at offset 448: learned 452, rounded to 512.
    assert_eq!(json[0]["capacity"], 512);
    m.destroy("M1").unwrap();
    assert!(!m.exists("M1"));
    assert_eq!(a.stats().cycles, 1, "a held Rc keeps the workspace alive");
    m.destroy_all().unwrap();
    assert!(m.ids().is_empty());
}

#[test]
fn statistics_are_readable_while_arrays_live_and_peak_resets() {
    let w = ws(strict().learning(LearningPolicy::None).initial_size(4096).timeline_len(3).build().unwrap());
    for n in [100usize, 2000, 300, 50] {
        let s = w.enter().unwrap();
        let _a = s.zeros::<u8, _>(n).unwrap();
        let live = w.stats();
        assert_eq!(live.bytes_in_use, n.next_multiple_of(64));
        assert_eq!(live.open_scopes, 1);
    }
    let s = w.stats();
    assert_eq!(s.peak_bytes, 2048);
    assert_eq!(w.timeline(), vec![2048, 320, 64], "bounded timeline keeps the last 3");
    w.reset_peak();
    cycle(&w, &[64]);
    assert_eq!(w.stats().peak_bytes, 64);
}

#[test]
fn workspace_is_send_and_scopes_stay_on_their_thread() {
    fn is_send<T: Send>() {}
    is_send::<Workspace>();
    is_send::<workspace_core::Handle<f32, ndarray::Ix2>>();
    let w = ws(WorkspaceConfig::default());
    cycle(&w, &[128]);
    let moved = std::thread::spawn(move || {
        cycle(&w, &[128]);
        w
    })
    .join()
    .unwrap();
    assert_eq!(moved.stats().cycles, 2);
}

#[test]
fn allocator_api2_containers_live_in_the_workspace() {
    let w = ws(strict().learning(LearningPolicy::None).initial_size(1 << 16).build().unwrap());
    let s = w.enter().unwrap();
    let mut v = allocator_api2::vec::Vec::new_in(&s);
    v.extend(0..1000u32);
    assert_eq!(v.iter().sum::<u32>(), 499_500);
    assert!(matches!(s.placement(v.as_ptr()), Placement::Arena(_)));
    let mut map = hashbrown::HashMap::new_in(&s);
    for i in 0..100u64 {
        map.insert(i, i * i);
    }
    assert_eq!(map[&9], 81);
    assert!(w.bytes_in_use() >= 4000 + 100 * 16, "vector and map live in the arena");
}

#[test]
fn the_engine_hands_out_nothing_without_an_open_scope_and_rejects_bad_requests() {
    let w = ws(strict().learning(LearningPolicy::None).initial_size(1 << 16).build().unwrap());
    let engine = w.engine();
    assert!(engine.try_alloc_fast(64, 16).is_none(), "closed: the fast path is off");
    let err = engine.alloc(64, 16).unwrap_err();
    assert!(matches!(err, Error::NotOpen { .. }), "{err:?}");
    assert!(err.to_string().contains("allocating needs an open cycle"), "{err}");
    {
        let scope = w.enter().unwrap();
        assert!(matches!(engine.alloc(0, 16), Err(Error::ZeroLength { .. })));
        let err = engine.alloc(64, 24).unwrap_err();
        assert!(err.to_string().contains("alignment 24, which is not a power of two"), "{err}");
        let (_, offset) = engine.alloc(64, 16).unwrap();
        assert_eq!(offset, 0, "the rejected requests took nothing");
        assert!(scope.zeros::<f32, _>(16).is_ok());
    }
    assert!(engine.try_alloc_fast(64, 16).is_none(), "closed again: off again");
    let scope = w.enter().unwrap();
    assert_eq!(engine.alloc(64, 16).unwrap().1, 0, "a new cycle starts at the arena's start");
    drop(scope);
    assert_eq!(w.stats().cycles, 2);
}

/// Minor page faults of this thread so far: per thread, so that other tests running
/// meanwhile do not count.
#[cfg(target_os = "linux")]
fn minor_faults() -> u64 {
    // SAFETY: getrusage writes into the struct we pass; zeroed is a valid rusage.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut usage), 0, "getrusage(RUSAGE_THREAD)");
        usage.ru_minflt as u64
    }
}

/// Whether this process runs under valgrind, whose tools map their preload libraries
/// into it (`vgpreload_core`, `vgpreload_memcheck`, ...).
#[cfg(target_os = "linux")]
fn under_valgrind() -> bool {
    std::fs::read_to_string("/proc/self/maps").is_ok_and(|maps| maps.contains("/vgpreload_"))
}

#[cfg(target_os = "linux")]
#[test]
fn the_memory_of_the_first_cycle_is_the_arena_of_every_later_one() {
    // 4.35 MB: past the first huge page of the reservation, which is 4 KiB pages.
    const SIZES: [usize; 4] = [300_000, 1_000_000, 3_000_000, 50_000];
    // One cycle: the arrays' addresses, and the minor faults this thread took meanwhile.
    let run = |w: &Workspace| {
        let mut at = [0usize; SIZES.len()]; // nothing on the heap while counting
        let faults = minor_faults();
        {
            let scope = w.enter().unwrap();
            for (slot, &n) in at.iter_mut().zip(&SIZES) {
                let v = scope.zeros::<u8, _>(n).unwrap(); // writes every byte
                *slot = v.as_ptr() as usize;
            }
        }
        (at, minor_faults() - faults)
    };
    // Count only the workspace's memory: a workspace of its own first takes the code
    // of a first and of a later cycle through every page of text, data and stack it
    // needs (a page of code run for the first time faults too, as a file page). It
    // stays alive, so that its memory cannot be the measured workspace's.
    let rehearsal = Workspace::with_debug_mode("REHEARSAL", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    for _ in 0..3 {
        run(&rehearsal);
    }

    let w = ws(WorkspaceConfig::default());
    let (first, cold) = run(&w);
    let learned = w.capacity();
    assert!(learned >= SIZES.iter().sum::<usize>(), "learned {learned}");
    let later: Vec<_> = (0..3).map(|_| run(&w)).collect();
    for (again, _) in &later {
        assert_eq!(*again, first, "later cycles are laid out where the first one was");
    }
    let stats = w.stats();
    assert_eq!((stats.capacity, stats.growth_events, stats.external_allocations), (learned, 1, 4));

    // Valgrind runs this thread's code through its own translator and shadow memory,
    // which fault in pages of their own as they go: a count that says nothing about
    // the workspace. The layout above is still checked.
    if under_valgrind() {
        eprintln!("under valgrind: page faults not counted (the tool's shadow memory faults on this thread too)");
        return;
    }
    let faults: Vec<u64> = later.iter().map(|&(_, faults)| faults).collect();
    assert!(cold > 0, "the first cycle faults its arena in");
    assert_eq!(faults, [0, 0, 0], "later cycles touch only memory the first cycle faulted in ({cold} faults)");

    // The count does see the arena: give its pages back to the system behind the
    // workspace's back, and the next cycle faults them in again.
    for (&address, &n) in first.iter().zip(&SIZES) {
        let start = address.next_multiple_of(4096);
        let end = (address + n) / 4096 * 4096;
        // SAFETY: whole pages inside arrays of the workspace, which is closed: nothing
        // refers to them, and the next cycle writes every byte it hands out.
        let given_back = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        assert_eq!(given_back, 0, "madvise");
    }
    let (again, refaulted) = run(&w);
    assert_eq!(again, first);
    assert!(refaulted > 0, "pages given back fault in again");
    drop(rehearsal);
}
