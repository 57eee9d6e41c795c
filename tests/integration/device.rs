//! Training on a device: the simulated device gives the host's losses and parameters,
//! holds its memory flat once steady, refuses what it cannot run with the reason, and
//! leaves the network as it was when a step fails; a CUDA device where there is none is
//! an error, never a panic; every CUDA C kernel compiles with NVRTC.

use carve::ndarray::{Array1, Array2};
use carve::nn::device::{compile_kernels, KERNEL_NAMES};
use carve::nn::{Device, Network, NetworkConfig, NetworkConfigBuilder, Updater};
use carve::Error;

/// A small classification batch: `rows` examples of `inputs` features, labels from a
/// fixed rule so that the loss can fall.
fn batch(rows: usize, inputs: usize, classes: usize, seed: u32) -> (Array2<f32>, Array1<u32>) {
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        (state % 1000) as f32 / 500.0 - 1.0
    };
    let x = Array2::from_shape_simple_fn((rows, inputs), &mut next);
    // The class is the largest of the first `classes` features: learnable.
    let y = Array1::from_iter(
        x.rows().into_iter().map(|r| (0..classes).fold(0, |best, c| if r[c] > r[best] { c } else { best }) as u32),
    );
    (x, y)
}

fn mlp(device: Device, updater: Updater) -> NetworkConfigBuilder {
    NetworkConfig::builder(64).dense(48).relu().dense(32).relu().dense(10).seed(7).updater(updater).device(device)
}

fn relative(a: f32, b: f32) -> f32 {
    (a - b).abs() / a.abs().max(b.abs()).max(f32::MIN_POSITIVE)
}

/// Trains the same network on the host and on `device` over `steps` batches; returns
/// both loss traces and both parameter vectors.
/// A run's losses, step by step, and its parameters at the end.
type Run = (Vec<f32>, Vec<f32>);

fn host_and(device: Device, updater: Updater, steps: usize) -> (Run, Run) {
    let mut host = Network::new(mlp(Device::Host, updater).build().unwrap()).unwrap();
    let mut dev = Network::new(mlp(device, updater).build().unwrap()).unwrap();
    assert_eq!(host.params(), dev.params(), "the same initialisation");
    let (mut host_losses, mut dev_losses) = (Vec::new(), Vec::new());
    for step in 0..steps {
        // Batches of two sizes: the workspace meets both shapes.
        let (x, y) = batch(if step % 3 == 0 { 40 } else { 32 }, 64, 10, step as u32);
        host_losses.push(host.fit_batch(x.view(), y.view()).unwrap());
        dev_losses.push(dev.fit_batch(x.view(), y.view()).unwrap());
    }
    ((host_losses, host.params().to_vec()), (dev_losses, dev.params().to_vec()))
}

#[test]
fn the_simulated_device_trains_to_the_hosts_losses() {
    for updater in [Updater::adam(0.01), Updater::sgd(0.05, 0.9)] {
        let ((host, host_params), (sim, sim_params)) = host_and(Device::simulated(), updater, 100);
        for (step, (h, s)) in host.iter().zip(&sim).enumerate() {
            assert!(relative(*h, *s) <= 1e-5, "{updater:?} step {step}: host {h}, simulated {s}");
        }
        for (i, (h, s)) in host_params.iter().zip(&sim_params).enumerate() {
            assert!((h - s).abs() <= 1e-5 * h.abs().max(1e-3), "{updater:?} parameter {i}: host {h}, simulated {s}");
        }
        assert!(sim[99] < 0.8 * sim[0], "{updater:?}: the loss falls ({} → {})", sim[0], sim[99]);
    }
}

