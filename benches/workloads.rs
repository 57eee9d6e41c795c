//! The workloads the benches share, written once: the training step's arrays (an MLP
//! 784-1024-1024-10 forward and backward pass at batch 128) and the small-array loop.
//! `alloc.rs`, `alloc_compare.rs`, `cuda.rs`, `device_plan.rs`, `gemm.rs`, `network.rs`,
//! `plan.rs` and `planned_networks.rs` include it with `mod workloads;`, and the root package's
//! `examples/cuda_smoke.rs` with `#[path]`.

// Each bench uses part of this module.
#![allow(dead_code)]

/// The configuration of an MLP `widths[0]-…-widths[last]` of carve's reference
/// network: dense layers with a ReLU between each two.
pub(crate) fn mlp(widths: &[usize]) -> carve::nn::NetworkConfigBuilder {
    let mut builder = carve::nn::NetworkConfig::builder(widths[0]);
    for (i, &width) in widths[1..].iter().enumerate() {
        builder = builder.dense(width);
        if i + 2 < widths.len() {
            builder = builder.relu();
        }
    }
    builder
}

/// The networks the planned-workspace figures compare (`planned_networks.rs`,
/// `device_plan.rs`): a name, the widths and the batch size.
pub(crate) const PLANNED_NETWORKS: [(&str, &[usize], usize); 2] = [
    ("digits 64-128-64-10, batch 32", &[64, 128, 64, 10], 32),
    ("784-1024-1024-10, batch 128", &[784, 1024, 1024, 10], 128),
];

/// A fixed batch of `batch` rows for an MLP of `widths`: features in [0, 1) and a label
/// per row.
pub(crate) fn mlp_batch(widths: &[usize], batch: usize) -> (ndarray::Array2<f32>, ndarray::Array1<u32>) {
    let classes = *widths.last().expect("widths");
    let x = ndarray::Array2::from_shape_fn((batch, widths[0]), |(r, c)| ((r * 31 + c * 17) % 97) as f32 / 97.0);
    let y = ndarray::Array1::from_shape_fn(batch, |r| (r % classes) as u32);
    (x, y)
}

/// The training step's batch size.
pub(crate) const BATCH: usize = 128;
/// Its input features (28×28 images).
pub(crate) const INPUTS: usize = 784;
/// The width of each of its two hidden layers.
pub(crate) const HIDDEN: usize = 1024;
/// Its classes.
pub(crate) const CLASSES: usize = 10;

/// The 19 arrays of the training step, as f32 shapes (rows, cols), in the order a step
/// allocates them.
pub(crate) fn training_shapes() -> Vec<(usize, usize)> {
    let (b, i, h, o) = (BATCH, INPUTS, HIDDEN, CLASSES);
    vec![
        // forward: input, pre-activations and activations, logits, probabilities
        (b, i),
        (b, h),
        (b, h),
        (b, h),
        (b, h),
        (b, o),
        (b, o),
        // backward: output gradient, then per layer weight, bias and input gradients
        (b, o),
        (h, o),
        (1, o),
        (b, h),
        (b, h),
        (h, h),
        (1, h),
        (b, h),
        (b, h),
        (i, h),
        (1, h),
        (b, i),
    ]
}

/// The training step's arrays as f32 element counts.
pub(crate) fn training_sizes() -> Vec<usize> {
    training_shapes().iter().map(|&(rows, cols)| rows * cols).collect()
}

/// The training step's arrays in bytes.
pub(crate) fn training_bytes() -> Vec<usize> {
    training_sizes().iter().map(|n| n * size_of::<f32>()).collect()
}

/// 64 arrays of 256 B … 64 KiB, as f32 element counts.
pub(crate) fn small_sizes() -> Vec<usize> {
    (0..64).map(|i| (256usize << (i % 9)) / 4).collect()
}
