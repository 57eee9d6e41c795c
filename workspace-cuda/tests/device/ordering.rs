//! Stream ordering on the simulated device: memory is never handed out again while work
//! on another stream may still read it, and the simulator shows the hazard when the
//! ordering is bypassed. No test here depends on timing: a stream is *held* (an unbounded
//! delay) and `quiesce` waits until everything that can run has run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use ndarray::Array1;
use workspace_core::backend::Placement;
use workspace_core::WorkspaceConfig;
use workspace_cuda::device::sim::{SimDevice, SimHold};
use workspace_cuda::{Device, DeviceArray, DeviceWorkspace, Error, PinnedWorkspace};

use crate::policies::fixed;

/// `mem::forget`, except that what is forgotten stays reachable from a static, so
/// valgrind's leak check (which CI runs over this binary) does not report the
/// deliberate leak as memory definitely lost. Its destructor never runs, as with
/// `mem::forget`.
pub(crate) fn forget<T>(value: T) {
    static KEPT: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());
    let leaked = Box::into_raw(Box::new(value));
    KEPT.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(leaked as usize);
}

/// A device, its default (home) stream and a copy stream.
fn setup() -> (SimDevice, DeviceWorkspace<SimDevice>, workspace_cuda::device::sim::SimStream) {
    let sim = SimDevice::new().unwrap();
    let copy = sim.new_stream().unwrap();
    let ws = DeviceWorkspace::new("W", fixed(4096), &sim, &sim.default_stream()).unwrap();
    (sim, ws, copy)
}

/// How the read on the copy stream is delayed.
#[derive(Clone, Copy)]
enum Delay {
    /// Held until the home stream has run all it can.
    Hold,
    /// Slowed by a sleep before each copy.
    Sleep,
}

/// Cycle 1 writes 1s and a delayed read on the copy stream copies them out; cycle 2 writes
/// 2s into the same memory. Returns what the delayed read saw.
fn delayed_read_sees(delay: Delay, ignore_waits: bool) -> f32 {
    let (sim, ws, copy) = setup();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &copy, 64).unwrap();
    sim.synchronize(&copy).unwrap();
    sim.ignore_stream_waits(ignore_waits);
    let scope = ws.enter().unwrap();
    let x = scope.htod(&Array1::from_elem(64, 1.0f32)).unwrap();
    let first = scope.placement(&x);
    sim.synchronize(ws.stream()).unwrap(); // the write is done: only the read is delayed
    let hold = match delay {
        Delay::Hold => Some(sim.hold(&copy)),
        Delay::Sleep => {
            sim.set_delay(&copy, Duration::from_millis(30));
            None
        }
    };
    let mut out_view = out.view_mut();
    let on = scope.on_stream(&copy).unwrap();
    on.dtod(&x, &mut out_view).unwrap();
    drop(on);
    drop(scope); // the reset
    let scope = ws.enter().unwrap();
    let y = scope.htod(&Array1::from_elem(64, 2.0f32)).unwrap();
    assert_eq!(scope.placement(&y), first, "the new data goes where the old was");
    sim.quiesce(); // with the wait, the write of 2s is blocked behind the delayed read
    drop(hold);
    drop(scope);
    ws.synchronize().unwrap();
    sim.synchronize(&copy).unwrap();
    out.to_host().unwrap()[0]
}

#[test]
fn a_reset_waits_for_a_delayed_read_on_another_stream() {
    assert_eq!(delayed_read_sees(Delay::Hold, false), 1.0, "the delayed read saw the next cycle's data");
}

#[test]
fn a_reset_waits_for_a_slow_stream() {
    assert_eq!(delayed_read_sees(Delay::Sleep, false), 1.0, "the delayed read saw the next cycle's data");
}

#[test]
fn without_the_wait_the_delayed_read_sees_the_next_cycles_data() {
    // The simulator exposes the race that the wait prevents.
    assert_eq!(delayed_read_sees(Delay::Hold, true), 2.0);
}

