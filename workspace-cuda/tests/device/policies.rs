//! The device's side of the policy table. The table itself
//! (`workspace-core/tests/common/policy_suite.rs`, shared with the host suite) runs on
//! every [`Device`] through the [`Target`] implementation below; this file holds what only
//! device workspaces have: handles and leverage across devices' streams, host/device copies,
//! `on_stream`, owned device arrays, pinned staging and running out of device memory. Every
//! function is generic over `D: Device` and runs on the simulator and, where there is one,
//! on a real GPU (see `main.rs`). Expected numbers follow from the device alignment: every
//! allocation occupies a multiple of 256 bytes.

use bytemuck::Pod;
use ndarray::{arr1, Array, Array1, Array2, Dimension, Ix1, ShapeBuilder};
use workspace_core::backend::{Placement, ScopeKind};
use workspace_core::{
    AllocationPolicy, Error as CoreError, LearningPolicy, Location, Workspace, WorkspaceConfig, WorkspaceConfigBuilder,
    WorkspaceStats,
};
use workspace_cuda::{Device, DeviceArray, DeviceScope, DeviceViewMut, DeviceWorkspace, Error, PinnedWorkspace};

use crate::policy_suite::Target;

impl<D: Device> Target for D {
    type Ws = DeviceWorkspace<D>;
    type Scope<'w>
        = DeviceScope<'w, D>
    where
        D: 'w;
    type Array<'s, E: Pod, Dim: Dimension>
        = DeviceViewMut<'s, D, E, Dim>
    where
        D: 's;
    type Error = Error;

    const UNIT: usize = workspace_cuda::DEVICE_ALIGNMENT;

    fn backend(&self) -> &'static str {
        D::ARENA_KIND
    }

    fn builder(&self) -> WorkspaceConfigBuilder {
        WorkspaceConfig::builder()
    }

    fn default_config(&self) -> WorkspaceConfig {
        WorkspaceConfig::default()
    }

    fn named(&self, name: &str, config: WorkspaceConfig) -> DeviceWorkspace<D> {
        named(self, name, config)
    }

    fn enter<'w>(ws: &'w DeviceWorkspace<D>) -> Result<DeviceScope<'w, D>, Error>
    where
        D: 'w,
    {
        ws.enter()
    }

    fn borrow_open<'w>(ws: &'w DeviceWorkspace<D>) -> Result<DeviceScope<'w, D>, Error>
    where
        D: 'w,
    {
        ws.borrow_open()
    }

    fn trim(ws: &DeviceWorkspace<D>) -> Result<(), Error> {
        ws.trim()
    }

    fn generation(ws: &DeviceWorkspace<D>) -> u64 {
        ws.generation()
    }

    fn is_open(ws: &DeviceWorkspace<D>) -> bool {
        ws.is_open()
    }

    fn capacity(ws: &DeviceWorkspace<D>) -> usize {
        ws.capacity()
    }

    fn bytes_in_use(ws: &DeviceWorkspace<D>) -> usize {
        ws.bytes_in_use()
    }

    fn stats(ws: &DeviceWorkspace<D>) -> WorkspaceStats {
        ws.stats()
    }

    fn reset_peak(ws: &DeviceWorkspace<D>) {
        ws.reset_peak()
    }

    fn cycle_history(ws: &DeviceWorkspace<D>) -> Vec<usize> {
        ws.cycle_history()
    }

    fn config(ws: &DeviceWorkspace<D>) -> &WorkspaceConfig {
        ws.config()
    }

    fn kind(scope: &DeviceScope<'_, D>) -> ScopeKind {
        scope.kind()
    }

    fn zeros<'s, E: Pod, Sh: ShapeBuilder>(
        scope: &'s DeviceScope<'_, D>,
        shape: Sh,
    ) -> Result<DeviceViewMut<'s, D, E, Sh::Dim>, Error>
    where
        D: 's,
    {
        scope.zeros(shape)
    }

    fn uninit_address<E: Pod>(scope: &DeviceScope<'_, D>, len: usize) -> Result<usize, Error> {
        scope.uninit::<E, _>(len).map(|mut v| v.device_ptr_mut() as usize)
    }

    fn from_host<'s, E: Pod>(
        scope: &'s DeviceScope<'_, D>,
        values: &Array1<E>,
    ) -> Result<DeviceViewMut<'s, D, E, Ix1>, Error>
    where
        D: 's,
    {
        scope.htod(values)
    }

    fn write<E: Pod, Dim: Dimension>(array: &mut DeviceViewMut<'_, D, E, Dim>, values: &Array<E, Dim>) {
        array.htod_from(values).unwrap();
    }

    fn to_host<E: Pod, Dim: Dimension>(array: &DeviceViewMut<'_, D, E, Dim>) -> Array<E, Dim> {
        array.to_host().unwrap()
    }

    fn address<E: Pod, Dim: Dimension>(array: &DeviceViewMut<'_, D, E, Dim>) -> usize {
        array.device_ptr() as usize
    }

    fn placement<E: Pod, Dim: Dimension>(
        scope: &DeviceScope<'_, D>,
        array: &DeviceViewMut<'_, D, E, Dim>,
    ) -> Placement {
        scope.placement(array)
    }

    fn core(err: &Error) -> Option<&CoreError> {
        match err {
            Error::Workspace(core) => Some(core),
            _ => None,
        }
    }
}

