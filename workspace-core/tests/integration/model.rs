//! Property tests: random programs of enter/exit/alloc/write/read/detach/leverage/
//! trim/reset run against a simple model of what every array must contain, under
//! every debug mode: each program gives the same outcome at every step (which calls
//! succeed, with which error, and the workspace's accounting) whatever the mode.
//!
//! `PROPTEST_CASES` scales the number of programs (10,000 by default; `.ci/run` lowers
//! it under valgrind, where everything runs 20–50× slower).

use ndarray::Array1;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use workspace_core::{
    AllocationPolicy, DebugMode, Error, Handle, LearningPolicy, ResetPolicy, Scope, SpillPolicy, Workspace,
    WorkspaceConfig,
};

#[derive(Clone, Debug)]
enum Op {
    Enter,
    Exit,
    /// Close the bottom scope first (out of order); the reset must wait for the last.
    ExitOldest,
    Alloc {
        len: usize,
        seed: u32,
    },
    /// Several views at once inside one step: none may overlap another.
    Views {
        lens: Vec<usize>,
    },
    Write {
        pick: usize,
        index: usize,
        value: u32,
    },
    Detach {
        pick: usize,
    },
    Leverage {
        pick: usize,
    },
    Trim,
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Enter),
        2 => Just(Op::Exit),
        1 => Just(Op::ExitOldest),
        6 => (1usize..600, any::<u32>()).prop_map(|(len, seed)| Op::Alloc { len, seed }),
        2 => prop::collection::vec(1usize..300, 1..5).prop_map(|lens| Op::Views { lens }),
        3 => (any::<usize>(), any::<usize>(), any::<u32>()).prop_map(|(pick, index, value)| Op::Write { pick, index, value }),
        2 => any::<usize>().prop_map(|pick| Op::Detach { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Leverage { pick }),
        1 => Just(Op::Trim),
        1 => Just(Op::Reset),
    ]
}

fn config() -> impl Strategy<Value = WorkspaceConfig> {
    (
        prop_oneof![
            Just(LearningPolicy::None),
            Just(LearningPolicy::FirstLoop),
            Just(LearningPolicy::OverTime { cycles: 3 })
        ],
        prop_oneof![Just(SpillPolicy::External), Just(SpillPolicy::Reallocate), Just(SpillPolicy::Fail)],
        prop_oneof![Just(ResetPolicy::BlockLeft), Just(ResetPolicy::EndOfBuffer)],
        prop_oneof![Just(0usize), Just(1024), Just(8192)],
        prop_oneof![Just(None), Just(Some(16_384usize)), Just(Some(1000usize))],
        prop_oneof![Just(AllocationPolicy::Strict), Just(AllocationPolicy::Overallocate(0.25))],
    )
        .prop_filter_map("contradictory", |(learning, spill, reset, initial, max, allocation)| {
            let mut b = WorkspaceConfig::builder()
                .learning(learning)
                .spill(spill)
                .reset(reset)
                .initial_size(initial)
                .allocation(allocation)
                .alignment(if initial == 1024 { 16 } else { 64 });
            if let Some(max) = max {
                b = b.max_size(max);
            }
            b.build().ok()
        })
}

/// What a live array must contain.
struct Tracked {
    handle: Handle<u32, ndarray::Ix1>,
    expected: Vec<u32>,
    /// Whether it lives in the outer workspace (which stays open all program long).
    outer: bool,
}

