//! Sizes and alignments at their limits, on both devices: configured alignments above the
//! device's own (honoured up to `MAX_DEVICE_ALIGNMENT`, refused beyond it), and shapes
//! whose element count or byte size does not fit (typed errors for every element type,
//! zero-sized ones included). Every function is generic over `D: Device` and runs in
//! `limits::sim` on the simulated device, whose allocations are aligned to exactly what
//! the device promises and no more, and in `limits::cuda` on GPU 0 where there is one.

use ndarray::{Array1, IxDyn};
use workspace_core::{
    AllocationPolicy, Error as CoreError, LearningPolicy, ResetPolicy, SpillPolicy, WorkspaceConfig,
    WorkspaceConfigBuilder,
};
use workspace_cuda::{Device, DeviceArray, DeviceWorkspace, Error, PinnedWorkspace};

use crate::policies::named;

macro_rules! on_both {
    ($($name:ident),* $(,)?) => {
        /// On the simulated device.
        mod sim {
            $( #[test] fn $name() { crate::on_sim(super::$name::<workspace_cuda::device::sim::SimDevice>) } )*
        }
        /// On a real GPU, skipped without one.
        mod cuda {
            $( #[test] fn $name() { crate::on_gpu(super::$name::<workspace_cuda::CudaDevice>) } )*
        }
    };
}

on_both!(
    configured_alignments_above_the_device_alignment_are_honoured,
    alignments_beyond_what_a_device_can_pad_are_refused_at_creation,
    element_counts_beyond_isize_max_are_shape_overflows_for_every_element_type,
);

fn strict() -> WorkspaceConfigBuilder {
    WorkspaceConfig::builder().allocation(AllocationPolicy::Strict)
}

/// Checks that `address` is a multiple of `align`.
fn assert_aligned(address: usize, align: usize, what: &str) {
    assert_eq!(address % align, 0, "{what} at {address:#x} is not aligned to the configured {align}");
}

/// Sizes that do not divide any of the alignments, so packing them would misalign the next.
const ODD_SIZES: [usize; 7] = [1, 3, 255, 257, 1000, 4097, 5];

fn configured_alignments_above_the_device_alignment_are_honoured<D: Device>(dev: &D) {
    for align in [512, 4096, 8192, 65536] {
        let configs = [
            ("FIXED", strict().learning(LearningPolicy::None).initial_size(3 * align + 100)),
            ("LEARNING", WorkspaceConfig::builder()),
            (
                "CIRCULAR",
                strict().learning(LearningPolicy::None).initial_size(8 * align).reset(ResetPolicy::EndOfBuffer),
            ),
            ("SPILLING", strict().learning(LearningPolicy::None).initial_size(align).spill(SpillPolicy::Reallocate)),
        ];
        for (name, builder) in configs {
            let w = named(dev, name, builder.alignment(align).build().unwrap());
            assert_eq!(w.config().alignment(), align, "{name}");
            for cycle in 0..3u8 {
                let scope = w.enter().unwrap();
                let mut written = Vec::new();
                for (i, &n) in ODD_SIZES.iter().enumerate() {
                    let what = format!("{name}, alignment {align}, cycle {cycle}, allocation {i} of {n}");
                    let value = cycle.wrapping_mul(16).wrapping_add(i as u8);
                    let bytes = scope.htod(&Array1::from_elem(n, value)).unwrap();
                    assert_aligned(bytes.device_ptr() as usize, align, &format!("u8 {what}"));
                    let doubles = scope.zeros::<f64, _>((n, 3)).unwrap();
                    assert_aligned(doubles.device_ptr() as usize, align, &format!("f64 {what}"));
                    let mut halves = scope.uninit::<u16, _>(n).unwrap();
                    assert_aligned(halves.device_ptr_mut() as usize, align, &format!("u16 {what}"));
                    let triples = scope.zeros::<[u8; 3], _>(n).unwrap();
                    assert_aligned(triples.device_ptr() as usize, align, &format!("[u8; 3] {what}"));
                    let handle = scope.zeros_handle::<f32, _>(n).unwrap();
                    let view = handle.view(&scope).unwrap();
                    assert_aligned(view.device_ptr() as usize, align, &format!("f32 handle {what}"));
                    written.push((bytes, value));
                }
                // Padding to the alignment never made two allocations overlap.
                for (bytes, value) in written {
                    assert!(bytes.to_host().unwrap().iter().all(|&b| b == value), "{name}, alignment {align}");
                }
            }
        }
        let pinned = [
            ("PINNED-LEARNING", strict().max_size(64 << 20)),
            ("PINNED-FIXED", strict().learning(LearningPolicy::None).initial_size(align).max_size(64 << 20)),
        ];
        for (name, builder) in pinned {
            let staging = PinnedWorkspace::new(name, builder.alignment(align).build().unwrap(), dev).unwrap();
            for cycle in 0..3 {
                let stage = staging.enter().unwrap();
                for (i, &n) in ODD_SIZES.iter().enumerate() {
                    let what = format!("{name}, alignment {align}, cycle {cycle}, allocation {i} of {n}");
                    let bytes = stage.filled::<u8, _>(n, i as u8).unwrap();
                    assert_aligned(bytes.view().unwrap().as_ptr() as usize, align, &format!("pinned u8 {what}"));
                    let doubles = stage.zeros::<f64, _>((n, 2)).unwrap();
                    assert_aligned(doubles.view().unwrap().as_ptr() as usize, align, &format!("pinned f64 {what}"));
                    assert!(bytes.view().unwrap().iter().all(|&b| b == i as u8), "{what}");
                }
            }
        }
    }
    // The largest alignment, in an arena and in spills.
    let align = workspace_cuda::MAX_DEVICE_ALIGNMENT;
    let w = named(
        dev,
        "LARGEST",
        strict().learning(LearningPolicy::None).initial_size(align).alignment(align).build().unwrap(),
    );
    let s = w.enter().unwrap();
    for n in [1, 3000, 5] {
        assert_aligned(s.zeros::<u8, _>(n).unwrap().device_ptr() as usize, align, "the largest alignment");
    }
}

fn alignments_beyond_what_a_device_can_pad_are_refused_at_creation<D: Device>(dev: &D) {
    for align in [4 << 20, 1 << 30] {
        let config = WorkspaceConfig::builder().alignment(align).build().unwrap();
        let err = DeviceWorkspace::new("HUGE", config.clone(), dev, &dev.default_stream()).expect_err("too large");
        assert!(matches!(err, Error::Workspace(CoreError::InvalidConfig { .. })), "{err:?}");
        assert!(err.to_string().contains("alignment") && err.to_string().contains("HUGE"), "{err}");
        let bounded = WorkspaceConfig::builder().alignment(align).max_size(1 << 31).build().unwrap();
        let err = PinnedWorkspace::new("HUGE", bounded, dev).expect_err("too large");
        assert!(matches!(err, Error::Workspace(CoreError::InvalidConfig { .. })), "{err:?}");
    }
    // The largest alignment is accepted.
    let config = WorkspaceConfig::builder().alignment(workspace_cuda::MAX_DEVICE_ALIGNMENT).build().unwrap();
    assert!(DeviceWorkspace::new("LARGEST", config, dev, &dev.default_stream()).is_ok());
}

/// Every way of allocating `dim` elements of `T` in device or pinned memory, each with the
/// error it returned (or `None` when it succeeded).
fn allocation_errors<D: Device, T: bytemuck::Pod>(dev: &D, dim: IxDyn) -> Vec<(&'static str, Option<Error>)> {
    let w = named(dev, "T", WorkspaceConfig::default());
    let s = w.enter().unwrap();
    let staging = PinnedWorkspace::for_transfers("STAGE", dev, 4096).unwrap();
    let stage = staging.enter().unwrap();
    vec![
        ("DeviceScope::zeros", s.zeros::<T, _>(dim.clone()).err()),
        ("DeviceScope::uninit", s.uninit::<T, _>(dim.clone()).err()),
        ("DeviceScope::zeros_handle", s.zeros_handle::<T, _>(dim.clone()).err()),
        ("DeviceArray::zeros", DeviceArray::<D, T, _>::zeros(dev, &dev.default_stream(), dim.clone()).err()),
        ("PinnedScope::zeros", stage.zeros::<T, _>(dim.clone()).err()),
    ]
}

fn overflow_case<D: Device, T: bytemuck::Pod>(dev: &D) {
    let huge = isize::MAX as usize + 1;
    for shape in [vec![usize::MAX], vec![huge], vec![2, huge / 2], vec![usize::MAX / 2, 3], vec![1 << 40, 1 << 40]] {
        for (call, err) in allocation_errors::<D, T>(dev, IxDyn(&shape)) {
            let what = format!("{call}::<{}>({shape:?})", std::any::type_name::<T>());
            match err {
                Some(Error::Workspace(CoreError::ShapeOverflow { shape: ref reported, element_size, .. })) => {
                    assert_eq!((reported, element_size), (&shape, std::mem::size_of::<T>()), "{what}");
                }
                other => panic!("{what}: expected a shape overflow, got {other:?}"),
            }
        }
    }
}

fn element_counts_beyond_isize_max_are_shape_overflows_for_every_element_type<D: Device>(dev: &D) {
    overflow_case::<D, u8>(dev);
    overflow_case::<D, u16>(dev);
    overflow_case::<D, f32>(dev);
    overflow_case::<D, f64>(dev);
    overflow_case::<D, [u8; 3]>(dev);
    overflow_case::<D, [f64; 32]>(dev);
    overflow_case::<D, ()>(dev);
    overflow_case::<D, [f32; 0]>(dev);
    // Zero-sized elements in a shape that fits: a typed error too, never a panic.
    for (call, err) in allocation_errors::<D, ()>(dev, IxDyn(&[5])) {
        let err = err.unwrap_or_else(|| panic!("{call}: zero-sized elements were accepted"));
        assert!(matches!(err, Error::Workspace(CoreError::InvalidInput(_))), "{call}: {err:?}");
        assert!(err.to_string().contains("zero-sized") && err.to_string().contains("()"), "{call}: {err}");
    }
    for (call, err) in allocation_errors::<D, ()>(dev, IxDyn(&[3, 0])) {
        assert!(matches!(err, Some(Error::Workspace(CoreError::ZeroLength { .. }))), "{call}: {err:?}");
    }
    let host = Array1::from_elem(5, ());
    let w = named(dev, "T", WorkspaceConfig::default());
    let s = w.enter().unwrap();
    assert!(matches!(s.htod(&host), Err(Error::Workspace(CoreError::InvalidInput(_)))));
    let err = DeviceArray::htod(dev, &dev.default_stream(), &host).unwrap_err();
    assert!(matches!(err, Error::Workspace(CoreError::InvalidInput(_))), "{err:?}");
    let staging = PinnedWorkspace::for_transfers("STAGE", dev, 4096).unwrap();
    let err = staging.enter().unwrap().copy_of(&host).unwrap_err();
    assert!(matches!(err, Error::Workspace(CoreError::InvalidInput(_))), "{err:?}");
}
