//! The device step: a network's training step as seam operations on one stream, its
//! arrays in a device workspace, its parameters and updater state in one allocation.

use std::ops::Range;

use ndarray::{Array2, ArrayView2, ArrayView3, ArrayViewMut1, Ix1, Ix2};
use std::mem::size_of;
use workspace_core::WorkspaceConfig;
use workspace_core::{LearningPolicy, SpillPolicy, WorkspaceMode};
use workspace_cuda::{
    Device as _, DeviceArray, DeviceFrame, DevicePlanGroup, DeviceScope, DeviceWorkspace, PinnedScope, PinnedWorkspace,
};

use crate::{Error, Result};

use super::super::layer::Layer;
use super::super::params::Params;
use super::super::residual::{join_of, MAX_NESTING};
use super::super::updater::{decay_factors, Updater};
use super::kernel::{Attention as KernelAttention, Gemm, Kernel};
use super::{device_error, Compute, DeviceForm, DeviceStats, SimCompute};

/// Values of each of the four rows of the state allocation are padded to this many, so
/// that every row starts on the device alignment (256 bytes).
const ROW_ALIGN: usize = 64;

/// A batch as a device step takes it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum StepInput<'a> {
    /// `[batch, features]`.
    Flat(ArrayView2<'a, f32>),
    /// `[batch, time, features]`, in standard layout.
    Sequences(ArrayView3<'a, f32>),
    /// `[batch, time]` token ids, each below the first layer's vocabulary.
    Tokens(ArrayView2<'a, u32>),
}

impl StepInput<'_> {
    /// The number of values (features or ids).
    fn len(&self) -> usize {
        match self {
            StepInput::Flat(x) => x.len(),
            StepInput::Sequences(x) => x.len(),
            StepInput::Tokens(ids) => ids.len(),
        }
    }

    /// `(batch, steps)`: the rows of the step are `batch · steps`.
    fn dims(&self) -> (usize, usize) {
        match self {
            StepInput::Flat(x) => (x.nrows(), 1),
            StepInput::Sequences(x) => (x.shape()[0], x.shape()[1]),
            StepInput::Tokens(ids) => ids.dim(),
        }
    }
}

/// A device step behind one type, whatever its device.
pub(crate) trait DeviceStep {
    /// What the step holds.
    fn stats(&self) -> DeviceStats;
    /// One training step on `x` and `labels` (one per row of the step: `[batch, steps]`),
    /// each checked by the caller, from the parameters the device holds; writes the
    /// updated parameters into `params` and the step's gradients into `grads` (neither
    /// when it fails); returns the mean loss.
    fn fit(
        &mut self,
        x: StepInput<'_>,
        labels: ArrayView2<'_, u32>,
        params: &mut [f32],
        grads: &mut [f32],
    ) -> Result<f32>;
    /// Sends `params` to the device, for the next step to start from (the caller set
    /// some since the last step). The updater's moments go on as they are, as on the
    /// host.
    fn send_params(&mut self, params: &[f32]) -> Result<()>;
    /// Whether the step takes token ids (its first layer is an embedding).
    fn takes_tokens(&self) -> bool;
    /// The first layer's vocabulary, when it is an embedding.
    fn vocabulary(&self) -> Option<usize>;
    /// The most steps a sequence may have (a position embedding's context).
    fn max_steps(&self) -> Option<usize>;
}

/// Builds the device step of `device` for `layers`, laid out by `layout`, starting from
/// `params`.
pub(crate) fn build(
    device: super::Device,
    layers: &[Box<dyn Layer>],
    layout: &Params,
    params: &[f32],
    updater: Updater,
    mode: WorkspaceMode,
) -> Result<Option<Box<dyn DeviceStep>>> {
    if device == super::Device::Host {
        return Ok(None);
    }
    let plan = Plan::of(layers, layout, updater)?;
    match device {
        super::Device::Host => Ok(None),
        super::Device::Simulated => Ok(Some(Box::new(Trainer::new(SimCompute::new()?, plan, params, mode)?))),
        super::Device::Cuda(ordinal) => Ok(Some(super::cuda::trainer(ordinal, plan, params, mode)?)),
    }
}

/// What the step runs: each layer's form, input width and parameter region.
pub(crate) struct Plan {
    forms: Vec<DeviceForm>,
    names: Vec<String>,
    widths: Vec<usize>,
    regions: Vec<Range<usize>>,
    classes: usize,
    total: usize,
    updater: Updater,
    /// AdamW's decay factor of each value (empty for other updaters).
    decay: Vec<f32>,
}

impl Plan {
    fn of(layers: &[Box<dyn Layer>], layout: &Params, updater: Updater) -> Result<Plan> {
        let mut forms = Vec::with_capacity(layers.len());
        for (i, layer) in layers.iter().enumerate() {
            let invalid = |what: String| Error::InvalidConfig { reason: format!("layer '{}': {what}", layer.name()) };
            let form = layer.device_form().ok_or_else(|| {
                invalid(
                    "has no device form (Layer::device_form), so it cannot train on a device; devices run dense, \
                     ReLU, GELU (its tanh form), layer-norm, embedding and attention layers and residual blocks: \
                     train this network on the host"
                        .into(),
                )
            })?;
            let width = layout.widths[i];
            let expected = match form {
                DeviceForm::Dense { inputs, outputs } => (inputs == width).then_some(inputs * outputs + outputs),
                DeviceForm::Relu | DeviceForm::Gelu => Some(0),
                DeviceForm::LayerNorm { .. } => Some(2 * width),
                // A network of token ids counts its vocabulary as its inputs.
                DeviceForm::Embedding { vocabulary, width: w } => {
                    (i == 0 && (width == vocabulary || width == 1)).then_some(vocabulary * w)
                }
                DeviceForm::PositionEmbedding { context, width: w } => (w == width).then_some(context * w),
                DeviceForm::Attention { width: w, heads } => {
                    (w == width && heads > 0 && w % heads == 0).then_some(4 * w * w + 4 * w)
                }
                DeviceForm::Residual { from } => {
                    if join_of(layers, i) != Some(from) {
                        return Err(invalid(format!(
                            "says it joins a residual block from layer {from}, but it is not that join"
                        )));
                    }
                    Some(0)
                }
            };
            if expected != Some(layout.layout.regions[i].len()) {
                return Err(invalid(format!(
                    "says it is {form:?} on a device, which does not match its place (layer {i}), its input width {width} \
                     and its {} parameters",
                    layout.layout.regions[i].len()
                )));
            }
            forms.push(form);
        }
        let total = layout.layout.total;
        if u32::try_from(total).is_err() {
            return Err(Error::InvalidConfig {
                reason: format!("{total} parameter values are more than a device step indexes (2³² − 1)"),
            });
        }
        let decay = match updater {
            Updater::AdamW { .. } => decay_factors(updater.decay_factor(), layout),
            _ => Vec::new(),
        };
        Ok(Plan {
            forms,
            names: layers.iter().map(|l| l.name().to_string()).collect(),
            widths: layout.widths.clone(),
            regions: layout.layout.regions.clone(),
            classes: layout.outputs,
            total,
            updater,
            decay,
        })
    }

    /// Whether the step takes token ids (its first layer is an embedding).
    pub(crate) fn takes_tokens(&self) -> bool {
        matches!(self.forms.first(), Some(DeviceForm::Embedding { .. }))
    }

    /// The most steps a sequence may have (the smallest position embedding's context).
    pub(crate) fn max_steps(&self) -> Option<usize> {
        self.forms
            .iter()
            .filter_map(|f| match f {
                DeviceForm::PositionEmbedding { context, .. } => Some(*context),
                _ => None,
            })
            .min()
    }

    /// The vocabulary of the first layer, when it is an embedding.
    pub(crate) fn vocabulary(&self) -> Option<usize> {
        match self.forms.first() {
            Some(DeviceForm::Embedding { vocabulary, .. }) => Some(*vocabulary),
            _ => None,
        }
    }
}

/// The step's device workspaces, by role, as the host step's: the activations (and
/// what the backward pass keeps, the batch, the residual joins' gradients) for the whole
/// step; the gradients of the layers' outputs in two workspaces taken in turn (each
/// layer's input gradient in one, its output's in the other, closed once the layer is
/// through); each layer's working memory (packing buffers, temporaries) for the layer.
struct Roles<D: workspace_cuda::Device> {
    act: DeviceWorkspace<D>,
    grad: [DeviceWorkspace<D>; 2],
    work: DeviceWorkspace<D>,
}

impl<D: workspace_cuda::Device> Roles<D> {
    fn new(
        device: &D,
        stream: &D::Stream,
        config: &WorkspaceConfig,
        group: Option<&DevicePlanGroup<D>>,
    ) -> Result<Self> {
        let ws = |name: &str| match group {
            Some(group) => group.workspace(name, config, stream),
            None => DeviceWorkspace::new(name, config.clone(), device, stream),
        };
        Ok(Roles {
            act: ws("DEVICE_ACT")?,
            grad: [ws("DEVICE_ACT_GRAD_1")?, ws("DEVICE_ACT_GRAD_2")?],
            work: ws("DEVICE_WORKING_MEM")?,
        })
    }

    fn all(&self) -> [&DeviceWorkspace<D>; 4] {
        [&self.act, &self.grad[0], &self.grad[1], &self.work]
    }
}

/// The device step on compute `C`.
pub(crate) struct Trainer<C: Compute> {
    compute: C,
    plan: Plan,
    /// Rows of `pad` values: the parameters, their gradients, the updater's first and
    /// second moments (SGD: velocity; the fourth row unused), and for AdamW the decay
    /// factors.
    state: DeviceArray<C::D, f32, Ix2>,
    pad: usize,
    /// The summed loss (f64) and the update's status (u32) the step reads back.
    loss: DeviceArray<C::D, f64, Ix1>,
    status: DeviceArray<C::D, u32, Ix1>,
    roles: Roles<C::D>,
    /// `WorkspaceMode::Planned`: the roles are members of this group, one arena at
    /// offsets planned from a recorded step of each shape.
    group: Option<DevicePlanGroup<C::D>>,
    /// Page-locked staging for a batch and its labels, of the bytes the largest batch so
    /// far needs (made again, larger, when a larger one comes).
    staging: Option<(PinnedWorkspace<C::D>, usize)>,
    /// The step's activations by address, reused step to step (input first).
    outputs: Vec<u64>,
    /// Per layer: what an attention layer keeps for its backward pass (`qkv`, `att`,
    /// `probs`); zeros for the others.
    kept: Vec<[u64; 3]>,
    /// The parameter row read back after each step (`pad` values).
    values: Vec<f32>,
    /// The gradient row read back after each step (`pad` values).
    grads_row: Vec<f32>,
    step: u64,
    /// A device error of an earlier step, after which the device's state is not the
    /// network's.
    failed: Option<String>,
}

impl<C: Compute> Trainer<C> {
    pub(crate) fn new(compute: C, plan: Plan, params: &[f32], mode: WorkspaceMode) -> Result<Trainer<C>> {
        let (device, stream) = (compute.device().clone(), compute.stream().clone());
        let pad = plan.total.div_ceil(ROW_ALIGN).max(1) * ROW_ALIGN;
        let rows = if plan.decay.is_empty() { 4 } else { 5 };
        let mut host = Array2::<f32>::zeros((rows, pad));
        host.row_mut(0).as_slice_mut().expect("standard layout")[..params.len()].copy_from_slice(params);
        if !plan.decay.is_empty() {
            host.row_mut(4).as_slice_mut().expect("standard layout")[..plan.total].copy_from_slice(&plan.decay);
        }
        let state = DeviceArray::htod(&device, &stream, &host)?;
        let loss = DeviceArray::zeros(&device, &stream, 1)?;
        let status = DeviceArray::zeros(&device, &stream, 1)?;
        let (roles, group) = match mode {
            WorkspaceMode::Planned => {
                let group = DevicePlanGroup::new("DEVICE_STEP", &device, &stream)?;
                let config =
                    WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build()?;
                (Roles::new(&device, &stream, &config, Some(&group))?, Some(group))
            }
            // Each role learns its size from the first step (a later, larger batch grows
            // it once).
            WorkspaceMode::Enabled => {
                let config = WorkspaceConfig::builder()
                    .learning(LearningPolicy::FirstLoop)
                    .spill(SpillPolicy::Reallocate)
                    .build()?;
                (Roles::new(&device, &stream, &config, None)?, None)
            }
            // No arenas: every array its own device allocation, freed when its scope
            // closes (the arithmetic is the same).
            _ => {
                let config =
                    WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build()?;
                (Roles::new(&device, &stream, &config, None)?, None)
            }
        };
        let layers = plan.forms.len();
        let (outputs, kept) = (Vec::with_capacity(layers + 1), vec![[0; 3]; layers]);
        let values = vec![0.0; pad];
        Ok(Trainer {
            compute,
            plan,
            state,
            pad,
            loss,
            status,
            roles,
            group,
            staging: None,
            outputs,
            kept,
            values,
            grads_row: vec![0.0; pad],
            step: 0,
            failed: None,
        })
    }
}

/// Issues `kernel` on `compute`.
fn run<C: Compute>(compute: &mut C, kernel: Kernel) -> Result<()> {
    // SAFETY: every address a step names lies in its trainer's state allocation or in
    // arrays of the step's open workspace scopes, all on the compute's stream, each range
    // sized from the plan's widths and the batch; the state and the scopes outlive the
    // kernel in the stream's order (a scope's reset is ordered after the work issued
    // before it, the state is freed in stream order); the ranges a kernel writes are
    // fresh arrays or gradient rows no other range of the same kernel touches.
    unsafe { compute.run(kernel) }
}

/// A buffer of `len` values in `frame` (address 0 when none is needed).
fn scratch_in<D: workspace_cuda::Device>(frame: &DeviceFrame<'_, D>, len: usize) -> Result<u64> {
    if len == 0 {
        return Ok(0);
    }
    Ok(frame.uninit::<f32, _>(len)?.device_ptr_mut())
}

/// A fresh array of `len` values of `scope` that a kernel writes whole, by address.
fn fresh<D: workspace_cuda::Device, T: bytemuck::Pod>(scope: &DeviceScope<'_, D>, len: usize) -> Result<u64> {
    Ok(scope.uninit::<T, _>(len.max(1))?.device_ptr_mut())
}

/// `C (m × n) ← op(A)·op(B) + beta·C`, with the buffer the compute wants for it (the host
/// product's packing, cuBLAS's workspace) in a frame of `scope` that closes after it: the
/// next product takes the same bytes.
fn product<C: Compute>(
    compute: &mut C,
    scope: &DeviceScope<'_, C::D>,
    (m, n, k): (usize, usize, usize),
    (a, a_t): (u64, bool),
    (b, b_t): (u64, bool),
    c: u64,
    beta: f32,
) -> Result<()> {
    let scratch_len = compute.gemm_scratch(m, n, k);
    let frame = scope.frame()?;
    let scratch = scratch_in(&frame, scratch_len)?;
    run(compute, Kernel::Gemm(Gemm { m, n, k, a, a_t, b, b_t, c, alpha: 1.0, beta, scratch, scratch_len }))
}

const F32: u64 = size_of::<f32>() as u64;

impl<C: Compute> DeviceStep for Trainer<C> {
    /// The state read back whole, its row of parameters replaced, and sent again (a
    /// checkpoint's restore, not a step's work).
    fn send_params(&mut self, params: &[f32]) -> Result<()> {
        let shape = self.state.shape();
        let mut host = Array2::<f32>::zeros((shape[0], shape[1]));
        self.state.view().dtoh_into(&mut host)?;
        host.row_mut(0).as_slice_mut().expect("standard layout")[..self.plan.total].copy_from_slice(params);
        self.state.view_mut().htod_from(&host)?;
        Ok(())
    }

    fn takes_tokens(&self) -> bool {
        self.plan.takes_tokens()
    }

    fn vocabulary(&self) -> Option<usize> {
        self.plan.vocabulary()
    }

    fn max_steps(&self) -> Option<usize> {
        self.plan.max_steps()
    }

    fn stats(&self) -> DeviceStats {
        let roles = self.roles.all().map(|ws| ws.stats());
        let planned = self.group.as_ref().map(|g| g.stats());
        let arenas = planned.as_ref().map_or(0, |p| p.arena_bytes) + roles.iter().map(|r| r.capacity).sum::<usize>();
        let growths = planned.as_ref().map_or(0, |p| p.plans + p.replans);
        DeviceStats {
            device: self.compute.device().describe(),
            bytes: self.state.len() * size_of::<f32>() + 16 + arenas,
            // The state, the loss and the status, then the arenas' and the spills'.
            allocations: 3 + growths + roles.iter().map(|r| r.growth_events + r.external_allocations).sum::<u64>(),
            steps: self.step,
            plan_bytes: planned.as_ref().map(|p| p.plan_bytes),
            lower_bound_bytes: planned.as_ref().map(|p| p.lower_bound_bytes),
        }
    }

    fn fit(
        &mut self,
        x: StepInput<'_>,
        labels: ArrayView2<'_, u32>,
        params: &mut [f32],
        grads: &mut [f32],
    ) -> Result<f32> {
        if let Some(error) = &self.failed {
            return Err(Error::InvalidInput(format!(
                "an earlier training step failed on {} ({error}): its state there is lost; the network holds the \
                 parameters of its last good step: build a new network from them to go on",
                self.compute.device().describe()
            )));
        }
        let (batch, steps) = x.dims();
        // The batch, staged through pinned memory.
        // Features and ids are 4 bytes each, as the labels.
        let need = (x.len() * 4).next_multiple_of(64) + (labels.len() * size_of::<u32>()).next_multiple_of(64);
        if self.staging.as_ref().is_none_or(|(_, bytes)| *bytes < need) {
            self.staging = None;
            self.staging = Some((PinnedWorkspace::for_transfers("DEVICE_STAGING", self.compute.device(), need)?, need));
        }
        let staging = &self.staging.as_ref().expect("made above").0;
        let stage = staging.enter()?;
        let mut pass = Pass {
            compute: &mut self.compute,
            plan: &self.plan,
            roles: &self.roles,
            base: self.state.device_ptr(),
            pad: self.pad,
            loss: self.loss.device_ptr(),
            status: self.status.device_ptr(),
            outputs: &mut self.outputs,
            kept: &mut self.kept,
            step: self.step,
        };
        let issued = match &self.group {
            Some(group) => {
                // Token ids, sequences and flat batches of one shape share no plan.
                let kind = match x {
                    StepInput::Flat(_) => 1u64,
                    StepInput::Sequences(_) => 2,
                    StepInput::Tokens(_) => 3,
                };
                let key = (batch as u64) << 34 | (steps as u64) << 2 | kind;
                group.iteration(key, || pass.run(&stage, x, labels)).map(|_| ())
            }
            None => pass.run(&stage, x, labels),
        };
        if let Err(error) = issued {
            // The device failed an operation (reported now, maybe of an earlier step's
            // work): what ran after it is unknown, so the device's state is no longer the
            // network's.
            if let Error::Device(workspace_cuda::Error::Device { source, .. }) = &error {
                self.failed = Some(source.to_string());
            }
            return Err(error);
        }

        // Read back the loss and the status (this waits for the step), then the values.
        let (plan, n) = (&self.plan, self.plan.total);
        let mut loss_sum = [0.0f64];
        let mut bad = [0u32];
        self.loss.view().dtoh_into(&mut ArrayViewMut1::from(&mut loss_sum[..]))?;
        self.status.view().dtoh_into(&mut ArrayViewMut1::from(&mut bad[..]))?;
        let values = &mut self.values;
        self.state.view().row(0).expect("the parameters' row").dtoh_into(&mut ArrayViewMut1::from(&mut values[..]))?;
        drop(stage);
        if let Some(error) = self.compute.device().take_deferred_error() {
            // Work after the failure may have run (the update among it): the device's
            // state is no longer the network's. The network keeps the parameters of its
            // last good step; this step refuses every later one.
            self.failed = Some(error.to_string());
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
        let mean = (loss_sum[0] / (batch * steps) as f64) as f32;
        if !mean.is_finite() {
            return Err(Error::NonFinite { layer: "loss".into(), what: format!("the batch's mean loss is {mean}") });
        }
        // The step's gradients, for `Network::layer_grads`: read before anything is
        // stored, so that a failed read leaves the network as it was.
        let mut row = ArrayViewMut1::from(&mut self.grads_row[..]);
        self.state.view().row(1).expect("the gradients' row").dtoh_into(&mut row)?;
        params.copy_from_slice(&self.values[..n]);
        grads.copy_from_slice(&self.grads_row[..n]);
        self.step += 1;
        Ok(mean)
    }
}

/// One step's work, issued: what it reads and where it writes.
struct Pass<'t, C: Compute> {
    compute: &'t mut C,
    plan: &'t Plan,
    roles: &'t Roles<C::D>,
    /// The state allocation's address and its rows' length.
    base: u64,
    pad: usize,
    loss: u64,
    status: u64,
    outputs: &'t mut Vec<u64>,
    kept: &'t mut Vec<[u64; 3]>,
    step: u64,
}

impl<C: Compute> Pass<'_, C> {
    /// The device address of element `at` of state row `row`.
    fn state_at(&self, row: usize, at: usize) -> u64 {
        self.base + (row * self.pad + at) as u64 * F32
    }

    /// Issues the step: the batch's copies from `stage`, forward, loss, backward and the
    /// update, every scope closed when it returns.
    fn run(&mut self, stage: &PinnedScope<'_, C::D>, x: StepInput<'_>, labels: ArrayView2<'_, u32>) -> Result<()> {
        let (batch, steps) = x.dims();
        let rows = batch * steps;
        let (classes, layers) = (self.plan.classes, self.plan.forms.len());
        let roles = self.roles;
        let act = roles.act.enter()?;
        let x_at = match x {
            StepInput::Flat(x) => act.htod_pinned(&stage.copy_of(&x)?)?.device_ptr(),
            StepInput::Sequences(x) => act.htod_pinned(&stage.copy_of(&x)?)?.device_ptr(),
            StepInput::Tokens(ids) => act.htod_pinned(&stage.copy_of(&ids)?)?.device_ptr(),
        };
        let labels_at = act.htod_pinned(&stage.copy_of(&labels)?)?.device_ptr();

        // Forward: each layer's output a fresh array of the activations' scope.
        self.outputs.clear();
        self.outputs.push(x_at);
        for i in 0..layers {
            let out = self.forward(i, &act, batch, steps)?;
            self.outputs.push(out);
        }

        // The loss and the gradient of the logits.
        let mut held: [Option<DeviceScope<'_, C::D>>; 2] = [Some(roles.grad[0].enter()?), None];
        let mut cur = 0;
        let logits_grad = fresh::<_, f32>(held[cur].as_ref().expect("just opened"), rows * classes)?;
        {
            let work = roles.work.enter()?;
            let row_loss = fresh::<_, f64>(&work, rows)?;
            let kernel = Kernel::SoftmaxCrossEntropy {
                logits: self.outputs[layers],
                labels: labels_at,
                grad: logits_grad,
                row_loss,
                loss: self.loss,
                rows,
                classes,
                scale: 1.0 / rows as f32,
            };
            run(self.compute, kernel)?;
        }

        // Backward, into the gradient row of the state. The gradients of residual joins
        // are copied into the activations' scope, on a fixed stack, for their blocks'
        // inputs.
        let mut skips = [(0usize, 0u64); MAX_NESTING];
        let mut pending = 0;
        let mut dy = logits_grad;
        for i in (0..layers).rev() {
            let width = self.plan.widths[i];
            if let DeviceForm::Residual { from } = self.plan.forms[i] {
                if pending == MAX_NESTING {
                    return Err(Error::InvalidInput(format!("residual blocks nested more than {MAX_NESTING} deep")));
                }
                let skip = fresh::<_, f32>(&act, rows * width)?;
                run(self.compute, Kernel::Copy { x: dy, y: skip, n: rows * width })?;
                skips[pending] = (from, skip);
                pending += 1;
                continue;
            }
            let next = 1 - cur;
            held[next] = if i > 0 { Some(roles.grad[next].enter()?) } else { None };
            let dx = self.backward(i, held[next].as_ref(), dy, batch, steps)?;
            // The joins' gradients of the blocks that start here, into their input's.
            while pending > 0 && skips[pending - 1].0 == i {
                pending -= 1;
                if i > 0 {
                    run(self.compute, Kernel::AddAssign { acc: dx, x: skips[pending].1, n: rows * width })?;
                }
            }
            // This layer's output gradient is through.
            held[cur] = None;
            cur = next;
            dy = dx;
        }
        drop(held);
        if pending != 0 {
            return Err(Error::InvalidInput(format!(
                "{pending} residual join(s) found no block input to add their gradient to: the network's blocks are \
                 not nested as built"
            )));
        }

        // The update, stored only when finite everywhere.
        let decay = if self.plan.decay.is_empty() { 0 } else { self.state_at(4, 0) };
        let update = Kernel::Update {
            updater: self.plan.updater,
            t: i32::try_from(self.step + 1).unwrap_or(i32::MAX),
            values: self.state_at(0, 0),
            grads: self.state_at(1, 0),
            first: self.state_at(2, 0),
            second: self.state_at(3, 0),
            decay,
            n: self.plan.total,
            status: self.status,
        };
        run(self.compute, update)?;
        drop(act);
        Ok(())
    }

    /// Layer `i`'s forward pass: its output, in `act`.
    fn forward(&mut self, i: usize, act: &DeviceScope<'_, C::D>, batch: usize, steps: usize) -> Result<u64> {
        let rows = batch * steps;
        let (input, width) = (self.outputs[i], self.plan.widths[i]);
        let weights = self.state_at(0, self.plan.regions[i].start);
        let compute = &mut *self.compute;
        Ok(match self.plan.forms[i] {
            DeviceForm::Dense { inputs, outputs } => {
                let out = fresh::<_, f32>(act, rows * outputs)?;
                let bias = weights + (inputs * outputs) as u64 * F32;
                run(compute, Kernel::BiasRows { bias, out, rows, cols: outputs })?;
                let work = self.roles.work.enter()?;
                product(compute, &work, (rows, outputs, inputs), (input, false), (weights, false), out, 1.0)?;
                out
            }
            DeviceForm::Relu => {
                let y = fresh::<_, f32>(act, rows * width)?;
                run(compute, Kernel::Relu { x: input, y, n: rows * width })?;
                y
            }
            DeviceForm::Gelu => {
                let y = fresh::<_, f32>(act, rows * width)?;
                run(compute, Kernel::Gelu { x: input, y, n: rows * width })?;
                y
            }
            DeviceForm::LayerNorm { eps } => {
                let y = fresh::<_, f32>(act, rows * width)?;
                run(compute, Kernel::LayerNorm { x: input, params: weights, y, rows, cols: width, eps })?;
                y
            }
            DeviceForm::Embedding { vocabulary, width } => {
                let out = fresh::<_, f32>(act, rows * width)?;
                run(compute, Kernel::Embedding { ids: input, table: weights, out, rows, width, vocabulary })?;
                out
            }
            DeviceForm::PositionEmbedding { width, .. } => {
                let y = fresh::<_, f32>(act, rows * width)?;
                run(compute, Kernel::AddPositions { x: input, table: weights, y, batch, steps, width })?;
                y
            }
            DeviceForm::Attention { width: d, heads } => {
                let qkv = fresh::<_, f32>(act, rows * 3 * d)?;
                let qkv_b = weights + (d * 3 * d) as u64 * F32;
                run(compute, Kernel::BiasRows { bias: qkv_b, out: qkv, rows, cols: 3 * d })?;
                let core = attention(batch, steps, d, heads);
                let att = fresh::<_, f32>(act, rows * d)?;
                let probs = fresh::<_, f32>(act, core.probs_len())?;
                let out = fresh::<_, f32>(act, rows * d)?;
                let work = self.roles.work.enter()?;
                product(compute, &work, (rows, 3 * d, d), (input, false), (weights, false), qkv, 1.0)?;
                let scratch_len = compute.attention_scratch(steps, d / heads);
                let frame = work.frame()?;
                let scratch = scratch_in(&frame, scratch_len)?;
                run(
                    compute,
                    Kernel::AttentionForward(KernelAttention { qkv, att, probs, scratch, scratch_len, ..core }),
                )?;
                drop(frame);
                let proj_w = qkv_b + (3 * d) as u64 * F32;
                let proj_b = proj_w + (d * d) as u64 * F32;
                run(compute, Kernel::BiasRows { bias: proj_b, out, rows, cols: d })?;
                product(compute, &work, (rows, d, d), (att, false), (proj_w, false), out, 1.0)?;
                self.kept[i] = [qkv, att, probs];
                out
            }
            DeviceForm::Residual { from } => {
                let y = fresh::<_, f32>(act, rows * width)?;
                run(compute, Kernel::Add { a: input, b: self.outputs[from], y, n: rows * width })?;
                y
            }
        })
    }

    /// Layer `i`'s backward pass from `dy`: its parameters' gradients into the state,
    /// its input's gradient into `grad` (given back; 0 when there is no `grad`: the first
    /// layer's input needs none).
    fn backward(
        &mut self,
        i: usize,
        grad: Option<&DeviceScope<'_, C::D>>,
        dy: u64,
        batch: usize,
        steps: usize,
    ) -> Result<u64> {
        let rows = batch * steps;
        let (input, width) = (self.outputs[i], self.plan.widths[i]);
        let weights = self.state_at(0, self.plan.regions[i].start);
        let grads = self.state_at(1, self.plan.regions[i].start);
        let dx = |len: usize| grad.map_or(Ok(0), |g| fresh::<_, f32>(g, len));
        let work = self.roles.work.enter()?;
        let compute = &mut *self.compute;
        Ok(match self.plan.forms[i] {
            DeviceForm::Residual { .. } => unreachable!("joins are handled by the pass"),
            DeviceForm::Dense { inputs, outputs: n_out } => {
                product(compute, &work, (inputs, n_out, rows), (input, true), (dy, false), grads, 0.0)?;
                let gb = grads + (inputs * n_out) as u64 * F32;
                run(compute, Kernel::SumRows { x: dy, sum: gb, rows, cols: n_out })?;
                let dx = dx(rows * inputs)?;
                if dx != 0 {
                    product(compute, &work, (rows, inputs, n_out), (dy, false), (weights, true), dx, 0.0)?;
                }
                dx
            }
            DeviceForm::Relu => {
                let dx = dx(rows * width)?;
                if dx != 0 {
                    run(compute, Kernel::ReluBackward { y: self.outputs[i + 1], dy, dx, n: rows * width })?;
                }
                dx
            }
            DeviceForm::Gelu => {
                let dx = dx(rows * width)?;
                if dx != 0 {
                    run(compute, Kernel::GeluBackward { x: input, dy, dx, n: rows * width })?;
                }
                dx
            }
            DeviceForm::LayerNorm { eps } => {
                let dx = dx(rows * width)?;
                let stats = fresh::<_, f32>(&work, 2 * rows)?;
                let (x, params, cols) = (input, weights, width);
                run(compute, Kernel::LayerNormBackward { x, params, dy, grads, dx, stats, rows, cols, eps })?;
                dx
            }
            DeviceForm::Embedding { vocabulary, width } => {
                run(compute, Kernel::EmbeddingBackward { ids: input, dy, dtable: grads, rows, width, vocabulary })?;
                0
            }
            DeviceForm::PositionEmbedding { context, width } => {
                run(compute, Kernel::PositionsBackward { dy, dtable: grads, batch, steps, width, context })?;
                let dx = dx(rows * width)?;
                if dx != 0 {
                    run(compute, Kernel::Copy { x: dy, y: dx, n: rows * width })?;
                }
                dx
            }
            DeviceForm::Attention { width: d, heads } => {
                let [qkv, att, probs] = self.kept[i];
                let g_qkv_b = grads + (d * 3 * d) as u64 * F32;
                let g_proj_w = g_qkv_b + (3 * d) as u64 * F32;
                let g_proj_b = g_proj_w + (d * d) as u64 * F32;
                let proj_w = weights + (d * 3 * d + 3 * d) as u64 * F32;
                // The output projection.
                product(compute, &work, (d, d, rows), (att, true), (dy, false), g_proj_w, 0.0)?;
                run(compute, Kernel::SumRows { x: dy, sum: g_proj_b, rows, cols: d })?;
                let d_att = fresh::<_, f32>(&work, rows * d)?;
                product(compute, &work, (rows, d, d), (dy, false), (proj_w, true), d_att, 0.0)?;
                // The heads: one sequence's and head's `dP` at a time on the host, all of
                // them at once on a GPU.
                let d_qkv = fresh::<_, f32>(&work, rows * 3 * d)?;
                let scores = fresh::<_, f32>(&work, batch * heads * steps * steps)?;
                let scratch_len = compute.attention_scratch(steps, d / heads);
                let frame = work.frame()?;
                let scratch = scratch_in(&frame, scratch_len)?;
                let core = KernelAttention {
                    qkv,
                    att,
                    probs,
                    d_att,
                    d_qkv,
                    work: scores,
                    scratch,
                    scratch_len,
                    ..attention(batch, steps, d, heads)
                };
                run(compute, Kernel::AttentionBackward(core))?;
                drop(frame);
                // The input projection.
                product(compute, &work, (d, 3 * d, rows), (input, true), (d_qkv, false), grads, 0.0)?;
                run(compute, Kernel::SumRows { x: d_qkv, sum: g_qkv_b, rows, cols: 3 * d })?;
                let dx = dx(rows * d)?;
                if dx != 0 {
                    product(compute, &work, (rows, d, 3 * d), (d_qkv, false), (weights, true), dx, 0.0)?;
                }
                dx
            }
        })
    }
}

/// An attention core's shape, its arrays to be filled in.
fn attention(batch: usize, steps: usize, width: usize, heads: usize) -> KernelAttention {
    let narrow = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    KernelAttention {
        qkv: 0,
        att: 0,
        probs: 0,
        d_att: 0,
        d_qkv: 0,
        work: 0,
        batch: narrow(batch),
        steps: narrow(steps),
        width: narrow(width),
        heads: narrow(heads),
        scratch: 0,
        scratch_len: 0,
    }
}

#[cfg(test)]
mod tests {
    use ndarray::{Array1, Array2};
    use workspace_cuda::{Device as _, DeviceError};

    use super::*;
    use crate::nn::Dense;

    #[test]
    fn a_step_that_failed_on_the_device_leaves_the_parameters_and_refuses_the_next() {
        let layers: Vec<Box<dyn Layer>> = vec![Box::new(Dense::new(3, 4)), Box::new(Dense::new(4, 2))];
        let layout = Params::of(3, &layers).unwrap();
        let plan = Plan::of(&layers, &layout, Updater::adam(0.1)).unwrap();
        let mut params: Vec<f32> = (0..layout.layout.total).map(|i| (i % 7) as f32 / 7.0 - 0.4).collect();
        let mut trainer = Trainer::new(SimCompute::new().unwrap(), plan, &params, WorkspaceMode::Enabled).unwrap();
        let (x, y) = (Array2::<f32>::ones((5, 3)), Array1::<u32>::zeros(5).insert_axis(ndarray::Axis(1)));
        let mut grads = vec![0.0; params.len()];
        trainer.fit(StepInput::Flat(x.view()), y.view(), &mut params, &mut grads).unwrap();
        let after_one = params.clone();
        // A fault of the device during the next step (what a kernel out of bounds or a
        // lost context gives).
        trainer.compute.device().defer_error(DeviceError::Fault { op: "gemm", detail: "injected".into() });
        let err = trainer.fit(StepInput::Flat(x.view()), y.view(), &mut params, &mut grads).unwrap_err();
        assert!(err.to_string().contains("injected"), "{err}");
        assert_eq!(params, after_one, "the failed step stored nothing into the network");
        let err = trainer.fit(StepInput::Flat(x.view()), y.view(), &mut params, &mut grads).unwrap_err();
        assert!(err.to_string().contains("an earlier training step failed"), "{err}");
        assert_eq!(params, after_one);
    }
}
