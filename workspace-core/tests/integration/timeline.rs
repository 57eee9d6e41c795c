//! The timeline: scripts stored once, divergences, bounded history, the Chrome trace
//! read back against the recorded events, and the reports of failures.

use std::collections::HashMap;

use serde_json::Value;
use workspace_core::timeline::{self, EventKind, Timeline};
use workspace_core::{ArrayType, Error, LayerWorkspaceMgr, LearningPolicy, SpillPolicy, Workspace, WorkspaceConfig};

fn mgr(prefix: &str) -> LayerWorkspaceMgr {
    LayerWorkspaceMgr::builder()
        .with(ArrayType::Activations, &format!("{prefix}_ACT"), WorkspaceConfig::default())
        .with(ArrayType::ActivationGrad, &format!("{prefix}_GRAD"), WorkspaceConfig::default())
        .default_workspace(&format!("{prefix}_WORKING"), WorkspaceConfig::default())
        .build()
        .unwrap()
}

/// A training-like iteration: two layers' activations, their working memory, and a
/// gradient per layer, `rows` rows.
fn iteration(mgr: &LayerWorkspaceMgr, rows: usize) -> workspace_core::Result<()> {
    let act = mgr.enter(ArrayType::Activations)?;
    for (name, width) in [("dense_0", 24), ("dense_1", 10)] {
        let _layer = timeline::layer(name);
        let working = mgr.enter(ArrayType::FfWorkingMem)?;
        let _tmp = working.zeros::<f32, _>((rows, 2 * width))?;
        let _out = act.zeros::<f32, _>((rows, width))?;
    }
    for name in ["dense_1", "dense_0"] {
        let _layer = timeline::layer(name);
        let grad = mgr.enter(ArrayType::ActivationGrad)?;
        let _g = grad.zeros::<f32, _>((rows, 7))?;
    }
    Ok(())
}

#[test]
fn a_steady_run_is_one_script_and_its_events_carry_role_and_layer() {
    let mgr = mgr("TL_STEADY");
    let timeline = Timeline::start().unwrap();
    timeline.attach_mgr(&mgr).unwrap();
    for _ in 0..50 {
        iteration(&mgr, 8).unwrap();
        timeline.end_iteration();
    }
    let snapshot = timeline.snapshot();
    assert_eq!(snapshot.iterations_recorded(), 50);
    assert_eq!(snapshot.scripts().len(), 1, "{:?}", snapshot.scripts());
    let stats = snapshot.scripts()[0];
    assert_eq!((stats.iterations, stats.first_iteration, stats.last_iteration), (50, 0, 49));
    let events = snapshot.script_events(0);
    assert_eq!(snapshot.events(), 50 * events.len() as u64);
    let allocs: Vec<_> = events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Alloc { bytes, requested } => {
                Some((e.workspace.to_string(), e.role, e.layer.as_deref().map(str::to_string), bytes, requested))
            }
            EventKind::Close => None,
        })
        .collect();
    let s = |x: &str| Some(x.to_string());
    assert_eq!(
        allocs,
        vec![
            ("TL_STEADY_WORKING".into(), Some(ArrayType::FfWorkingMem), s("dense_0"), 1536, 1536),
            ("TL_STEADY_ACT".into(), Some(ArrayType::Activations), s("dense_0"), 768, 768),
            ("TL_STEADY_WORKING".into(), Some(ArrayType::FfWorkingMem), s("dense_1"), 640, 640),
            ("TL_STEADY_ACT".into(), Some(ArrayType::Activations), s("dense_1"), 320, 320),
            ("TL_STEADY_GRAD".into(), Some(ArrayType::ActivationGrad), s("dense_1"), 256, 224),
            ("TL_STEADY_GRAD".into(), Some(ArrayType::ActivationGrad), s("dense_0"), 256, 224),
        ]
    );
    // Two working-memory cycles, the activations' and two gradients' closed.
    assert_eq!(events.iter().filter(|e| e.kind == EventKind::Close).count(), 5);
    // The lower bound: the first layer's working memory and output.
    assert_eq!(stats.lower_bound, 1536 + 768);
    // Every record refers to the one script.
    assert!(snapshot.records().iter().all(|r| r.script == Some(0)));
}

