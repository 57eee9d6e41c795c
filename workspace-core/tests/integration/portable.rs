//! Planned managers that move between threads (`PortableMgr`): used from many threads
//! one at a time, replaying their plans there; a closure that keeps a reference leaves
//! the manager leaked on its thread and later calls fail; a panic leaves it usable.

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::sync::Mutex;

use workspace_core::planned::PortableMgr;
use workspace_core::{ArrayType, Error, LayerWorkspaceMgr, LearningPolicy, SpillPolicy, Workspace, WorkspaceConfig};

/// Keeps `value` alive, and reachable, for the rest of the process: what a call kept
/// leaves its manager leaked, and leak checkers (valgrind) should see it still
/// reachable rather than lost.
fn park<T>(value: T) {
    static PARKED: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    PARKED.lock().unwrap().push(Box::into_raw(Box::new(value)) as usize);
}

fn config() -> WorkspaceConfig {
    WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build().unwrap()
}

fn portable() -> PortableMgr {
    let builder = LayerWorkspaceMgr::builder()
        .with(ArrayType::Activations, "ACT", config())
        .default_workspace("WORK", config())
        .helper("CACHE", config());
    PortableMgr::build("PORTABLE", 4, builder).unwrap()
}

/// One iteration: activations and working memory, as a layer allocates them; returns
/// the sum and whether the iteration replayed its plan.
fn iteration(mgr: &LayerWorkspaceMgr, n: usize, value: f32) -> (f32, bool) {
    let group = mgr.plan_group().expect("planned");
    let (sum, on_plan) = group
        .iteration(n as u64, || {
            let act = mgr.enter(ArrayType::Activations)?;
            let x = act.filled::<f32, _>(n, value)?;
            let work = mgr.enter(ArrayType::FfWorkingMem)?;
            let mut y = work.zeros::<f32, _>(n)?;
            y.zip_mut_with(&x, |y, &x| *y = 2.0 * x);
            Ok::<_, Error>(y.sum())
        })
        .unwrap();
    (sum, on_plan)
}

#[test]
fn moves_between_threads_and_replays_its_plan_on_each() {
    let arena = Mutex::new(portable());
    std::thread::scope(|s| {
        for t in 0..4 {
            let arena = &arena;
            s.spawn(move || {
                for i in 0..25 {
                    let mut arena = arena.lock().unwrap();
                    let (sum, _) = arena.with(|mgr| iteration(mgr, 64 + (i % 2) * 32, t as f32)).unwrap();
                    assert_eq!(sum, 2.0 * t as f32 * (64 + (i % 2) * 32) as f32);
                }
            });
        }
    });
    let mut arena = arena.into_inner().unwrap();
    let stats = arena.with(|mgr| mgr.plan_group().unwrap().stats()).unwrap();
    assert_eq!(stats.recorded_iterations, 2, "one recording per shape, whichever thread ran it: {stats:?}");
    assert_eq!(stats.planned_iterations, 98, "every other iteration replayed its plan: {stats:?}");
    assert!(!arena.is_kept());
}

#[test]
fn a_call_that_keeps_a_clone_leaves_the_manager_on_its_thread() {
    thread_local! {
        static KEPT: RefCell<Option<Rc<Workspace>>> = const { RefCell::new(None) };
    }
    let mut arena = portable();
    // A clone dropped before the call returns is fine.
    arena.with(|mgr| drop(mgr.workspace(ArrayType::Activations).cloned())).unwrap();
    assert!(!arena.is_kept());
    // One kept in a thread-local is not: the value still comes back, later calls fail.
    let sum = arena
        .with(|mgr| {
            KEPT.with(|k| *k.borrow_mut() = mgr.workspace(ArrayType::Activations).cloned());
            iteration(mgr, 8, 1.0).0
        })
        .unwrap();
    assert_eq!(sum, 16.0);
    assert!(arena.is_kept());
    let err = arena.with(|_| ()).unwrap_err();
    assert!(err.to_string().contains("kept a reference"), "{err}");
    // The kept workspace still works on this thread (it was leaked, not freed).
    KEPT.with(|k| {
        let ws = k.borrow_mut().take().unwrap();
        {
            let scope = ws.enter().unwrap();
            assert_eq!(scope.filled::<f32, _>(4, 1.0).unwrap().sum(), 4.0);
        }
        park(ws);
    });
    // The poisoned value may move: it holds nothing any more.
    std::thread::spawn(move || assert!(arena.with(|_| ()).is_err())).join().unwrap();
}

#[test]
fn every_kind_of_kept_reference_is_caught() {
    type Keep = fn(&LayerWorkspaceMgr) -> Box<dyn std::any::Any>;
    let keeps: [(&str, Keep); 5] = [
        ("a clone of the manager", |mgr| Box::new(mgr.clone())),
        ("a clone of the group", |mgr| Box::new(mgr.plan_group().unwrap().clone())),
        ("a weak workspace", |mgr| Box::new(Rc::downgrade(mgr.workspace(ArrayType::Activations).unwrap()))),
        ("the helper", |mgr| Box::new(mgr.helper("CACHE").unwrap().clone())),
        ("an open shared scope", |mgr| Box::new(mgr.enter(ArrayType::Activations).unwrap())),
    ];
    for (what, keep) in keeps {
        let mut arena = portable();
        let kept = arena.with(keep).unwrap();
        assert!(arena.is_kept(), "{what} was not caught");
        park(kept);
        assert!(arena.with(|_| ()).is_err(), "{what}: the manager stays unusable once kept");
    }
    // A weak reference dropped in time is fine.
    let mut arena = portable();
    arena.with(|mgr| drop::<Weak<Workspace>>(Rc::downgrade(mgr.workspace(ArrayType::Activations).unwrap()))).unwrap();
    assert!(!arena.is_kept());
}

#[test]
fn a_panic_is_resumed_and_leaves_the_manager_usable() {
    let arena = Mutex::new(portable());
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut arena = arena.lock().unwrap();
        arena.with(|mgr| {
            let group = mgr.plan_group().unwrap();
            let _ = group.iteration(32, || -> Result<(), Error> {
                let act = mgr.enter(ArrayType::Activations)?;
                let _x = act.zeros::<f32, _>(32)?;
                panic!("a layer panicked");
            });
        })
    }));
    assert!(caught.is_err());
    let mut arena = arena.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner());
    assert!(!arena.is_kept());
    let handle = std::thread::spawn(move || {
        for _ in 0..3 {
            assert_eq!(arena.with(|mgr| iteration(mgr, 32, 1.0)).unwrap().0, 64.0);
        }
        arena.with(|mgr| mgr.plan_group().unwrap().stats()).unwrap()
    });
    let stats = handle.join().unwrap();
    assert_eq!(stats.abandoned_iterations, 1, "{stats:?}");
    assert_eq!((stats.recorded_iterations, stats.planned_iterations), (1, 2), "{stats:?}");
}
