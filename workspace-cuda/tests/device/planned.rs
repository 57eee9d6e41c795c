//! Plan groups of device workspaces on the simulated device: the host's planning and
//! replay over one device allocation, and the order of reuse across streams. A read
//! still queued on one stream never sees a plan slot (of a cycle or of a frame)
//! overwritten by a member on another stream, nor the arena freed under it; with the
//! waits bypassed the simulator shows both. Random programs over members on up to three
//! streams, with slowed streams, check every allocation's bytes as the work issued on
//! them saw them.

use std::time::Duration;

use ndarray::Array1;
use workspace_core::{LearningPolicy, SpillPolicy, WorkspaceConfig};
use workspace_cuda::device::sim::{SimDevice, SimHold, SimStream};
use workspace_cuda::{
    Device, DeviceArray, DeviceFrame, DevicePlanGroup, DeviceScope, DeviceViewMut, DeviceWorkspace, Error,
};

use crate::ordering::forget;
use crate::random::{self, Rng};

fn config() -> WorkspaceConfig {
    WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build().unwrap()
}

#[test]
fn members_on_one_stream_run_on_one_plan_at_the_lower_bound() {
    let sim = SimDevice::new().unwrap();
    let stream = sim.default_stream();
    let group = DevicePlanGroup::new("G", &sim, &stream).unwrap();
    let act = group.workspace("ACT", &config(), &stream).unwrap();
    let work = group.workspace("WORK", &config(), &stream).unwrap();
    for step in 0..5 {
        let (sum, _) = group
            .iteration(1, || {
                let a = act.enter()?;
                let mut x = a.htod(&Array1::from_elem(1024, 1.0f32))?; // 4 KiB to the end
                for layer in 0..3 {
                    let w = work.enter()?; // 8 KiB per cycle, dead at its end
                    let t = w.htod(&Array1::from_elem(2048, (step + layer) as f32))?;
                    let frame = w.frame()?; // 4 KiB, dead at its close
                    let twos = a.htod(&Array1::from_elem(1024, 2.0f32))?;
                    let u = frame.copy_of(&twos)?;
                    x.copy_from(&u)?;
                    assert_eq!(t.to_host()?[0], (step + layer) as f32);
                }
                Ok::<_, Error>(x.to_host()?.sum())
            })
            .unwrap();
        assert_eq!(sum, 2048.0);
    }
    let stats = group.stats();
    assert_eq!((stats.plans, stats.recorded_iterations, stats.planned_iterations, stats.divergences), (1, 1, 4, 0));
    assert!(stats.plan_bytes <= stats.per_role_bytes && stats.plan_bytes >= stats.lower_bound_bytes, "{stats:?}");
    assert!(group.capacity() >= stats.plan_bytes);
    assert_eq!((group.streams(), group.cross_stream_waits()), (1, 0), "one stream: stream order is enough");
    assert_eq!(sim.faults(), Vec::<String>::new());
}

#[test]
fn joining_checks_the_device_the_state_and_the_membership() {
    let (sim, other) = (SimDevice::new().unwrap(), SimDevice::new().unwrap());
    let err = DevicePlanGroup::new("G", &sim, &other.default_stream()).unwrap_err();
    assert!(matches!(err, Error::StreamMismatch { .. }), "{err:?}");
    let group = DevicePlanGroup::new("G", &sim, &sim.default_stream()).unwrap();
    let foreign = DeviceWorkspace::new("F", config(), &other, &other.default_stream()).unwrap();
    assert!(matches!(group.join(&foreign), Err(Error::DeviceMismatch { .. })));
    let ws = DeviceWorkspace::new("W", config(), &sim, &sim.default_stream()).unwrap();
    {
        let _open = ws.enter().unwrap();
        let err = group.join(&ws).unwrap_err();
        assert!(matches!(err, Error::Workspace(workspace_core::Error::StillOpen { .. })), "{err:?}");
    }
    group.join(&ws).unwrap();
    assert!(group.has_member(&ws));
    let second = DevicePlanGroup::new("H", &sim, &sim.default_stream()).unwrap();
    let err = second.join(&ws).unwrap_err();
    assert!(matches!(err, Error::Workspace(workspace_core::Error::InvalidConfig { .. })), "{err:?}");
    let err = second.leave(&ws).unwrap_err();
    assert!(err.to_string().contains("not a member"), "{err}");
    group.leave(&ws).unwrap();
    assert!(!group.has_member(&ws));
    second.join(&ws).unwrap();
}

