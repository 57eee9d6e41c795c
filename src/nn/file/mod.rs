//! Saving and loading models in safetensors, the format the Rust ML crates (candle,
//! burn) and PyTorch read.
//!
//! A file carve writes holds each layer's parameters under PyTorch's names and layouts
//! (`nn.Linear`: `{layer}.weight` `[out, in]` and `{layer}.bias`; `nn.LSTM`:
//! `{layer}.weight_ih_l0` `[4·hidden, in]`, `{layer}.weight_hh_l0`, `{layer}.bias_ih_l0`,
//! `{layer}.bias_hh_l0`, gates in PyTorch's order i, f, g, o), so that PyTorch loads its
//! weights by name, and the layer configuration as JSON in the header's metadata
//! (`carve.model`), so that [`Model::load`] needs nothing else. A user's own layer is
//! saved under the names it gives its parameters ([`Layer::param_shapes`]:
//! `{layer}.{param}`, in carve's layout) with its width in the configuration; such a file
//! loads with the configuration that builds the layer ([`Model::load_with`]). A PyTorch `state_dict`
//! saved with `safetensors.torch.save_file` has no configuration: [`Model::load_pytorch`]
//! takes it from a [`NetworkConfig`] and finds each layer's tensors by its name or its
//! position (`nn.Sequential` numbers its children). A GPT of nanoGPT's shape (embedding,
//! position embedding, pre-LN blocks of attention and a GELU MLP, a final layer norm and
//! a head) is saved and found under nanoGPT's names (`transformer.wte.weight`,
//! `transformer.h.{i}.attn.c_attn.weight`, `lm_head.weight`, ...), so that nanoGPT's
//! state dicts load and carve's files load in nanoGPT. Where they differ: carve's GELU
//! is the tanh form (`nn.GELU(approximate="tanh")`; nanoGPT's `nn.GELU()` is exact, so
//! its activations differ by up to about 5e-4), carve writes `lm_head.bias` (nanoGPT's head has
//! none: `load_state_dict(strict=False)`) and keeps the head untied from `wte`, and a
//! `torch.compile`d model's `_orig_mod.` prefix is not stripped.
//!
//! The format itself is the `safetensors` crate's: it parses and checks each header and
//! lays out each file carve saves; `safetensors.rs` reads files header first, so that a
//! file is checked before any of its data is read, and names the tensor at fault in
//! every error.
//!
//! Loading checks everything: a truncated file, a header that lies about its lengths,
//! a tensor of the wrong shape or type, a missing tensor or one no layer uses, a
//! non-finite weight — each a typed [`Error::ModelFile`] naming the tensor, never a
//! panic or a read out of bounds. The header is read and checked against the file's
//! length, and the whole configuration against the header, before any tensor's data is
//! read: refusing a lying or mismatched file costs O(header), however large the file.

mod safetensors;

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use ndarray::{Array2, ArrayView2};
use serde_json::{json, Value};

use self::safetensors::{file_error, Out, Tensors};
use super::layer::{Layer, ParamShape};
use super::limits::reserve_filled;
use super::params::Params;
use super::residual::{residual_from, Residual};
use super::serve::Model;
use super::{
    Attention, Dense, Embedding, Gelu, GeluForm, LastStep, LayerNorm, Lstm, MaskedMean, Network, NetworkConfig,
    PositionEmbedding, Relu,
};
use crate::{Error, Result};

/// The metadata key of the layer configuration.
const CONFIG_KEY: &str = "carve.model";

/// The metadata key of a text model's symbols ([`Model::with_symbols`]): one character
/// per token, in token order.
const SYMBOLS_KEY: &str = "carve.symbols";
/// The version of the configuration's layout: 1, or 2 when a layer needs a reader that
/// knows more than version 1's (a GELU of the exact form, which a version-1 reader would
/// load as the tanh form: it refuses version 2 instead).
const VERSION: u64 = 1;
/// See [`VERSION`].
const VERSION_EXACT_GELU: u64 = 2;

/// The largest size (a width, a vocabulary, a count of heads) a file may give a layer.
const MAX_SIZE: u64 = 1 << 32;

/// `nn.LSTM`'s gate blocks are i, f, g, o; carve's (DL4J's) are g, f, o, i: carve's
/// block `c` is PyTorch's block `TORCH_BLOCK[c]`.
const TORCH_BLOCK: [usize; 4] = [2, 1, 3, 0];

/// A layer as a file describes it.
#[derive(Clone, Debug)]
enum Kind {
    Dense {
        inputs: usize,
        outputs: usize,
    },
    Relu,
    Lstm {
        inputs: usize,
        hidden: usize,
    },
    LastStep,
    MaskedMean,
    /// `nn.Embedding(vocabulary, width)`.
    Embedding {
        vocabulary: usize,
        width: usize,
    },
    /// A learned position embedding (`nn.Embedding(context, width)`).
    Positions {
        context: usize,
        width: usize,
    },
    /// `nn.LayerNorm(width, eps)`.
    LayerNorm {
        width: usize,
        eps: f32,
    },
    /// GELU in `form`.
    Gelu {
        form: GeluForm,
    },
    /// The join of a residual block that starts at layer `from`.
    Residual {
        from: usize,
    },
    /// Causal self-attention, GPT-2's `c_attn` and `c_proj` (`nn.Linear` layouts).
    Attention {
        width: usize,
        heads: usize,
        recompute: bool,
    },
    /// A user's own layer of `inputs` input columns: its parameters under its own names,
    /// in carve's layout.
    Custom {
        inputs: usize,
        params: Vec<ParamShape>,
    },
}