pub(crate) fn named<D: Device>(dev: &D, name: &str, config: WorkspaceConfig) -> DeviceWorkspace<D> {
    DeviceWorkspace::new(name, config, dev, &dev.default_stream()).unwrap()
}

fn ws<D: Device>(dev: &D, config: WorkspaceConfig) -> DeviceWorkspace<D> {
    named(dev, "T", config)
}

fn strict() -> WorkspaceConfigBuilder {
    WorkspaceConfig::builder().allocation(AllocationPolicy::Strict)
}

pub(crate) fn fixed(bytes: usize) -> WorkspaceConfig {
    strict().learning(LearningPolicy::None).initial_size(bytes).build().unwrap()
}

pub(crate) fn borrowing_an_open_workspace_does_not_reset_it<D: Device>(dev: &D) {
    let outer_ws = named(dev, "OUTER", WorkspaceConfig::default());
    let inner_ws = named(dev, "INNER", WorkspaceConfig::default());
    let outer = outer_ws.enter().unwrap();
    let generation = outer_ws.generation();
    let kept = {
        let inner = inner_ws.enter().unwrap();
        let x = inner.htod(&Array2::from_elem((3, 3), 2.0f64)).unwrap();
        let borrowed = outer_ws.borrow_open().unwrap();
        assert_eq!(borrowed.kind(), ScopeKind::Borrowed);
        let kept = borrowed.copy_handle(&x).unwrap();
        drop(borrowed);
        assert_eq!(outer_ws.generation(), generation, "borrowing opens no generation");
        kept
    }; // INNER resets here
    assert_eq!(kept.to_host(&outer).unwrap().sum(), 18.0);
    assert_eq!(kept.workspace_name().as_ref(), "OUTER");
}

pub(crate) fn stale_handles_name_the_workspace_the_generations_and_the_fix<D: Device>(dev: &D) {
    let a = named(dev, "ALPHA", WorkspaceConfig::default());
    let mut h = {
        let s = a.enter().unwrap();
        let mut h = s.zeros_handle::<f32, _>((2, 3)).unwrap();
        h.view_mut(&s).unwrap().htod_from(&Array2::from_elem((2, 3), 1.0)).unwrap();
        assert_eq!(h.to_host(&s).unwrap().sum(), 6.0);
        h
    };
    let s = a.enter().unwrap();
    let err = h.view_mut(&s).expect_err("stale");
    assert!(matches!(
        err,
        Error::Workspace(CoreError::StaleHandle { array_generation: 1, workspace_generation: 2, .. })
    ));
    let msg = err.to_string();
    for needle in ["'ALPHA'", "generation 1", "generation 2", "detach()", "leverage_to"] {
        assert!(msg.contains(needle), "message lacks {needle}: {msg}");
    }
    assert!(h.detach(&s).is_err() && h.to_host(&s).is_err());
}