#[test]
fn an_arena_the_device_cannot_give_is_a_typed_error_and_the_group_stays_usable() {
    let sim = SimDevice::with_memory_limit(1 << 20).unwrap();
    let stream = sim.default_stream();
    let group = DevicePlanGroup::new("G", &sim, &stream).unwrap();
    let a = group.workspace("A", &config(), &stream).unwrap();
    let err = group.reserve(1 << 30).unwrap_err();
    match &err {
        Error::Workspace(workspace_core::Error::Backend { workspace, .. }) => assert_eq!(workspace.as_ref(), "G"),
        other => panic!("{other:?}"),
    }
    assert_eq!(group.capacity(), 0);
    for _ in 0..3 {
        let (sum, _) = group
            .iteration(0, || {
                let s = a.enter()?;
                let x = s.htod(&Array1::from_elem(1024, 1.0f32))?;
                Ok::<_, Error>(x.to_host()?.sum())
            })
            .unwrap();
        assert_eq!(sum, 1024.0);
    }
    assert_eq!(group.stats().planned_iterations, 2);
}

/// The end of a held-read test: lets everything run that can (a wait keeps what comes
/// after the held stream's work blocked), releases `hold`, waits for `streams` and turns
/// the stream waits back on.
fn release_and_drain(sim: &SimDevice, hold: Option<SimHold>, streams: [&SimStream; 2]) {
    sim.quiesce();
    drop(hold);
    for stream in streams {
        sim.synchronize(stream).unwrap();
    }
    sim.ignore_stream_waits(false);
}

/// What is delayed on the first member's stream while a later member on another stream
/// takes the same bytes.
#[derive(Clone, Copy, Debug)]
enum Delay {
    Hold,
    Sleep,
}

/// An iteration: member A (on the group's stream) writes 1s into a plan slot (of its
/// cycle, or of a frame when `framed`) and a read of it is queued on A's stream; the
/// slot dies; member B, on a second stream, writes 2s into the same slot. Recorded
/// once, then replayed with the read delayed. Returns what the read saw and the group.
fn slot_reuse_sees(framed: bool, delay: Delay, ignore_waits: bool) -> (f32, DevicePlanGroup<SimDevice>) {
    let sim = SimDevice::new().unwrap();
    let (s1, s2) = (sim.default_stream(), sim.new_stream().unwrap());
    let group = DevicePlanGroup::new("G", &sim, &s1).unwrap();
    let a = group.workspace("A", &config(), &s1).unwrap();
    let b = group.workspace("B", &config(), &s2).unwrap();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &s1, 256).unwrap();
    let mut hold = None;
    let mut seen_slot = Vec::new();
    for replay in [false, true] {
        group.start_iteration(9).unwrap();
        {
            let sa = a.enter().unwrap();
            let frame = if framed { Some(sa.frame().unwrap()) } else { None };
            let x = match &frame {
                Some(frame) => frame.htod(&Array1::from_elem(256, 1.0f32)).unwrap(),
                None => sa.htod(&Array1::from_elem(256, 1.0f32)).unwrap(),
            };
            if replay {
                sim.synchronize(&s1).unwrap(); // the write is done: only the read is delayed
                sim.ignore_stream_waits(ignore_waits);
                match delay {
                    Delay::Hold => hold = Some(sim.hold(&s1)),
                    Delay::Sleep => sim.set_delay(&s1, Duration::from_millis(30)),
                }
            }
            out.view_mut().copy_from(&x).unwrap(); // queued on A's stream
            seen_slot.push(x.device_ptr());
            drop(frame);
            if framed {
                // A's cycle stays open while B takes the frame's bytes.
                let sb = b.enter().unwrap();
                let y = sb.htod(&Array1::from_elem(256, 2.0f32)).unwrap();
                seen_slot.push(y.device_ptr());
            }
        }
        if !framed {
            let sb = b.enter().unwrap();
            let y = sb.htod(&Array1::from_elem(256, 2.0f32)).unwrap();
            seen_slot.push(y.device_ptr());
        }
        group.finish_iteration().unwrap();
    }
    assert_eq!(seen_slot[2], seen_slot[3], "the replay gives B the bytes A's slot had");
    // With the wait, B's write is blocked behind the delayed read.
    release_and_drain(&sim, hold, [&s1, &s2]);
    (out.to_host().unwrap()[0], group)
}

