//! Device workspaces against what a user would use instead, in the same run: allocation
//! per call against `cuMemAlloc`/`cuMemFree` and `cuMemAllocAsync`/`cuMemFreeAsync`, and
//! pinned staging against pageable memory for host-to-device copies. Without a GPU it
//! prints why and measures nothing. `examples/cuda_smoke.rs` prints the same comparisons
//! as a table (and JSON).
//!
//! Run: `cargo bench --bench cuda`

use std::hint::black_box;
use std::sync::OnceLock;

use carve::WorkspaceConfig;
use criterion::{criterion_main, Criterion, Throughput};
use ndarray::ArrayView1;
use workspace_cuda::device::cuda::raw;
use workspace_cuda::{CudaDevice, Device, DeviceWorkspace, PinnedWorkspace};

mod workloads;

use workloads::training_bytes;

/// GPU 0, or `None` after saying once why there is none.
fn gpu() -> Option<CudaDevice> {
    static GPU: OnceLock<Option<CudaDevice>> = OnceLock::new();
    GPU.get_or_init(|| match CudaDevice::new(0) {
        Ok(gpu) => Some(gpu),
        Err(err) => {
            println!("cuda bench skipped: {err}");
            None
        }
    })
    .clone()
}

fn allocation(c: &mut Criterion) {
    let Some(gpu) = gpu() else { return };
    let sizes = training_bytes();
    let stream = gpu.default_stream();
    let mut group = c.benchmark_group("cuda_training_step_19_allocs");
    let ws = DeviceWorkspace::new("BENCH", WorkspaceConfig::default(), &gpu, &stream).expect("workspace");
    group.bench_function("device_workspace", |b| {
        b.iter(|| {
            let scope = ws.enter().expect("enter");
            for &bytes in &sizes {
                let mut memory = scope.uninit::<u8, _>(bytes).expect("allocation");
                black_box(memory.device_ptr_mut());
            }
        })
    });
    group.bench_function("cuMemAlloc_cuMemFree", |b| {
        b.iter(|| {
            for &bytes in &sizes {
                raw::malloc_free(&gpu, bytes, 1).expect("cuMemAlloc");
            }
        })
    });
    if gpu.supports_memory_pools() {
        group.bench_function("cuMemAllocAsync_cuMemFreeAsync", |b| {
            b.iter(|| {
                for &bytes in &sizes {
                    raw::malloc_free_async(&gpu, &stream, bytes, 1).expect("cuMemAllocAsync");
                }
                gpu.synchronize(&stream).expect("synchronize");
            })
        });
    }
    group.finish();
}

fn htod(c: &mut Criterion) {
    let Some(gpu) = gpu() else { return };
    const BYTES: usize = 64 << 20;
    let ws = DeviceWorkspace::new("HTOD", WorkspaceConfig::default(), &gpu, &gpu.default_stream()).expect("workspace");
    let pageable: Vec<u8> = (0..BYTES).map(|i| (i % 251) as u8).collect();
    let staging = PinnedWorkspace::for_transfers("PINNED", &gpu, BYTES).expect("pinned workspace");
    let stage = staging.enter().expect("enter");
    let pinned = stage.copy_of(&ArrayView1::from(&pageable[..])).expect("pinned copy");
    let mut group = c.benchmark_group("cuda_htod_64MiB");
    group.throughput(Throughput::Bytes(BYTES as u64));
    group.sample_size(20);
    group.bench_function("pageable", |b| {
        b.iter(|| {
            let scope = ws.enter().expect("enter");
            scope.htod(&ArrayView1::from(&pageable[..])).expect("htod");
            ws.synchronize().expect("synchronize");
        })
    });
    group.bench_function("pinned_staging", |b| {
        b.iter(|| {
            let scope = ws.enter().expect("enter");
            scope.htod_pinned(&pinned).expect("htod");
            ws.synchronize().expect("synchronize");
        })
    });
    group.finish();
}

// The macro defines an undocumented `benches` function.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::allocation, super::htod);
}
criterion_main!(group::benches);