impl Kind {
    /// The kind of a layer of `inputs` input columns: a built-in one, or a user's own.
    fn of(layer: &dyn Layer, inputs: usize) -> Kind {
        let any: &dyn Any = layer;
        if let Some(dense) = any.downcast_ref::<Dense>() {
            return Kind::Dense { inputs: dense.inputs(), outputs: dense.outputs() };
        }
        if let Some(lstm) = any.downcast_ref::<Lstm>() {
            return Kind::Lstm { inputs: lstm.inputs(), hidden: lstm.hidden() };
        }
        if any.is::<Relu>() {
            return Kind::Relu;
        }
        if any.is::<LastStep>() {
            return Kind::LastStep;
        }
        if any.is::<MaskedMean>() {
            return Kind::MaskedMean;
        }
        if let Some(e) = any.downcast_ref::<Embedding>() {
            return Kind::Embedding { vocabulary: e.vocabulary(), width: e.width() };
        }
        if let Some(p) = any.downcast_ref::<PositionEmbedding>() {
            return Kind::Positions { context: p.context(), width: inputs };
        }
        if let Some(n) = any.downcast_ref::<LayerNorm>() {
            return Kind::LayerNorm { width: inputs, eps: n.eps() };
        }
        if let Some(g) = any.downcast_ref::<Gelu>() {
            return Kind::Gelu { form: g.form() };
        }
        if let Some(from) = residual_from(layer) {
            return Kind::Residual { from };
        }
        if let Some(a) = any.downcast_ref::<Attention>() {
            return Kind::Attention { width: a.width(), heads: a.heads(), recompute: a.is_recomputing() };
        }
        Kind::Custom { inputs, params: layer.param_shapes(inputs) }
    }

    /// The input width of a built-in layer with parameters.
    fn inputs(&self) -> Option<usize> {
        match *self {
            Kind::Dense { inputs, .. } | Kind::Lstm { inputs, .. } => Some(inputs),
            Kind::Embedding { vocabulary, .. } => Some(vocabulary),
            _ => None,
        }
    }

    /// The name of the tensor that locates the layer's parameters (`None`: it has none).
    fn key_tensor(&self) -> Option<String> {
        match self {
            Kind::Dense { .. } => Some("weight".into()),
            Kind::Lstm { .. } => Some("weight_ih_l0".into()),
            Kind::Embedding { .. } | Kind::Positions { .. } | Kind::LayerNorm { .. } => Some("weight".into()),
            Kind::Attention { .. } => Some("c_attn.weight".into()),
            Kind::Custom { params, .. } => params.first().map(|p| p.name.clone()),
            _ => None,
        }
    }

    fn to_json(&self, name: &str, tensors: &str) -> Value {
        match self {
            Kind::Dense { inputs, outputs } => {
                json!({ "kind": "dense", "name": name, "tensors": tensors, "inputs": inputs, "outputs": outputs })
            }
            Kind::Lstm { inputs, hidden } => {
                json!({ "kind": "lstm", "name": name, "tensors": tensors, "inputs": inputs, "hidden": hidden })
            }
            Kind::Relu => json!({ "kind": "relu", "name": name }),
            Kind::LastStep => json!({ "kind": "last_step", "name": name }),
            Kind::MaskedMean => json!({ "kind": "masked_mean", "name": name }),
            Kind::Embedding { vocabulary, width } => {
                json!({ "kind": "embedding", "name": name, "tensors": tensors, "vocabulary": vocabulary, "width": width })
            }
            Kind::Positions { context, width } => {
                json!({ "kind": "positions", "name": name, "tensors": tensors, "context": context, "width": width })
            }
            Kind::LayerNorm { width, eps } => {
                json!({ "kind": "layer_norm", "name": name, "tensors": tensors, "width": width, "eps": eps })
            }
            // The tanh form writes no "form", as before there was another (a file with a
            // GELU of the exact form is of version 2, which older readers refuse).
            Kind::Gelu { form: GeluForm::Tanh } => json!({ "kind": "gelu", "name": name }),
            Kind::Gelu { form: GeluForm::Exact } => json!({ "kind": "gelu", "name": name, "form": "exact" }),
            Kind::Residual { from } => json!({ "kind": "residual", "name": name, "from": from }),
            Kind::Attention { width, heads, recompute } => json!({
                "kind": "attention", "name": name, "tensors": tensors, "width": width, "heads": heads,
                "recompute": recompute
            }),
            Kind::Custom { inputs, params } => {
                let params: Vec<Value> = params.iter().map(|p| json!({ "name": p.name, "shape": p.shape })).collect();
                json!({ "kind": "custom", "name": name, "tensors": tensors, "inputs": inputs, "params": params })
            }
        }
    }
}

impl Network {
    /// Saves the network's parameters and layer configuration as a safetensors file
    /// that [`Model::load`] serves (and PyTorch reads by name: see [`Model::save`]).
    /// The updater's state is not saved.
    ///
    /// # Errors
    ///
    /// As [`Network::freeze`] and [`Model::save`].
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        self.freeze()?.save(path)
    }
}