pub(crate) fn foreign_handles_are_refused_and_leverage_moves_them<D: Device>(dev: &D) {
    let a = named(dev, "ALPHA", WorkspaceConfig::default());
    let b = named(dev, "BETA", WorkspaceConfig::default());
    let (sa, sb) = (a.enter().unwrap(), b.enter().unwrap());
    let h = sa.htod_handle(&arr1(&[1.0f32, 2.0, 3.0, 4.0])).unwrap();
    let err = h.view(&sb).expect_err("foreign");
    assert!(matches!(err, Error::Workspace(CoreError::WrongWorkspace { .. })));
    assert!(err.to_string().contains("'ALPHA'") && err.to_string().contains("'BETA'"), "{err}");
    let moved = h.leverage_to(&sa, &sb).unwrap();
    assert_eq!(moved.view(&sb).unwrap().shape(), &[4]);
    assert_eq!(moved.workspace_name().as_ref(), "BETA");
    assert_eq!(moved.to_host(&sb).unwrap(), arr1(&[1.0, 2.0, 3.0, 4.0]));
}

pub(crate) fn leverage_to_a_closed_workspace_is_an_error<D: Device>(dev: &D) {
    let source = named(dev, "SRC", WorkspaceConfig::default());
    let target = named(dev, "OUT", WorkspaceConfig::default());
    let s = source.enter().unwrap();
    let h = s.htod_handle(&arr1(&[5u16, 6, 7])).unwrap();
    let err = h.leverage_to_workspace(&s, &target).expect_err("closed target");
    assert!(matches!(err, Error::Workspace(CoreError::NotOpen { .. })), "{err:?}");
    assert!(err.to_string().contains("'OUT'"), "{err}");
    let open = target.enter().unwrap();
    let moved = h.leverage_to_workspace(&s, &target).unwrap();
    drop(s); // SRC resets; the copy in OUT survives
    assert_eq!(moved.to_host(&open).unwrap(), arr1(&[5, 6, 7]));
}

pub(crate) fn detach_copies_exact_values_that_survive_the_reset<D: Device>(dev: &D) {
    let w = ws(dev, fixed(4096));
    let expected = Array2::from_shape_fn((3, 4), |(i, j)| (i * 10 + j) as f32);
    let (owned, first) = {
        let s = w.enter().unwrap();
        let x = s.htod(&expected).unwrap();
        (x.detach().unwrap(), s.placement(&x))
    };
    {
        // The next cycle overwrites the same arena bytes.
        let s = w.enter().unwrap();
        let y = s.htod(&Array2::from_elem((3, 4), -1.0f32)).unwrap();
        assert_eq!(s.placement(&y), first);
    }
    assert_eq!(owned.shape(), &[3, 4]);
    assert_eq!(owned.to_host().unwrap(), expected);
}

pub(crate) fn copies_follow_logical_order_for_any_host_layout<D: Device>(dev: &D) {
    let w = ws(dev, WorkspaceConfig::default());
    let s = w.enter().unwrap();
    let host = Array2::from_shape_fn((3, 4), |(i, j)| (i * 10 + j) as f32);
    let transposed = s.htod(&host.t()).unwrap(); // a non-contiguous source
    assert_eq!(transposed.shape(), &[4, 3]);
    assert_eq!(transposed.to_host().unwrap(), host.t());
    let mut target = Array2::<f32>::zeros((3, 4));
    let mut target_t = target.view_mut().reversed_axes(); // a non-contiguous destination
    transposed.dtoh_into(&mut target_t).unwrap();
    assert_eq!(target, host);
    let err = transposed.dtoh_into(&mut Array2::<f32>::zeros((3, 4))).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    assert!(err.to_string().contains("[4, 3]") && err.to_string().contains("[3, 4]"), "{err}");
}

pub(crate) fn leverage_into_an_outer_workspace_survives_the_inner_reset<D: Device>(dev: &D) {
    let outer_ws = named(dev, "OUTER", WorkspaceConfig::default());
    let inner_ws = named(dev, "INNER", WorkspaceConfig::default());
    let outer = outer_ws.enter().unwrap();
    let kept = {
        let inner = inner_ws.enter().unwrap();
        let x = inner.htod(&Array1::from_shape_fn(100, |i| i as i32)).unwrap();
        x.leverage_to(&outer).unwrap()
    };
    assert_eq!(kept.workspace_name().as_ref(), "OUTER");
    assert_eq!(kept.to_host().unwrap().sum(), 4950);
}

