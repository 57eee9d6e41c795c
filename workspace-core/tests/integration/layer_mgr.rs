//! LayerWorkspaceMgr semantics and every error message it produces.

use ndarray::{Array2, ArrayView2};
use workspace_core::{
    freeze, ArrayType, DebugMode, Error, LayerWorkspaceMgr, WorkspaceConfig, WorkspaceManager, WorkspaceMode,
};

fn mgr() -> LayerWorkspaceMgr {
    LayerWorkspaceMgr::builder()
        .with(ArrayType::Activations, "ACT", WorkspaceConfig::default())
        .with(ArrayType::Input, "ACT", WorkspaceConfig::default())
        .scoped_out(ArrayType::FfCache)
        .default_workspace("WORK", WorkspaceConfig::default())
        .helper("CACHE", WorkspaceConfig::default())
        .build()
        .expect("valid manager")
}

#[test]
fn every_type_maps_somewhere_or_build_names_the_missing_one() {
    let err = LayerWorkspaceMgr::builder()
        .with(ArrayType::Activations, "ACT", WorkspaceConfig::default())
        .build()
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err:?}");
    assert!(text.contains("array type Input is mapped to no workspace"), "{text}");
    assert!(text.contains("scoped_out(ArrayType::Input)"), "{text}");

    let m = mgr();
    assert_eq!(m.workspace_name(ArrayType::Activations), Some("ACT"));
    assert_eq!(m.workspace_name(ArrayType::Input), Some("ACT"));
    assert_eq!(m.workspace_name(ArrayType::BpWorkingMem), Some("WORK"));
    assert_eq!(m.workspace_name(ArrayType::FfCache), None);
    assert!(m.is_scoped_out(ArrayType::FfCache));
    // ACT, WORK, CACHE: duplicates across types are listed once.
    let names: Vec<String> = m.workspaces().map(|ws| ws.name().to_string()).collect();
    assert_eq!(names, ["ACT", "WORK", "CACHE"]);
}

#[test]
fn no_workspaces_scopes_everything_out() {
    let m = LayerWorkspaceMgr::no_workspaces();
    for ty in ArrayType::ALL {
        assert!(m.is_scoped_out(ty), "{ty:?}");
        assert!(m.workspace(ty).is_none());
        let scope = m.enter(ty).unwrap();
        assert_eq!(scope.array_type(), ty);
        assert_eq!(&**scope.target_name(), format!("heap ({ty:?})"));
        let a = scope.zeros::<f32, _>((3, 3)).unwrap();
        m.validate(ty, "any", &a).unwrap();
        // Each type its own heap: another type's array is misplaced, as with a
        // workspace of each type's own.
        let other = ArrayType::ALL[(ty as usize + 1) % ArrayType::ALL.len()];
        assert!(matches!(m.validate(other, "any", &a), Err(Error::WrongLocation { .. })));
    }
    assert_eq!(m.capacity(), 0);
    assert_eq!(m.workspaces().count(), 0);
}

#[test]
fn a_heap_scopes_handle_read_through_another_says_so_and_empty_arrays_leverage_in_every_mode() {
    // A scoped-out type's handle is read through any scope of the type while its cycle
    // lasts, as a workspace's is; a standalone heap scope's through itself alone, and
    // the error says why (not "'heap' but accessed through 'heap'").
    let m = LayerWorkspaceMgr::no_workspaces();
    let act = m.enter(ArrayType::Activations).unwrap();
    let handle = act.zeros_handle::<f32, _>(4).unwrap();
    assert_eq!(handle.view(&act).unwrap().len(), 4);
    let nested = m.enter(ArrayType::Activations).unwrap();
    assert_eq!(handle.view(&nested).unwrap().len(), 4);
    assert_eq!(handle.view(&m.borrow_open(ArrayType::Activations).unwrap()).unwrap().len(), 4);
    let err = handle.view(&m.enter(ArrayType::FfCache).unwrap()).unwrap_err();
    assert!(matches!(err, Error::WrongWorkspace { .. }), "{err:?}");
    drop((nested, act));
    let err = handle.view(&m.enter(ArrayType::Activations).unwrap()).unwrap_err();
    assert!(matches!(err, Error::StaleHandle { .. }), "the cycle ended: {err:?}");
    let (first, second) = (workspace_core::Scope::heap(), workspace_core::Scope::heap());
    let handle = first.zeros_handle::<f32, _>(4).unwrap();
    let err = handle.view(&second).unwrap_err();
    assert!(matches!(err, Error::WrongWorkspace { .. }), "{err:?}");
    assert!(
        err.to_string().contains("two standalone heap scopes, `Scope::heap()`, each read only through itself"),
        "{err}"
    );
    // An empty array is kept as it is, whatever the mode (nothing to copy).
    let empty = Array2::<f32>::zeros((0, 3));
    for m in [mgr(), LayerWorkspaceMgr::no_workspaces()] {
        let act = m.enter(ArrayType::Activations).unwrap();
        let kept = act.leverage(empty.view()).unwrap();
        assert_eq!(kept.dim(), (0, 3));
    }
}