#[test]
fn iterations_that_differ_are_stored_once_each_and_referenced_after() {
    let mgr = mgr("TL_SHAPES");
    let timeline = Timeline::start().unwrap();
    timeline.attach_mgr(&mgr).unwrap();
    let rows = [8, 16, 8, 16, 8, 4, 16, 4];
    for &r in &rows {
        iteration(&mgr, r).unwrap();
        timeline.end_iteration();
    }
    let snapshot = timeline.snapshot();
    assert_eq!(snapshot.scripts().len(), 3);
    let scripts: Vec<_> = snapshot.records().iter().map(|r| r.script.unwrap()).collect();
    assert_eq!(scripts, vec![0, 1, 0, 1, 0, 2, 1, 2]);
    // Each script is its shape's: the first allocation is 2 * 24 floats a row.
    for (script, r) in [(0, 8u64), (1, 16), (2, 4)] {
        let first = snapshot.script_events(script)[0].kind;
        assert_eq!(first, EventKind::Alloc { bytes: r * 48 * 4, requested: r * 48 * 4 });
    }
    assert_eq!(snapshot.scripts()[1].iterations, 3);
}

#[test]
fn the_history_does_not_grow_with_the_run() {
    let mgr = mgr("TL_FLAT");
    let timeline = Timeline::start().unwrap();
    timeline.attach_mgr(&mgr).unwrap();
    let mut at = Vec::new();
    for i in 0..20_000u32 {
        iteration(&mgr, [8, 16, 4][(i % 3) as usize]).unwrap();
        timeline.end_iteration();
        if i == 4_999 || i == 19_999 {
            at.push(timeline.history_bytes());
        }
    }
    assert_eq!(at[0], at[1], "history bytes at 5,000 and 20,000 iterations");
    let snapshot = timeline.snapshot();
    assert_eq!(snapshot.iterations_recorded(), 20_000);
    // The most recent 4,096 with their times, and a sample of the earlier ones.
    let records = snapshot.records();
    assert!(records.len() > 4096 && records.len() <= 4096 + 1024, "{}", records.len());
    assert!(records.windows(2).all(|w| w[0].index < w[1].index));
    assert_eq!(records[0].index, 0);
    assert_eq!(records.last().unwrap().index, 19_999);
}