impl Model {
    /// Saves the model as a safetensors file: each layer's parameters under PyTorch's
    /// names and layouts (`{layer}.weight` `[out, in]`, `{layer}.bias`;
    /// `{layer}.weight_ih_l0`, `weight_hh_l0`, `bias_ih_l0`, `bias_hh_l0`, gates i, f, g,
    /// o), `{layer}` being the layer's name (or `layers.{index}` when two layers share
    /// a name), and the layer configuration in the header's metadata. The file is
    /// written beside `path` and renamed over it, so a failed save leaves no
    /// half-written file.
    ///
    /// An LSTM's biases are saved in `bias_ih_l0`, with `bias_hh_l0` all `-0.0`, so
    /// that their sum gives back each bias exactly.
    ///
    /// ```
    /// use carve::nn::{serve::Model, Network, NetworkConfig};
    /// use carve::ndarray::Array2;
    ///
    /// let net = Network::new(NetworkConfig::builder(4).dense(8).relu().dense(3).seed(7).build()?)?;
    /// let path = std::env::temp_dir().join(format!("carve-doc-{}.safetensors", std::process::id()));
    /// net.save(&path)?;
    /// let model = Model::load(&path)?;
    /// let x = Array2::<f32>::ones((2, 4));
    /// assert_eq!(model.output(x.view())?, net.freeze()?.output(x.view())?);
    /// # std::fs::remove_file(&path).unwrap();
    /// # Ok::<(), carve::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::ModelFile`] naming a tensor that holds a value that is not finite (the
    /// file is not written), or when the file cannot be written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let kinds: Vec<Kind> =
            self.layers().iter().enumerate().map(|(i, layer)| Kind::of(layer.as_ref(), self.layer_inputs(i))).collect();
        let prefixes = tensor_prefixes(self.layers(), &kinds);
        let mut config = Vec::new();
        let mut tensors = Vec::new();
        for (index, (layer, kind)) in self.layers().iter().zip(&kinds).enumerate() {
            let prefix = prefixes[index].clone();
            config.push(kind.to_json(layer.name(), &prefix));
            save_params(kind, self.layer_params(index), &prefix, &mut tensors);
        }
        for tensor in &tensors {
            if let Some(at) = tensor.values.iter().position(|v| !v.is_finite()) {
                return Err(file_error(
                    &path.as_ref().display().to_string(),
                    Some(&tensor.name),
                    format!(
                        "value {at} is {}: a model's weights must be finite (did training diverge?); nothing was written",
                        tensor.values[at]
                    ),
                ));
            }
        }
        let version = if kinds.iter().any(|k| matches!(k, Kind::Gelu { form: GeluForm::Exact })) {
            VERSION_EXACT_GELU
        } else {
            VERSION
        };
        let model = json!({ "version": version, "inputs": self.inputs(), "layers": config });
        let mut metadata =
            BTreeMap::from([("format".to_string(), "pt".to_string()), (CONFIG_KEY.to_string(), model.to_string())]);
        if let Some(symbols) = self.symbols() {
            metadata.insert(SYMBOLS_KEY.to_string(), symbols.iter().collect());
        }
        safetensors::write(path.as_ref(), &metadata, &tensors)
    }

    /// Loads a model saved by [`Model::save`] or [`Network::save`]: the layer
    /// configuration from the file's metadata, the parameters from its tensors.
    ///
    /// # Errors
    ///
    /// [`Error::ModelFile`] for a file that cannot be read, is not safetensors, is
    /// truncated, has a header that lies about its lengths, has no carve configuration
    /// (a PyTorch `state_dict`: load it with [`Model::load_pytorch`]), or whose tensors
    /// are missing, of the wrong shape or type, unused, or not finite — naming the
    /// tensor; [`Error::ShapeMismatch`] when the layers do not chain (a layer of
    /// another width than its input's) and [`Error::InvalidConfig`] for layers that
    /// cannot form a network (residual blocks that do not close, a token embedding
    /// that is not the first layer).
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        let file = Tensors::open(path.as_ref())?;
        let config = file.metadata().get(CONFIG_KEY).ok_or_else(|| {
            file_error(
                file.path(),
                None,
                format!(
                    "its metadata has no '{CONFIG_KEY}' configuration (a PyTorch state_dict?): load it with \
                     Model::load_pytorch and the network's NetworkConfig"
                ),
            )
        })?;
        let (inputs, layers) = parse_config(&file, config)?;
        // The input width is checked against the first layer with parameters (the
        // layers before it keep the width): a file without one says nothing checkable.
        match layers.iter().find_map(|saved| saved.kind.inputs()) {
            Some(first) if first == inputs => {}
            Some(first) => {
                return Err(file_error(
                    file.path(),
                    None,
                    format!(
                        "its configuration says {inputs} inputs, but its first layer with parameters takes {first}"
                    ),
                ))
            }
            None => {
                return Err(file_error(
                    file.path(),
                    None,
                    "its configuration has no layer with parameters: nothing in it is a model",
                ))
            }
        }
        // Every layer's tensors are found and checked against the header before any
        // tensor's data is read: a file that does not fit its configuration costs
        // O(header) to refuse.
        let mut used = BTreeSet::new();
        let found = layers
            .into_iter()
            .map(|saved| Found::find(&file, saved.name, &saved.prefix, saved.kind, Biases::Required, &mut used))
            .collect::<Result<Vec<_>>>()?;
        check_all_used(&file, &used)?;
        let layers = found.iter().map(Found::layer).collect::<Result<Vec<_>>>()?;
        let values = found.into_iter().map(|layer| layer.load(&file)).collect::<Result<Vec<_>>>()?;
        let model = assemble(&file, inputs, layers.into(), values)?;
        match file.metadata().get(SYMBOLS_KEY) {
            None => Ok(model),
            Some(symbols) => model.with_symbols(symbols).map_err(|e| {
                file_error(file.path(), None, format!("its '{SYMBOLS_KEY}' metadata does not fit the model: {e}"))
            }),
        }
    }

    /// Loads a model saved by [`Model::save`] or [`Network::save`] with the layers of
    /// `config` (its updater, seed and workspace modes do not matter): what loads a
    /// model of a user's own layers, whose configuration only the caller can build. Each
    /// layer's parameters are found under the name the file gives them
    /// (`{layer}.{param}`, or `layers.{index}.{param}` when two layers share a name).
    ///
    /// # Errors
    ///
    /// As [`Model::load`]; also [`Error::ModelFile`] when a layer's tensors are not
    /// found or are of another shape than `config`'s layer takes.
    pub fn load_with(path: impl AsRef<Path>, config: &NetworkConfig) -> Result<Model> {
        let file = Tensors::open(path.as_ref())?;
        let layout = Params::of(config.inputs(), config.layers())?;
        let kinds: Vec<Kind> = config
            .layers()
            .iter()
            .enumerate()
            .map(|(index, layer)| Kind::of(layer.as_ref(), layout.widths[index]))
            .collect();
        // A carve file says what it holds: its layers must be the configuration's.
        if let Some(saved) = file.metadata().get(CONFIG_KEY) {
            check_saved_layers(&file, saved, config, &kinds)?;
        }
        let prefixes = tensor_prefixes(config.layers(), &kinds);
        let mut used = BTreeSet::new();
        let mut found = Vec::with_capacity(kinds.len());
        for ((layer, kind), prefix) in config.layers().iter().zip(kinds).zip(&prefixes) {
            found.push(Found::find(&file, layer.name().to_string(), prefix, kind, Biases::Required, &mut used)?);
        }
        check_all_used(&file, &used)?;
        let values = found.into_iter().map(|layer| layer.load(&file)).collect::<Result<Vec<_>>>()?;
        assemble(&file, config.inputs(), config.shared_layers(), values)
    }

    /// Loads a model from a safetensors file of PyTorch's names and layouts (a
    /// `state_dict` saved with `safetensors.torch.save_file`), with the layers of
    /// `config` (its updater, seed and workspace modes do not matter).
    ///
    /// Each layer with parameters finds its tensors by its name (`fc1.weight` for a
    /// layer named `fc1`) or by its position in the network (`2.weight` for the third
    /// layer, as `nn.Sequential` numbers its children: the builder's `dense`, `relu`
    /// and `lstm` make the same numbering), also under a prefix (`model.2.weight`). A
    /// layer of `nn.Linear` without bias, or `nn.LSTM` without biases, loads with zero
    /// biases. Every tensor in the file must be used.
    ///
    /// # Errors
    ///
    /// As [`Model::load`]; also [`Error::ModelFile`] when a layer's tensors are not
    /// found, or found under more than one name. A layer of the user's own in `config`
    /// finds its tensors as a built-in layer does (by its name or index, and its
    /// [`Layer::param_shapes`](crate::nn::Layer::param_shapes)' names) and reads them in
    /// carve's layout, as [`Model::save`] writes them: nothing is transposed for it.
    pub fn load_pytorch(path: impl AsRef<Path>, config: &NetworkConfig) -> Result<Model> {
        let file = Tensors::open(path.as_ref())?;
        let mut used = BTreeSet::new();
        let mut prefixes = BTreeSet::new();
        let mut found = Vec::new();
        let layout = Params::of(config.inputs(), config.layers())?;
        let kinds: Vec<Kind> = config
            .layers()
            .iter()
            .enumerate()
            .map(|(index, layer)| Kind::of(layer.as_ref(), layout.widths[index]))
            .collect();
        // A GPT of nanoGPT's shape finds its tensors under nanoGPT's names when the file
        // has them.
        let gpt = gpt_prefixes(&kinds).filter(|p| file.contains(&format!("{}.weight", p[0])));
        if gpt.is_some() {
            // nanoGPT's causal-mask buffer (`attn.bias`, [1, 1, T, T]) is not a parameter.
            for name in file.names() {
                if name.starts_with("transformer.h.") && name.ends_with(".attn.bias") {
                    used.insert(name.to_string());
                }
            }
        }
        for (index, (layer, kind)) in config.layers().iter().zip(kinds).enumerate() {
            let name = layer.name();
            let prefix = match (kind.key_tensor(), &gpt) {
                (Some(_), Some(prefixes)) => prefixes[index].clone(),
                (Some(key), None) => find_prefix(&file, name, index, &key)?,
                (None, _) => String::new(),
            };
            if !prefix.is_empty() && !prefixes.insert(prefix.clone()) {
                return Err(file_error(
                    file.path(),
                    Some(&prefix),
                    format!("layer {index} ('{name}') finds the tensors another layer took: name the layers as the file does"),
                ));
            }
            found.push(Found::find(&file, name.to_string(), &prefix, kind, Biases::Optional, &mut used)?);
        }
        check_all_used(&file, &used)?;
        let values = found.into_iter().map(|layer| layer.load(&file)).collect::<Result<Vec<_>>>()?;
        assemble(&file, config.inputs(), config.shared_layers(), values)
    }
}