/// A spill block is read on the copy stream (held) and freed at the reset. Returns the sum
/// the read copied out and the simulator's faults.
fn spill_read_after_reset(ignore_waits: bool) -> (u32, Vec<String>) {
    let sim = SimDevice::new().unwrap();
    let copy = sim.new_stream().unwrap();
    let ws = DeviceWorkspace::new("LEARNING", WorkspaceConfig::default(), &sim, &sim.default_stream()).unwrap();
    let mut out = DeviceArray::<_, u32>::zeros(&sim, &copy, 256).unwrap();
    sim.synchronize(&copy).unwrap();
    sim.ignore_stream_waits(ignore_waits);
    let scope = ws.enter().unwrap();
    let x = scope.htod(&Array1::from_elem(256, 4u32)).unwrap();
    assert_eq!(scope.placement(&x), Placement::Elsewhere, "spilled while learning");
    sim.synchronize(ws.stream()).unwrap();
    let hold = sim.hold(&copy);
    let mut out_view = out.view_mut();
    let on = scope.on_stream(&copy).unwrap();
    on.dtod(&x, &mut out_view).unwrap();
    drop(on);
    drop(scope); // frees the spill block, in the home stream's order
    assert!(ws.capacity() > 0, "learned: a new arena");
    sim.quiesce();
    drop(hold);
    sim.synchronize(&copy).unwrap();
    ws.synchronize().unwrap();
    (out.to_host().unwrap().sum(), sim.faults())
}

#[test]
fn a_spill_block_is_freed_only_after_a_delayed_read() {
    let (sum, faults) = spill_read_after_reset(false);
    assert!(faults.is_empty(), "{faults:?}");
    assert_eq!(sum, 1024);
}

#[test]
fn without_the_wait_the_spill_block_is_freed_under_the_read() {
    let (sum, faults) = spill_read_after_reset(true);
    assert_eq!(sum, 0, "the read found nothing to copy");
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert!(faults[0].starts_with("dtod") && faults[0].contains("use after free"), "{faults:?}");
}

/// Runs a cross-stream read with `failing` record calls injected when it ends, then checks
/// that the next cycle's write still waits for it. Returns the errors of the enters that
/// failed before one succeeded.
fn read_with_failing_joins(failing: usize) -> Vec<Error> {
    let (sim, ws, copy) = setup();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &copy, 64).unwrap();
    sim.synchronize(&copy).unwrap();
    let scope = ws.enter().unwrap();
    let x = scope.htod(&Array1::from_elem(64, 1.0f32)).unwrap();
    sim.synchronize(ws.stream()).unwrap();
    let hold = sim.hold(&copy);
    let mut out_view = out.view_mut();
    let on = scope.on_stream(&copy).unwrap();
    on.dtod(&x, &mut out_view).unwrap();
    sim.fail_next_records(failing);
    drop(on); // the join fails (deferred)
    drop(scope); // the reset joins again, or waits, or keeps the stream for `enter`
    let mut errors = Vec::new();
    let scope = loop {
        match ws.enter() {
            Ok(scope) => break scope,
            Err(error) => {
                assert!(!ws.is_open());
                errors.push(error);
                sim.fail_next_records(0);
                assert!(errors.len() < 3, "{errors:?}");
            }
        }
    };
    scope.htod(&Array1::from_elem(64, 2.0f32)).unwrap();
    sim.quiesce();
    drop(hold);
    drop(scope);
    ws.synchronize().unwrap();
    sim.synchronize(&copy).unwrap();
    assert_eq!(out.to_host().unwrap()[0], 1.0, "the next cycle overwrote memory still being read");
    errors
}

#[test]
fn a_failed_join_is_redone_at_the_reset_and_reported_by_the_next_enter() {
    let errors = read_with_failing_joins(1);
    assert_eq!(errors.len(), 1);
    let msg = errors[0].to_string();
    assert!(msg.contains("'W'") && msg.contains("SIMULATED_FAILURE"), "{msg}");
}