pub(crate) fn leverage_across_streams_orders_both_streams<D: Device>(dev: &D) {
    let other = dev.new_stream().unwrap();
    let source = named(dev, "SRC", WorkspaceConfig::default());
    let target = DeviceWorkspace::new("DST", WorkspaceConfig::default(), dev, &other).unwrap();
    let out = target.enter().unwrap();
    let mut copies = Vec::new();
    for round in 0..4 {
        let s = source.enter().unwrap();
        let x = s.htod(&Array1::from_elem(4096, round as f32)).unwrap();
        copies.push(x.leverage_to(&out).unwrap());
        // The source memory is reused next round, right after the copy was issued.
    }
    for (round, copy) in copies.iter().enumerate() {
        assert_eq!(copy.to_host().unwrap().sum(), 4096.0 * round as f32);
    }
}

pub(crate) fn bad_input_is_a_typed_error<D: Device>(dev: &D) {
    let w = ws(dev, WorkspaceConfig::default());
    let s = w.enter().unwrap();
    // Shapes with no elements or too many bytes: the table's `bad_shapes_are_a_typed_error`.
    let mut v = s.zeros::<f32, _>(4).unwrap();
    let err = v.htod_from(&arr1(&[1.0f32; 5])).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    let err = DeviceArray::<D, f32>::zeros(dev, &dev.default_stream(), 0).unwrap_err();
    assert!(matches!(err, Error::Workspace(CoreError::ZeroLength { .. })), "{err:?}");
}

pub(crate) fn out_of_device_memory_is_an_error_and_the_workspace_stays_usable<D: Device>(dev: &D) {
    let w = ws(dev, WorkspaceConfig::default());
    let s = w.enter().unwrap();
    // A petabyte: representable, but no device (and no simulator) has it.
    let err = s.zeros::<u8, _>(1usize << 50).expect_err("out of memory");
    assert!(matches!(err, Error::Workspace(CoreError::Backend { .. })), "{err:?}");
    assert!(err.to_string().contains("'T'") && err.to_string().contains("out of memory"), "{err}");
    assert_eq!(s.htod(&arr1(&[3u8, 4])).unwrap().to_host().unwrap(), arr1(&[3, 4]));
}

/// Workspaces are `Send` (the table's `workspace_is_send_and_runs_on_another_thread`), and
/// so are handles and owned arrays.
pub(crate) fn handles_and_owned_arrays_are_send<D: Device>(_: &D) {
    fn is_send<T: Send>() {}
    is_send::<DeviceWorkspace<D>>();
    is_send::<workspace_cuda::DeviceHandle<f32, ndarray::Ix2>>();
    is_send::<DeviceArray<D, f32>>();
}

pub(crate) fn host_and_device_workspaces_copy_both_ways<D: Device>(dev: &D) {
    let host_ws = Workspace::new("HOST", WorkspaceConfig::default()).unwrap();
    let device_ws = named(dev, "DEV", WorkspaceConfig::default());
    let host = host_ws.enter().unwrap();
    let a = host.from_shape_fn((8, 16), |(i, j)| (i * 16 + j) as f32).unwrap();
    let scope = device_ws.enter().unwrap();
    let on_device = scope.htod(&a).unwrap();
    let back = on_device.dtoh_in(&host).unwrap();
    assert_eq!(back, a);
    assert!(host.holds(&back), "the copy lives in the host workspace");
    let mut into = host.zeros::<f32, _>((8, 16)).unwrap();
    on_device.dtoh_into(&mut into).unwrap();
    assert_eq!(into, a);
}

/// Uninitialised arrays over memory of an earlier cycle, filled from the host and from the
/// device (zeros over such memory: the table's `zeros_are_zero_even_over_memory_of_an_earlier_cycle`).
pub(crate) fn uninit_arrays_fill_from_the_host_and_from_the_device<D: Device>(dev: &D) {
    let w = ws(dev, fixed(4096));
    let first = {
        let s = w.enter().unwrap();
        let x = s.htod(&Array1::from_elem(1024, u32::MAX)).unwrap();
        s.placement(&x)
    };
    let s = w.enter().unwrap();
    let filled = s.uninit::<u32, _>(1024).unwrap().htod_from(&Array1::from_elem(1024, 3)).unwrap();
    let copied = s.uninit::<u32, _>(1024).unwrap().copy_from(&filled).unwrap();
    assert_eq!(s.placement(&filled), first, "over the earlier cycle's array");
    assert_eq!(filled.to_host().unwrap(), Array1::from_elem(1024, 3));
    assert_eq!(copied.to_host().unwrap().sum(), 3 * 1024);
}