/// Issue: a device network copied its parameters to the device once; values set through
/// `layer_params_mut` (a checkpoint restored) were trained on by the host's `evaluate`
/// and undone by the next device step, and `layer_grads` stayed zero.
#[test]
fn parameters_set_between_device_steps_are_trained_from_and_the_gradients_are_the_steps() {
    for updater in [Updater::adam(0.01), Updater::sgd(0.05, 0.9)] {
        let mut host = Network::new(mlp(Device::Host, updater).build().unwrap()).unwrap();
        let mut sim = Network::new(mlp(Device::simulated(), updater).build().unwrap()).unwrap();
        for step in 0..6 {
            let (x, y) = batch(32, 64, 10, step);
            if step == 3 {
                // A checkpoint restored into both, layer by layer.
                for net in [&mut host, &mut sim] {
                    net.layer_params_mut(0).iter_mut().enumerate().for_each(|(i, v)| *v = (i % 13) as f32 * 0.01);
                    net.layer_params_mut(2).fill(0.02);
                }
            }
            let (h, s) = (host.fit_batch(x.view(), y.view()).unwrap(), sim.fit_batch(x.view(), y.view()).unwrap());
            assert!(relative(h, s) <= 1e-5, "{updater:?} step {step}: host {h}, simulated {s}");
            for layer in 0..host.layers().len() {
                let (hg, sg) = (host.layer_grads(layer), sim.layer_grads(layer));
                if hg.is_empty() {
                    continue; // an activation
                }
                assert!(hg.iter().any(|&g| g != 0.0), "{updater:?} step {step} layer {layer}: host gradients 0");
                for (i, (h, s)) in hg.iter().zip(sg).enumerate() {
                    let tolerance = 1e-4 * h.abs().max(1e-3);
                    assert!((h - s).abs() <= tolerance, "{updater:?} step {step} layer {layer} gradient {i}: {h} {s}");
                }
            }
        }
        for (i, (h, s)) in host.params().iter().zip(sim.params()).enumerate() {
            assert!((h - s).abs() <= 1e-5 * h.abs().max(1e-3), "{updater:?} parameter {i}: host {h}, simulated {s}");
        }
        // The restored values were trained from: a layer set to 0.02 everywhere moved
        // from there, by a few steps' updates.
        assert!(sim.layer_params(2).iter().all(|v| (v - 0.02).abs() < 0.2), "{:?}", &sim.layer_params(2)[..4]);
    }
}