#[test]
fn a_delayed_read_of_a_plan_slot_is_not_overwritten_by_a_member_on_another_stream() {
    for framed in [false, true] {
        for delay in [Delay::Hold, Delay::Sleep] {
            let (seen, group) = slot_reuse_sees(framed, delay, false);
            assert_eq!(seen, 1.0, "framed {framed}, {delay:?}: the read saw the other member's data");
            let stats = group.stats();
            assert_eq!((stats.planned_iterations, stats.divergences), (1, 0), "{stats:?}");
            assert_eq!(group.streams(), 2);
            assert!(group.cross_stream_waits() >= 1);
        }
    }
}

#[test]
fn without_the_wait_the_delayed_read_sees_the_other_members_data() {
    // The race the group's events prevent is there to see when the waits are bypassed.
    for framed in [false, true] {
        assert_eq!(slot_reuse_sees(framed, Delay::Hold, true).0, 2.0, "framed {framed}");
    }
}

/// A member on a stream of its own reads the group's arena (the read held) before the
/// group gives the arena back on its stream. Returns the read's sum and the faults.
fn arena_free_after_a_held_read(ignore_waits: bool) -> (f32, Vec<String>) {
    let sim = SimDevice::new().unwrap();
    let (home, s1) = (sim.default_stream(), sim.new_stream().unwrap());
    let group = DevicePlanGroup::new("G", &sim, &home).unwrap();
    let a = group.workspace("A", &config(), &s1).unwrap();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &s1, 64).unwrap();
    let mut hold = None;
    for replay in [false, true] {
        group.start_iteration(0).unwrap();
        {
            let sa = a.enter().unwrap();
            let x = sa.htod(&Array1::from_elem(64, 1.0f32)).unwrap();
            if replay {
                out.view_mut().fill_zeros().unwrap(); // forget the recording's read
                sim.synchronize(&s1).unwrap();
                sim.ignore_stream_waits(ignore_waits);
                hold = Some(sim.hold(&s1));
            }
            out.view_mut().copy_from(&x).unwrap();
        }
        group.finish_iteration().unwrap();
    }
    group.trim().unwrap(); // frees the arena on the group's stream
    assert_eq!(group.capacity(), 0);
    release_and_drain(&sim, hold, [&s1, &home]);
    (out.to_host().unwrap().sum(), sim.faults())
}

#[test]
fn the_arena_is_freed_only_after_every_members_stream() {
    let (sum, faults) = arena_free_after_a_held_read(false);
    assert!(faults.is_empty(), "{faults:?}");
    assert_eq!(sum, 64.0);
}

#[test]
fn without_the_wait_the_arena_is_freed_under_the_read() {
    let (sum, faults) = arena_free_after_a_held_read(true);
    assert_eq!(sum, 0.0, "the read found nothing to copy: {faults:?}");
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert!(faults[0].contains("use after free"), "{faults:?}");
}

// ---------------------------------------------------------------------------------------
// Random programs

/// Programs per run: a tenth of the host's (`random::cases`): 1,000, or `PROPTEST_CASES`
/// / 10 (scaled down under valgrind).
fn cases() -> u64 {
    (random::cases() / 10).max(4)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    /// Enter the member (opens a cycle, or nests).
    Open(usize),
    /// Close the member's innermost scope, after the frames opened in it.
    Close(usize),
    /// Open a frame in the member's innermost scope.
    Frame(usize),
    /// Close the member's open frame number `k` (modulo their number; 0 the newest).
    EndFrame(usize, usize),
    /// Forget the member's newest frame.
    Forget(usize),
    /// Write `bytes` of a pattern from the member's innermost scope (`at` 0) or from one
    /// of its open frames.
    Alloc { member: usize, bytes: usize, at: usize },
}

fn program(rng: &mut Rng, members: usize) -> Vec<Op> {
    let len = 4 + rng.below(30) as usize;
    (0..len)
        .map(|_| {
            let m = rng.below(members as u64) as usize;
            match rng.below(12) {
                0 | 1 => Op::Open(m),
                2 | 3 => Op::Close(m),
                4 | 5 => Op::Frame(m),
                6 => Op::EndFrame(m, rng.below(3) as usize),
                7 => Op::Forget(m),
                _ => Op::Alloc { member: m, bytes: 1 + rng.below(3000) as usize, at: rng.below(3) as usize },
            }
        })
        .collect()
}