#[test]
fn an_exported_trace_reads_back_as_the_recorded_events() {
    let mgr = mgr("TL_EXPORT");
    let timeline = Timeline::start().unwrap();
    timeline.attach_mgr(&mgr).unwrap();
    for r in [8, 16, 8, 8] {
        iteration(&mgr, r).unwrap();
        timeline.end_iteration();
    }
    let snapshot = timeline.snapshot();
    let mut bytes = Vec::new();
    let summary = snapshot.write_chrome_trace(&mut bytes).unwrap();
    let trace: Value = serde_json::from_slice(&bytes).expect("valid JSON");
    let events = trace["traceEvents"].as_array().unwrap();
    assert_eq!(trace["otherData"]["iterations"], 4);
    // Thread names: the iterations' track and one per workspace.
    let threads: HashMap<u64, String> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| (e["tid"].as_u64().unwrap(), e["args"]["name"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(threads.len(), 1 + snapshot.workspaces().len());
    let iterations: Vec<&Value> = events.iter().filter(|e| e["cat"] == "iteration").collect();
    assert_eq!(iterations.len(), 4);
    assert_eq!(summary.iterations, 4);
    for record in snapshot.records() {
        let script = record.script.unwrap();
        let recorded: Vec<(String, String, String, u64)> = snapshot
            .script_events(script)
            .into_iter()
            .filter_map(|e| match e.kind {
                EventKind::Alloc { bytes, .. } => Some((
                    e.workspace.to_string(),
                    format!("{:?}", e.role.unwrap()),
                    e.layer.unwrap().to_string(),
                    bytes,
                )),
                EventKind::Close => None,
            })
            .collect();
        let mut slices: Vec<&Value> =
            events.iter().filter(|e| e["cat"] == "alloc" && e["args"]["iteration"] == record.index).collect();
        slices.sort_by_key(|e| e["args"]["event"].as_u64().unwrap());
        let exported: Vec<(String, String, String, u64)> = slices
            .iter()
            .map(|e| {
                let args = &e["args"];
                // Each slice is on its workspace's track, inside its iteration.
                assert_eq!(threads[&e["tid"].as_u64().unwrap()], args["workspace"].as_str().unwrap());
                assert_eq!(e["ph"], "X");
                assert!(e["dur"].as_f64().unwrap() >= 0.0);
                (
                    args["workspace"].as_str().unwrap().to_string(),
                    args["role"].as_str().unwrap().to_string(),
                    args["layer"].as_str().unwrap().to_string(),
                    args["bytes"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(exported, recorded, "iteration {}", record.index);
    }
    // A counter track per workspace, back to 0 live bytes at each iteration's end.
    let mut last: HashMap<String, u64> = HashMap::new();
    for e in events.iter().filter(|e| e["ph"] == "C") {
        last.insert(e["name"].as_str().unwrap().to_string(), e["args"]["bytes"].as_u64().unwrap());
    }
    assert_eq!(last.len(), snapshot.workspaces().len(), "{last:?}");
    assert!(last.values().all(|&b| b == 0), "{last:?}");
    assert_eq!(summary.slices, events.iter().filter(|e| e["cat"] == "alloc").count());
    assert_slices_nest(events);
}

/// Slices on one track nest (Perfetto's rule for complete events): whole nanoseconds.
fn assert_slices_nest(events: &[Value]) {
    let ns = |v: &Value| (v.as_f64().unwrap() * 1000.0).round() as i64;
    let mut tracks: HashMap<u64, Vec<(i64, i64)>> = HashMap::new();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        let (ts, dur) = (ns(&e["ts"]), ns(&e["dur"]));
        tracks.entry(e["tid"].as_u64().unwrap()).or_default().push((ts, ts + dur));
    }
    for (tid, mut slices) in tracks {
        slices.sort_by_key(|&(start, end)| (start, std::cmp::Reverse(end)));
        let mut open: Vec<i64> = Vec::new();
        for (start, end) in slices {
            while open.last().is_some_and(|&e| e <= start) {
                open.pop();
            }
            if let Some(&outer) = open.last() {
                assert!(end <= outer, "track {tid}: [{start}, {end}) overlaps a slice ending at {outer}");
            }
            open.push(end);
        }
    }
}

#[test]
fn one_timeline_records_on_a_thread_and_a_dropped_one_lets_go() {
    let mgr = mgr("TL_DROP");
    let timeline = Timeline::start().unwrap();
    let err = Timeline::start().unwrap_err();
    assert!(err.to_string().contains("already records"), "{err}");
    timeline.attach_mgr(&mgr).unwrap();
    iteration(&mgr, 8).unwrap();
    timeline.end_iteration();
    // Attaching an open workspace is refused.
    let act = mgr.enter(ArrayType::Activations).unwrap();
    assert!(matches!(timeline.attach(mgr.workspace(ArrayType::Activations).unwrap()), Err(Error::StillOpen { .. })));
    drop(act);
    drop(timeline);
    assert!(!timeline::is_active());
    // The workspaces go on, unrecorded; a new timeline starts afresh.
    iteration(&mgr, 8).unwrap();
    let again = Timeline::start().unwrap();
    iteration(&mgr, 8).unwrap();
    again.end_iteration();
    assert_eq!(again.snapshot().events(), 0, "not attached to the new one");
}

#[test]
fn a_budget_failure_names_the_lower_bound_padding_and_the_largest_holders() {
    let budget = WorkspaceConfig::builder().initial_size(4096).max_size(4096).build().unwrap();
    let mgr = LayerWorkspaceMgr::builder()
        .with(ArrayType::Activations, "TL_FAIL_ACT", budget)
        .default_workspace("TL_FAIL_WORKING", WorkspaceConfig::default())
        .build()
        .unwrap();
    let timeline = Timeline::start().unwrap();
    timeline.attach_mgr(&mgr).unwrap();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let err = {
        let _l = timeline::layer("embed");
        let _a = act.zeros::<u8, _>(1000).unwrap(); // 1024 bytes padded to 64
        let _b = act.zeros::<u8, _>(1000).unwrap();
        let _l = timeline::layer("dense");
        let _c = act.zeros::<u8, _>(1500).unwrap();
        let working = mgr.enter(ArrayType::FfWorkingMem).unwrap();
        let _w = working.zeros::<u8, _>(300).unwrap();
        act.zeros::<u8, _>(4000).unwrap_err()
    };
    let Error::BudgetExceeded { report, requested, .. } = &err else { panic!("{err:?}") };
    assert_eq!((*requested, report.requested, report.capacity), (4000, 4000, 4096));
    assert_eq!(report.in_use, 1024 + 1024 + 1536);
    assert_eq!(report.lower_bound, Some(1000 + 1000 + 1500 + 300));
    assert_eq!(report.padding_bytes, Some(24 + 24 + 36 + 20));
    assert_eq!(report.fragmentation_bytes, Some(0));
    let holders: Vec<_> = report
        .holders
        .iter()
        .map(|h| (h.workspace.to_string(), h.role, h.layer.as_deref().map(str::to_string), h.bytes, h.allocations))
        .collect();
    assert_eq!(
        holders,
        vec![
            ("TL_FAIL_ACT".into(), Some(ArrayType::Activations), Some("embed".into()), 2048, 2),
            ("TL_FAIL_ACT".into(), Some(ArrayType::Activations), Some("dense".into()), 1536, 1),
            ("TL_FAIL_WORKING".into(), Some(ArrayType::FfWorkingMem), Some("dense".into()), 320, 1),
        ]
    );
    let message = err.to_string();
    for part in [
        "request 4000 bytes",
        "capacity 4096 bytes",
        "lower bound of the iteration so far 3800 bytes",
        "104 bytes lost to padding and 0 to fragmentation",
        "Activations of layer 'embed' in 'TL_FAIL_ACT': 2048 bytes in 2 allocations",
        "FfWorkingMem of layer 'dense' in 'TL_FAIL_WORKING': 320 bytes",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
}

#[test]
fn an_exhausted_arena_and_a_backend_refusal_carry_reports() {
    let fail = WorkspaceConfig::builder()
        .initial_size(1024)
        .learning(LearningPolicy::None)
        .spill(SpillPolicy::Fail)
        .build()
        .unwrap();
    let ws = Workspace::new("TL_EXHAUSTED", fail).unwrap();
    let timeline = Timeline::start().unwrap();
    timeline.attach(&ws).unwrap();
    let scope = ws.enter().unwrap();
    let _l = timeline::layer("conv");
    let _a = scope.zeros::<u8, _>(600).unwrap();
    let err = scope.zeros::<u8, _>(600).unwrap_err();
    let Error::Exhausted { report, .. } = &err else { panic!("{err:?}") };
    assert_eq!((report.requested, report.capacity, report.in_use), (600, 1024, 640));
    assert_eq!(report.holders[0].layer.as_deref(), Some("conv"));
    assert!(err.to_string().contains("unlabelled of layer 'conv' in 'TL_EXHAUSTED': 640 bytes"), "{err}");
    drop(scope);
    timeline.end_iteration(); // and the label with it

    // A spill the system allocator cannot give.
    let external = WorkspaceConfig::builder()
        .initial_size(1024)
        .learning(LearningPolicy::None)
        .spill(SpillPolicy::External)
        .build()
        .unwrap();
    let ws = Workspace::new("TL_OOM", external).unwrap();
    timeline.attach(&ws).unwrap();
    let scope = ws.enter().unwrap();
    let _l = timeline::layer("conv");
    let _a = scope.zeros::<u8, _>(512).unwrap();
    let err = scope.zeros::<u8, _>(usize::MAX / 4).unwrap_err();
    let Error::Backend { report, .. } = &err else { panic!("{err:?}") };
    assert_eq!((report.requested, report.capacity), (usize::MAX / 4, 1024));
    assert_eq!(report.lower_bound, Some(512));
    assert!(
        err.to_string().contains("largest live holders: unlabelled of layer 'conv' in 'TL_OOM': 512 bytes"),
        "{err}"
    );
}

#[test]
fn a_frame_closed_below_the_top_ends_only_its_own_allocations() {
    let ws = Workspace::new("TL_FRAMES", WorkspaceConfig::default()).unwrap();
    let timeline = Timeline::start().unwrap();
    timeline.attach(&ws).unwrap();
    {
        let scope = ws.enter().unwrap();
        let f1 = scope.frame().unwrap();
        let _a = f1.zeros::<u8, _>(64).unwrap();
        let f2 = scope.frame().unwrap();
        let _b = f2.zeros::<u8, _>(4096).unwrap();
        drop(f1); // below the top: frame 2's allocation lives on
        let _c = scope.zeros::<u8, _>(4096).unwrap();
    }
    timeline.end_iteration();
    let snapshot = timeline.snapshot();
    assert_eq!(snapshot.scripts()[0].lower_bound, 4096 + 4096);
    // Exported, the frames' allocations are on tracks of their own, and nest.
    let mut bytes = Vec::new();
    snapshot.write_chrome_trace(&mut bytes).unwrap();
    let trace: Value = serde_json::from_slice(&bytes).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let names: Vec<&str> =
        events.iter().filter(|e| e["name"] == "thread_name").filter_map(|e| e["args"]["name"].as_str()).collect();
    assert!(names.contains(&"TL_FRAMES frame 1") && names.contains(&"TL_FRAMES frame 2"), "{names:?}");
    assert_slices_nest(events);
}

#[test]
fn workspaces_of_one_name_stay_apart() {
    let a = Workspace::new("TL_SAME", WorkspaceConfig::default()).unwrap();
    let other = workspace_core::WorkspaceManager::shape_only();
    let b = other.get_or_create("TL_SAME", &WorkspaceConfig::default()).unwrap();
    let timeline = Timeline::start().unwrap();
    timeline.attach(&a).unwrap();
    timeline.attach(&b).unwrap();
    let sa = a.enter().unwrap();
    let _x = sa.zeros::<u8, _>(1000).unwrap();
    {
        let sb = b.enter().unwrap();
        let _y = sb.zeros::<u8, _>(10).unwrap();
    } // b's close ends nothing of a's
    let _z = sa.zeros::<u8, _>(1000).unwrap();
    drop(sa);
    timeline.end_iteration();
    let snapshot = timeline.snapshot();
    assert_eq!(snapshot.workspaces().iter().map(|w| w.to_string()).collect::<Vec<_>>(), ["TL_SAME", "TL_SAME#2"]);
    assert_eq!(snapshot.scripts()[0].lower_bound, 2000);
}

#[test]
fn a_nested_enter_keeps_the_cycle_role_and_a_report_sees_what_an_earlier_iteration_left_live() {
    let budget = WorkspaceConfig::builder().initial_size(8192).max_size(8192).build().unwrap();
    let mgr = LayerWorkspaceMgr::builder()
        .with(ArrayType::Activations, "TL_NESTED", budget.clone())
        .default_workspace("TL_NESTED", budget)
        .build()
        .unwrap();
    let timeline = Timeline::start().unwrap();
    timeline.attach_mgr(&mgr).unwrap();
    let act = mgr.enter(ArrayType::Activations).unwrap();
    let _a = act.zeros::<u8, _>(64).unwrap();
    {
        let cache = mgr.enter(ArrayType::FfCache).unwrap();
        let _c = cache.zeros::<u8, _>(128).unwrap();
    }
    let _b = act.zeros::<u8, _>(3000).unwrap();
    // The cycle stays open across the end of the iteration.
    timeline.end_iteration();
    let err = act.zeros::<u8, _>(8000).unwrap_err();
    let Error::BudgetExceeded { report, .. } = &err else { panic!("{err:?}") };
    // What the iteration before left live is live now: 64 + 128 + 3000 bytes.
    assert_eq!(report.lower_bound, Some(64 + 128 + 3000), "{report:?}");
    assert_eq!(report.holders.len(), 1, "{report:?}");
    assert_eq!(report.holders[0].role, Some(ArrayType::Activations), "{report:?}");
    assert_eq!((report.holders[0].bytes, report.holders[0].allocations), (64 + 128 + 3008, 3), "{report:?}");
    assert_eq!(report.fragmentation_bytes, Some(0), "{report:?}");
}

#[test]
fn a_new_iteration_scales_the_times_it_shares_with_a_slower_one_and_labels_end_with_it() {
    let ws = Workspace::new("TL_TIMES", WorkspaceConfig::default()).unwrap();
    let timeline = Timeline::start().unwrap();
    timeline.attach(&ws).unwrap();
    // The slow iteration sleeps far longer than the fast one takes, even under valgrind.
    const SLOW: std::time::Duration = std::time::Duration::from_millis(300);
    let step = |extra: bool, sleep: bool| {
        let scope = ws.enter().unwrap();
        let _a = scope.zeros::<u8, _>(64).unwrap();
        if sleep {
            std::thread::sleep(SLOW);
        }
        let _b = scope.zeros::<u8, _>(64).unwrap();
        if extra {
            let _c = scope.zeros::<u8, _>(64).unwrap();
        }
    };
    step(false, true);
    // The fast iteration begins inside this call: its times are at most `began.elapsed()`.
    let began = std::time::Instant::now();
    timeline.end_iteration();
    {
        let _forgotten = timeline::layer("left set");
        std::mem::forget(_forgotten);
    }
    step(true, false); // diverges after two events of the slow script
    let took = u64::try_from(began.elapsed().as_nanos()).unwrap();
    timeline.end_iteration();
    let snapshot = timeline.snapshot();
    let fast = snapshot.scripts().iter().find(|s| s.events == 4).expect("the second script");
    let events = snapshot.script_events(fast.script);
    let times: Vec<u64> = events.iter().map(|e| e.time_ns).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(took < SLOW.as_nanos() as u64, "the fast iteration took {took} ns: the test cannot tell the two apart");
    assert!(times.iter().all(|&t| t <= took), "the slow iteration's times, unscaled: {times:?} (fast took {took} ns)");
    // A label left set is cleared by the end of the iteration.
    step(false, false);
    timeline.end_iteration();
    let last = snapshot.records().len();
    let now = timeline.snapshot();
    let script = now.records()[last].script.unwrap();
    assert!(now.script_events(script).iter().all(|e| e.layer.is_none()), "{:?}", now.script_events(script));
}

#[test]
fn a_backend_error_that_refuses_no_memory_prints_no_memory_report() {
    // SAFETY: nothing else maps the file: its directory does not exist.
    let location = unsafe { workspace_core::Location::mmap("/nonexistent-carve-timeline-dir/x.ws") };
    let config = WorkspaceConfig::builder()
        .location(location)
        .learning(LearningPolicy::None)
        .initial_size(4096)
        .build()
        .unwrap();
    let err = Workspace::new("TL_MMAP", config).unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    assert!(!err.to_string().contains("Memory:"), "{err}");
}
