//! Frames on device workspaces: the host's semantics (bytes handed out again in the same
//! cycle once a frame closes, whatever the order frames close in, or if one is forgotten),
//! ordered on the stream: a read still queued on another stream never sees a frame's
//! bytes overwritten, and the simulator shows the overwrite when the waits are bypassed.
//! No test depends on timing: streams are held, or slowed, and `quiesce` waits until
//! everything that can run has run.
//!
//! Within one workspace two mechanisms order a closed frame's bytes: the frame's close
//! makes the workspace's stream wait for every stream with a use not yet ordered, and
//! every later write through the workspace waits for conflicting uses anyway
//! (`order_home_use`); the tests here hold with either. Where only the close can order
//! the reuse (another member of a plan group takes the bytes), `planned.rs` tests it.

use std::time::Duration;

use ndarray::Array1;
use workspace_core::backend::Placement;
use workspace_cuda::device::sim::SimDevice;
use workspace_cuda::{Device, DeviceArray, DeviceWorkspace};

use crate::ordering::forget;
use crate::policies::fixed;

fn setup() -> (SimDevice, DeviceWorkspace<SimDevice>, workspace_cuda::device::sim::SimStream) {
    let sim = SimDevice::new().unwrap();
    let copy = sim.new_stream().unwrap();
    let ws = DeviceWorkspace::new("W", fixed(16 << 10), &sim, &sim.default_stream()).unwrap();
    (sim, ws, copy)
}

#[test]
fn a_frames_bytes_are_handed_out_again_in_the_same_cycle() {
    let (_sim, ws, _) = setup();
    let scope = ws.enter().unwrap();
    let kept = scope.htod(&Array1::from_elem(64, 7.0f32)).unwrap(); // 256 B at 0
    let mut placements = Vec::new();
    for step in 0..3 {
        let frame = scope.frame().unwrap();
        assert_eq!(frame.level(), 1);
        let x = frame.htod(&Array1::from_elem(1024, step as f32)).unwrap(); // 4 KiB
        placements.push(frame.placement(&x));
        assert_eq!(x.to_host().unwrap().sum(), 1024.0 * step as f32);
    }
    assert_eq!(placements, vec![Placement::Arena(256); 3], "each frame's bytes went to the next");
    assert_eq!(kept.to_host().unwrap().sum(), 448.0, "the scope's array survives the frames");
    drop(scope);
    assert_eq!(ws.stats().peak_bytes, 256 + 4096);
}

#[test]
fn frames_close_in_any_order_and_a_forgotten_frame_keeps_its_bytes_to_the_end_of_the_cycle() {
    let (_sim, ws, _) = setup();
    let scope = ws.enter().unwrap();
    let outer = scope.frame().unwrap();
    let a = outer.zeros::<u8, _>(256).unwrap();
    assert_eq!(outer.placement(&a), Placement::Arena(0));
    let inner = scope.frame().unwrap();
    assert_eq!(inner.level(), 2);
    let b = inner.zeros::<u8, _>(256).unwrap();
    assert_eq!(inner.placement(&b), Placement::Arena(256));
    // The scope allocates while frames are open: that stays, whatever closes.
    let c = scope.htod(&Array1::from_elem(64, 5u8)).unwrap();
    assert_eq!(scope.placement(&c), Placement::Arena(512));
    drop(outer); // below the top: marked closed, nothing given back yet
    drop(inner); // the top: both go, down to the scope's allocation
    let d = scope.zeros::<u8, _>(256).unwrap();
    assert_eq!(scope.placement(&d), Placement::Arena(768), "nothing below the scope's allocation is reused");
    assert_eq!(c.to_host().unwrap(), Array1::from_elem(64, 5u8));
    let forgotten = scope.frame().unwrap();
    let e = forgotten.htod(&Array1::from_elem(256, 9u8)).unwrap();
    let at = forgotten.placement(&e);
    forget(forgotten);
    let f = scope.zeros::<u8, _>(256).unwrap();
    assert!(scope.placement(&f) != at, "a forgotten frame's bytes are kept");
    drop(scope);
    // The next cycle starts from the bottom again.
    let scope = ws.enter().unwrap();
    let frame = scope.frame().unwrap();
    assert_eq!(frame.level(), 1, "the end of the cycle forgets every frame");
    let g = frame.zeros::<u8, _>(256).unwrap();
    assert_eq!(frame.placement(&g), Placement::Arena(0));
}