/// The tensor prefixes of nanoGPT's `GPT` for layers of `kinds`, when they are its
/// shape: an embedding, a position embedding, blocks of (layer norm, attention, join,
/// layer norm, dense, GELU, dense, join), a layer norm and a dense head —
/// `transformer.wte`, `transformer.wpe`, `transformer.h.{i}.ln_1`, `.attn`, `.ln_2`,
/// `.mlp.c_fc`, `.mlp.c_proj`, `transformer.ln_f`, `lm_head` (empty for the layers
/// without parameters).
fn gpt_prefixes(kinds: &[Kind]) -> Option<Vec<String>> {
    let n = kinds.len();
    if n < 4 || !(n - 4).is_multiple_of(8) {
        return None;
    }
    let mut prefixes = vec![String::new(); n];
    match (&kinds[0], &kinds[1], &kinds[n - 2], &kinds[n - 1]) {
        (Kind::Embedding { .. }, Kind::Positions { .. }, Kind::LayerNorm { .. }, Kind::Dense { .. }) => {}
        _ => return None,
    }
    prefixes[0] = "transformer.wte".into();
    prefixes[1] = "transformer.wpe".into();
    prefixes[n - 2] = "transformer.ln_f".into();
    prefixes[n - 1] = "lm_head".into();
    for (b, block) in kinds[2..n - 2].chunks_exact(8).enumerate() {
        let start = 2 + 8 * b;
        let shape = matches!(
            block,
            [
                Kind::LayerNorm { .. },
                Kind::Attention { .. },
                Kind::Residual { from: a },
                Kind::LayerNorm { .. },
                Kind::Dense { .. },
                Kind::Gelu { .. },
                Kind::Dense { .. },
                Kind::Residual { from: m },
            ] if *a == start && *m == start + 3
        );
        if !shape {
            return None;
        }
        let h = format!("transformer.h.{b}");
        for (k, suffix) in [(0, "ln_1"), (1, "attn"), (3, "ln_2"), (4, "mlp.c_fc"), (6, "mlp.c_proj")] {
            prefixes[start + k] = format!("{h}.{suffix}");
        }
    }
    Some(prefixes)
}

/// The prefix of each layer's tensors in a file carve writes: nanoGPT's names for a GPT
/// of its shape, otherwise each layer's name, or `layers.{index}` when the names are
/// not unique (or empty, or dotted).
fn tensor_prefixes(layers: &[Box<dyn Layer>], kinds: &[Kind]) -> Vec<String> {
    if let Some(prefixes) = gpt_prefixes(kinds) {
        return prefixes;
    }
    let names: Vec<&str> = layers.iter().map(|l| l.name()).collect();
    let unique = unique_names(&names);
    names
        .iter()
        .enumerate()
        .map(|(index, name)| if unique { name.to_string() } else { format!("layers.{index}") })
        .collect()
}

