//! 1,000 short-lived threads using the per-thread manager leave no memory behind.
//!
//! The measurement counts the live bytes of every thread but the harness's (which
//! starts, times and reports the test while it runs), so this binary holds this one
//! test only: another test finishing meanwhile would show up as bytes freed by someone
//! else.

mod common;

use common::{live_bytes, scaled};
use workspace_core::alloc_check::CountingAllocator;
use workspace_core::alloc_check::{process_counts, Threads};
use workspace_core::{WorkspaceConfig, WorkspaceManager};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator::system();

#[test]
fn short_lived_threads_leave_no_memory_behind() {
    if cfg!(target_os = "linux") {
        // The harness's thread is told apart: it allocated before the test began (its
        // arguments, the list of tests), and none of that counts here.
        let others = process_counts(Threads::ExceptMain);
        let all = process_counts(Threads::All);
        assert!(all.allocations > others.allocations, "the main thread's allocations are counted apart");
    }
    let work = || {
        let manager = WorkspaceManager::current();
        let config = WorkspaceConfig::default();
        for id in ["A", "B"] {
            manager.get_or_create(id, &config).unwrap();
            for _ in 0..3 {
                let scope = manager.enter(id).unwrap();
                scope.zeros::<f32, _>((64, 64)).unwrap();
                scope.zeros::<f32, _>(100_000).unwrap();
            }
        }
        assert_eq!(manager.ids().len(), 2);
        assert!(manager.stats().iter().all(|s| s.capacity > 0), "the workspaces were really used");
    };
    std::thread::spawn(work).join().unwrap(); // warm up lazy runtime state
    let threads = scaled(1_000);
    let before = live_bytes();
    for _ in 0..threads {
        std::thread::spawn(work).join().unwrap();
    }
    let after = live_bytes();
    assert_eq!(after - before, 0, "{threads} threads left {} bytes behind", after - before);
    // The count does see a thread's leak.
    // Kept reachable (valgrind reports an unreachable block as definitely lost).
    static KEPT: std::sync::Mutex<Option<Vec<u8>>> = std::sync::Mutex::new(None);
    std::thread::spawn(|| *KEPT.lock().unwrap() = Some(std::hint::black_box(vec![0u8; 1000]))).join().unwrap();
    assert_eq!(live_bytes() - after, 1000, "a thread's leak is counted");
}