/// A live allocation: its view (its lifetime extended to the run's, and dropped before
/// the scope or frame it borrows), the member, the frame it dies with (0: the cycle),
/// and its pattern byte.
struct Live<D: Device> {
    view: DeviceViewMut<'static, D, u8>,
    member: usize,
    frame: u64,
    tag: u8,
}

/// Reads queued at deaths: what each should see.
type Reads<D> = Vec<(DeviceArray<D, u8>, u8)>;

struct Open<D: Device> {
    frame: DeviceFrame<'static, D>,
    scope: usize,
    id: u64,
}

/// Queues reads of the allocations of `member` that `dies` picks, on the member's
/// stream or, every third time, on `other` through the scope's `on_stream` (which is
/// dropped or forgotten), and forgets them.
fn end<D: Device>(
    live: &mut Vec<Live<D>>,
    reads: &mut Reads<D>,
    member: usize,
    scope: &DeviceScope<'_, D>,
    other: &D::Stream,
    rng: &mut Rng,
    dies: impl Fn(&Live<D>) -> bool,
) {
    let device = scope.workspace().device().clone();
    let mut kept = Vec::new();
    for l in live.drain(..) {
        if l.member != member || !dies(&l) {
            kept.push(l);
            continue;
        }
        let len = l.view.len();
        match rng.below(3) {
            0 => {
                let mut out = DeviceArray::<_, u8>::zeros(&device, other, len).unwrap();
                {
                    let mut out_view = out.view_mut();
                    let on = scope.on_stream(other).unwrap();
                    on.dtod(&l.view, &mut out_view).unwrap();
                    if rng.below(2) == 0 {
                        forget(on);
                    }
                }
                reads.push((out, l.tag));
            }
            _ => {
                let mut out = DeviceArray::<_, u8>::zeros(&device, l.view.stream(), len).unwrap();
                out.view_mut().copy_from(&l.view).unwrap();
                reads.push((out, l.tag));
            }
        }
    }
    *live = kept;
}