pub(crate) fn on_stream_orders_work_both_ways<D: Device>(dev: &D) {
    let copy_stream = dev.new_stream().unwrap();
    let w = ws(dev, WorkspaceConfig::default());
    let mut kept = DeviceArray::<D, f32>::zeros(dev, &copy_stream, 512).unwrap();
    let mut host = Array1::<f32>::zeros(512);
    {
        let s = w.enter().unwrap();
        let mut x = s.htod(&Array1::from_elem(512, 1.5f32)).unwrap();
        let mut kept_view = kept.view_mut();
        let on = s.on_stream(&copy_stream).unwrap();
        on.dtod(&x, &mut kept_view).unwrap(); // sees the home stream's write
        on.dtoh(&x, &mut host).unwrap();
        on.finish().unwrap();
        x.htod_from(&Array1::from_elem(512, 9.0f32)).unwrap(); // after the copy, on the home stream
    }
    assert_eq!(host.sum(), 768.0);
    assert_eq!(kept.to_host().unwrap().sum(), 768.0);
}

pub(crate) fn on_stream_refuses_memory_it_cannot_order<D: Device>(dev: &D) {
    let copy_stream = dev.new_stream().unwrap();
    let w = named(dev, "MINE", WorkspaceConfig::default());
    let other = named(dev, "OTHER", WorkspaceConfig::default());
    let (s, t) = (w.enter().unwrap(), other.enter().unwrap());
    let foreign = t.htod(&Array1::from_elem(8, 1u8)).unwrap();
    let mut mine = s.zeros::<u8, _>(8).unwrap();
    let mut on_home = DeviceArray::<D, u8>::zeros(dev, &dev.default_stream(), 8).unwrap();
    let mut on_home_view = on_home.view_mut();
    let mine_view = s.zeros::<u8, _>(8).unwrap();
    let on = s.on_stream(&copy_stream).unwrap();
    let err = on.dtod(&foreign, &mut mine).unwrap_err();
    assert!(matches!(err, Error::StreamMismatch { .. }), "{err:?}");
    assert!(err.to_string().contains("'OTHER'") && err.to_string().contains("on_stream"), "{err}");
    let err = on.dtod(&mine_view, &mut on_home_view).unwrap_err();
    assert!(err.to_string().contains("owned device array"), "{err}");
}

pub(crate) fn owned_arrays_round_trip_and_detach_from_handles<D: Device>(dev: &D) {
    let host = Array2::from_shape_fn((5, 7), |(i, j)| (i as i64) - (j as i64));
    let owned = DeviceArray::htod(dev, &dev.default_stream(), &host).unwrap();
    assert_eq!((owned.len(), owned.shape()), (35, &[5usize, 7][..]));
    assert_eq!(owned.to_host().unwrap(), host);
    let w = ws(dev, WorkspaceConfig::default());
    let s = w.enter().unwrap();
    let in_ws = s.copy_of(&owned.view()).unwrap();
    let h = s.copy_handle(&in_ws).unwrap();
    let detached = h.detach(&s).unwrap();
    drop(s);
    assert_eq!(detached.to_host().unwrap(), host);
    let zeros = DeviceArray::<D, u16, _>::zeros(dev, &dev.default_stream(), (2, 2)).unwrap();
    assert_eq!(zeros.to_host().unwrap(), Array2::<u16>::zeros((2, 2)));
}

pub(crate) fn pinned_staging_round_trips_and_is_bounded<D: Device>(dev: &D) {
    let staging = PinnedWorkspace::for_transfers("STAGE", dev, 8192).unwrap();
    let w = ws(dev, WorkspaceConfig::default());
    let host = Array2::from_shape_fn((16, 32), |(i, j)| (i * 32 + j) as f32); // 2048 bytes
    for _ in 0..3 {
        let stage = staging.enter().unwrap();
        let up = stage.copy_of(&host).unwrap();
        let s = w.enter().unwrap();
        let on_device = s.htod_pinned(&up).unwrap();
        let mut down = stage.zeros::<f32, _>((16, 32)).unwrap();
        on_device.dtoh_pinned(&mut down).unwrap();
        assert_eq!(down.view().unwrap(), host);
        let err = stage.zeros::<u8, _>(8192).expect_err("bounded");
        assert!(matches!(err, Error::Workspace(CoreError::Exhausted { .. })), "{err:?}");
    }
    let stats = staging.stats();
    assert_eq!((stats.capacity, stats.pinned_allocations, stats.cycles), (8192, 1, 3));
    assert_eq!(stats.backend, D::PINNED_KIND);
}