/// Checks a carve file's saved configuration (`saved`, its metadata) against the
/// layers `config` builds: the same input width, and per layer the same kind and
/// sizes (and, for a user's own layer, the same parameter names and shapes).
fn check_saved_layers(file: &Tensors, saved: &str, config: &NetworkConfig, kinds: &[Kind]) -> Result<()> {
    let bad = |why: String| file_error(file.path(), None, why);
    let saved: Value = serde_json::from_str(saved)
        .map_err(|e| bad(format!("its '{CONFIG_KEY}' configuration is not valid JSON: {e}")))?;
    let entries = saved.get("layers").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    if saved.get("inputs").and_then(Value::as_u64) != Some(config.inputs() as u64) || entries.len() != kinds.len() {
        return Err(bad(format!(
            "it holds a model of {} inputs and {} layers; the configuration builds {} inputs and {} layers: load it \
             with the configuration it was saved from",
            saved.get("inputs").map_or("no".into(), Value::to_string),
            entries.len(),
            config.inputs(),
            kinds.len()
        )));
    }
    // What a layer is, without where its tensors are or how attention keeps its
    // scores (either form runs the same parameters to the same bits); a GELU's tanh
    // form said or not.
    let described = |value: &Value| {
        let mut value = value.clone();
        if let Some(object) = value.as_object_mut() {
            object.remove("tensors");
            object.remove("recompute");
            if object.get("form").and_then(Value::as_str) == Some("tanh") {
                object.remove("form");
            }
        }
        value
    };
    for (index, ((layer, kind), entry)) in config.layers().iter().zip(kinds).zip(entries).enumerate() {
        let ours = described(&kind.to_json(layer.name(), ""));
        if described(entry) != ours {
            return Err(bad(format!(
                "layer {index} is saved as {} but the configuration builds {}: load the file with the configuration \
                 it was saved from",
                short(&described(entry).to_string()),
                short(&ours.to_string())
            )));
        }
    }
    Ok(())
}

/// Whether every layer name is unique, non-empty and free of dots: then each layer's
/// tensors are saved under its name, otherwise under its position (`layers.{index}`).
fn unique_names(names: &[&str]) -> bool {
    names.iter().collect::<BTreeSet<_>>().len() == names.len()
        && names.iter().all(|n| !n.is_empty() && !n.contains('.'))
}

/// A model of `layers` on `inputs` columns, each layer's parameters from `values` (in
/// carve's layout) laid into the flat buffer.
fn assemble(file: &Tensors, inputs: usize, layers: Arc<[Box<dyn Layer>]>, values: Vec<Vec<f32>>) -> Result<Model> {
    let layout = Params::of(inputs, &layers)?;
    let mut params = reserve_filled(layout.layout.total, 0.0).map_err(|why| {
        file_error(file.path(), None, format!("{why}: the machine cannot hold this model's parameters"))
    })?;
    for ((layer, region), values) in layers.iter().zip(&layout.layout.regions).zip(values) {
        if values.len() != region.len() {
            return Err(Error::ShapeMismatch {
                context: format!("layer '{}' parameters from the file", layer.name()),
                expected: vec![region.len()],
                actual: vec![values.len()],
            });
        }
        params[region.clone()].copy_from_slice(&values);
    }
    Model::from_parts(inputs, layers, Arc::new(layout), Arc::new(params))
}

/// Appends the parameters of a layer of `kind` (`values`, its region of the flat
/// buffer) under `prefix`: a built-in layer's in PyTorch's layouts, a user's own under
/// its names, in carve's layout.
fn save_params(kind: &Kind, values: &[f32], prefix: &str, out: &mut Vec<Out>) {
    let mut push = |suffix: &str, shape: Vec<usize>, values: Vec<f32>| {
        out.push(Out { name: format!("{prefix}.{suffix}"), shape, values });
    };
    match *kind {
        Kind::Dense { inputs, outputs } => {
            let (w, b) = values.split_at(inputs * outputs);
            let w = ArrayView2::from_shape((inputs, outputs), w).expect("inputs × outputs values");
            // [in, out] → [out, in]
            push("weight", vec![outputs, inputs], w.t().iter().copied().collect());
            push("bias", vec![outputs], b.to_vec());
        }
        Kind::Lstm { inputs, hidden: h } => {
            let to_torch = |w: ArrayView2<'_, f32>| {
                // [rows, 4h] in carve's blocks → [4h, rows] in PyTorch's.
                let mut t = Array2::<f32>::zeros((4 * h, w.nrows()));
                for (c, &torch) in TORCH_BLOCK.iter().enumerate() {
                    for j in 0..h {
                        t.row_mut(torch * h + j).assign(&w.column(c * h + j));
                    }
                }
                t.into_raw_vec_and_offset().0
            };
            let (w, rest) = values.split_at(inputs * 4 * h);
            let (u, b) = rest.split_at(h * 4 * h);
            let w = ArrayView2::from_shape((inputs, 4 * h), w).expect("inputs × 4h values");
            let u = ArrayView2::from_shape((h, 4 * h), u).expect("h × 4h values");
            push("weight_ih_l0", vec![4 * h, inputs], to_torch(w));
            push("weight_hh_l0", vec![4 * h, h], to_torch(u));
            let mut bias = vec![0.0; 4 * h];
            for (c, &torch) in TORCH_BLOCK.iter().enumerate() {
                bias[torch * h..(torch + 1) * h].copy_from_slice(&b[c * h..][..h]);
            }
            push("bias_ih_l0", vec![4 * h], bias);
            // x + (-0.0) == x for every x (+0.0 included): the sum gives the bias back bit for bit.
            push("bias_hh_l0", vec![4 * h], vec![-0.0; 4 * h]);
        }
        Kind::Custom { ref params, .. } => {
            let mut at = 0;
            for p in params {
                push(&p.name, p.shape.clone(), values[at..at + p.len()].to_vec());
                at += p.len();
            }
        }
        Kind::Embedding { vocabulary: rows, width } | Kind::Positions { context: rows, width } => {
            push("weight", vec![rows, width], values.to_vec());
        }
        Kind::LayerNorm { width, .. } => {
            push("weight", vec![width], values[..width].to_vec());
            push("bias", vec![width], values[width..].to_vec());
        }
        Kind::Attention { width: d, .. } => {
            let (qkv_w, rest) = values.split_at(d * 3 * d);
            let (qkv_b, rest) = rest.split_at(3 * d);
            let (proj_w, proj_b) = rest.split_at(d * d);
            // [in, out] → [out, in], as nn.Linear holds them.
            let qkv_w = ArrayView2::from_shape((d, 3 * d), qkv_w).expect("d × 3d values");
            let proj_w = ArrayView2::from_shape((d, d), proj_w).expect("d × d values");
            push("c_attn.weight", vec![3 * d, d], qkv_w.t().iter().copied().collect());
            push("c_attn.bias", vec![3 * d], qkv_b.to_vec());
            push("c_proj.weight", vec![d, d], proj_w.t().iter().copied().collect());
            push("c_proj.bias", vec![d], proj_b.to_vec());
        }
        Kind::Relu | Kind::LastStep | Kind::MaskedMean | Kind::Gelu { .. } | Kind::Residual { .. } => {}
    }
}