/// Runs `ops` and returns what every step observed: the outcome of each allocation
/// and the workspace's accounting after each step.
fn run(config: WorkspaceConfig, mode: DebugMode, ops: Vec<Op>) -> Result<Vec<String>, TestCaseError> {
    let mut trace = Vec::new();
    let ws = Workspace::with_debug_mode("MODEL", config, mode).unwrap();
    let outer_ws = Workspace::with_debug_mode("OUTER", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    let outer = outer_ws.enter().unwrap();
    let mut scopes: Vec<Scope<'_>> = Vec::new();
    let mut tracked: Vec<Tracked> = Vec::new();
    let mut stale: Vec<(Handle<u32, ndarray::Ix1>, u64)> = Vec::new();
    let mut detached: Vec<(Array1<u32>, Vec<u32>)> = Vec::new();
    let mut generation = 0u64;
    let mut cycles = 0u64;
    let mut capacity = ws.capacity();
    // The only allocation errors a program may meet: a full arena under SpillPolicy::Fail
    // (in every debug mode alike), and a budget only where one is set.
    let may_fail = |err: &Error| match err {
        Error::Exhausted { .. } => ws.config().spill() == SpillPolicy::Fail,
        Error::BudgetExceeded { .. } => ws.config().max_size() != usize::MAX,
        _ => false,
    };

    let close_all = |scopes: &mut Vec<Scope<'_>>, tracked: &mut Vec<Tracked>, stale: &mut Vec<_>, cycles: &mut u64| {
        if !scopes.is_empty() {
            scopes.clear();
            *cycles += 1;
            for t in std::mem::take(tracked) {
                if t.outer {
                    tracked.push(t);
                } else {
                    let g = t.handle.generation();
                    stale.push((t.handle, g));
                }
            }
        }
    };

    for op in ops {
        match op {
            Op::Enter => {
                if scopes.len() < 4 {
                    scopes.push(ws.enter().unwrap());
                    if scopes.len() == 1 {
                        generation += 1;
                    }
                }
            }
            Op::Exit => {
                if scopes.len() == 1 {
                    close_all(&mut scopes, &mut tracked, &mut stale, &mut cycles);
                } else {
                    scopes.pop();
                }
            }
            Op::ExitOldest => {
                if scopes.len() == 1 {
                    close_all(&mut scopes, &mut tracked, &mut stale, &mut cycles);
                } else if !scopes.is_empty() {
                    scopes.remove(0);
                }
            }
            Op::Reset => close_all(&mut scopes, &mut tracked, &mut stale, &mut cycles),
            Op::Trim => {
                let result = ws.trim();
                prop_assert_eq!(result.is_ok(), scopes.is_empty(), "trim only when closed");
                if result.is_ok() {
                    capacity = ws.capacity();
                }
            }
            Op::Alloc { len, seed } => {
                let Some(scope) = scopes.last() else { continue };
                let result = scope.zeros_handle::<u32, _>(len);
                trace.push(outcome(&result));
                match result {
                    Ok(mut handle) => {
                        let expected: Vec<u32> =
                            (0..len as u32).map(|i| seed.wrapping_mul(31).wrapping_add(i)).collect();
                        prop_assert!(handle.view(scope).unwrap().iter().all(|&x| x == 0), "zeros are zero");
                        handle.view_mut(scope).unwrap().iter_mut().zip(&expected).for_each(|(x, e)| *x = *e);
                        tracked.push(Tracked { handle, expected, outer: false });
                    }
                    Err(err) if may_fail(&err) => {}
                    Err(other) => prop_assert!(false, "unexpected error {other}"),
                }
            }
            Op::Views { lens } => {
                let Some(scope) = scopes.last() else { continue };
                let mut views = Vec::new();
                for (k, len) in lens.iter().enumerate() {
                    let result = scope.filled::<u32, _>(*len, k as u32 + 1);
                    trace.push(outcome(&result));
                    match result {
                        Ok(v) => views.push((v, k as u32 + 1)),
                        Err(err) if may_fail(&err) => {}
                        Err(other) => prop_assert!(false, "unexpected error {other}"),
                    }
                }
                for (v, k) in &views {
                    prop_assert!(v.iter().all(|x| x == k), "views overlap");
                }
            }
            Op::Write { pick, index, value } => {
                if tracked.is_empty() {
                    continue;
                }
                let n = tracked.len();
                let t = &mut tracked[pick % n];
                let scope = if t.outer { &outer } else { scopes.last().expect("tracked arrays imply an open scope") };
                let i = index % t.expected.len();
                t.handle.view_mut(scope).unwrap()[i] = value;
                t.expected[i] = value;
            }
            Op::Detach { pick } => {
                if tracked.is_empty() {
                    continue;
                }
                let t = &tracked[pick % tracked.len()];
                let scope = if t.outer { &outer } else { scopes.last().unwrap() };
                detached.push((t.handle.detach(scope).unwrap(), t.expected.clone()));
            }
            Op::Leverage { pick } => {
                if tracked.is_empty() {
                    continue;
                }
                let t = &tracked[pick % tracked.len()];
                let scope = if t.outer { &outer } else { scopes.last().unwrap() };
                let handle = t.handle.leverage_to(scope, &outer).unwrap();
                let expected = t.expected.clone();
                tracked.push(Tracked { handle, expected, outer: true });
            }
        }
        // Invariants after every step.
        let stats = ws.stats();
        trace.push(format!(
            "gen {} open {} capacity {} in use {} spilled {} learned {:?} growths {} cycle {}",
            stats.generation,
            stats.open_scopes,
            stats.capacity,
            stats.bytes_in_use,
            stats.spilled_in_use,
            stats.learned_size,
            stats.growth_events,
            stats.last_cycle_bytes
        ));
        prop_assert_eq!(ws.generation(), generation);
        prop_assert_eq!(ws.is_open(), !scopes.is_empty());
        prop_assert_eq!(ws.stats().cycles, cycles);
        prop_assert!(ws.capacity() >= capacity, "a workspace never shrinks by itself");
        capacity = ws.capacity();
        for t in &tracked {
            let scope = if t.outer { &outer } else { scopes.last().unwrap() };
            let view = t.handle.view(scope).unwrap();
            prop_assert_eq!(view.as_slice().unwrap(), &t.expected[..], "live array overwritten");
        }
        if let Some(scope) = scopes.last() {
            for (h, g) in &stale {
                match h.view(scope) {
                    Err(Error::StaleHandle { array_generation, workspace_generation, .. }) => {
                        prop_assert_eq!(array_generation, *g);
                        prop_assert_eq!(workspace_generation, generation);
                    }
                    other => prop_assert!(false, "stale handle was readable: {:?}", other.map(|v| v.to_owned())),
                }
            }
        }
    }
    drop(scopes);
    for (owned, expected) in &detached {
        prop_assert_eq!(owned.as_slice().unwrap(), &expected[..], "detached array changed");
    }
    Ok(trace)
}

fn outcome<T>(result: &Result<T, Error>) -> String {
    match result {
        Ok(_) => "ok".into(),
        Err(err) => format!("{err}"),
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

#[test]
fn random_programs_match_the_model() {
    let mut runner = TestRunner::new(Config { cases: cases(), failure_persistence: None, ..Config::default() });
    let strategy = (config(), prop::collection::vec(op(), 1..60));
    runner
        .run(&strategy, |(config, ops)| {
            let plain = run(config.clone(), DebugMode::Disabled, ops.clone())?;
            for mode in [DebugMode::SpillEverything, DebugMode::BypassEverything] {
                let debug = run(config.clone(), mode, ops.clone())?;
                for (step, (a, b)) in plain.iter().zip(&debug).enumerate() {
                    prop_assert_eq!(a, b, "{:?} differs from Disabled at step {}", mode, step);
                }
                prop_assert_eq!(plain.len(), debug.len());
            }
            Ok(())
        })
        .unwrap();
}