#[test]
fn a_steady_device_step_allocates_no_device_memory() {
    let mut net = Network::new(mlp(Device::simulated(), Updater::adam(0.01)).build().unwrap()).unwrap();
    assert_eq!(net.device(), Device::Simulated);
    let (x, y) = batch(32, 64, 10, 1);
    for _ in 0..20 {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    let steady = net.device_stats().expect("on a device");
    for _ in 0..20 {
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    let after = net.device_stats().unwrap();
    assert_eq!(after.allocations, steady.allocations, "no device allocation per steady step");
    assert_eq!(after.bytes, steady.bytes);
    assert_eq!(after.steps, 40);
    assert_eq!(net.iterations(), 40);
    assert!(after.device.contains("simulated"), "{}", after.device);
    assert!(Network::new(mlp(Device::Host, Updater::adam(0.01)).build().unwrap()).unwrap().device_stats().is_none());
}

#[test]
fn what_a_device_cannot_run_is_refused_with_the_reason() {
    let lstm = NetworkConfig::builder(4).lstm(8).last_step().dense(3).device(Device::simulated()).build().unwrap();
    let err = Network::new(lstm).unwrap_err().to_string();
    assert!(err.contains("has no device form") && err.contains("lstm"), "{err}");
    // GELU's exact form: the devices' kernel is the tanh form.
    let exact = NetworkConfig::builder(4).dense(8).gelu_exact().dense(3).device(Device::simulated()).build().unwrap();
    let err = Network::new(exact).unwrap_err().to_string();
    assert!(err.contains("has no device form") && err.contains("gelu_1") && err.contains("tanh form"), "{err}");
    let tanh = NetworkConfig::builder(4).dense(8).gelu().dense(3).device(Device::simulated()).build().unwrap();
    assert!(Network::new(tanh).is_ok());

    // Data-parallel workers run on the host: a device network is refused, not trained on
    // the host behind the caller's back.
    let net = Network::new(mlp(Device::simulated(), Updater::adam(0.01)).build().unwrap()).unwrap();
    let err = carve::nn::parallel::DataParallel::new(net, carve::nn::parallel::ParallelConfig::threads(2));
    assert!(
        matches!(err, Err(Error::InvalidConfig { ref reason }) if reason.contains("on the host")),
        "{:?}",
        err.err()
    );

    // Sequences are not on devices yet: a clear error, and the network stays usable.
    let mut net = Network::new(mlp(Device::simulated(), Updater::adam(0.01)).build().unwrap()).unwrap();
    let x3 = carve::ndarray::Array3::<f32>::zeros((2, 3, 64));
    let err =
        net.fit_batch(carve::nn::Input::Sequences { features: x3.view(), mask: None }, Array1::<u32>::zeros(2).view());
    assert!(matches!(err, Err(Error::InvalidInput(ref m)) if m.contains("flat batch")), "{err:?}");
    let (x, y) = batch(8, 64, 10, 2);
    let wrong = Array1::<u32>::from_elem(8, 10);
    assert!(matches!(net.fit_batch(x.view(), wrong.view()), Err(Error::InvalidInput(_))));
    assert!(matches!(net.fit_batch(x.view(), y.slice(carve::ndarray::s![..4])), Err(Error::ShapeMismatch { .. })));
    net.fit_batch(x.view(), y.view()).unwrap();
}

#[test]
fn a_step_that_would_not_be_finite_changes_nothing() {
    let mut net = Network::new(mlp(Device::simulated(), Updater::sgd(0.1, 0.0)).build().unwrap()).unwrap();
    let (x, y) = batch(16, 64, 10, 3);
    net.fit_batch(x.view(), y.view()).unwrap();
    let before = net.params().to_vec();
    let mut nan = x.clone();
    nan[[3, 5]] = f32::NAN;
    let err = net.fit_batch(nan.view(), y.view()).unwrap_err();
    assert!(matches!(err, Error::NonFinite { ref layer, .. } if layer == "input"), "{err}");
    // Inputs so large that the gradients overflow: the update's check refuses the step.
    let huge = x.mapv(|v| v * 3e38);
    let err = net.fit_batch(huge.view(), y.view()).unwrap_err();
    assert!(matches!(err, Error::NonFinite { .. }), "{err}");
    assert_eq!(net.params(), &before[..], "nothing stored");
    assert_eq!(net.iterations(), 1);
    net.fit_batch(x.view(), y.view()).unwrap();
    assert_eq!(net.iterations(), 2);
}

#[test]
fn a_cuda_device_where_there_is_none_is_an_error_with_the_reason() {
    if carve::workspace_cuda::probe().is_available() {
        eprintln!("a CUDA device is present: the no-device path is not exercised here");
        return;
    }
    let err = Network::new(mlp(Device::cuda(0), Updater::adam(0.01)).build().unwrap()).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("no CUDA device"), "{message}");
    assert_eq!("cuda".parse::<Device>().unwrap(), Device::cuda(0));
    assert!("tpu".parse::<Device>().is_err());
}

/// Every kernel of `kernels.cu` compiles with NVRTC for the GPUs carve targets. NVRTC
/// comes from the `nvidia-cuda-nvrtc` wheel in CI (`CARVE_REQUIRE_NVRTC=1` there, so a
/// missing library fails instead of skipping).
#[test]
fn every_kernel_compiles_with_nvrtc() {
    for arch in ["compute_90", "compute_80", "compute_75"] {
        match compile_kernels(arch) {
            Ok(ptx) => {
                for name in KERNEL_NAMES {
                    assert!(ptx.contains(&format!(".entry {name}(")), "{arch}: no kernel {name} in the PTX");
                }
            }
            Err(e) if e.to_string().contains("was not found") && std::env::var_os("CARVE_REQUIRE_NVRTC").is_none() => {
                eprintln!("NVRTC is not installed, the kernels were not compiled: {e}");
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        }
    }
}

/// A small GPT: token and position embeddings, two blocks of attention and an MLP
/// (each behind a layer norm, in a residual block), a final layer norm and the head.
fn gpt(device: Device, updater: Updater, attention_recompute: bool) -> NetworkConfigBuilder {
    let (vocabulary, context) = (20, 12);
    let mut b = NetworkConfig::builder(vocabulary).embedding(16).position_embedding(context);
    for _ in 0..2 {
        b = b
            .residual(|b| {
                if attention_recompute {
                    b.layer_norm().attention_recompute(2)
                } else {
                    b.layer_norm().attention(2)
                }
            })
            .residual(|b| b.layer_norm().dense(48).gelu().dense(16));
    }
    b.layer_norm().dense(vocabulary).seed(11).updater(updater).device(device)
}

/// Token sequences whose next token follows from the current one: learnable.
fn tokens(batch: usize, steps: usize, seed: u32) -> (Array2<u32>, Array2<u32>) {
    let ids = Array2::from_shape_fn((batch, steps + 1), |(b, t)| {
        ((b as u32 * 7 + seed * 3 + t as u32 * 5) % 20 + (t as u32 % 3)) % 20
    });
    let x = ids.slice(carve::ndarray::s![.., ..steps]).to_owned();
    let y = ids.slice(carve::ndarray::s![.., 1..]).to_owned();
    (x, y)
}

#[test]
fn the_simulated_device_trains_the_gpt_to_the_hosts_losses() {
    for (updater, recompute) in [(Updater::adamw(3e-3, 0.1), false), (Updater::adam(3e-3), true)] {
        let mut host = Network::new(gpt(Device::Host, updater, recompute).build().unwrap()).unwrap();
        let mut sim = Network::new(gpt(Device::simulated(), updater, recompute).build().unwrap()).unwrap();
        let (mut first, mut last) = (0.0, 0.0);
        for step in 0..40 {
            // Two sequence lengths: the workspace meets both shapes.
            let (x, y) = tokens(4, if step % 4 == 0 { 12 } else { 9 }, step);
            let h = host.fit_batch(carve::nn::Input::tokens(x.view()), y.view()).unwrap();
            let s = sim.fit_batch(carve::nn::Input::tokens(x.view()), y.view()).unwrap();
            assert!(relative(h, s) <= 1e-5, "{updater:?} step {step}: host {h}, simulated {s}");
            if step == 0 {
                first = s;
            }
            last = s;
        }
        for (i, (h, s)) in host.params().iter().zip(sim.params()).enumerate() {
            assert!((h - s).abs() <= 1e-5 * h.abs().max(1e-3), "{updater:?} parameter {i}: host {h}, simulated {s}");
        }
        assert!(last < 0.8 * first, "{updater:?}: the loss falls ({first} → {last})");
    }
}

#[test]
fn the_gpt_on_a_device_refuses_what_it_cannot_take() {
    let mut net = Network::new(gpt(Device::simulated(), Updater::adam(1e-3), false).build().unwrap()).unwrap();
    let (x, y) = tokens(2, 12, 0);
    // A token beyond the vocabulary, sequences beyond the context, a mask.
    let mut bad = x.clone();
    bad[[1, 3]] = 20;
    let err = net.fit_batch(carve::nn::Input::tokens(bad.view()), y.view()).unwrap_err().to_string();
    assert!(err.contains("token id 20"), "{err}");
    let (long_x, long_y) = tokens(2, 13, 0);
    let err = net.fit_batch(carve::nn::Input::tokens(long_x.view()), long_y.view()).unwrap_err().to_string();
    assert!(err.contains("context of 12"), "{err}");
    let mask = Array2::<f32>::ones((2, 12));
    let masked = carve::nn::Input::Tokens { ids: x.view(), mask: Some(mask.view()) };
    let err = net.fit_batch(masked, y.view()).unwrap_err().to_string();
    assert!(err.contains("without masks"), "{err}");
    assert_eq!(net.iterations(), 0);
    net.fit_batch(carve::nn::Input::tokens(x.view()), y.view()).unwrap();
    assert_eq!(net.iterations(), 1);
}

#[test]
fn every_workspace_mode_trains_the_same_on_a_device_and_planned_holds_the_bound() {
    let mut traces = Vec::new();
    for mode in [carve::WorkspaceMode::Enabled, carve::WorkspaceMode::Planned, carve::WorkspaceMode::None] {
        let config = gpt(Device::simulated(), Updater::adamw(3e-3, 0.1), false).training_workspace_mode(mode);
        let mut net = Network::new(config.build().unwrap()).unwrap();
        let mut losses = Vec::new();
        for step in 0..12 {
            let (x, y) = tokens(4, if step % 4 == 0 { 12 } else { 9 }, step);
            losses.push(net.fit_batch(carve::nn::Input::tokens(x.view()), y.view()).unwrap().to_bits());
        }
        let stats = net.device_stats().unwrap();
        let steady = stats.allocations;
        for step in 12..16 {
            let (x, y) = tokens(4, if step % 4 == 0 { 12 } else { 9 }, step);
            net.fit_batch(carve::nn::Input::tokens(x.view()), y.view()).unwrap();
        }
        let after = net.device_stats().unwrap();
        match mode {
            carve::WorkspaceMode::Planned => {
                let (plan, bound) = (after.plan_bytes.unwrap(), after.lower_bound_bytes.unwrap());
                assert!(bound > 0 && plan >= bound && plan as f64 <= 1.05 * bound as f64, "plan {plan}, bound {bound}");
                assert_eq!(after.allocations, steady, "no device allocation once both shapes are planned");
            }
            carve::WorkspaceMode::Enabled => assert_eq!(after.allocations, steady, "no device allocation once steady"),
            _ => assert!(after.allocations > steady, "without workspaces every array is its own allocation"),
        }
        traces.push((mode, losses));
    }
    for w in traces.windows(2) {
        assert_eq!(w[0].1, w[1].1, "{:?} and {:?} give other losses", w[0].0, w[1].0);
    }
}

#[test]
fn a_dry_run_of_a_device_networks_training_steps_is_refused_and_its_inferences_sized() {
    // The host's workspaces say nothing of a step on a device: no prediction that the
    // step would not keep, but an error saying why; its inferences run on the host.
    use carve::nn::dry::{BatchShape, DryPass};
    let config = NetworkConfig::builder(64).dense(32).relu().dense(10).device(Device::Simulated).build().unwrap();
    let mut net = Network::new(config).unwrap();
    match net.dry_run(&[DryPass::Infer(BatchShape::flat(8)), DryPass::Train(BatchShape::flat(8))]) {
        Err(Error::InvalidInput(m)) => assert!(m.contains("trains on sim") && m.contains("device_stats"), "{m}"),
        other => panic!("{other:?}"),
    }
    let estimate = net.dry_run(&[DryPass::Infer(BatchShape::flat(8))]).unwrap();
    let (x, _) = batch(8, 64, 10, 1);
    net.output(x.view()).unwrap();
    assert_eq!(net.last_inference_workspace_bytes(), estimate.per_pass_bytes[0]);
}