/// Runs `ops` as one iteration of `group` over `members`; every allocation's pattern is
/// read (often on another stream, which may be slowed) when it dies, into `reads`, which
/// the caller checks once every stream has finished. Returns the allocations made.
fn run<D: Device>(
    group: &DevicePlanGroup<D>,
    members: &[DeviceWorkspace<D>],
    others: &[D::Stream],
    ops: &[Op],
    seed: u64,
    reads: &mut Reads<D>,
) -> usize {
    let mut rng = Rng(seed);
    group.start_iteration(7).unwrap();
    let mut scopes: Vec<Vec<Box<DeviceScope<'static, D>>>> = members.iter().map(|_| Vec::new()).collect();
    let mut frames: Vec<Vec<Open<D>>> = members.iter().map(|_| Vec::new()).collect();
    let mut live: Vec<Live<D>> = Vec::new();
    let (mut made, mut next_frame, mut tag) = (0, 0u64, seed as u8);
    for &op in ops {
        match op {
            Op::Open(m) => {
                let scope = members[m].enter().unwrap();
                // SAFETY: the workspaces outlive the run; every scope is dropped in it.
                let scope: DeviceScope<'static, D> = unsafe { std::mem::transmute(scope) };
                scopes[m].push(Box::new(scope));
            }
            Op::Close(m) => {
                let Some(index) = scopes[m].len().checked_sub(1) else { continue };
                while let Some(at) = frames[m].iter().rposition(|f| f.scope == index) {
                    let open = frames[m].remove(at);
                    end(&mut live, reads, m, &scopes[m][index], &others[m], &mut rng, |l| l.frame == open.id);
                }
                if index == 0 {
                    end(&mut live, reads, m, &scopes[m][0], &others[m], &mut rng, |_| true);
                }
                scopes[m].pop();
            }
            Op::Frame(m) => {
                let Some(scope) = scopes[m].last() else { continue };
                // SAFETY: the box stays in `scopes[m]` until every frame made from it has
                // been dropped (`Close` and the end of the run drop them first).
                let scope: &'static DeviceScope<'static, D> = unsafe { &*(&**scope as *const DeviceScope<'static, D>) };
                next_frame += 1;
                frames[m].push(Open { frame: scope.frame().unwrap(), scope: scopes[m].len() - 1, id: next_frame });
            }
            Op::EndFrame(m, k) => {
                let count = frames[m].len();
                if count == 0 {
                    continue;
                }
                let open = frames[m].remove(count - 1 - k % count);
                end(&mut live, reads, m, &scopes[m][open.scope], &others[m], &mut rng, |l| l.frame == open.id);
            }
            Op::Forget(m) => {
                let Some(open) = frames[m].pop() else { continue };
                for l in live.iter_mut().filter(|l| l.frame == open.id) {
                    l.frame = 0; // lives on to the end of the cycle
                }
                forget(open.frame);
            }
            Op::Alloc { member: m, bytes, at } => {
                let Some(scope) = scopes[m].last() else { continue };
                tag = tag.wrapping_add(1).max(1);
                let values = Array1::from_elem(bytes, tag);
                let count = frames[m].len();
                let (view, frame) = if at == 0 || count == 0 {
                    (scope.htod(&values).unwrap(), 0)
                } else {
                    let open = &frames[m][(at - 1) % count];
                    (open.frame.htod(&values).unwrap(), open.id)
                };
                let address = view.device_ptr();
                for other in &live {
                    let (start, len) = (other.view.device_ptr(), other.view.len() as u64);
                    assert!(
                        address + bytes as u64 <= start || start + len <= address,
                        "[{address:#x}, +{bytes}) of member {m} overlaps a live allocation of member {}",
                        other.member
                    );
                }
                // SAFETY: the view is dropped (by `end`, or at the end of the run) before
                // the scope or frame it borrows.
                let view: DeviceViewMut<'static, D, u8> = unsafe { std::mem::transmute(view) };
                live.push(Live { view, member: m, frame, tag });
                made += 1;
            }
        }
    }
    for m in 0..members.len() {
        while let Some(open) = frames[m].pop() {
            end(&mut live, reads, m, &scopes[m][open.scope], &others[m], &mut rng, |l| l.frame == open.id);
        }
        if let Some(first) = scopes[m].first() {
            end(&mut live, reads, m, first, &others[m], &mut rng, |_| true);
        }
        while scopes[m].pop().is_some() {}
    }
    assert!(live.is_empty());
    group.finish_iteration().unwrap();
    made
}

/// Waits for `streams`, then counts the reads in `reads` that saw something else than
/// the pattern written before them.
fn overwritten<D: Device>(device: &D, streams: &[D::Stream], reads: Reads<D>) -> usize {
    for stream in streams {
        device.synchronize(stream).unwrap();
    }
    reads.into_iter().filter(|(out, tag)| out.to_host().unwrap().iter().any(|b| b != tag)).count()
}

/// What `random_programs` saw.
#[derive(Debug, Default)]
struct Seen {
    /// Programs whose exact replay ran on its plan.
    exact: u64,
    /// Waits the groups issued to order a reuse after another stream.
    waits: u64,
    /// Reads that saw bytes overwritten, and the programs where that happened.
    overwritten: usize,
    spoiled: u64,
}

/// `cases` random programs, each over 1 to 3 members of a fresh group on three streams
/// of `new_device()` (the group and every member on a random one of them): recorded,
/// replayed as recorded, replayed with an operation left out, and replayed again, the
/// group's arena sometimes given back between iterations while their work still runs.
/// The reads of every allocation are checked once the four iterations are over, so
/// that reuse across iterations and streams is checked too. `slow` may slow a stream;
/// `after` checks the device after each program.
fn random_programs<D: Device>(
    cases: u64,
    seed: u64,
    new_device: impl Fn() -> D,
    slow: impl Fn(&D, &D::Stream, u64),
    after: impl Fn(&D, &[Op], usize),
) -> Seen {
    let mut rng = Rng(seed);
    let mut seen = Seen::default();
    for case in 0..cases {
        let device = new_device();
        let streams: Vec<D::Stream> =
            [device.default_stream()].into_iter().chain((0..2).map(|_| device.new_stream().unwrap())).collect();
        for stream in &streams {
            slow(&device, stream, rng.below(4));
        }
        let count = 1 + rng.below(3) as usize;
        let group = DevicePlanGroup::new("G", &device, &streams[rng.below(3) as usize]).unwrap();
        let members: Vec<DeviceWorkspace<D>> = (0..count)
            .map(|i| group.workspace(&format!("M{i}"), &config(), &streams[rng.below(3) as usize]).unwrap())
            .collect();
        let others: Vec<D::Stream> = (0..count).map(|_| streams[rng.below(3) as usize].clone()).collect();
        let ops = program(&mut rng, count);
        let mut fewer = ops.clone();
        fewer.remove(rng.below(ops.len() as u64) as usize);
        let mut reads = Vec::new();
        let mut made = 0;
        for (i, (program, salt)) in [(&ops, 0), (&ops, 1), (&fewer, 2), (&ops, 3)].into_iter().enumerate() {
            let before = group.stats();
            let allocations = run(&group, &members, &others, program, case ^ salt, &mut reads);
            if i == 0 {
                made = allocations;
            }
            if i == 1 && made > 0 {
                let after_exact = group.stats();
                assert_eq!(after_exact.divergences, before.divergences, "an exact replay diverged: {ops:?}");
                assert_eq!(after_exact.planned_iterations, before.planned_iterations + 1, "{ops:?}");
                seen.exact += 1;
            }
            if rng.below(4) == 0 {
                group.trim().unwrap(); // freed while the reads may still run
            }
        }
        seen.waits += group.cross_stream_waits();
        drop(members);
        drop(group);
        let overwritten = overwritten(&device, &streams, reads);
        seen.overwritten += overwritten;
        seen.spoiled += u64::from(overwritten > 0);
        after(&device, &ops, overwritten);
    }
    seen
}

#[test]
fn random_programs_over_members_on_several_streams_never_see_their_bytes_overwritten() {
    let cases = cases();
    let seen = random_programs(
        cases,
        0xDE71_CE5E_ED00,
        || SimDevice::new().unwrap(),
        |sim, stream, pick| sim.set_delay(stream, Duration::from_micros([0, 0, 20, 100][pick as usize])),
        |sim, ops, overwritten| {
            assert_eq!(overwritten, 0, "a read saw its allocation overwritten: {ops:?}");
            sim.quiesce();
            assert!(sim.faults().is_empty(), "{:?}: {ops:?}", sim.faults());
            assert_eq!(sim.take_deferred_error(), None);
            assert_eq!(sim.live_device_bytes(), 0, "device memory leaked: {ops:?}");
        },
    );
    // The test can fail: most replays ran on their plan, and reuse crossed streams.
    assert!(seen.exact > cases / 2, "{seen:?} of {cases} programs");
    assert!(seen.waits > 0, "no reuse across streams was ordered: {seen:?}");
}

#[test]
fn without_the_waits_random_programs_see_their_bytes_overwritten() {
    // The checker of the test above catches the races that the waits prevent: with them
    // bypassed, some program reads overwritten bytes (or its device reports a use after
    // free, which makes its next call fail).
    let cases = (cases() / 10).max(20);
    let spoiled = (0..cases)
        .filter(|&case| {
            let outcome = std::panic::catch_unwind(|| {
                random_programs(
                    1,
                    0xBAD_5EED ^ case,
                    || {
                        let sim = SimDevice::new().unwrap();
                        sim.ignore_stream_waits(true);
                        sim
                    },
                    |sim, stream, pick| sim.set_delay(stream, Duration::from_micros([0, 50, 200, 500][pick as usize])),
                    |sim, _, _| {
                        sim.quiesce();
                        let _ = sim.take_deferred_error();
                    },
                )
            });
            match outcome {
                Ok(seen) => seen.spoiled > 0,
                Err(_) => true,
            }
        })
        .count();
    assert!(spoiled > 0, "none of {cases} programs saw an overwrite without the waits");
}

/// The random programs on GPU 0 (no knobs to slow a stream there: the device's own
/// timing), or skipped with a line on stderr without one.
#[test]
fn random_programs_on_a_real_gpu() {
    crate::on_gpu_with(|gpu| {
        let cases = cases().min(100);
        let seen = random_programs(
            cases,
            0xDE71_CE5E_ED00,
            || gpu.clone(),
            |_, _, _| {},
            |gpu, ops, overwritten| {
                assert_eq!(overwritten, 0, "a read saw its allocation overwritten: {ops:?}");
                gpu.synchronize(&gpu.default_stream()).unwrap();
                assert_eq!(gpu.take_deferred_error(), None);
            },
        );
        assert!(seen.exact > cases / 2, "{seen:?} of {cases} programs");
    });
}

/// Member A reads its frame's array on a third stream through an `OnStream` that it
/// forgets (the read held); the frame closes and member B, on A's stream, takes the same
/// bytes. Returns what the read saw.
fn forgotten_read_of_a_frame_sees(ignore_waits: bool) -> f32 {
    let sim = SimDevice::new().unwrap();
    let (home, reader) = (sim.default_stream(), sim.new_stream().unwrap());
    let group = DevicePlanGroup::new("G", &sim, &home).unwrap();
    let a = group.workspace("A", &config(), &home).unwrap();
    let b = group.workspace("B", &config(), &home).unwrap();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &reader, 256).unwrap();
    sim.synchronize(&reader).unwrap();
    let mut hold = None;
    let mut slots = Vec::new();
    for replay in [false, true] {
        group.start_iteration(3).unwrap();
        {
            let sa = a.enter().unwrap();
            {
                let frame = sa.frame().unwrap();
                let x = frame.htod(&Array1::from_elem(256, 1.0f32)).unwrap();
                slots.push(x.device_ptr());
                if replay {
                    sim.synchronize(&home).unwrap();
                    sim.ignore_stream_waits(ignore_waits);
                    hold = Some(sim.hold(&reader));
                }
                let mut out_view = out.view_mut();
                let on = frame.on_stream(&reader).unwrap();
                on.dtod(&x, &mut out_view).unwrap();
                forget(on); // only the frame's close can order the read now
            }
            let sb = b.enter().unwrap();
            let y = sb.htod(&Array1::from_elem(256, 2.0f32)).unwrap();
            slots.push(y.device_ptr());
        }
        group.finish_iteration().unwrap();
    }
    assert_eq!(slots[2], slots[3], "the replay gives B the frame's bytes");
    release_and_drain(&sim, hold, [&reader, &home]);
    out.to_host().unwrap()[0]
}

#[test]
fn a_frames_close_orders_a_forgotten_read_before_another_member_reuses_its_bytes() {
    assert_eq!(forgotten_read_of_a_frame_sees(false), 1.0, "the read saw the other member's data");
    assert_eq!(forgotten_read_of_a_frame_sees(true), 2.0, "the bypass shows the race");
}

/// A group with one stream: member A's memory is written on a third stream through a
/// forgotten `OnStream` (held), and the close of A's cycle can order that stream
/// neither by an event nor on the host (failures injected). Member B, on the same
/// stream, then takes the bytes. Returns what B's zeros read afterwards.
fn unordered_write_then_reuse_sees(_: ()) -> f32 {
    let sim = SimDevice::new().unwrap();
    let (home, writer) = (sim.default_stream(), sim.new_stream().unwrap());
    let group = DevicePlanGroup::new("G", &sim, &home).unwrap();
    let a = group.workspace("A", &config(), &home).unwrap();
    let b = group.workspace("B", &config(), &home).unwrap();
    let ones = DeviceArray::htod(&sim, &writer, &Array1::from_elem(256, 1.0f32)).unwrap();
    sim.synchronize(&writer).unwrap();
    let mut seen = 0.0;
    for replay in [false, true] {
        group.start_iteration(5).unwrap();
        let mut hold = None;
        {
            let s = a.enter().unwrap();
            let _src = s.htod(&Array1::from_elem(256, 1.0f32)).unwrap();
            let mut x = s.zeros::<f32, _>(256).unwrap();
            if replay {
                sim.synchronize(&home).unwrap();
                hold = Some(sim.hold(&writer));
                let ones_view = ones.view();
                let on = s.on_stream(&writer).unwrap();
                on.dtod(&ones_view, &mut x).unwrap(); // held: writes x later
                forget(on);
                sim.fail_next_records(2); // the join at the close, and its host wait
            }
        }
        {
            let s = b.enter().unwrap();
            let mut y = None;
            match hold {
                // Over A's bytes: with the wait, taken only once the late write is done.
                Some(hold) => crate::ordering::release_when_blocked(&sim, hold, || {
                    y = Some(s.zeros::<f32, _>(512).unwrap());
                }),
                None => y = Some(s.zeros::<f32, _>(512).unwrap()),
            }
            sim.quiesce();
            sim.synchronize(&writer).unwrap();
            let y = y.unwrap();
            seen = y.to_host().unwrap().sum();
        }
        group.finish_iteration().unwrap();
    }
    assert_eq!(group.streams(), 1);
    sim.synchronize(&writer).unwrap();
    let _ = sim.take_deferred_error();
    seen
}

#[test]
fn a_stream_that_could_not_be_ordered_is_waited_for_before_a_single_stream_group_reuses_bytes() {
    assert_eq!(unordered_write_then_reuse_sees(()), 0.0, "B's zeros were overwritten by the late write");
}

/// Member A, on the group's stream, reads its slot (the read held); then member B joins
/// on a second stream, and a recording iteration lends B the arena's bytes A read.
/// Nothing was recorded while the group had one stream: only the join orders B's stream
/// after A's. Returns what the read saw.
fn late_member_sees(ignore_waits: bool) -> f32 {
    let sim = SimDevice::new().unwrap();
    let (home, s2) = (sim.default_stream(), sim.new_stream().unwrap());
    let group = DevicePlanGroup::new("G", &sim, &home).unwrap();
    let a = group.workspace("A", &config(), &home).unwrap();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &home, 256).unwrap();
    let mut hold = None;
    for replay in [false, true] {
        group.start_iteration(1).unwrap();
        let s = a.enter().unwrap();
        let x = s.htod(&Array1::from_elem(256, 1.0f32)).unwrap();
        if replay {
            out.view_mut().fill_zeros().unwrap();
            sim.synchronize(&home).unwrap();
            sim.ignore_stream_waits(ignore_waits);
            hold = Some(sim.hold(&home));
        }
        out.view_mut().copy_from(&x).unwrap(); // held on the replay
        drop(s);
        group.finish_iteration().unwrap();
    }
    let b = group.workspace("B", &config(), &s2).unwrap();
    group.start_iteration(2).unwrap(); // a new key: recorded, lending the arena
    {
        let s = b.enter().unwrap();
        let y = s.zeros::<f32, _>(256).unwrap();
        assert_eq!(group.stats().arena_bytes, 1024);
        let _ = y;
    }
    group.finish_iteration().unwrap();
    release_and_drain(&sim, hold, [&home, &s2]);
    out.to_host().unwrap()[0]
}

