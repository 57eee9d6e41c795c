//! The device step: a network's training step as seam operations on one stream, its
//! arrays in a device workspace, its parameters and updater state in one allocation.

use std::ops::Range;

use ndarray::{Array2, ArrayView1, ArrayView2, ArrayViewMut1, Ix1, Ix2};
use std::mem::size_of;
use workspace_core::WorkspaceConfig;
use workspace_cuda::{Device as _, DeviceArray, DeviceWorkspace, PinnedWorkspace};

use crate::{Error, Result};

use super::super::layer::Layer;
use super::super::params::Params;
use super::super::updater::Updater;
use super::kernel::{Gemm, Kernel};
use super::{device_error, Compute, DeviceForm, DeviceStats, SimCompute};

/// Values of each of the four rows of the state allocation are padded to this many, so
/// that every row starts on the device alignment (256 bytes).
const ROW_ALIGN: usize = 64;

/// A device step behind one type, whatever its device.
pub(crate) trait DeviceStep {
    /// What the step holds.
    fn stats(&self) -> DeviceStats;
    /// One training step on `x` (`[batch, inputs]`) and `labels`, each checked by the
    /// caller; writes the updated parameters into `params`; returns the mean loss.
    fn fit(&mut self, x: ArrayView2<'_, f32>, labels: ArrayView1<'_, u32>, params: &mut [f32]) -> Result<f32>;
}

/// Builds the device step of `device` for `layers`, laid out by `layout`, starting from
/// `params`.
pub(crate) fn build(
    device: super::Device,
    layers: &[Box<dyn Layer>],
    layout: &Params,
    params: &[f32],
    updater: Updater,
    config: WorkspaceConfig,
) -> Result<Option<Box<dyn DeviceStep>>> {
    let plan = Plan::of(layers, layout, updater)?;
    match device {
        super::Device::Host => Ok(None),
        super::Device::Simulated => Ok(Some(Box::new(Trainer::new(SimCompute::new()?, plan, params, config)?))),
        super::Device::Cuda(ordinal) => Ok(Some(super::cuda::trainer(ordinal, plan, params, config)?)),
    }
}

/// What the step runs: each layer's form, input width and parameter region.
pub(crate) struct Plan {
    forms: Vec<DeviceForm>,
    names: Vec<String>,
    regions: Vec<Range<usize>>,
    classes: usize,
    total: usize,
    updater: Updater,
}

impl Plan {
    fn of(layers: &[Box<dyn Layer>], layout: &Params, updater: Updater) -> Result<Plan> {
        let mut forms = Vec::with_capacity(layers.len());
        for (i, layer) in layers.iter().enumerate() {
            let form = layer.device_form().ok_or_else(|| Error::InvalidConfig {
                reason: format!(
                    "layer '{}' has no device form (Layer::device_form), so it cannot train on a device; devices \
                     run dense and ReLU layers so far: train this network on the host",
                    layer.name()
                ),
            })?;
            let expected = match form {
                DeviceForm::Dense { inputs, outputs } => {
                    (inputs == layout.widths[i]).then_some(inputs * outputs + outputs)
                }
                DeviceForm::Relu => Some(0),
            };
            if expected != Some(layout.layout.regions[i].len()) {
                return Err(Error::InvalidConfig {
                    reason: format!(
                        "layer '{}' says it is {form:?} on a device, which does not match its input width {} and its \
                         {} parameters",
                        layer.name(),
                        layout.widths[i],
                        layout.layout.regions[i].len()
                    ),
                });
            }
            forms.push(form);
        }
        if matches!(updater, Updater::AdamW { .. }) {
            return Err(Error::InvalidConfig {
                reason: "AdamW's weight decay is not on devices yet: train with Adam or SGD on a device, or AdamW on \
                         the host"
                    .into(),
            });
        }
        let total = layout.layout.total;
        if u32::try_from(total).is_err() {
            return Err(Error::InvalidConfig {
                reason: format!("{total} parameter values are more than a device step indexes (2³² − 1)"),
            });
        }
        Ok(Plan {
            forms,
            names: layers.iter().map(|l| l.name().to_string()).collect(),
            regions: layout.layout.regions.clone(),
            classes: layout.outputs,
            total,
            updater,
        })
    }
}