#[test]
fn a_stream_that_cannot_be_ordered_keeps_the_workspace_closed_until_it_is() {
    // Fails: the join when the use ends, the join and the host wait at the reset, and the
    // join and the host wait of the first enter. The second enter orders the stream and
    // reports the error kept from the reset; the third opens.
    let errors = read_with_failing_joins(5);
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[0].to_string().contains("last cycle's memory"), "{}", errors[0]);
    assert!(errors[1].to_string().contains("when a scope closed"), "{}", errors[1]);
}

#[test]
fn a_declared_stream_waits_for_the_workspaces_writes() {
    for ignore_waits in [false, true] {
        let (sim, ws, copy) = setup();
        let mut out = DeviceArray::<_, u32>::zeros(&sim, &copy, 64).unwrap();
        sim.synchronize(&copy).unwrap();
        sim.ignore_stream_waits(ignore_waits);
        let scope = ws.enter().unwrap();
        let hold = sim.hold(ws.stream()); // the workspace's write is delayed
        let x = scope.htod(&Array1::from_elem(64, 6u32)).unwrap();
        let mut out_view = out.view_mut();
        let on = scope.on_stream(&copy).unwrap();
        on.dtod(&x, &mut out_view).unwrap();
        sim.quiesce();
        drop(hold);
        on.finish().unwrap();
        drop(scope);
        sim.synchronize(&copy).unwrap();
        let seen = out.to_host().unwrap()[0];
        let expected = if ignore_waits { u32::from_ne_bytes([workspace_cuda::device::sim::POISON; 4]) } else { 6 };
        assert_eq!(seen, expected, "ignore_stream_waits = {ignore_waits}");
    }
}

#[test]
fn a_copy_into_a_workspace_on_another_stream_waits_for_the_source() {
    for ignore_waits in [false, true] {
        let (sim, source, copy) = setup();
        let target = DeviceWorkspace::new("DST", fixed(4096), &sim, &copy).unwrap();
        sim.ignore_stream_waits(ignore_waits);
        let out = target.enter().unwrap();
        let s = source.enter().unwrap();
        let hold = sim.hold(source.stream()); // the source's write is delayed
        let x = s.htod(&Array1::from_elem(64, 3u32)).unwrap();
        let kept = x.leverage_to(&out).unwrap();
        sim.quiesce();
        drop(hold);
        let seen = kept.to_host().unwrap()[0];
        let expected = if ignore_waits { u32::from_ne_bytes([workspace_cuda::device::sim::POISON; 4]) } else { 3 };
        assert_eq!(seen, expected, "ignore_stream_waits = {ignore_waits}");
    }
}

/// Runs `host_side` on this thread while a helper releases `hold` once this thread blocks
/// on the device, or once `host_side` is over (then it did not wait, and the device work
/// runs after it).
pub(crate) fn release_when_blocked(sim: &SimDevice, hold: SimHold, host_side: impl FnOnce()) {
    let done = AtomicBool::new(false);
    thread::scope(|t| {
        t.spawn(|| {
            while sim.blocked_host_threads() == 0 && !done.load(Ordering::Acquire) {
                thread::yield_now();
            }
            drop(hold);
        });
        host_side();
        done.store(true, Ordering::Release);
    });
}

#[test]
fn pinned_memory_is_handed_out_again_only_after_its_transfers() {
    let sim = SimDevice::new().unwrap();
    let home = sim.default_stream();
    let staging = PinnedWorkspace::for_transfers("STAGE", &sim, 4096).unwrap();
    let ws = DeviceWorkspace::new("W", fixed(4096), &sim, &home).unwrap();
    let scope = ws.enter().unwrap();
    let mut target = scope.zeros::<u32, _>(256).unwrap();
    sim.synchronize(&home).unwrap();
    let hold = sim.hold(&home);
    let first = {
        let stage = staging.enter().unwrap();
        let x = stage.filled::<u32, _>(256, 1).unwrap();
        target.htod_pinned(&x).unwrap(); // queued behind the hold
        stage.placement(&x)
    };
    release_when_blocked(&sim, hold, || {
        let stage = staging.enter().unwrap(); // must wait for the copy
        let y = stage.filled::<u32, _>(256, 2).unwrap(); // host writes
        assert_eq!(stage.placement(&y), first, "the same pinned bytes");
    });
    assert_eq!(target.to_host().unwrap().sum(), 256, "the copy read the next cycle's data");
}