#[test]
fn bad_requests_in_a_frame_are_typed_errors_and_the_frame_stays_usable() {
    let sim = SimDevice::with_memory_limit(1 << 20).unwrap();
    let ws = DeviceWorkspace::new("W", fixed(16 << 10), &sim, &sim.default_stream()).unwrap();
    let scope = ws.enter().unwrap();
    let frame = scope.frame().unwrap();
    let err = frame.zeros::<f32, _>(1usize << 62).unwrap_err();
    assert!(matches!(err, workspace_cuda::Error::Workspace(workspace_core::Error::ShapeOverflow { .. })), "{err:?}");
    let err = frame.zeros::<f32, _>(0).unwrap_err();
    assert!(matches!(err, workspace_cuda::Error::Workspace(workspace_core::Error::ZeroLength { .. })), "{err:?}");
    let err = frame.zeros::<f32, _>(1 << 20).unwrap_err(); // 4 MiB spill on a 1 MiB device
    assert!(
        matches!(err, workspace_cuda::Error::Workspace(workspace_core::Error::Backend { .. }))
            && err.to_string().contains("'W'"),
        "{err:?}"
    );
    let x = frame.zeros::<f32, _>(16).unwrap();
    assert_eq!(x.to_host().unwrap().sum(), 0.0, "the frame is usable after its errors");
}

/// How the read on the copy stream is delayed.
#[derive(Clone, Copy, Debug)]
enum Delay {
    /// Held until everything else has run.
    Hold,
    /// Slowed by a sleep before each copy.
    Sleep,
}

/// How the use on the copy stream ends.
#[derive(Clone, Copy, Debug)]
enum End {
    /// Dropped normally (the workspace's stream waits for it then).
    Dropped,
    /// Forgotten: the frame's close must order it.
    Forgotten,
}

/// A frame's array of 1s is read on the copy stream (delayed); the frame closes and the
/// next frame writes 2s into the same bytes on the workspace's stream. Returns what the
/// delayed read saw.
fn delayed_read_of_a_frame_sees(delay: Delay, end: End, ignore_waits: bool) -> f32 {
    let (sim, ws, copy) = setup();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &copy, 256).unwrap();
    sim.synchronize(&copy).unwrap();
    sim.ignore_stream_waits(ignore_waits);
    let scope = ws.enter().unwrap();
    let hold;
    let first;
    {
        let frame = scope.frame().unwrap();
        let x = frame.htod(&Array1::from_elem(256, 1.0f32)).unwrap();
        first = frame.placement(&x);
        sim.synchronize(ws.stream()).unwrap(); // the write is done: only the read is delayed
        hold = match delay {
            Delay::Hold => Some(sim.hold(&copy)),
            Delay::Sleep => {
                sim.set_delay(&copy, Duration::from_millis(30));
                None
            }
        };
        let mut out_view = out.view_mut();
        let on = frame.on_stream(&copy).unwrap();
        on.dtod(&x, &mut out_view).unwrap();
        match end {
            End::Dropped => drop(on),
            End::Forgotten => forget(on),
        }
    } // the frame closes
    let frame = scope.frame().unwrap();
    let y = frame.htod(&Array1::from_elem(256, 2.0f32)).unwrap();
    assert_eq!(frame.placement(&y), first, "the new data goes where the old was");
    sim.quiesce(); // with the wait, the write of 2s is blocked behind the delayed read
    drop(hold);
    drop(frame);
    drop(scope);
    ws.synchronize().unwrap();
    sim.synchronize(&copy).unwrap();
    out.to_host().unwrap()[0]
}

#[test]
fn a_delayed_read_of_a_closed_frame_never_sees_its_bytes_overwritten() {
    for delay in [Delay::Hold, Delay::Sleep] {
        for end in [End::Dropped, End::Forgotten] {
            assert_eq!(
                delayed_read_of_a_frame_sees(delay, end, false),
                1.0,
                "{delay:?}, {end:?}: the delayed read saw the next frame's data"
            );
        }
    }
}

#[test]
fn without_the_wait_the_delayed_read_sees_the_next_frames_data() {
    // The race the frame's close prevents is there to see when the waits are bypassed.
    assert_eq!(delayed_read_of_a_frame_sees(Delay::Hold, End::Forgotten, true), 2.0);
}

#[test]
fn a_copy_of_a_frames_array_into_a_workspace_on_another_stream_is_ordered_before_its_reuse() {
    for ignore_waits in [false, true] {
        let (sim, ws, copy) = setup();
        let target = DeviceWorkspace::new("DST", fixed(4096), &sim, &copy).unwrap();
        sim.ignore_stream_waits(ignore_waits);
        let out = target.enter().unwrap();
        let scope = ws.enter().unwrap();
        let kept;
        let hold = sim.hold(&copy); // the copy on the target's stream is delayed
        {
            let frame = scope.frame().unwrap();
            let x = frame.htod(&Array1::from_elem(64, 3u32)).unwrap();
            sim.synchronize(ws.stream()).unwrap();
            kept = out.copy_of(&x).unwrap(); // runs on the copy stream, reading the frame
        }
        let frame = scope.frame().unwrap();
        let _y = frame.htod(&Array1::from_elem(64, 4u32)).unwrap(); // same bytes
        sim.quiesce();
        drop(hold);
        let seen = kept.to_host().unwrap()[0];
        assert_eq!(seen, if ignore_waits { 4 } else { 3 }, "ignore_stream_waits = {ignore_waits}");
    }
}