/// The device step on compute `C`.
pub(crate) struct Trainer<C: Compute> {
    compute: C,
    plan: Plan,
    /// Four rows of `pad` values: the parameters, their gradients, the updater's first
    /// and second moments (SGD: velocity; the fourth row unused).
    state: DeviceArray<C::D, f32, Ix2>,
    pad: usize,
    /// The summed loss (f64) and the update's status (u32) the step reads back.
    loss: DeviceArray<C::D, f64, Ix1>,
    status: DeviceArray<C::D, u32, Ix1>,
    workspace: DeviceWorkspace<C::D>,
    /// Page-locked staging for a batch and its labels, of the bytes the largest batch so
    /// far needs (made again, larger, when a larger one comes).
    staging: Option<(PinnedWorkspace<C::D>, usize)>,
    /// The step's activations by address, reused step to step (input first).
    outputs: Vec<u64>,
    /// The parameter row read back after each step (`pad` values).
    values: Vec<f32>,
    step: u64,
}

impl<C: Compute> Trainer<C> {
    pub(crate) fn new(compute: C, plan: Plan, params: &[f32], config: WorkspaceConfig) -> Result<Trainer<C>> {
        let (device, stream) = (compute.device().clone(), compute.stream().clone());
        let pad = plan.total.div_ceil(ROW_ALIGN).max(1) * ROW_ALIGN;
        let mut host = Array2::<f32>::zeros((4, pad));
        host.row_mut(0).as_slice_mut().expect("standard layout")[..params.len()].copy_from_slice(params);
        let state = DeviceArray::htod(&device, &stream, &host)?;
        let loss = DeviceArray::zeros(&device, &stream, 1)?;
        let status = DeviceArray::zeros(&device, &stream, 1)?;
        let workspace = DeviceWorkspace::new("DEVICE_STEP", config, &device, &stream)?;
        let outputs = Vec::with_capacity(plan.forms.len() + 1);
        let values = vec![0.0; pad];
        Ok(Trainer { compute, plan, state, pad, loss, status, workspace, staging: None, outputs, values, step: 0 })
    }
}

/// Issues `kernel` on `compute`.
fn run<C: Compute>(compute: &mut C, kernel: Kernel) -> Result<()> {
    // SAFETY: every address a step names lies in its trainer's state allocation or in
    // arrays of the step's open workspace scope, all on the compute's stream, each range
    // sized from the plan's widths and the batch; the state and the scope outlive the
    // kernel in the stream's order (the scope's reset is ordered after it, the state is
    // freed in stream order); the ranges a kernel writes are fresh arrays of the scope or
    // gradient rows no other range of the same kernel touches.
    unsafe { compute.run(kernel) }
}

/// A product's packing buffer of `len` values in `scope` (address 0 when none is needed).
fn scratch_at<D: workspace_cuda::Device>(scope: &workspace_cuda::DeviceScope<'_, D>, len: usize) -> Result<u64> {
    if len == 0 {
        return Ok(0);
    }
    Ok(scope.uninit::<f32, _>(len)?.device_ptr_mut())
}

/// A fresh `[rows, cols]` array of `scope` that a kernel writes whole, by address.
fn fresh<D: workspace_cuda::Device, T: bytemuck::Pod>(
    scope: &workspace_cuda::DeviceScope<'_, D>,
    rows: usize,
    cols: usize,
) -> Result<u64> {
    Ok(scope.uninit::<T, _>((rows, cols))?.device_ptr_mut())
}