/// Whether a layer's biases may be absent (PyTorch's `bias=False`: zero biases).
#[derive(Clone, Copy, PartialEq)]
enum Biases {
    /// carve writes every bias: one missing is a broken file.
    Required,
    /// A PyTorch file may have none.
    Optional,
}

/// A layer whose tensors were found in a file and checked against its header (shapes
/// and presence), not yet read.
struct Found {
    name: String,
    kind: Kind,
    /// The tensor of each of the kind's [`Kind::tensors`] (`None`: an optional bias
    /// the file does not have).
    tensors: Vec<Option<String>>,
}

impl Kind {
    /// The tensors of a layer of this kind: their names' suffixes, shapes (PyTorch's
    /// layouts), and whether each is a bias.
    fn tensors(&self) -> Vec<(String, Vec<usize>, bool)> {
        let t = |name: &str, shape: Vec<usize>, bias: bool| (name.to_string(), shape, bias);
        match self {
            &Kind::Dense { inputs, outputs } => {
                vec![t("weight", vec![outputs, inputs], false), t("bias", vec![outputs], true)]
            }
            &Kind::Lstm { inputs, hidden: h } => vec![
                t("weight_ih_l0", vec![4 * h, inputs], false),
                t("weight_hh_l0", vec![4 * h, h], false),
                t("bias_ih_l0", vec![4 * h], true),
                t("bias_hh_l0", vec![4 * h], true),
            ],
            Kind::Custom { params, .. } => params.iter().map(|p| t(&p.name, p.shape.clone(), false)).collect(),
            &Kind::Embedding { vocabulary: rows, width } | &Kind::Positions { context: rows, width } => {
                vec![t("weight", vec![rows, width], false)]
            }
            &Kind::LayerNorm { width, .. } => vec![t("weight", vec![width], false), t("bias", vec![width], true)],
            &Kind::Attention { width: d, .. } => vec![
                t("c_attn.weight", vec![3 * d, d], false),
                t("c_attn.bias", vec![3 * d], true),
                t("c_proj.weight", vec![d, d], false),
                t("c_proj.bias", vec![d], true),
            ],
            Kind::Relu | Kind::LastStep | Kind::MaskedMean | Kind::Gelu { .. } | Kind::Residual { .. } => Vec::new(),
        }
    }
}

impl Found {
    /// Finds the tensors of layer `name` of `kind` under `prefix` in `file`'s header
    /// and checks their shapes; the tensors found are added to `used`.
    fn find(
        file: &Tensors,
        name: String,
        prefix: &str,
        kind: Kind,
        biases: Biases,
        used: &mut BTreeSet<String>,
    ) -> Result<Found> {
        let mut tensors = Vec::new();
        for (suffix, shape, bias) in kind.tensors() {
            let key = format!("{prefix}.{suffix}");
            if bias && biases == Biases::Optional && !file.contains(&key) {
                tensors.push(None);
                continue;
            }
            file.check(&key, &shape)?;
            if !used.insert(key.clone()) {
                // Read once per layer that claims it, a tensor shared by many layers would
                // make a small file cost any memory and time to load.
                return Err(file_error(
                    file.path(),
                    Some(&key),
                    format!(
                        "layer '{}' reads it, but another layer already does: each tensor belongs to one layer",
                        short(&name)
                    ),
                ));
            }
            tensors.push(Some(key));
        }
        if let (Kind::Lstm { .. }, [_, _, ih, hh]) = (&kind, tensors.as_slice()) {
            if ih.is_some() != hh.is_some() {
                let missing = if ih.is_none() { "bias_ih_l0" } else { "bias_hh_l0" };
                return Err(file_error(
                    file.path(),
                    Some(&format!("{prefix}.{missing}")),
                    "not in the file, but its pair is: an LSTM has both biases or neither",
                ));
            }
        }
        Ok(Found { name, kind, tensors })
    }

    /// The layer a carve file's configuration describes (built-in layers only: a
    /// user's own is built by the configuration [`Model::load_with`] takes).
    fn layer(&self) -> Result<Box<dyn Layer>> {
        let name = self.name.as_str();
        Ok(match self.kind {
            Kind::Dense { inputs, outputs } => Box::new(Dense::try_named(name, inputs, outputs)?),
            Kind::Lstm { inputs, hidden } => Box::new(Lstm::named(name, inputs, hidden)?),
            Kind::Relu => Box::new(Relu::named(name)),
            Kind::LastStep => Box::new(LastStep::named(name)),
            Kind::MaskedMean => Box::new(MaskedMean::named(name)),
            Kind::Embedding { vocabulary, width } => Box::new(Embedding::named(name, vocabulary, width)?),
            Kind::Positions { context, width } => Box::new(PositionEmbedding::named(name, context, width)?),
            Kind::LayerNorm { eps, .. } => Box::new(LayerNorm::named(name).with_eps(eps)?),
            Kind::Gelu { form } => Box::new(Gelu::with_form(name, form)),
            Kind::Residual { from } => Box::new(Residual::new(name, from)),
            Kind::Attention { width, heads, recompute } => {
                let attention = Attention::named(name, width, heads)?;
                Box::new(if recompute { attention.recomputing() } else { attention })
            }
            Kind::Custom { .. } => unreachable!("a carve file's configuration lists built-in layers only"),
        })
    }