#[test]
fn a_reused_name_with_another_config_is_an_error() {
    let _first = mgr();
    let other = WorkspaceConfig::builder().initial_size(1 << 20).build().unwrap();
    let err = LayerWorkspaceMgr::builder().default_workspace("ACT", other).build().unwrap_err();
    assert!(matches!(err, Error::ConfigMismatch { ref workspace, .. } if workspace == "ACT"), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "workspace 'ACT' already exists with a different configuration: existing {}, requested {}; use one \
             configuration per id, or destroy the workspace first",
            WorkspaceConfig::default(),
            WorkspaceConfig::builder().initial_size(1 << 20).build().unwrap()
        )
    );
    // The same names and configurations are shared, not duplicated.
    let again = mgr();
    assert!(std::rc::Rc::ptr_eq(
        again.workspace(ArrayType::Activations).unwrap(),
        mgr().workspace(ArrayType::Activations).unwrap()
    ));
    let err = LayerWorkspaceMgr::builder()
        .default_workspace("W", WorkspaceConfig::default())
        .helper("H", WorkspaceConfig::default())
        .helper("H", WorkspaceConfig::default())
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("helper workspace 'H' is declared twice"), "{err}");
}

#[test]
fn validate_accepts_the_right_workspace_and_names_everything_otherwise() {
    let m = mgr();
    let act = m.enter(ArrayType::Activations).unwrap();
    let good = act.zeros::<f32, _>((4, 8)).unwrap();
    m.validate(ArrayType::Activations, "dense_0", &good).unwrap();
    m.validate(ArrayType::Input, "dense_0", &good).unwrap(); // Input shares ACT

    let working = m.enter(ArrayType::FfWorkingMem).unwrap();
    let scratch = working.zeros::<f32, _>((4, 8)).unwrap();
    let err = m.validate(ArrayType::Activations, "my_layer", &scratch).unwrap_err();
    match &err {
        Error::WrongLocation { layer, array_type, expected, actual } => {
            assert_eq!(layer, "my_layer");
            assert_eq!(*array_type, ArrayType::Activations);
            assert_eq!(expected, "workspace 'ACT'");
            assert_eq!(actual, "workspace 'WORK'");
        }
        other => panic!("expected WrongLocation, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "layer 'my_layer' produced Activations in workspace 'WORK', but Activations must live in workspace \
         'ACT': allocate it from the Activations scope the layer was given (`ctx.activations` for a forward \
         output), or copy it there with `TypedScope::copy_of` (`TypedScope::leverage` copies only what does not \
         live there already: a layer that passes its input on returns `ctx.activations.leverage(x)?`)"
    );

    let heap = Array2::<f32>::zeros((2, 2));
    let err = m.validate(ArrayType::Activations, "l", &heap).unwrap_err();
    assert!(
        err.to_string().contains(
            "in memory outside this manager's workspaces (heap, an input, or another workspace), but Activations \
             must live in workspace 'ACT'"
        ),
        "{err}"
    );

    // A scoped-out type's arrays are those its scopes allocated (on the heap), as a
    // workspace's are those it holds: not a workspace's, nor any other heap array.
    let cache = m.enter(ArrayType::FfCache).unwrap();
    m.validate(ArrayType::FfCache, "l", &cache.zeros::<f32, _>(3).unwrap()).unwrap();
    let err = m.validate(ArrayType::FfCache, "l", &good).unwrap_err();
    assert!(err.to_string().contains("FfCache must live in workspace 'heap (FfCache)'"), "{err}");
    assert!(err.to_string().contains("produced FfCache in workspace 'ACT'"), "{err}");
    let err = m.validate(ArrayType::FfCache, "l", &heap).unwrap_err();
    assert!(err.to_string().contains("produced FfCache in memory outside this manager's workspaces"), "{err}");

    // A view into the middle of a workspace array, and a transposed one, still count.
    m.validate(ArrayType::Activations, "l", &good.slice(ndarray::s![1..3, 2..]).t()).unwrap();
    assert_eq!(m.location_of(&scratch), "workspace 'WORK'");
    assert_eq!(m.location_of(&heap), "no workspace (heap)");
}

#[test]
fn spilled_arrays_are_located_too() {
    let m = mgr();
    let act = m.enter(ArrayType::Activations).unwrap();
    // The first cycle learns: everything spills, and must still validate.
    let a = act.zeros::<f64, _>(10_000).unwrap();
    assert_eq!(act.workspace().unwrap().capacity(), 0, "still learning: nothing in an arena yet");
    m.validate(ArrayType::Activations, "l", &a).unwrap();
    drop(act);
    let act = m.enter(ArrayType::Activations).unwrap();
    let b = act.zeros::<f64, _>(10_000).unwrap();
    assert!(act.workspace().unwrap().capacity() >= 80_000);
    m.validate(ArrayType::Activations, "l", &b).unwrap();
}

#[test]
fn borrow_open_of_a_closed_workspace_is_an_error() {
    let m = mgr();
    let err = m.borrow_open(ArrayType::Activations).unwrap_err();
    assert!(matches!(err, Error::NotOpen { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "workspace 'ACT' is not open: borrowing it as an allocation target needs an open cycle; enter it with \
         `enter()` first (leveraging to a closed workspace is an error, never a silent no-op)"
    );
    let outer = m.enter(ArrayType::Activations).unwrap();
    let borrowed = m.borrow_open(ArrayType::Activations).unwrap();
    let a = borrowed.zeros::<u8, _>(16).unwrap();
    assert!(outer.holds(&a));
    // A scoped-out type alike: borrowed only while a scope of it is open.
    let err = m.borrow_open(ArrayType::FfCache).unwrap_err();
    assert!(matches!(err, Error::NotOpen { .. }), "{err:?}");
    assert!(err.to_string().starts_with("workspace 'heap (FfCache)' is not open: "), "{err}");
    let cache = m.enter(ArrayType::FfCache).unwrap();
    let a = m.borrow_open(ArrayType::FfCache).unwrap().zeros::<u8, _>(16).map(|a| a.to_owned()).unwrap();
    assert_eq!(a.len(), 16);
    drop(cache);
}

#[test]
fn leverage_copies_only_when_needed() {
    let m = mgr();
    let act = m.enter(ArrayType::Activations).unwrap();
    let working = m.enter(ArrayType::FfWorkingMem).unwrap();
    let mut a = working.zeros::<f32, _>((3, 2)).unwrap();
    a.iter_mut().enumerate().for_each(|(i, v)| *v = i as f32);
    let a: ArrayView2<'_, f32> = freeze(a);
    let moved = act.leverage(a).unwrap();
    assert_ne!(moved.as_ptr(), a.as_ptr());
    assert_eq!(moved, a);
    assert!(act.holds(&moved));
    let same = act.leverage(moved).unwrap();
    assert_eq!(same.as_ptr(), moved.as_ptr(), "already there: no copy");
    let dup = act.copy_of(&moved).unwrap();
    assert_ne!(dup.as_ptr(), moved.as_ptr());
    assert_eq!(dup, moved);
}

#[test]
fn leverage_to_a_type_needs_an_open_workspace() {
    let m = mgr();
    let source = Array2::<f32>::from_elem((2, 2), 5.0);
    let err = m.leverage_to(ArrayType::Activations, &source).unwrap_err();
    assert!(matches!(err, Error::NotOpen { .. }), "closed target must be an error: {err:?}");
    assert!(err.to_string().starts_with("workspace 'ACT' is not open: "), "{err}");
    // A scoped-out type alike: its heap workspace must be open, and its handle lives
    // until that cycle ends.
    let err = m.leverage_to(ArrayType::FfCache, &source).unwrap_err();
    assert!(matches!(err, Error::NotOpen { .. }), "closed target must be an error: {err:?}");
    let cache = m.enter(ArrayType::FfCache).unwrap();
    let handle = m.leverage_to(ArrayType::FfCache, &source).unwrap();
    assert_eq!(handle.view(&cache).unwrap(), source);
    drop(cache);
    let cache = m.enter(ArrayType::FfCache).unwrap();
    assert!(matches!(handle.view(&cache), Err(Error::StaleHandle { .. })));
    let act = m.enter(ArrayType::Activations).unwrap();
    let handle = m.leverage_to(ArrayType::Activations, &source).unwrap();
    assert_eq!(handle.view(&act).unwrap(), source);
    assert_eq!(&**handle.workspace_name(), "ACT");
    drop(act);
    let act = m.enter(ArrayType::Activations).unwrap();
    assert!(matches!(handle.view(&act), Err(Error::StaleHandle { .. })));
}

#[test]
fn helpers_are_named_and_unknown_ones_are_errors() {
    let m = mgr();
    let err = m.enter_helper("NOPE").unwrap_err();
    assert_eq!(
        err.to_string(),
        "layer workspace manager has no helper workspace 'NOPE': declare it with \
         `LayerWorkspaceMgrBuilder::helper(\"NOPE\", config)` (declared: [\"CACHE\"])"
    );
    let scope = m.enter_helper("CACHE").unwrap();
    assert_eq!(&**scope.target_name(), "CACHE");
    assert_eq!(m.helper("CACHE").unwrap().generation(), 1);
}

#[test]
fn workspaces_reset_per_role_and_report_peaks() {
    let m = mgr();
    let act = m.enter(ArrayType::Activations).unwrap();
    let _a = act.zeros::<f32, _>(1000).unwrap();
    for _ in 0..3 {
        let w = m.enter(ArrayType::FfWorkingMem).unwrap();
        let _s = w.zeros::<f32, _>(500).unwrap();
    }
    let work = m.workspace(ArrayType::FfWorkingMem).unwrap();
    assert_eq!(work.generation(), 3, "working memory: one cycle per layer call");
    assert_eq!(m.workspace(ArrayType::Activations).unwrap().generation(), 1);
    assert!(m.peak_bytes() >= 4000 + 2000);
    drop(act);
    m.reset_peaks();
    assert_eq!(m.peak_bytes(), 0);
}

#[test]
fn bypassed_workspaces_validate_heap_arrays() {
    let m = mgr();
    for ws in m.workspaces() {
        ws.set_debug_mode(DebugMode::BypassEverything).unwrap();
    }
    let act = m.enter(ArrayType::Activations).unwrap();
    let a = act.zeros::<f32, _>(4).unwrap();
    assert!(act.workspace().is_some(), "the scope still belongs to its workspace: only the memory moved");
    m.validate(ArrayType::Activations, "l", &a).unwrap();
    drop(act);
    for ws in m.workspaces() {
        ws.set_debug_mode(DebugMode::Disabled).unwrap();
    }
    WorkspaceManager::current().destroy_all().unwrap();
}

#[test]
fn workspace_mode_parses_and_prints() {
    assert_eq!(WorkspaceMode::default(), WorkspaceMode::Enabled);
    assert_eq!("enabled".parse::<WorkspaceMode>().unwrap(), WorkspaceMode::Enabled);
    assert_eq!("None".parse::<WorkspaceMode>().unwrap(), WorkspaceMode::None);
    assert_eq!(WorkspaceMode::None.to_string(), "none");
    let err = "on".parse::<WorkspaceMode>().unwrap_err();
    assert!(err.to_string().contains("unknown workspace mode 'on': use 'enabled', 'planned' or 'none'"), "{err}");
}

#[test]
fn array_types_are_the_nine_roles_of_dl4j_each_once() {
    let names: Vec<String> = ArrayType::ALL.iter().map(|t| format!("{t:?}")).collect();
    assert_eq!(
        names,
        [
            "Input",
            "Activations",
            "ActivationGrad",
            "FfWorkingMem",
            "BpWorkingMem",
            "RnnFfLoopWorkingMem",
            "RnnBpLoopWorkingMem",
            "UpdaterWorkingMem",
            "FfCache"
        ]
    );
    // Each role maps to its own workspace when asked to: no two share a slot.
    let mut builder = LayerWorkspaceMgr::builder();
    for (i, ty) in ArrayType::ALL.into_iter().enumerate() {
        builder = builder.with(ty, &format!("ROLE_{i}"), WorkspaceConfig::default());
    }
    let m = builder.build().unwrap();
    for (i, ty) in ArrayType::ALL.into_iter().enumerate() {
        assert_eq!(&**m.workspace(ty).unwrap().name(), format!("ROLE_{i}"), "{ty:?}");
    }
    WorkspaceManager::current().destroy_all().unwrap();
}

#[test]
fn create_uninit_gives_writable_memory_in_the_types_workspace() {
    let m = mgr();
    let act = m.enter(ArrayType::Activations).unwrap();
    let mut raw = act.uninit::<f32, _>((3, 5)).unwrap();
    raw.fill(std::mem::MaybeUninit::new(2.5));
    // SAFETY: every element was written just above.
    let ready = unsafe { raw.assume_init() };
    assert_eq!(ready.sum(), 15.0 * 2.5);
    m.validate(ArrayType::Activations, "uninit", &ready).unwrap();
    let err = m.validate(ArrayType::FfWorkingMem, "uninit", &ready).unwrap_err();
    assert!(matches!(err, Error::WrongLocation { .. }), "{err:?}");
    drop(act);
    WorkspaceManager::current().destroy_all().unwrap();
}

/// The layer manager's and the handles' rules hold the same way in every debug mode:
/// only where the memory comes from changes.
#[test]
fn handles_and_leverage_behave_the_same_in_every_debug_mode() {
    let mut outcomes = Vec::new();
    for mode in [DebugMode::Disabled, DebugMode::SpillEverything, DebugMode::BypassEverything] {
        let m = mgr();
        for ws in m.workspaces() {
            ws.set_debug_mode(mode).unwrap();
        }
        let act_ws = m.workspace(ArrayType::Activations).unwrap().clone();
        let mut seen = Vec::new();
        let source = Array2::from_shape_fn((3, 4), |(r, c)| (r * 4 + c) as f32);
        // Leverage to a closed workspace: NotOpen, in every mode.
        let closed = m.leverage_to(ArrayType::Activations, &source);
        seen.push(format!("closed: {:?}", closed.as_ref().map(|_| ()).map_err(|e| e.to_string())));
        assert!(matches!(closed, Err(Error::NotOpen { .. })), "{mode:?}: {closed:?}");
        // borrow_open of a closed workspace: NotOpen too.
        assert!(matches!(act_ws.borrow_open(), Err(Error::NotOpen { .. })), "{mode:?}");
        {
            let act = m.enter(ArrayType::Activations).unwrap();
            // A handle leveraged into the open workspace is readable through its scope...
            let handle = m.leverage_to(ArrayType::Activations, &source).unwrap();
            assert_eq!(handle.view(&act).unwrap(), source, "{mode:?}");
            // ... and through a nested scope of the same workspace in the same cycle.
            let nested = act_ws.enter().unwrap();
            assert_eq!(handle.view(&nested).unwrap(), source, "{mode:?}: nested scope");
            let borrowed = act_ws.borrow_open().unwrap();
            assert_eq!(handle.detach(&borrowed).unwrap(), source, "{mode:?}: borrowed scope");
            drop((nested, borrowed));
            // Where a layer's output lives is checked as with the mode off.
            let out = act.zeros::<f32, _>((2, 2)).unwrap();
            m.validate(ArrayType::Activations, "dense", &out).unwrap();
            let work = m.enter(ArrayType::FfWorkingMem).unwrap();
            let scratch = work.zeros::<f32, _>((2, 2)).unwrap();
            let err = m.validate(ArrayType::Activations, "dense", &scratch).unwrap_err();
            seen.push(err.to_string());
            drop(work);
            drop(act);
            // The cycle ended: the handle is stale in the next one, with the same message.
            let act = m.enter(ArrayType::Activations).unwrap();
            let stale = handle.view(&act).map(|v| v.to_owned()).unwrap_err();
            assert!(matches!(stale, Error::StaleHandle { .. }), "{mode:?}: {stale:?}");
            seen.push(stale.to_string());
        }
        let stats = act_ws.stats();
        seen.push(format!("gen {} cycles {} capacity {}", stats.generation, stats.cycles, stats.capacity));
        outcomes.push((mode, seen));
        for ws in m.workspaces() {
            ws.set_debug_mode(DebugMode::Disabled).unwrap();
        }
        WorkspaceManager::current().destroy_all().unwrap();
    }
    let (_, plain) = &outcomes[0];
    for (mode, seen) in &outcomes[1..] {
        assert_eq!(seen, plain, "{mode:?} differs from Disabled");
    }
}

/// DL4J's spellings still compile, as deprecated aliases of the names every scope uses.
#[test]
#[allow(deprecated)]
fn dl4j_spellings_are_aliases_of_the_scope_names() {
    let mgr = LayerWorkspaceMgr::builder().default_workspace("ACT", WorkspaceConfig::default()).build().unwrap();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let created = act.create::<f32, _>((2, 3)).unwrap();
    assert_eq!(created, ndarray::Array2::<f32>::zeros((2, 3)));
    assert!(act.holds(&created));
    let source = ndarray::arr1(&[1.0f32, 2.0, 3.0]);
    let dup = act.dup(&source).unwrap();
    assert_eq!(dup, source);
    assert!(act.holds(&dup));
    let mut uninit = act.create_uninit::<f32, _>(3).unwrap();
    assert_eq!(uninit.len(), 3);
    assert!(act.holds(&uninit.view_mut()));
}

#[test]
fn map_of_and_rows_of_write_every_element_in_one_pass() {
    let m = mgr();
    let act = m.enter(ArrayType::Activations).unwrap();
    let source = Array2::<f32>::from_shape_fn((4, 5), |(r, c)| r as f32 - c as f32);
    // Contiguous, and a transposed (non-contiguous) source: the same values.
    let relu = act.map_of(&source, |v| v.max(0.0)).unwrap();
    assert_eq!(relu, source.mapv(|v| v.max(0.0)));
    assert!(act.holds(&relu));
    let t = act.map_of(&source.t(), |v| v * 2.0).unwrap();
    assert_eq!(t, source.t().mapv(|v| v * 2.0));
    // Another element type.
    let bits = act.map_of(&source, f32::to_bits).unwrap();
    assert_eq!(bits[[3, 1]], 2.0f32.to_bits());
    // A row broadcast over rows, also from a strided row.
    let bias = ndarray::arr1(&[1.0f32, -2.0, 3.5]);
    let rows = act.rows_of(&bias, 4).unwrap();
    assert_eq!(rows.dim(), (4, 3));
    assert!(rows.rows().into_iter().all(|r| r == bias));
    let column = source.column(2);
    let strided = act.rows_of(&column, 2).unwrap();
    assert_eq!(strided.row(1), column);
    // No rows is no memory: an error, as for every empty allocation.
    assert!(act.rows_of(&bias, 0).is_err());
}

/// A call's outcome as a word: `ok`, or the error's kind.
fn word<T>(r: Result<T, Error>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(Error::NotOpen { .. }) => "NotOpen".into(),
        Err(Error::WrongWorkspace { .. }) => "WrongWorkspace".into(),
        Err(Error::StaleHandle { .. }) => "StaleHandle".into(),
        Err(Error::WrongLocation { .. }) => "WrongLocation".into(),
        Err(Error::ConfigMismatch { .. }) => "ConfigMismatch".into(),
        Err(Error::Exhausted { .. }) => "Exhausted".into(),
        Err(Error::BudgetExceeded { .. }) => "BudgetExceeded".into(),
        Err(other) => format!("unexpected: {other}"),
    }
}

/// The outcome of every call of a layer's life, as a word per call: `ok`, or the
/// error's kind.
fn script(m: &LayerWorkspaceMgr) -> Vec<String> {
    let source = Array2::<f32>::from_elem((2, 3), 1.5);
    let mut out = vec![
        word(m.borrow_open(ArrayType::Activations)),
        word(m.leverage_to(ArrayType::Activations, &source)),
        word(m.borrow_open(ArrayType::FfCache)),
    ];
    let act = m.enter(ArrayType::Activations).unwrap();
    // A forward pass keeps a handle for the backward pass, which reads it back through
    // a scope it borrows.
    let kept = act.copy_handle(&source).unwrap();
    let leveraged = m.leverage_to(ArrayType::Activations, &source).unwrap();
    {
        let working = m.enter(ArrayType::FfWorkingMem).unwrap();
        let nested = m.enter(ArrayType::Activations).unwrap();
        let inner = nested.copy_handle(&source).unwrap();
        out.push(word(kept.view(&nested)));
        out.push(word(kept.view(&working)));
        drop(nested);
        out.push(word(inner.view(&act)));
    }
    let backward = m.borrow_open(ArrayType::Activations).unwrap();
    out.push(word(kept.view(&backward)));
    out.push(word(leveraged.view(&backward)));
    for ty in [ArrayType::Input, ArrayType::FfCache] {
        out.push(word(m.borrow_open(ty).and_then(|scope| kept.view(&scope).map(|v| v.sum()))));
    }
    let y = act.zeros::<f32, _>(4).unwrap();
    out.push(word(m.validate(ArrayType::Activations, "l", &y)));
    out.push(word(m.validate(ArrayType::FfWorkingMem, "l", &y)));
    out.push(word(m.validate(ArrayType::Activations, "l", &source)));
    let y = freeze(y);
    out.push(format!("leverage copies: {}", act.leverage(y).unwrap().as_ptr() != y.as_ptr()));
    drop(backward);
    drop(act);
    let again = m.enter(ArrayType::Activations).unwrap();
    out.push(word(kept.view(&again)));
    out
}

#[test]
fn with_workspaces_off_every_call_succeeds_or_fails_as_with_them_on() {
    let builder = || {
        LayerWorkspaceMgr::builder()
            .with(ArrayType::Activations, "PARITY_ACT", WorkspaceConfig::default())
            .with(ArrayType::Input, "PARITY_ACT", WorkspaceConfig::default())
            .with(ArrayType::FfCache, "PARITY_ACT", WorkspaceConfig::default())
            .default_workspace("PARITY_WORK", WorkspaceConfig::default())
    };
    let on = script(&builder().build().unwrap());
    let off_mgr = builder().workspaces_off().build().unwrap();
    assert!(ArrayType::ALL.iter().all(|&ty| off_mgr.is_scoped_out(ty)));
    assert_eq!(off_mgr.workspaces().count(), 0, "no workspace, only heap blocks");
    let off = script(&off_mgr);
    assert_eq!(off, on);
    // What the script pins: the closed calls fail, the kept handle reads through every
    // scope of its workspace (nested, borrowed, a type sharing it) and no other, and
    // goes stale with the cycle.
    assert_eq!(
        on,
        [
            "NotOpen",
            "NotOpen",
            "NotOpen",
            "ok",
            "WrongWorkspace",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "ok",
            "WrongLocation",
            "WrongLocation",
            "leverage copies: false",
            "StaleHandle"
        ]
    );
    // `no_workspaces` gives each type a heap of its own, as a manager with a workspace
    // per type: its outcomes are those of such a manager.
    let each = ArrayType::ALL
        .iter()
        .fold(LayerWorkspaceMgr::builder(), |b, &ty| b.with(ty, &format!("PARITY_{ty:?}"), WorkspaceConfig::default()));
    assert_eq!(script(&LayerWorkspaceMgr::no_workspaces()), script(&each.build().unwrap()));
}

/// Outcomes of calls whose answer with workspaces on comes from the registry and the
/// configuration: managers sharing a name, a budget, a second configuration.
fn shared_script(off: bool) -> Vec<String> {
    let small = WorkspaceConfig::builder().max_size(4096).spill(workspace_core::SpillPolicy::Fail).build().unwrap();
    let builder = |config: &WorkspaceConfig| {
        let b = LayerWorkspaceMgr::builder()
            .with(ArrayType::Activations, "SHARED_ACT", WorkspaceConfig::default())
            .default_workspace("SHARED_SMALL", config.clone())
            .helper("SHARED_HELPER", WorkspaceConfig::default());
        if off {
            b.workspaces_off()
        } else {
            b
        }
    };
    let (a, c) = (builder(&small).build().unwrap(), builder(&small).build().unwrap());
    let mut out = vec![word(builder(&WorkspaceConfig::default()).build())];
    let act = a.enter(ArrayType::Activations).unwrap();
    let kept = act.copy_handle(&Array2::<f32>::zeros((2, 2))).unwrap();
    out.push(word(c.borrow_open(ArrayType::Activations).and_then(|s| kept.view(&s).map(|v| v.sum()))));
    let working = c.enter(ArrayType::FfWorkingMem).unwrap();
    out.push(word(working.zeros::<u8, _>(1024)));
    out.push(word(working.zeros::<u8, _>(1 << 20)));
    out.push(word(a.helper("SHARED_HELPER").map(|h| h.name().to_string())));
    out.push(format!("workspaces listed: {}", a.workspaces().count()));
    out
}

#[test]
fn with_workspaces_off_managers_share_heaps_by_name_and_keep_their_configurations() {
    let on = shared_script(false);
    let off = shared_script(true);
    // Listed workspaces differ by design: heap workspaces hold no arena.
    assert_eq!(on[..on.len() - 1], off[..off.len() - 1]);
    assert_eq!(
        on[..on.len() - 1],
        ["ConfigMismatch", "ok", "ok", "BudgetExceeded", "ok"].map(String::from),
        "a second configuration of a name, a handle read through another manager naming the same workspace, \
         an allocation past the budget"
    );
    assert_eq!(on.last().unwrap(), "workspaces listed: 3");
    assert_eq!(off.last().unwrap(), "workspaces listed: 0");
    // A planned manager cannot have its workspaces off, and a registry of workspaces
    // is not one of heap workspaces: both refused, not ignored.
    let group = workspace_core::planned::PlanGroup::with_plans("OFF_GROUP", 1);
    let err = LayerWorkspaceMgr::builder()
        .default_workspace("OFF_PLANNED", WorkspaceConfig::default())
        .planned(&group)
        .workspaces_off()
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("cannot have them off"), "{err}");
    let err = LayerWorkspaceMgr::builder()
        .default_workspace("OFF_REGISTRY", WorkspaceConfig::default())
        .in_manager(&WorkspaceManager::current())
        .workspaces_off()
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("WorkspaceManager::heaps()"), "{err}");
    assert!(!WorkspaceManager::current().exists("SHARED_ACT (heap)"));
    assert!(WorkspaceManager::heaps().exists("SHARED_ACT (heap)"));
    // The thread's registry speaks for its heap workspaces too: a debug mode is not
    // changed while one is open, `destroy` takes a name's heap workspace, `destroy_all`
    // every one.
    let off = LayerWorkspaceMgr::builder()
        .default_workspace("SHARED_OTHER", WorkspaceConfig::default())
        .workspaces_off()
        .build()
        .unwrap();
    let open = off.enter(ArrayType::Activations).unwrap();
    let err = WorkspaceManager::current().set_debug_mode(DebugMode::SpillEverything).unwrap_err();
    assert!(matches!(err, Error::StillOpen { .. }), "{err:?}");
    assert!(matches!(WorkspaceManager::current().destroy("SHARED_OTHER"), Err(Error::StillOpen { .. })));
    drop(open);
    WorkspaceManager::current().destroy("SHARED_OTHER").unwrap();
    assert!(!WorkspaceManager::heaps().exists("SHARED_OTHER (heap)"));
    WorkspaceManager::current().destroy_all().unwrap();
    assert!(!WorkspaceManager::heaps().exists("SHARED_ACT (heap)"), "destroyed with the thread's workspaces");
    let err = LayerWorkspaceMgr::builder()
        .default_workspace("OFF_REGISTRY", WorkspaceConfig::default())
        .in_manager(&WorkspaceManager::heaps())
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("add `workspaces_off()`"), "{err}");
    let err = WorkspaceManager::heaps().set_debug_mode(DebugMode::Disabled).unwrap_err();
    assert!(err.to_string().contains("always spill everything"), "{err}");
}