#[test]
fn host_reads_of_pinned_memory_wait_for_the_copy_into_it() {
    let sim = SimDevice::new().unwrap();
    let home = sim.default_stream();
    let staging = PinnedWorkspace::for_transfers("STAGE", &sim, 4096).unwrap();
    let ws = DeviceWorkspace::new("W", fixed(4096), &sim, &home).unwrap();
    let scope = ws.enter().unwrap();
    let x = scope.htod(&Array1::from_elem(256, 5u32)).unwrap();
    sim.synchronize(&home).unwrap();
    let stage = staging.enter().unwrap();
    let mut down = stage.zeros::<u32, _>(256).unwrap();
    let hold = sim.hold(&home);
    x.dtoh_pinned(&mut down).unwrap(); // queued behind the hold
    let mut seen = 0;
    release_when_blocked(&sim, hold, || seen = down.view().unwrap().sum());
    assert_eq!(seen, 5 * 256, "the host read before the copy");
}

#[test]
fn memory_of_two_devices_does_not_mix() {
    let (a, b) = (SimDevice::new().unwrap(), SimDevice::new().unwrap());
    let wa = DeviceWorkspace::new("A", WorkspaceConfig::default(), &a, &a.default_stream()).unwrap();
    let wb = DeviceWorkspace::new("B", WorkspaceConfig::default(), &b, &b.default_stream()).unwrap();
    let (sa, sb) = (wa.enter().unwrap(), wb.enter().unwrap());
    let x = sa.htod(&Array1::from_elem(8, 1u8)).unwrap();
    let err = x.leverage_to(&sb).expect_err("two devices");
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err:?}");
    assert!(err.to_string().contains("to_host"), "{err}");
    let staging = PinnedWorkspace::for_transfers("STAGE", &b, 4096).unwrap();
    let stage = staging.enter().unwrap();
    let mut p = stage.zeros::<u8, _>(8).unwrap();
    assert!(matches!(x.dtoh_pinned(&mut p), Err(Error::DeviceMismatch { .. })));
    let err = sa.on_stream(&b.default_stream()).expect_err("a stream of b");
    assert!(matches!(err, Error::StreamMismatch { .. }), "{err:?}");
    let err = DeviceArray::<_, u8>::zeros(&a, &b.default_stream(), 8).unwrap_err();
    assert!(matches!(err, Error::StreamMismatch { .. }), "{err:?}");
    assert!(a.faults().is_empty() && b.faults().is_empty());
}

/// Ways of writing a workspace view on the workspace's own stream.
#[derive(Clone, Copy, Debug)]
enum HomeWrite {
    Zeros,
    FromHost,
    FromPinned,
    FromDevice,
}