    /// Reads the layer's tensors: its parameters in carve's layout (its region of the
    /// flat buffer).
    ///
    /// A tensor is read into a buffer of its own and laid out anew (transposed, gates
    /// reordered) into another: loading a layer takes up to twice its largest tensor,
    /// every buffer reserved fallibly (a model the machine cannot hold is an error
    /// naming the tensor, not an abort).
    fn load(self, file: &Tensors) -> Result<Vec<f32>> {
        let shapes = self.kind.tensors();
        let read = |slot: usize| -> Result<Option<Vec<f32>>> {
            self.tensors[slot].as_deref().map(|key| file.values(key, &shapes[slot].1)).transpose()
        };
        // A buffer of `len` values of `value` for the tensor in `slot` (its new layout,
        // or the zeros of a bias the file does not have).
        let filled = |slot: usize, len: usize, value: f32| {
            reserve_filled(len, value).map_err(|why| {
                let tensor = self.tensors[slot].clone().unwrap_or_else(|| shapes[slot].0.clone());
                file_error(file.path(), Some(&tensor), format!("{why}: the machine cannot hold this model"))
            })
        };
        Ok(match self.kind {
            Kind::Dense { inputs, outputs } => {
                let weight = Array2::from_shape_vec((outputs, inputs), read(0)?.expect("a weight is required"))
                    .expect("checked shape");
                let mut values = filled(0, inputs * outputs + outputs, 0.0)?;
                let (w, b) = values.split_at_mut(inputs * outputs);
                // [out, in] → [in, out]
                for (dst, &src) in w.iter_mut().zip(weight.t().iter()) {
                    *dst = src;
                }
                if let Some(bias) = read(1)? {
                    b.copy_from_slice(&bias);
                }
                values
            }
            Kind::Lstm { inputs, hidden: h } => {
                let columns = 4 * h;
                let mut values = filled(0, (inputs + h + 1) * columns, 0.0)?;
                let (w, rest) = values.split_at_mut(inputs * columns);
                let (u, b) = rest.split_at_mut(h * columns);
                for (slot, rows, dst) in [(0, inputs, w), (1, h, u)] {
                    // [4h, rows] in PyTorch's blocks → [rows, 4h] in carve's.
                    let t =
                        Array2::from_shape_vec((columns, rows), read(slot)?.expect("required")).expect("checked shape");
                    let mut dst = ndarray::ArrayViewMut2::from_shape((rows, columns), dst).expect("rows × 4h values");
                    for (c, &torch) in TORCH_BLOCK.iter().enumerate() {
                        for j in 0..h {
                            dst.column_mut(c * h + j).assign(&t.row(torch * h + j));
                        }
                    }
                }
                // Both biases or neither: checked by `find`.
                let (b_ih, b_hh) = match (read(2)?, read(3)?) {
                    (Some(ih), Some(hh)) => (ih, hh),
                    _ => (filled(2, columns, 0.0)?, filled(3, columns, -0.0)?),
                };
                for (c, &torch) in TORCH_BLOCK.iter().enumerate() {
                    for j in 0..h {
                        b[c * h + j] = b_ih[torch * h + j] + b_hh[torch * h + j];
                    }
                }
                values
            }
            Kind::Custom { ref params, .. } => {
                let total = params.iter().map(ParamShape::len).sum();
                let mut values = filled(0, total, 0.0)?;
                let mut at = 0;
                for (slot, p) in params.iter().enumerate() {
                    let tensor = read(slot)?.expect("a user's layer's parameters are required");
                    values[at..at + p.len()].copy_from_slice(&tensor);
                    at += p.len();
                }
                values
            }
            Kind::Embedding { .. } | Kind::Positions { .. } => read(0)?.expect("a table is required"),
            Kind::LayerNorm { width, .. } => {
                let mut values = filled(0, 2 * width, 0.0)?;
                values[..width].copy_from_slice(&read(0)?.expect("a scale is required"));
                if let Some(bias) = read(1)? {
                    values[width..].copy_from_slice(&bias);
                }
                values
            }
            Kind::Attention { width: d, .. } => {
                let mut values = filled(0, d * 3 * d + 3 * d + d * d + d, 0.0)?;
                let (qkv_w, rest) = values.split_at_mut(d * 3 * d);
                let (qkv_b, rest) = rest.split_at_mut(3 * d);
                let (proj_w, proj_b) = rest.split_at_mut(d * d);
                // [out, in] → [in, out]
                for (slot, rows, dst) in [(0, 3 * d, qkv_w), (2, d, proj_w)] {
                    let t = Array2::from_shape_vec((rows, d), read(slot)?.expect("required")).expect("checked shape");
                    for (dst, &src) in dst.iter_mut().zip(t.t().iter()) {
                        *dst = src;
                    }
                }
                for (slot, dst) in [(1, qkv_b), (3, proj_b)] {
                    if let Some(bias) = read(slot)? {
                        dst.copy_from_slice(&bias);
                    }
                }
                values
            }
            Kind::Relu | Kind::LastStep | Kind::MaskedMean | Kind::Gelu { .. } | Kind::Residual { .. } => Vec::new(),
        })
    }
}

/// The prefix of layer `index` (named `name`) in a PyTorch file: the one `P` for which
/// `P.{key}` is in the file, `P` being the name or the index, alone (preferred) or after
/// a prefix of the file's (`model.P`).
fn find_prefix(file: &Tensors, name: &str, index: usize, key: &str) -> Result<String> {
    let by_name = format!("{name}.{key}");
    let by_index = format!("{index}.{key}");
    let prefix_of = |tensor: &str| tensor[..tensor.len() - key.len() - 1].to_string();
    for exact in [&by_name, &by_index] {
        if file.contains(exact) {
            return Ok(prefix_of(exact));
        }
    }
    let found: Vec<&str> = file
        .names()
        .filter(|tensor| {
            [&by_name, &by_index]
                .iter()
                .any(|want| tensor.strip_suffix(want.as_str()).is_some_and(|p| p.ends_with('.')))
        })
        .collect();
    match found.as_slice() {
        [one] => Ok(prefix_of(one)),
        [] => Err(file_error(
            file.path(),
            Some(&by_name),
            format!(
                "not in the file, nor '{by_index}' (layer {index}, '{name}', as nn.Sequential numbers it), alone or \
                 after a prefix; name the layer as the file does. The file holds: {}",
                list(file.names())
            ),
        )),
        many => Err(file_error(
            file.path(),
            Some(&by_name),
            format!(
                "layer {index} ('{name}') matches more than one tensor: {}; name it exactly",
                list(many.iter().copied())
            ),
        )),
    }
}