pub(crate) fn pinned_workspaces_must_be_bounded<D: Device>(dev: &D) {
    let err = PinnedWorkspace::new("UNBOUNDED", WorkspaceConfig::default(), dev).unwrap_err();
    assert!(matches!(err, Error::Workspace(CoreError::InvalidConfig { .. })), "{err:?}");
    assert!(err.to_string().contains("max_size") && err.to_string().contains("for_transfers"), "{err}");
    let mapped = WorkspaceConfig::builder()
        .location(Location::MmapAnonymous)
        .learning(LearningPolicy::None)
        .initial_size(4096)
        .max_size(4096)
        .build()
        .unwrap();
    assert!(PinnedWorkspace::new("MAPPED", mapped.clone(), dev).is_err());
    let err = DeviceWorkspace::new("MAPPED", mapped, dev, &dev.default_stream()).unwrap_err();
    assert!(err.to_string().contains("Location::Ram"), "{err}");
}

pub(crate) fn pinned_learning_stays_flat_after_warm_up<D: Device>(dev: &D) {
    let config = strict().max_size(1 << 20).build().unwrap();
    let staging = PinnedWorkspace::new("LEARN", config, dev).unwrap();
    for _ in 0..5 {
        let stage = staging.enter().unwrap();
        stage.filled::<f32, _>(1000, 1.0).unwrap();
        stage.filled::<f32, _>(1000, 2.0).unwrap();
    }
    let stats = staging.stats();
    // One spill chunk while learning (4000 at 0, 4000 at 4032: 8032 bytes), then the learned
    // arena (8064, a multiple of 64); nothing after warm-up.
    assert_eq!((stats.pinned_allocations, stats.growth_events, stats.capacity), (2, 1, 8064));
}

/// Device workspaces that are members of a device plan group of their own (on a second
/// stream of the device, so that the group orders its streams), every cycle an
/// iteration with a key of its own: each is recorded, so the member allocates as an
/// unplanned device workspace of its configuration would, and the table's outcomes must
/// hold as they are. (Replays, with memory from the group's arena, are compared in
/// `planned.rs`.)
pub(crate) struct DeviceMember<D: Device>(pub(crate) D);

/// A member and its group; the next iteration's key.
pub(crate) struct MemberWs<D: Device> {
    group: workspace_cuda::DevicePlanGroup<D>,
    ws: DeviceWorkspace<D>,
    key: std::cell::Cell<u64>,
}

/// A scope of a member; the one that opened its cycle ends the iteration after it.
pub(crate) struct MemberScope<'w, D: Device> {
    scope: Option<DeviceScope<'w, D>>,
    iteration: Option<&'w workspace_cuda::DevicePlanGroup<D>>,
}

impl<'w, D: Device> MemberScope<'w, D> {
    fn scope(&self) -> &DeviceScope<'w, D> {
        self.scope.as_ref().expect("the scope lives as long as this")
    }
}

impl<D: Device> Drop for MemberScope<'_, D> {
    fn drop(&mut self) {
        drop(self.scope.take());
        if let Some(group) = self.iteration {
            group.finish_iteration().expect("an iteration ends");
        }
    }
}

impl<D: Device> Target for DeviceMember<D> {
    type Ws = MemberWs<D>;
    type Scope<'w>
        = MemberScope<'w, D>
    where
        D: 'w;
    type Array<'s, E: Pod, Dim: Dimension>
        = DeviceViewMut<'s, D, E, Dim>
    where
        D: 's;
    type Error = Error;

    const UNIT: usize = workspace_cuda::DEVICE_ALIGNMENT;