/// A copy on the copy stream (held) reads `x`; its `OnStream` is forgotten, which ends the
/// borrow of `x` without running any destructor; then `write` overwrites `x` on the
/// workspace's stream. Returns what the copy read.
fn forgotten_read_then(write: HomeWrite) -> f32 {
    let (sim, ws, copy) = setup();
    let staging = PinnedWorkspace::for_transfers("STAGE", &sim, 4096).unwrap();
    let stage = staging.enter().unwrap();
    let twos = stage.filled::<f32, _>(64, 2.0).unwrap();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &copy, 64).unwrap();
    sim.synchronize(&copy).unwrap();
    let scope = ws.enter().unwrap();
    let threes = scope.htod(&Array1::from_elem(64, 3.0f32)).unwrap();
    let mut x = scope.htod(&Array1::from_elem(64, 1.0f32)).unwrap();
    sim.synchronize(ws.stream()).unwrap(); // the writes are done: only the read is delayed
    let hold = sim.hold(&copy);
    {
        let mut out_view = out.view_mut();
        let on = scope.on_stream(&copy).unwrap();
        on.dtod(&x, &mut out_view).unwrap();
        forget(on);
    }
    match write {
        HomeWrite::Zeros => x.fill_zeros().unwrap(),
        HomeWrite::FromHost => x.htod_from(&Array1::from_elem(64, 2.0f32)).unwrap(),
        HomeWrite::FromPinned => x.htod_pinned(&twos).unwrap(),
        HomeWrite::FromDevice => x.copy_from(&threes).unwrap(),
    }
    sim.quiesce(); // with the ordering, the write is blocked behind the held read
    drop(hold);
    drop(scope);
    ws.synchronize().unwrap();
    sim.synchronize(&copy).unwrap();
    assert!(sim.faults().is_empty(), "{:?}", sim.faults());
    out.to_host().unwrap()[0]
}

#[test]
fn a_forgotten_on_stream_still_orders_later_writes_after_its_reads() {
    for write in [HomeWrite::Zeros, HomeWrite::FromHost, HomeWrite::FromPinned, HomeWrite::FromDevice] {
        assert_eq!(forgotten_read_then(write), 1.0, "{write:?} overtook the copy still pending on the other stream");
    }
}

#[test]
fn a_kernel_pointer_taken_after_a_forgotten_on_stream_is_ordered_after_its_reads() {
    let (sim, ws, copy) = setup();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &copy, 64).unwrap();
    sim.synchronize(&copy).unwrap();
    let scope = ws.enter().unwrap();
    let mut x = scope.htod(&Array1::from_elem(64, 1.0f32)).unwrap();
    sim.synchronize(ws.stream()).unwrap();
    let hold = sim.hold(&copy);
    {
        let mut out_view = out.view_mut();
        let on = scope.on_stream(&copy).unwrap();
        on.dtod(&x, &mut out_view).unwrap();
        forget(on);
    }
    let _for_a_kernel = x.device_ptr_mut();
    // A kernel launched now on the workspace's stream must start after the held read.
    let launched_now = sim.record(ws.stream()).unwrap();
    sim.quiesce();
    assert!(!sim.event_complete(&launched_now), "a kernel writing x could run before the read of x");
    drop(hold);
    drop(scope);
    ws.synchronize().unwrap();
    sim.synchronize(&copy).unwrap();
    assert!(sim.event_complete(&launched_now));
    assert_eq!(out.to_host().unwrap()[0], 1.0);
}

#[test]
fn a_write_through_a_forgotten_on_stream_is_seen_by_later_reads_on_the_workspace_stream() {
    let (sim, ws, copy) = setup();
    let scope = ws.enter().unwrap();
    let mut y = scope.zeros::<u32, _>(64).unwrap();
    sim.synchronize(ws.stream()).unwrap();
    let hold = sim.hold(&copy);
    {
        let on = scope.on_stream(&copy).unwrap();
        on.htod(&Array1::from_elem(64, 7u32), &mut y).unwrap();
        forget(on);
    }
    let read = y.detach().unwrap(); // a read on the workspace's stream
    sim.quiesce();
    drop(hold);
    drop(scope);
    ws.synchronize().unwrap();
    sim.synchronize(&copy).unwrap();
    assert_eq!(read.to_host().unwrap()[0], 7, "the workspace's stream read before the other stream wrote");
}