#[test]
fn a_member_joining_on_a_new_stream_waits_for_what_the_group_did_before() {
    assert_eq!(late_member_sees(false), 1.0, "the late member overwrote a slot still being read");
    assert_eq!(late_member_sees(true), 0.0, "the bypass shows the race");
}

/// As `slot_reuse_sees`, with B's bytes reserved raw (`Shell::open` and `Open::alloc`,
/// what a kernel author without views would use) and zeroed by a raw device call.
fn raw_reuse_sees(ignore_waits: bool) -> f32 {
    let sim = SimDevice::new().unwrap();
    let (s1, s2) = (sim.default_stream(), sim.new_stream().unwrap());
    let group = DevicePlanGroup::new("G", &sim, &s1).unwrap();
    let a = group.workspace("A", &config(), &s1).unwrap();
    let b = group.workspace("B", &config(), &s2).unwrap();
    let mut out = DeviceArray::<_, f32>::zeros(&sim, &s1, 256).unwrap();
    let mut hold = None;
    let mut slots = Vec::new();
    for replay in [false, true] {
        group.start_iteration(4).unwrap();
        {
            let sa = a.enter().unwrap();
            let x = sa.htod(&Array1::from_elem(256, 1.0f32)).unwrap();
            slots.push(x.device_ptr());
            if replay {
                sim.synchronize(&s1).unwrap();
                sim.ignore_stream_waits(ignore_waits);
                hold = Some(sim.hold(&s1));
            }
            out.view_mut().copy_from(&x).unwrap(); // queued on A's stream
        }
        {
            let open = b.open().unwrap();
            let (base, offset) = open.alloc(1024, 256).unwrap();
            let address = base + offset as u64;
            slots.push(address);
            // SAFETY: the 1,024 bytes were just reserved in B's open cycle, which lasts
            // until `open` drops; the memset runs on B's stream, which the reservation
            // ordered after every other stream that used them.
            unsafe { sim.memset_zero(&s2, address, 1024).unwrap() };
        }
        group.finish_iteration().unwrap();
    }
    assert_eq!(slots[2], slots[3], "the replay gives B's raw bytes the slot A read");
    release_and_drain(&sim, hold, [&s1, &s2]);
    out.to_host().unwrap()[0]
}

#[test]
fn raw_reservations_of_a_member_are_ordered_too() {
    assert_eq!(raw_reuse_sees(false), 1.0, "a raw reservation overwrote a slot still being read");
    assert_eq!(raw_reuse_sees(true), 0.0, "the bypass shows the race");
}