    fn backend(&self) -> &'static str {
        D::ARENA_KIND
    }

    fn builder(&self) -> WorkspaceConfigBuilder {
        WorkspaceConfig::builder()
    }

    fn default_config(&self) -> WorkspaceConfig {
        WorkspaceConfig::default()
    }

    fn named(&self, name: &str, config: WorkspaceConfig) -> MemberWs<D> {
        let dev = &self.0;
        let group = workspace_cuda::DevicePlanGroup::new("MEMBERS", dev, &dev.default_stream()).unwrap();
        let ws = group.workspace(name, &config, &dev.new_stream().unwrap()).unwrap();
        MemberWs { group, ws, key: std::cell::Cell::new(0) }
    }

    fn enter<'w>(ws: &'w MemberWs<D>) -> Result<MemberScope<'w, D>, Error>
    where
        D: 'w,
    {
        let opens = !ws.ws.is_open();
        if opens {
            ws.key.set(ws.key.get() + 1);
            ws.group.start_iteration(ws.key.get())?;
        }
        match ws.ws.enter() {
            Ok(scope) => Ok(MemberScope { scope: Some(scope), iteration: opens.then_some(&ws.group) }),
            Err(err) => {
                if opens {
                    ws.group.abandon_iteration()?;
                }
                Err(err)
            }
        }
    }

    fn borrow_open<'w>(ws: &'w MemberWs<D>) -> Result<MemberScope<'w, D>, Error>
    where
        D: 'w,
    {
        Ok(MemberScope { scope: Some(ws.ws.borrow_open()?), iteration: None })
    }

    fn trim(ws: &MemberWs<D>) -> Result<(), Error> {
        ws.ws.trim()
    }

    fn generation(ws: &MemberWs<D>) -> u64 {
        ws.ws.generation()
    }

    fn is_open(ws: &MemberWs<D>) -> bool {
        ws.ws.is_open()
    }

    fn capacity(ws: &MemberWs<D>) -> usize {
        ws.ws.capacity()
    }

    fn bytes_in_use(ws: &MemberWs<D>) -> usize {
        ws.ws.bytes_in_use()
    }

    fn stats(ws: &MemberWs<D>) -> WorkspaceStats {
        ws.ws.stats()
    }

    fn reset_peak(ws: &MemberWs<D>) {
        ws.ws.reset_peak()
    }

    fn cycle_history(ws: &MemberWs<D>) -> Vec<usize> {
        ws.ws.cycle_history()
    }

    fn config(ws: &MemberWs<D>) -> &WorkspaceConfig {
        ws.ws.config()
    }

    fn kind(scope: &MemberScope<'_, D>) -> ScopeKind {
        scope.scope().kind()
    }

    fn zeros<'s, E: Pod, Sh: ShapeBuilder>(
        scope: &'s MemberScope<'_, D>,
        shape: Sh,
    ) -> Result<DeviceViewMut<'s, D, E, Sh::Dim>, Error>
    where
        D: 's,
    {
        scope.scope().zeros(shape)
    }

    fn uninit_address<E: Pod>(scope: &MemberScope<'_, D>, len: usize) -> Result<usize, Error> {
        <D as Target>::uninit_address::<E>(scope.scope(), len)
    }

    fn from_host<'s, E: Pod>(
        scope: &'s MemberScope<'_, D>,
        values: &Array1<E>,
    ) -> Result<DeviceViewMut<'s, D, E, Ix1>, Error>
    where
        D: 's,
    {
        scope.scope().htod(values)
    }

    fn write<E: Pod, Dim: Dimension>(array: &mut DeviceViewMut<'_, D, E, Dim>, values: &Array<E, Dim>) {
        <D as Target>::write(array, values)
    }

    fn to_host<E: Pod, Dim: Dimension>(array: &DeviceViewMut<'_, D, E, Dim>) -> Array<E, Dim> {
        <D as Target>::to_host(array)
    }

    fn address<E: Pod, Dim: Dimension>(array: &DeviceViewMut<'_, D, E, Dim>) -> usize {
        <D as Target>::address(array)
    }

    fn placement<E: Pod, Dim: Dimension>(
        scope: &MemberScope<'_, D>,
        array: &DeviceViewMut<'_, D, E, Dim>,
    ) -> Placement {
        scope.scope().placement(array)
    }

    fn core(err: &Error) -> Option<&CoreError> {
        <D as Target>::core(err)
    }
}