#[test]
fn dropping_a_workspace_whose_scope_and_on_stream_were_forgotten_waits_for_the_other_stream() {
    let (sim, ws, copy) = setup();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &copy, 64).unwrap();
    sim.synchronize(&copy).unwrap();
    let scope = ws.enter().unwrap();
    let x = scope.htod(&Array1::from_elem(64, 1.0f32)).unwrap();
    sim.synchronize(ws.stream()).unwrap();
    let hold = sim.hold(&copy);
    {
        let mut out_view = out.view_mut();
        let on = scope.on_stream(&copy).unwrap();
        on.dtod(&x, &mut out_view).unwrap();
        forget(on);
    }
    forget(scope); // the workspace stays open: its reset never runs
    drop(ws); // frees the arena in the workspace stream's order
    sim.quiesce();
    drop(hold);
    sim.synchronize(&copy).unwrap();
    sim.synchronize(&sim.default_stream()).unwrap();
    assert!(sim.faults().is_empty(), "the arena was freed under the read: {:?}", sim.faults());
    assert_eq!(out.to_host().unwrap()[0], 1.0);
    assert_eq!(sim.live_device_bytes(), 64 * 4, "only `out` is left");
}

#[test]
#[allow(clippy::needless_late_init, reason = "the late initialisation is the point: `y` is written after `on` exists")]
fn a_copy_declared_before_its_source_was_written_waits_for_the_write() {
    let (sim, ws, copy) = setup();
    let mut out = DeviceArray::<_, u32>::zeros(&sim, &copy, 64).unwrap();
    sim.synchronize(&copy).unwrap();
    let scope = ws.enter().unwrap();
    let y; // initialised after the declaration below, and still borrowable for its whole use
    let mut out_view = out.view_mut();
    let on = scope.on_stream(&copy).unwrap();
    sim.synchronize(ws.stream()).unwrap(); // the declaration's own ordering is behind us
    let hold = sim.hold(ws.stream()); // the workspace's write is delayed
    y = scope.htod(&Array1::from_elem(64, 6u32)).unwrap();
    on.dtod(&y, &mut out_view).unwrap();
    sim.quiesce();
    drop(hold);
    on.finish().unwrap();
    drop(scope);
    sim.synchronize(&copy).unwrap();
    assert_eq!(out.to_host().unwrap()[0], 6, "the copy read before the workspace's stream wrote");
}

#[test]
fn blocks_given_back_while_a_stream_cannot_be_ordered_are_freed_only_once_it_is() {
    let sim = SimDevice::new().unwrap();
    let copy = sim.new_stream().unwrap();
    let ws = DeviceWorkspace::new("LEARNING", WorkspaceConfig::default(), &sim, &sim.default_stream()).unwrap();
    let mut out = DeviceArray::<_, u32>::zeros(&sim, &copy, 256).unwrap();
    sim.synchronize(&copy).unwrap();
    let scope = ws.enter().unwrap();
    let x = scope.htod(&Array1::from_elem(256, 4u32)).unwrap();
    assert_eq!(scope.placement(&x), Placement::Elsewhere, "spilled while learning");
    sim.synchronize(ws.stream()).unwrap();
    let hold = sim.hold(&copy);
    let mut out_view = out.view_mut();
    let on = scope.on_stream(&copy).unwrap();
    on.dtod(&x, &mut out_view).unwrap();
    // The join when the use ends, then the join and the host wait at the reset, fail.
    sim.fail_next_records(3);
    drop(on);
    drop(scope); // the spill block is given back while the copy stream is unordered
    sim.quiesce();
    drop(hold);
    sim.synchronize(&copy).unwrap();
    ws.synchronize().unwrap();
    assert!(sim.faults().is_empty(), "the spill block was freed under the read: {:?}", sim.faults());
    assert_eq!(out.to_host().unwrap().sum(), 1024);
    let err = ws.enter().expect_err("the error kept from the reset");
    assert!(err.to_string().contains("SIMULATED_FAILURE"), "{err}");
    drop(ws.enter().unwrap());
    drop(ws);
    drop(out);
    sim.synchronize(&copy).unwrap();
    sim.synchronize(&sim.default_stream()).unwrap();
    assert_eq!(sim.live_device_bytes(), 0, "the block was freed once the stream was ordered");
}