/// A layer as a carve file's configuration gives it.
struct Saved {
    name: String,
    /// Its tensors' names are `{prefix}.weight` and so on.
    prefix: String,
    kind: Kind,
}

/// The configuration in a carve file's metadata: the inputs and, per layer, its name,
/// tensor prefix and kind. Nothing in it is trusted: a size that disagrees with a
/// tensor fails when the tensor is read.
fn parse_config(file: &Tensors, config: &str) -> Result<(usize, Vec<Saved>)> {
    let bad = |why: String| file_error(file.path(), None, format!("its '{CONFIG_KEY}' configuration {why}"));
    let config: Value = serde_json::from_str(config).map_err(|e| bad(format!("is not valid JSON: {e}")))?;
    // Sizes up to 2³²: no layer is wider, and the shapes built from them (a few times a
    // size, as an LSTM's four gates) cannot overflow before their checked products.
    let size = |value: &Value, key: &str| -> Result<usize> {
        let n = value
            .get(key)
            .and_then(Value::as_u64)
            .filter(|&n| n > 0)
            .ok_or_else(|| bad(format!("has no positive size '{key}' in {}", short(&value.to_string()))))?;
        match usize::try_from(n) {
            Ok(size) if n <= MAX_SIZE => Ok(size),
            _ => Err(bad(format!("gives '{key}' a size of {n}, beyond the {MAX_SIZE} a layer may have"))),
        }
    };
    match config.get("version").and_then(Value::as_u64) {
        Some(VERSION | VERSION_EXACT_GELU) => {}
        other => {
            return Err(bad(format!(
                "has version {other:?}; this carve reads versions {VERSION} and {VERSION_EXACT_GELU}"
            )))
        }
    }
    let inputs = size(&config, "inputs")?;
    let Some(Value::Array(entries)) = config.get("layers") else {
        return Err(bad("has no 'layers' list".into()));
    };
    let mut layers = Vec::with_capacity(entries.len().min(1024));
    for entry in entries {
        let text = |key: &str| entry.get(key).and_then(Value::as_str).map(str::to_string);
        let (Some(kind), Some(name)) = (text("kind"), text("name")) else {
            return Err(bad(format!("has a layer without a kind and a name: {}", short(&entry.to_string()))));
        };
        let kind = match kind.as_str() {
            "dense" => Kind::Dense { inputs: size(entry, "inputs")?, outputs: size(entry, "outputs")? },
            "lstm" => Kind::Lstm { inputs: size(entry, "inputs")?, hidden: size(entry, "hidden")? },
            "relu" => Kind::Relu,
            "last_step" => Kind::LastStep,
            "masked_mean" => Kind::MaskedMean,
            "embedding" => Kind::Embedding { vocabulary: size(entry, "vocabulary")?, width: size(entry, "width")? },
            "positions" => Kind::Positions { context: size(entry, "context")?, width: size(entry, "width")? },
            "layer_norm" => Kind::LayerNorm {
                width: size(entry, "width")?,
                eps: entry
                    .get("eps")
                    .and_then(Value::as_f64)
                    .map(|e| e as f32)
                    .ok_or_else(|| bad(format!("gives layer norm '{}' no 'eps'", short(&name))))?,
            },
            "gelu" => Kind::Gelu {
                form: match entry.get("form") {
                    None => GeluForm::Tanh,
                    Some(form) => match form.as_str() {
                        Some("tanh") => GeluForm::Tanh,
                        Some("exact") => GeluForm::Exact,
                        _ => {
                            return Err(bad(format!(
                                "gives GELU '{}' the form {}: it is \"tanh\" or \"exact\"",
                                short(&name),
                                short(&form.to_string())
                            )))
                        }
                    },
                },
            },
            "residual" => Kind::Residual {
                from: entry
                    .get("from")
                    .and_then(Value::as_u64)
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| bad(format!("gives residual join '{}' no 'from' layer", short(&name))))?,
            },
            "attention" => Kind::Attention {
                width: size(entry, "width")?,
                heads: size(entry, "heads")?,
                recompute: entry.get("recompute").and_then(Value::as_bool).unwrap_or(false),
            },
            "custom" => {
                return Err(bad(format!(
                    "has a layer of the user's own (layer '{}'): load the file with Model::load_with and the \
                     configuration that builds its layers",
                    short(&name)
                )))
            }
            other => {
                return Err(bad(format!("has a layer of unknown kind '{}' (layer '{}')", short(other), short(&name))))
            }
        };
        if let Kind::Lstm { hidden, .. } = kind {
            if hidden.checked_mul(4).is_none() {
                return Err(bad(format!("gives LSTM layer '{name}' {hidden} units, which overflows")));
            }
        }
        let prefix = match kind.key_tensor() {
            Some(_) => text("tensors").ok_or_else(|| bad(format!("gives layer '{name}' no 'tensors' prefix")))?,
            None => String::new(),
        };
        layers.push(Saved { name, prefix, kind });
    }
    Ok((inputs, layers))
}

/// Fails naming the first tensor of `file` that no layer read.
fn check_all_used(file: &Tensors, used: &BTreeSet<String>) -> Result<()> {
    match file.names().find(|name| !used.contains(*name)) {
        None => Ok(()),
        Some(unused) => Err(file_error(
            file.path(),
            Some(unused),
            "no layer of the configuration uses it (a layer missing from the configuration, or named differently)",
        )),
    }
}

/// `text`, cut to 120 characters: what a message repeats of a file's contents.
pub(crate) fn short(text: &str) -> String {
    match text.char_indices().nth(120) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

/// `a, b, c` (at most 12 of them).
fn list<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.collect();
    let mut shown = names.iter().take(12).map(|n| format!("'{}'", short(n))).collect::<Vec<_>>().join(", ");
    if names.len() > 12 {
        shown.push_str(&format!(" and {} more", names.len() - 12));
    }
    if shown.is_empty() {
        "no tensors".into()
    } else {
        shown
    }
}
