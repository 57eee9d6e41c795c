//! Models saved and loaded in safetensors: a saved network loads into a model that gives
//! its bits; files of PyTorch's names and layouts (tests/fixtures/models, made by
//! make_fixtures.py) load and give the outputs computed there independently; another
//! reader (the `safetensors` crate) reads carve's files; and no file, however broken or
//! lying, makes loading panic or read out of bounds: each gets a typed error naming the
//! tensor at fault.

use std::path::{Path, PathBuf};

use carve::nn::{serve::Model, Dense, Input, Lstm, Network, NetworkConfig};
use carve::Error;
use carve_rng::Rng;
use ndarray::{Array1, Array2, Array3, ArrayD};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

/// A file in a directory removed when the test ends.
struct Scratch(tempfile::TempDir);

impl Scratch {
    fn new() -> Scratch {
        Scratch(tempfile::tempdir().expect("a temporary directory"))
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

/// The tensor `name` of a fixture, read by the `safetensors` crate (not carve).
fn reference(file: &str, name: &str) -> ArrayD<f32> {
    let bytes = std::fs::read(fixture(file)).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = tensors.tensor(name).unwrap();
    assert_eq!(view.dtype(), safetensors::Dtype::F32);
    let values = view.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    ArrayD::from_shape_vec(view.shape().to_vec(), values).unwrap()
}

fn random(shape: (usize, usize), rng: &mut Rng) -> Array2<f32> {
    Array2::from_shape_fn(shape, |_| rng.uniform(-1.0, 1.0))
}

/// A trained MLP (a few steps of Adam, so that no weight is as initialised).
fn trained_mlp() -> Network {
    let config = NetworkConfig::builder(10).dense(16).relu().dense(12).relu().dense(4).seed(5).build().unwrap();
    let mut net = Network::new(config).unwrap();
    let mut rng = Rng::new(9);
    for _ in 0..5 {
        let x = random((8, 10), &mut rng);
        let y = Array1::from_shape_fn(8, |i| (i % 4) as u32);
        net.fit_batch(x.view(), y.view()).unwrap();
    }
    net
}

/// A trained sequence classifier: LSTM, `head`, dense.
fn trained_lstm(mean: bool) -> (Network, Array3<f32>, Array2<f32>) {
    let builder = NetworkConfig::builder(6).lstm(9);
    let builder = if mean { builder.masked_mean() } else { builder.last_step() };
    let mut net = Network::new(builder.dense(3).seed(2).build().unwrap()).unwrap();
    let mut rng = Rng::new(4);
    let x = Array3::from_shape_fn((5, 7, 6), |_| rng.uniform(-1.0, 1.0));
    let mask = Array2::from_shape_fn((5, 7), |(b, t)| f32::from(u8::from(t < 7 - b)));
    let y = Array1::from(vec![0u32, 1, 2, 0, 1]);
    for _ in 0..4 {
        net.fit_batch((x.view(), mask.view()), y.view()).unwrap();
    }
    (net, x, mask)
}

#[test]
fn a_saved_network_loads_into_a_model_that_gives_its_bits() {
    let dir = Scratch::new();
    let mut net = trained_mlp();
    let x = random((7, 10), &mut Rng::new(1));
    let path = dir.path("mlp.safetensors");
    net.save(&path).unwrap();
    let model = Model::load(&path).unwrap();
    assert_eq!((model.inputs(), model.classes()), (10, 4));
    assert_eq!(model.weight_bytes(), net.freeze().unwrap().weight_bytes());
    assert_eq!(model.output(x.view()).unwrap(), net.output(x.view()).unwrap());
    // Saving the loaded model gives the same bytes.
    let again = dir.path("again.safetensors");
    model.save(&again).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(&again).unwrap());
    // No temporary file is left beside the model.
    let names: Vec<_> = std::fs::read_dir(dir.0.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 2, "{names:?}");

    for mean in [false, true] {
        let (mut net, x, mask) = trained_lstm(mean);
        let path = dir.path(&format!("lstm_{mean}.safetensors"));
        net.save(&path).unwrap();
        let model = Model::load(&path).unwrap();
        let input = Input::from((x.view(), mask.view()));
        assert_eq!(model.output(input).unwrap(), net.output(input).unwrap(), "masked mean: {mean}");
    }
}

#[test]
fn carves_files_are_read_by_another_reader_in_pytorchs_layouts() {
    let dir = Scratch::new();
    let as_f32 = |bytes: &[u8]| -> Vec<f32> {
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    };
    let mut net =
        Network::new(NetworkConfig::builder(3).layer(Dense::named("fc", 3, 2)).seed(4).build().unwrap()).unwrap();
    let path = dir.path("fc.safetensors");
    net.save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = tensors.names();
    names.sort();
    assert_eq!(names, ["fc.bias", "fc.weight"]);
    let weight = tensors.tensor("fc.weight").unwrap();
    assert_eq!(weight.shape(), [2, 3], "nn.Linear's [out, in]");
    // nn.Linear computes x·Wᵀ + b: so do the file's tensors, as the network does.
    let weight = Array2::from_shape_vec((2, 3), as_f32(weight.data())).unwrap();
    let bias = Array1::from(as_f32(tensors.tensor("fc.bias").unwrap().data()));
    let x = random((4, 3), &mut Rng::new(8));
    let logits = x.dot(&weight.t()) + &bias;
    let probs = net.output(x.view()).unwrap();
    for (row, want) in logits.rows().into_iter().zip(probs.rows()) {
        let total: f32 = row.iter().map(|z| z.exp()).sum();
        for (z, p) in row.iter().zip(want) {
            assert!((z.exp() / total - p).abs() < 1e-6, "{logits} against {probs}");
        }
    }
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = metadata.metadata().as_ref().unwrap();
    assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
    assert!(meta["carve.model"].contains(r#""kind":"dense""#), "{meta:?}");

    // Layers sharing a name are saved by position.
    let twins = NetworkConfig::builder(3).layer(Dense::named("d", 3, 4)).layer(Dense::named("d", 4, 2)).build();
    let path = dir.path("twins.safetensors");
    Network::new(twins.unwrap()).unwrap().save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let mut names = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap()
        .names()
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    names.sort();
    assert_eq!(names, ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]);
    assert_eq!(Model::load(&path).unwrap().layers()[1].name(), "d");

    // An LSTM's gates are stored in PyTorch's order i, f, g, o, and its biases sum back
    // exactly: bias_hh_l0 is all -0.0.
    let (net, _, _) = trained_lstm(false);
    let path = dir.path("lstm.safetensors");
    net.save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(tensors.tensor("lstm_0.weight_ih_l0").unwrap().shape(), [36, 6]);
    assert_eq!(tensors.tensor("lstm_0.weight_hh_l0").unwrap().shape(), [36, 9]);
    let hh = tensors.tensor("lstm_0.bias_hh_l0").unwrap();
    assert!(hh
        .data()
        .chunks_exact(4)
        .all(|b| f32::from_le_bytes(b.try_into().unwrap()).to_bits() == (-0.0f32).to_bits()));
    let ih = as_f32(tensors.tensor("lstm_0.bias_ih_l0").unwrap().data());
    // carve initialises the forget gate's biases at 1 and the others at 0; after a few
    // steps they have moved, but the forget block (PyTorch's second) is still near 1.
    let block_mean = |k: usize| ih[k * 9..(k + 1) * 9].iter().sum::<f32>() / 9.0;
    assert!((block_mean(1) - 1.0).abs() < 0.1, "forget gate block: {ih:?}");
    for k in [0, 2, 3] {
        assert!(block_mean(k).abs() < 0.1, "block {k}: {ih:?}");
    }
}

fn assert_close(got: &Array2<f32>, want: &ArrayD<f32>, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}");
    for (g, w) in got.iter().zip(want.iter()) {
        assert!((g - w).abs() <= 2e-6 + 1e-5 * w.abs(), "{what}: {g} against the reference {w}\n{got}\n{want}");
    }
}

#[test]
fn pytorch_files_load_and_match_the_reference_outputs() {
    // nn.Sequential inside a module: net.0.weight, net.2.weight, net.4.weight.
    let config = NetworkConfig::builder(64).dense(32).relu().dense(16).relu().dense(10).build().unwrap();
    let model = Model::load_pytorch(fixture("mlp_pytorch.safetensors"), &config).unwrap();
    let x: Array2<f32> = reference("mlp_reference.safetensors", "x").into_dimensionality().unwrap();
    let want = reference("mlp_reference.safetensors", "probabilities");
    assert_close(&model.output(x.view()).unwrap(), &want, "MLP");

    // Named modules: lstm.*, fc.*, with a head over the steps that hold data.
    let x: Array3<f32> = reference("lstm_reference.safetensors", "x").into_dimensionality().unwrap();
    let mask: Array2<f32> = reference("lstm_reference.safetensors", "mask").into_dimensionality().unwrap();
    for (mean, want) in [(false, "probabilities_last_step"), (true, "probabilities_masked_mean")] {
        let builder = NetworkConfig::builder(12).layer(Lstm::named("lstm", 12, 8).unwrap());
        let builder = if mean { builder.masked_mean() } else { builder.last_step() };
        let config = builder.layer(Dense::named("fc", 8, 9)).build().unwrap();
        let model = Model::load_pytorch(fixture("lstm_pytorch.safetensors"), &config).unwrap();
        let got = model.output((x.view(), mask.view())).unwrap();
        assert_close(&got, &reference("lstm_reference.safetensors", want), want);

        // Saved by carve and loaded back, with no configuration needed: the same bits.
        let dir = Scratch::new();
        let path = dir.path("from_pytorch.safetensors");
        model.save(&path).unwrap();
        assert_eq!(Model::load(&path).unwrap().output((x.view(), mask.view())).unwrap(), got);
    }
}

fn config_error(result: carve::Result<Model>) -> (Option<String>, String) {
    match result {
        Err(Error::ModelFile { tensor, reason, .. }) => (tensor, reason),
        other => panic!("expected a model-file error, got {other:?}"),
    }
}

#[test]
fn a_pytorch_file_with_the_wrong_configuration_gets_an_error_naming_the_tensor() {
    let file = fixture("mlp_pytorch.safetensors");
    // A wrong width: the tensor's shape disagrees.
    let config = NetworkConfig::builder(64).dense(30).relu().dense(16).relu().dense(10).build().unwrap();
    let err = Model::load_pytorch(&file, &config).unwrap_err();
    let (tensor, reason) = config_error(Err(err));
    assert_eq!(tensor.as_deref(), Some("net.0.weight"));
    assert!(reason.contains("[32, 64]") && reason.contains("[30, 64]"), "{reason}");
    // A layer missing: net.4.* is left over.
    let config = NetworkConfig::builder(64).dense(32).relu().dense(16).build().unwrap();
    let (tensor, reason) = config_error(Model::load_pytorch(&file, &config));
    assert_eq!(tensor.as_deref(), Some("net.4.bias"));
    assert!(reason.contains("no layer of the configuration uses it"), "{reason}");
    // Layers named differently from the file, and not at its positions.
    let config = NetworkConfig::builder(64).relu().dense(32).relu().dense(16).relu().dense(10).build().unwrap();
    let (tensor, reason) = config_error(Model::load_pytorch(&file, &config));
    assert_eq!(tensor.as_deref(), Some("dense_1.weight"));
    assert!(reason.contains("'1.weight'") && reason.contains("net.0.weight"), "{reason}");
    // A PyTorch file has no configuration of its own.
    let (tensor, reason) = config_error(Model::load(&file));
    assert_eq!(tensor, None);
    assert!(reason.contains("Model::load_pytorch"), "{reason}");
    // A missing file.
    let (_, reason) = config_error(Model::load(fixture("no_such_model.safetensors")));
    assert!(reason.contains("cannot be read"), "{reason}");
}

/// A safetensors file of `header` (JSON) and `data`, its length as the file says it.
fn file_of(header: &str, data: &[u8]) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

fn load_bytes(dir: &Scratch, bytes: &[u8]) -> carve::Result<Model> {
    let path = dir.path("hostile.safetensors");
    std::fs::write(&path, bytes).unwrap();
    Model::load(&path)
}

/// The header of carve's file for a one-layer model `dense_0` of 2 inputs, 2 outputs,
/// with the tensors' entries given.
fn one_dense_header(weight: &str, bias: &str) -> String {
    let config = r#"{\"version\":1,\"inputs\":2,\"layers\":[{\"kind\":\"dense\",\"name\":\"dense_0\",\"tensors\":\"dense_0\",\"inputs\":2,\"outputs\":2}]}"#;
    format!(r#"{{"__metadata__":{{"carve.model":"{config}"}},"dense_0.weight":{weight},"dense_0.bias":{bias}}}"#)
}

#[test]
fn broken_and_lying_files_get_typed_errors_naming_the_tensor() {
    let dir = Scratch::new();
    let data: Vec<u8> = [0.5f32, -0.5, 0.25, 1.0, 0.0, 0.1].iter().flat_map(|v| v.to_le_bytes()).collect();
    let good = one_dense_header(
        r#"{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}"#,
        r#"{"dtype":"F32","shape":[2],"data_offsets":[16,24]}"#,
    );
    let model = load_bytes(&dir, &file_of(&good, &data)).unwrap();
    assert_eq!(model.output(Array2::<f32>::ones((1, 2)).view()).unwrap().shape(), [1, 2]);

    let cases: Vec<(&str, Vec<u8>, Option<&str>, &str)> = vec![
        ("empty file", vec![], None, "shorter than the 8-byte header length"),
        (
            "header length larger than the file",
            {
                let mut bytes = file_of(&good, &data);
                bytes[..8].copy_from_slice(&(good.len() as u64 + 100).to_le_bytes());
                bytes
            },
            None,
            "the header claims",
        ),
        (
            "header length u64::MAX",
            {
                let mut bytes = file_of(&good, &data);
                bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
                bytes
            },
            None,
            "the header claims",
        ),
        (
            "header length cutting the JSON",
            {
                let mut bytes = file_of(&good, &data);
                bytes[..8].copy_from_slice(&(good.len() as u64 - 3).to_le_bytes());
                bytes
            },
            None,
            "not valid JSON",
        ),
        ("truncated data", file_of(&good, &data[..20]), Some("dense_0.bias"), "outside the file's 20 bytes"),
        ("extra data", file_of(&good, &[&data[..], &[0u8; 4]].concat()), Some("dense_0.bias"), "bytes no tensor owns"),
        (
            "offsets beyond the data",
            file_of(
                &one_dense_header(
                    r#"{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}"#,
                    r#"{"dtype":"F32","shape":[2],"data_offsets":[16,4000000000000]}"#,
                ),
                &data,
            ),
            Some("dense_0.bias"),
            "lie outside",
        ),
        (
            "offsets reversed",
            file_of(
                &one_dense_header(
                    r#"{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}"#,
                    r#"{"dtype":"F32","shape":[2],"data_offsets":[16,24]}"#,
                ),
                &data,
            ),
            Some("dense_0.weight"),
            "lie outside",
        ),
        (
            "overlapping tensors",
            file_of(
                &one_dense_header(
                    r#"{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}"#,
                    r#"{"dtype":"F32","shape":[2],"data_offsets":[8,16]}"#,
                ),
                &data[..16],
            ),
            Some("dense_0.bias"),
            "overlaps tensor 'dense_0.weight'",
        ),
        (
            "shape and offsets disagree",
            file_of(
                &one_dense_header(
                    r#"{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}"#,
                    r#"{"dtype":"F32","shape":[2],"data_offsets":[16,24]}"#,
                ),
                &data,
            ),
            Some("dense_0.weight"),
            "needs 24 bytes",
        ),
        (
            "overflowing shape",
            file_of(
                &one_dense_header(
                    r#"{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,16]}"#,
                    r#"{"dtype":"F32","shape":[2],"data_offsets":[16,24]}"#,
                ),
                &data,
            ),
            Some("dense_0.weight"),
            "overflows",
        ),
        (
            "another dtype",
            file_of(
                &one_dense_header(
                    r#"{"dtype":"F16","shape":[2,4],"data_offsets":[0,16]}"#,
                    r#"{"dtype":"F32","shape":[2],"data_offsets":[16,24]}"#,
                ),
                &data,
            ),
            Some("dense_0.weight"),
            "dtype F16",
        ),
        (
            "the configuration's shape",
            file_of(
                &one_dense_header(
                    r#"{"dtype":"F32","shape":[4],"data_offsets":[0,16]}"#,
                    r#"{"dtype":"F32","shape":[2],"data_offsets":[16,24]}"#,
                ),
                &data,
            ),
            Some("dense_0.weight"),
            "the model needs [2, 2]",
        ),
        (
            "a missing tensor",
            file_of(
                &good.replace(r#","dense_0.bias":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}"#, ""),
                &data[..16],
            ),
            Some("dense_0.bias"),
            "not in the file",
        ),
        (
            "a tensor nothing uses",
            file_of(
                &one_dense_header(
                    r#"{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}"#,
                    r#"{"dtype":"F32","shape":[2],"data_offsets":[16,24]},"extra":{"dtype":"F32","shape":[0],"data_offsets":[24,24]}"#,
                ),
                &data,
            ),
            Some("extra"),
            "no layer of the configuration uses it",
        ),
        (
            "a NaN weight",
            file_of(&good, &[&f32::NAN.to_le_bytes()[..], &data[4..]].concat()),
            Some("dense_0.weight"),
            "value 0 is NaN",
        ),
        ("a header that is not an object", file_of("[1, 2]   ", &[]), None, "not a JSON object"),
        (
            "a configuration of another version",
            file_of(&good.replace(r#"\"version\":1"#, r#"\"version\":7"#), &data),
            None,
            "version Some(7)",
        ),
        (
            "a configuration with no sizes",
            file_of(&good.replace(r#"\"outputs\":2"#, r#"\"outputs\":0"#), &data),
            None,
            "no positive size 'outputs'",
        ),
        (
            "a configuration of an unknown kind",
            file_of(&good.replace(r#"\"kind\":\"dense\""#, r#"\"kind\":\"conv\""#), &data),
            None,
            "unknown kind 'conv'",
        ),
    ];
    for (what, bytes, tensor, needle) in cases {
        match load_bytes(&dir, &bytes) {
            Err(Error::ModelFile { tensor: got, reason, path }) => {
                assert_eq!(got.as_deref(), tensor, "{what}: {reason}");
                assert!(reason.contains(needle), "{what}: '{reason}' should say '{needle}'");
                assert!(path.ends_with("hostile.safetensors"), "{what}: {path}");
                if let Some(tensor) = tensor {
                    assert!(reason.contains(&format!("'{tensor}'")), "{what}: the message names the tensor: {reason}");
                }
            }
            other => panic!("{what}: expected a model-file error, got {other:?}"),
        }
    }
}

#[test]
fn no_truncation_or_corruption_of_a_real_file_panics() {
    let dir = Scratch::new();
    let (net, _, _) = trained_lstm(true);
    let path = dir.path("model.safetensors");
    net.save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    // Every truncation fails (a shorter file cannot hold every tensor); under valgrind
    // (`CARVE_SOAK_SCALE`) every few lengths, the header's all.
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for len in (0..bytes.len()).filter(|&len| len <= header_end || len % scale == 0) {
        assert!(matches!(load_bytes(&dir, &bytes[..len]), Err(Error::ModelFile { .. })), "truncated to {len}");
    }
    // Random corruptions: errors or models, never a panic. The header (where a flipped
    // byte changes the structure) gets most of them.
    let mut rng = Rng::new(77);
    let (mut failed, mut loaded) = (0, 0);
    for _ in 0..(1500 / scale).max(100) {
        let mut corrupt = bytes.clone();
        for _ in 0..1 + rng.below(3) {
            let at = if rng.below(4) == 0 { rng.below(corrupt.len()) } else { rng.below(header_end) };
            corrupt[at] = rng.below(256) as u8;
        }
        match load_bytes(&dir, &corrupt) {
            Ok(model) => {
                loaded += 1;
                // What loads serves, or refuses with an error.
                let x = Array3::<f32>::zeros((1, 2, model.inputs().min(64)));
                let _ = model.output(Input::from(x.view()));
            }
            Err(Error::ModelFile { .. } | Error::InvalidConfig { .. } | Error::ShapeMismatch { .. }) => failed += 1,
            Err(other) => panic!("unexpected error kind: {other:?}"),
        }
    }
    assert!(failed > 0 && loaded > 0, "corruptions both fail and load: {failed} failed, {loaded} loaded");
}

#[test]
fn a_custom_layer_saves_and_loads_with_the_configuration_that_builds_it() {
    /// `y = 2x + b`, one learned bias per column (starting at 0.25).
    struct Doubler;
    impl carve::nn::Layer for Doubler {
        fn name(&self) -> &str {
            "doubler"
        }
        fn output_size(&self, inputs: usize) -> carve::Result<usize> {
            Ok(inputs)
        }
        fn param_shapes(&self, inputs: usize) -> Vec<carve::nn::ParamShape> {
            vec![carve::nn::ParamShape::new("bias", &[inputs])]
        }
        fn init(&self, _inputs: usize, params: &mut [f32], _init: &mut carve::nn::Init<'_>) {
            params.fill(0.25);
        }
        fn forward_rows<'a>(
            &self,
            params: &[f32],
            input: ndarray::ArrayView2<'a, f32>,
            ctx: &carve::nn::ForwardCtx<'a, '_>,
        ) -> carve::Result<ndarray::ArrayView2<'a, f32>> {
            Ok(carve::freeze(ctx.activations.from_shape_fn(input.raw_dim(), |(i, j)| 2.0 * input[[i, j]] + params[j])?))
        }
    }
    let config = || NetworkConfig::builder(3).layer(Doubler).dense(2).seed(4).build().unwrap();
    let mut net = Network::new(config()).unwrap();
    let dir = Scratch::new();
    let path = dir.path("custom.safetensors");
    net.save(&path).unwrap();
    // Without the configuration, the file names what it needs.
    match Model::load(&path) {
        Err(Error::ModelFile { reason, .. }) => assert!(reason.contains("Model::load_with"), "{reason}"),
        other => panic!("expected a model-file error, got {other:?}"),
    }
    let model = Model::load_with(&path, &config()).unwrap();
    assert_eq!(model.layer_params(0), [0.25; 3]);
    let x = Array2::from_shape_fn((4, 3), |(r, c)| (r * 3 + c) as f32 / 7.0);
    assert_eq!(model.output(x.view()).unwrap(), net.output(x.view()).unwrap());
}

#[test]
fn what_save_and_load_refuse_besides_broken_files() {
    let dir = Scratch::new();
    // A weight that is not finite: the save names it and writes nothing.
    let mut net = trained_mlp();
    net.layer_params_mut(2)[3] = f32::NAN;
    let path = dir.path("diverged.safetensors");
    match net.save(&path) {
        Err(Error::ModelFile { tensor, reason, .. }) => {
            assert!(tensor.as_deref().is_some_and(|t| t.starts_with("dense_2.")), "{tensor:?}");
            assert!(reason.contains("NaN") && reason.contains("nothing was written"), "{reason}");
        }
        other => panic!("expected a model-file error, got {other:?}"),
    }
    assert!(!path.exists());
    assert_eq!(std::fs::read_dir(dir.0.path()).unwrap().count(), 0, "no temporary file left");

    // Not a regular file.
    let (tensor, reason) = config_error(Model::load(dir.0.path()));
    assert_eq!(tensor, None);
    assert!(reason.contains("not a regular file"), "{reason}");

    // A configuration with no layer of parameters, or whose inputs are not its first
    // layer's: nothing checks its sizes, so it is refused.
    let relu_only = r#"{\"version\":1,\"inputs\":4294967296,\"layers\":[{\"kind\":\"relu\",\"name\":\"r\"}]}"#;
    let header = format!(r#"{{"__metadata__":{{"carve.model":"{relu_only}"}}}}"#);
    let (_, reason) = config_error(load_bytes(&dir, &file_of(&header, &[])));
    assert!(reason.contains("no layer with parameters"), "{reason}");
    // Sizes no layer has, whose shapes (three or four times the size) would overflow
    // before any product is checked: refused naming the size, never a panic (as in a
    // debug build's arithmetic).
    for (layer, key) in [
        (
            r#"{\"kind\":\"attention\",\"name\":\"a\",\"tensors\":\"a\",\"width\":9223372036854775808,\"heads\":1}"#,
            "'width'",
        ),
        (
            r#"{\"kind\":\"lstm\",\"name\":\"l\",\"tensors\":\"l\",\"inputs\":4,\"hidden\":4611686018427387904}"#,
            "'hidden'",
        ),
        (r#"{\"kind\":\"dense\",\"name\":\"d\",\"tensors\":\"d\",\"inputs\":4,\"outputs\":4294967297}"#, "'outputs'"),
    ] {
        let config = format!(r#"{{\"version\":1,\"inputs\":4,\"layers\":[{layer}]}}"#);
        let header = format!(r#"{{"__metadata__":{{"carve.model":"{config}"}}}}"#);
        let (_, reason) = config_error(load_bytes(&dir, &file_of(&header, &[])));
        assert!(reason.contains(key) && reason.contains("beyond the 4294967296"), "{reason}");
    }
    let data: Vec<u8> = [0.5f32, -0.5, 0.25, 1.0, 0.0, 0.1].iter().flat_map(|v| v.to_le_bytes()).collect();
    let wide = one_dense_header(
        r#"{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}"#,
        r#"{"dtype":"F32","shape":[2],"data_offsets":[16,24]}"#,
    )
    .replace(r#"\"inputs\":2,\"layers\""#, r#"\"inputs\":1000000,\"layers\""#);
    let (_, reason) = config_error(load_bytes(&dir, &file_of(&wide, &data)));
    assert!(reason.contains("1000000 inputs") && reason.contains("takes 2"), "{reason}");

    // Saves to one path from several threads at once: each writes a whole file of its
    // own and renames it; what is left is one of them, whole.
    let path = dir.path("shared.safetensors");
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| trained_mlp().save(&path).unwrap());
        }
    });
    assert_eq!(Model::load(&path).unwrap().classes(), 4);
    let names: Vec<_> = std::fs::read_dir(dir.0.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(names.iter().all(|n| !n.to_string_lossy().starts_with('.')), "a temporary file left: {names:?}");
}

#[test]
fn pytorch_names_prefer_the_exact_tensor_and_no_two_layers_share_one() {
    let dir = Scratch::new();
    let tensor = |name: &str, shape: &str, from: usize, to: usize| {
        format!(r#""{name}":{{"dtype":"F32","shape":{shape},"data_offsets":[{from},{to}]}}"#)
    };
    let values = |n: usize| -> Vec<u8> { (0..n).flat_map(|i| (i as f32 * 0.01).to_le_bytes()).collect() };
    // `0.weight` alone, and a nested `2.0.weight` (which also ends in `.0.weight`):
    // layer 0 takes the exact one; the layer named `2.0` takes the other.
    let header = format!(
        "{{{},{},{},{}}}",
        tensor("0.weight", "[2,3]", 0, 24),
        tensor("0.bias", "[2]", 24, 32),
        tensor("2.0.weight", "[2,2]", 32, 48),
        tensor("2.0.bias", "[2]", 48, 56)
    );
    let path = dir.path("nested.safetensors");
    std::fs::write(&path, file_of(&header, &values(14))).unwrap();
    let config = NetworkConfig::builder(3).dense(2).relu().layer(Dense::named("2.0", 2, 2)).build().unwrap();
    let model = Model::load_pytorch(&path, &config).unwrap();
    assert_eq!((model.inputs(), model.classes()), (3, 2));
    // Two layers that find the same tensors: refused, not shared.
    let header = format!("{{{},{}}}", tensor("fc.weight", "[2,2]", 0, 16), tensor("fc.bias", "[2]", 16, 24));
    std::fs::write(&path, file_of(&header, &values(6))).unwrap();
    let config =
        NetworkConfig::builder(2).layer(Dense::named("fc", 2, 2)).layer(Dense::named("fc", 2, 2)).build().unwrap();
    let (tensor, reason) = config_error(Model::load_pytorch(&path, &config));
    assert_eq!(tensor.as_deref(), Some("fc"));
    assert!(reason.contains("another layer took"), "{reason}");
}

/// A sparse file of `size` bytes: `header` (with its length) at the front, zeros after.
fn sparse_file(dir: &Scratch, name: &str, declared: u64, header: &str, size: u64) -> PathBuf {
    use std::io::Write;
    let path = dir.path(name);
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(&declared.to_le_bytes()).unwrap();
    file.write_all(header.as_bytes()).unwrap();
    file.set_len(size).unwrap();
    path
}

/// Issue: `Model::load` read a file whole before checking it (a 1 GiB file took 3.3 s
/// and 1 GiB of memory to refuse; one as large as the machine's memory got the process
/// killed). The header is read first and checked against the file's length, and the
/// whole configuration against the header, before any tensor's data: refusing a lying
/// or mismatched file costs O(header) whatever its size. Sparse files of 1 GiB and
/// 64 GiB, so that nothing of their size is ever written.
#[test]
fn refusing_a_huge_or_lying_file_reads_only_its_header() {
    let dir = Scratch::new();
    let dense = |inputs: u64, outputs: u64| {
        format!(
            r#"{{\"version\":1,\"inputs\":{inputs},\"layers\":[{{\"kind\":\"dense\",\"name\":\"fc\",\"tensors\":\"fc\",\"inputs\":{inputs},\"outputs\":{outputs}}}]}}"#
        )
    };
    for size in [1u64 << 30, 64 << 30] {
        let gib = size >> 30;
        // The tensors' place in a file of `size` bytes after a header of `header` bytes.
        let weight = |header: usize, outputs: u64, inputs: u64| {
            let data = size - 8 - header as u64;
            let bytes = outputs * inputs * 4;
            format!(
                r#"{{"__metadata__":{{"carve.model":"{}"}},"fc.weight":{{"dtype":"F32","shape":[{outputs},{inputs}],"data_offsets":[0,{bytes}]}},"fc.bias":{{"dtype":"F32","shape":[{outputs}],"data_offsets":[{bytes},{data}]}}}}"#,
                dense(inputs, outputs)
            )
        };
        // A header padded with spaces to `pad` bytes, so that the data's length is known
        // before the header is written, and holds `outputs` × (4 inputs + 1 bias) values
        // exactly.
        let pad = 4096 + ((size - 8 - 4096) % 20) as usize;
        let padded = |header: String| format!("{header:<pad$}");
        let outputs = (size - 8 - pad as u64) / 4 / 5;
        let exact = weight(pad, outputs, 4);
        let cases: Vec<(&str, u64, String, &str)> = vec![
            ("a header length beyond the file", size, exact.clone(), "the header claims"),
            ("a header length over the limit", size / 2, exact.clone(), "over the limit"),
            ("a header length that cuts the JSON", 100, exact.clone(), "not valid JSON"),
            ("a tensor whose offsets disagree with its shape", 4096, weight(pad, outputs - 1, 4), "'fc.bias'"),
            (
                "a configuration whose layer does not fit its tensors",
                4096,
                exact.replace(&format!(r#"\"outputs\":{outputs}"#), r#"\"outputs\":3"#),
                "has shape",
            ),
            (
                "a tensor missing, and one no layer uses in its place",
                4096,
                exact.replace(r#""fc.bias""#, r#""fc.extra""#),
                "'fc.bias': not in the file",
            ),
        ];
        for (what, declared, header, expected) in cases {
            let declared = if declared == 4096 { pad as u64 } else { declared };
            let path = sparse_file(&dir, "huge.safetensors", declared, &padded(header), size);
            let start = std::time::Instant::now();
            let refused = Model::load(&path).map(drop).unwrap_err();
            let took = start.elapsed();
            assert!(matches!(refused, Error::ModelFile { .. }), "{gib} GiB, {what}: {refused}");
            assert!(refused.to_string().contains(expected), "{gib} GiB, {what}: {refused}");
            // Reading the file would take seconds per GiB; the header, microseconds.
            assert!(took < std::time::Duration::from_secs(2), "{gib} GiB, {what}: refused in {took:?}");
            println!("{gib} GiB, {what}: refused in {took:?}");
        }
    }
}

/// A file cut short after its header was checked (another process truncating it while
/// it loads) is an I/O error naming the tensor, never a fault: tensors are read with
/// positioned reads, not through a mapping.
#[test]
fn a_file_cut_short_under_the_reader_is_an_error() {
    let dir = Scratch::new();
    let net = trained_mlp();
    let path = dir.path("cut.safetensors");
    net.save(&path).unwrap();
    let full = std::fs::metadata(&path).unwrap().len();
    // A FIFO is refused without blocking for a writer.
    let fifo = dir.path("fifo.safetensors");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if made.is_ok_and(|s| s.success()) {
        let refused = Model::load(&fifo).map(drop).unwrap_err();
        assert!(refused.to_string().contains("not a regular file"), "{refused}");
    }
    // Simulated: the header's lengths hold for the file as opened, then the data goes.
    // (Cut before opening, the length check refuses it; this is the reader's own check.)
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(full - 4).unwrap();
    let refused = Model::load(&path).map(drop).unwrap_err();
    assert!(matches!(refused, Error::ModelFile { .. }), "{refused}");
}

/// Layers that all claim one tensor would make a small file as costly to load as the
/// layers are many (each read the tensor anew): each tensor belongs to one layer.
#[test]
fn a_tensor_claimed_by_two_layers_is_refused_before_anything_is_read() {
    let dir = Scratch::new();
    let layer = |name: &str| {
        format!(
            r#"{{\"kind\":\"dense\",\"name\":\"{name}\",\"tensors\":\"fc\",\"inputs\":2,\"outputs\":2}},{{\"kind\":\"relu\",\"name\":\"r{name}\"}}"#
        )
    };
    let layers = (0..400).map(|i| layer(&format!("d{i}"))).collect::<Vec<_>>().join(",");
    let config = format!(r#"{{\"version\":1,\"inputs\":2,\"layers\":[{layers}]}}"#);
    let header = format!(
        r#"{{"__metadata__":{{"carve.model":"{config}"}},"fc.weight":{{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}},"fc.bias":{{"dtype":"F32","shape":[2],"data_offsets":[16,24]}}}}"#
    );
    let data: Vec<u8> = [0.5f32, -0.5, 0.25, 1.0, 0.0, 0.1].iter().flat_map(|v| v.to_le_bytes()).collect();
    let refused = load_bytes(&dir, &file_of(&header, &data)).map(drop).unwrap_err();
    let message = refused.to_string();
    assert!(matches!(&refused, Error::ModelFile { tensor: Some(t), .. } if t == "fc.weight"), "{refused}");
    assert!(message.contains("layer 'd1' reads it, but another layer already does"), "{message}");
}

/// The tensors of a safetensors file as the `safetensors` crate reads them: name, shape
/// and bytes, sorted by name; and its metadata, sorted.
#[allow(clippy::type_complexity)]
fn crate_view(bytes: &[u8]) -> (Vec<(String, Vec<usize>, Vec<u8>)>, Vec<(String, String)>) {
    let tensors = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let mut out: Vec<_> =
        tensors.tensors().into_iter().map(|(name, view)| (name, view.shape().to_vec(), view.data().to_vec())).collect();
    out.sort();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let mut metadata: Vec<_> =
        metadata.metadata().as_ref().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    metadata.sort();
    (out, metadata)
}

/// Files carve wrote with its own writer, before the `safetensors` crate laid its files
/// out (tensors in layer order, not by name), load, and save anew to the same tensors
/// and configuration.
#[test]
fn files_carve_wrote_before_the_crate_still_load() {
    let dir = Scratch::new();
    for (name, inputs, classes) in [("mlp_carve_old.safetensors", 64, 10), ("lstm_carve_old.safetensors", 12, 9)] {
        let model = Model::load(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((model.inputs(), model.classes()), (inputs, classes), "{name}");
        let path = dir.path(name);
        model.save(&path).unwrap();
        let (old, new) = (std::fs::read(fixture(name)).unwrap(), std::fs::read(&path).unwrap());
        assert_ne!(old, new, "{name}: the fixture is laid out as carve no longer writes");
        assert_eq!(crate_view(&old), crate_view(&new), "{name}: the same tensors and metadata");
        let x = Array3::from_shape_fn((2, 3, inputs), |(b, t, i)| ((b * 7 + t * 3 + i) % 11) as f32 * 0.1 - 0.5);
        let again = Model::load(&path).unwrap();
        assert_eq!(
            model.output(Input::from(x.view())).unwrap(),
            again.output(Input::from(x.view())).unwrap(),
            "{name}"
        );
    }
}

/// The crate writes the metadata's keys in a hash map's order, which changes from one
/// save to the next: carve sorts them, so that a model saves to the same bytes, laid
/// out as the crate lays them out.
#[test]
fn a_model_saves_to_the_same_bytes_every_time_laid_out_as_the_crate_does() {
    let dir = Scratch::new();
    let net = trained_mlp();
    let saves: Vec<Vec<u8>> = (0..8)
        .map(|i| {
            let path = dir.path(&format!("same_{i}.safetensors"));
            net.save(&path).unwrap();
            std::fs::read(&path).unwrap()
        })
        .collect();
    assert!(saves.iter().all(|bytes| *bytes == saves[0]), "every save gives the same bytes");
    let bytes = &saves[0];
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    let (config, format) = (header.find(r#""carve.model":"#).unwrap(), header.find(r#""format":"#).unwrap());
    assert!(config < format, "the metadata's keys sorted: {header}");
    // The crate's own layout of the same tensors and metadata: the same length, the same
    // data, the same header but for the order of its keys.
    let tensors = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let theirs = safetensors::serialize(tensors.tensors(), metadata.metadata().clone()).unwrap();
    assert_eq!(theirs.len(), bytes.len());
    assert_eq!(theirs[..8], bytes[..8], "the header's length");
    assert_eq!(theirs[8 + n..], bytes[8 + n..], "the data");
    let json = |b: &[u8]| serde_json::from_slice::<serde_json::Value>(b).unwrap();
    assert_eq!(json(&theirs[8..8 + n]), json(&bytes[8..8 + n]), "the header");
}

/// What the crate refuses in a header names the tensor at fault too: an entry it cannot
/// parse, tensors that leave a gap or do not start the data.
#[test]
fn header_entries_the_crate_refuses_get_errors_naming_the_tensor() {
    let dir = Scratch::new();
    let data: Vec<u8> = (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let bias = r#"{"dtype":"F32","shape":[2],"data_offsets":[16,24]}"#;
    // Each case: the header, the bytes of data after it, the tensor at fault, what the
    // error says.
    let cases: Vec<(&str, String, usize, Option<&str>, &str)> = vec![
        (
            "a dtype the format does not have",
            one_dense_header(r#"{"dtype":"F128","shape":[2,2],"data_offsets":[0,16]}"#, bias),
            24,
            Some("dense_0.weight"),
            "F128",
        ),
        (
            "a negative dimension",
            one_dense_header(r#"{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}"#, bias),
            24,
            Some("dense_0.weight"),
            "-2",
        ),
        (
            "three offsets",
            one_dense_header(r#"{"dtype":"F32","shape":[2,2],"data_offsets":[0,8,16]}"#, bias),
            24,
            Some("dense_0.weight"),
            "header entry",
        ),
        ("an entry that is not an object", one_dense_header("5", bias), 24, Some("dense_0.weight"), "header entry"),
        (
            "a gap between tensors",
            one_dense_header(
                r#"{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}"#,
                r#"{"dtype":"F32","shape":[2],"data_offsets":[24,32]}"#,
            ),
            32,
            Some("dense_0.bias"),
            "previous tensor ends at byte 16",
        ),
        (
            "data that no tensor starts",
            one_dense_header(
                r#"{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]}"#,
                r#"{"dtype":"F32","shape":[2],"data_offsets":[24,32]}"#,
            ),
            32,
            Some("dense_0.weight"),
            "starts at byte 8",
        ),
        (
            "metadata that is not strings",
            one_dense_header(r#"{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}"#, bias).replacen(
                r#"{"__metadata__":{"#,
                r#"{"__metadata__":{"n":1,"#,
                1,
            ),
            24,
            None,
            "not an object of strings",
        ),
    ];
    for (what, header, len, tensor, needle) in cases {
        match load_bytes(&dir, &file_of(&header, &data[..len])) {
            Err(Error::ModelFile { tensor: got, reason, .. }) => {
                assert_eq!(got.as_deref(), tensor, "{what}: {reason}");
                assert!(reason.contains(needle), "{what}: '{reason}' should say '{needle}'");
                if let Some(tensor) = tensor {
                    assert!(reason.contains(&format!("'{tensor}'")), "{what}: the message names the tensor: {reason}");
                }
            }
            other => panic!("{what}: expected a model-file error, got {other:?}"),
        }
    }
}