impl<C: Compute> DeviceStep for Trainer<C> {
    fn stats(&self) -> DeviceStats {
        let workspace = self.workspace.stats();
        DeviceStats {
            device: self.compute.device().describe(),
            bytes: self.state.len() * size_of::<f32>() + 16 + workspace.capacity,
            // The state, the loss and the status, then the workspace's own.
            allocations: 3 + workspace.growth_events + workspace.external_allocations,
            steps: self.step,
        }
    }

    fn fit(&mut self, x: ArrayView2<'_, f32>, labels: ArrayView1<'_, u32>, params: &mut [f32]) -> Result<f32> {
        let Trainer { compute, plan, state, pad, loss, status, workspace, staging, outputs, values, step } = self;
        let (batch, inputs) = x.dim();
        let (classes, layers, pad) = (plan.classes, plan.forms.len(), *pad);
        let base = state.device_ptr();
        let state_at = |row: usize, at: usize| base + ((row * pad + at) * size_of::<f32>()) as u64;
        let f32_bytes = |n: usize| (n * size_of::<f32>()) as u64;

        // The batch, staged through pinned memory.
        let need =
            (x.len() * size_of::<f32>()).next_multiple_of(64) + (labels.len() * size_of::<u32>()).next_multiple_of(64);
        if staging.as_ref().is_none_or(|(_, bytes)| *bytes < need) {
            *staging = None;
            *staging = Some((PinnedWorkspace::for_transfers("DEVICE_STAGING", compute.device(), need)?, need));
        }
        let stage = staging.as_ref().expect("made above").0.enter()?;
        let x_pinned = stage.copy_of(&x)?;
        let labels_pinned = stage.copy_of(&labels)?;
        let scope = workspace.enter()?;
        let x_dev = scope.htod_pinned(&x_pinned)?;
        let labels_dev = scope.htod_pinned(&labels_pinned)?;

        // Forward: each layer's output a fresh array of the scope.
        outputs.clear();
        outputs.push(x_dev.device_ptr());
        let mut width = inputs;
        for i in 0..layers {
            let input = outputs[i];
            let out = match plan.forms[i] {
                DeviceForm::Dense { inputs, outputs } => {
                    let out = fresh::<_, f32>(&scope, batch, outputs)?;
                    let weights = state_at(0, plan.regions[i].start);
                    let bias = weights + f32_bytes(inputs * outputs);
                    run(compute, Kernel::BiasRows { bias, out, rows: batch, cols: outputs })?;
                    let scratch_len = compute.gemm_scratch(batch, outputs, inputs);
                    let scratch = scratch_at(&scope, scratch_len)?;
                    let (m, n, k) = (batch, outputs, inputs);
                    let (a, b, c) = (input, weights, out);
                    let g =
                        Gemm { m, n, k, a, a_t: false, b, b_t: false, c, alpha: 1.0, beta: 1.0, scratch, scratch_len };
                    run(compute, Kernel::Gemm(g))?;
                    width = outputs;
                    out
                }
                DeviceForm::Relu => {
                    let y = fresh::<_, f32>(&scope, batch, width)?;
                    run(compute, Kernel::Relu { x: input, y, n: batch * width })?;
                    y
                }
            };
            outputs.push(out);
        }

        // The loss and the gradient of the logits.
        let logits_grad = fresh::<_, f32>(&scope, batch, classes)?;
        let row_loss = fresh::<_, f64>(&scope, batch, 1)?;
        run(
            compute,
            Kernel::SoftmaxCrossEntropy {
                logits: outputs[layers],
                labels: labels_dev.device_ptr(),
                grad: logits_grad,
                row_loss,
                loss: loss.device_ptr(),
                rows: batch,
                classes,
                scale: 1.0 / batch as f32,
            },
        )?;

        // Backward, into the gradient row of the state.
        let mut dy = logits_grad;
        let mut width = classes;
        for i in (0..layers).rev() {
            let input = outputs[i];
            match plan.forms[i] {
                DeviceForm::Dense { inputs, outputs: n_out } => {
                    let weights = state_at(0, plan.regions[i].start);
                    let gw = state_at(1, plan.regions[i].start);
                    let gb = gw + f32_bytes(inputs * n_out);
                    // dW = xᵀ · dy
                    let scratch_len = compute.gemm_scratch(inputs, n_out, batch);
                    let scratch = scratch_at(&scope, scratch_len)?;
                    let (m, n, k) = (inputs, n_out, batch);
                    let (a, b, c) = (input, dy, gw);
                    let g =
                        Gemm { m, n, k, a, a_t: true, b, b_t: false, c, alpha: 1.0, beta: 0.0, scratch, scratch_len };
                    run(compute, Kernel::Gemm(g))?;
                    run(compute, Kernel::SumRows { x: dy, sum: gb, rows: batch, cols: n_out })?;
                    if i > 0 {
                        // dx = dy · Wᵀ
                        let dx = fresh::<_, f32>(&scope, batch, inputs)?;
                        let scratch_len = compute.gemm_scratch(batch, inputs, n_out);
                        let scratch = scratch_at(&scope, scratch_len)?;
                        let (m, n, k) = (batch, inputs, n_out);
                        let (a, b, c) = (dy, weights, dx);
                        let g = Gemm {
                            m,
                            n,
                            k,
                            a,
                            a_t: false,
                            b,
                            b_t: true,
                            c,
                            alpha: 1.0,
                            beta: 0.0,
                            scratch,
                            scratch_len,
                        };
                        run(compute, Kernel::Gemm(g))?;
                        dy = dx;
                    }
                    width = inputs;
                }
                DeviceForm::Relu if i > 0 => {
                    let dx = fresh::<_, f32>(&scope, batch, width)?;
                    run(compute, Kernel::ReluBackward { y: outputs[i + 1], dy, dx, n: batch * width })?;
                    dy = dx;
                }
                DeviceForm::Relu => {}
            }
        }

        // The update, stored only when finite everywhere.
        let n = plan.total;
        let t = i32::try_from(*step + 1).unwrap_or(i32::MAX);
        let (values_at, grads, first, second) = (state_at(0, 0), state_at(1, 0), state_at(2, 0), state_at(3, 0));
        let update = Kernel::Update {
            updater: plan.updater,
            t,
            values: values_at,
            grads,
            first,
            second,
            n,
            status: status.device_ptr(),
        };
        run(compute, update)?;

        // Read back the loss and the status (this waits for the step), then the values.
        let mut loss_sum = [0.0f64];
        let mut bad = [0u32];
        loss.view().dtoh_into(&mut ArrayViewMut1::from(&mut loss_sum[..]))?;
        status.view().dtoh_into(&mut ArrayViewMut1::from(&mut bad[..]))?;
        state.view().row(0).expect("four rows").dtoh_into(&mut ArrayViewMut1::from(&mut values[..]))?;
        drop(scope);
        drop(stage);
        if let Some(error) = compute.device().take_deferred_error() {
            return Err(device_error("the training step", error));
        }
        if bad[0] != 0 {
            let element = n - bad[0] as usize;
            let layer = plan.regions.iter().position(|r| r.contains(&element)).unwrap_or(0);
            return Err(Error::NonFinite {
                layer: plan.names[layer].clone(),
                what: format!(
                    "the updater's step of its parameter value {} would not be finite; nothing was stored",
                    element - plan.regions[layer].start
                ),
            });
        }
        let mean = (loss_sum[0] / batch as f64) as f32;
        if !mean.is_finite() {
            return Err(Error::NonFinite { layer: "loss".into(), what: format!("the batch's mean loss is {mean}") });
        }
        params.copy_from_slice(&values[..n]);
        *step += 1;
        Ok(mean)
    }
}
