//! carve's error type: the errors of the crates underneath (workspaces, prefetching,
//! devices) and the reference network's own.
//!
//! Every error prints its message both ways, with `{}` and with `{:?}`, so that a
//! `carve::Error` returned from `main` tells the user what happened and what to do
//! instead of dumping a struct:
//!
//! ```
//! let err = carve::Error::from(carve::workspace_core::Error::InvalidDebugMode { value: "bogus".into() });
//! assert_eq!(format!("{err:?}"), format!("{err}"));
//! assert!(format!("{err:?}").contains("'bogus'"));
//! ```

use std::fmt;

/// The result type of carve.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error of carve.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A host workspace refused: configuration, allocation, budget, a stale handle, a
    /// layer output in the wrong workspace, and so on.
    #[error(transparent)]
    Workspace(#[from] workspace_core::Error),

    /// A device workspace, pinned staging or the device prefetcher refused.
    #[error(transparent)]
    Device(#[from] workspace_cuda::Error),

    /// The training data failed: a batch source or the prefetcher feeding the loop
    /// reported an error (downcast `source` to the data layer's error type, usually
    /// [`async_iter::Error`], for its details).
    #[error("training data: {source}")]
    Data {
        /// The data layer's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },

    /// A network or layer configuration contradicts itself or cannot be built.
    #[error("invalid network configuration: {reason}")]
    InvalidConfig {
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// Arrays handed to a layer or network do not have the shapes it needs.
    #[error("{context}: expected shape {expected:?}, got {actual:?}")]
    ShapeMismatch {
        /// Who complains, and about which array.
        context: String,
        /// The shape required (`usize::MAX` where any size goes).
        expected: Vec<usize>,
        /// The shape given.
        actual: Vec<usize>,
    },

    /// A value handed to a layer or network is out of range (a label beyond the
    /// number of classes, an empty batch).
    #[error("{0}")]
    InvalidInput(String),

    /// A training step met a value that is not finite (NaN or infinite): in the input,
    /// in a layer's output or gradients, in the loss, or in what the updater would
    /// store. The step was abandoned before any parameter or updater state changed.
    #[error(
        "non-finite value at '{layer}': {what}. The training step was abandoned before any parameter or \
         updater state changed (a serving request fails alone), and the network is still usable; remove NaN and \
         infinite values from the data, or scale the inputs or lower the learning rate if values overflow"
    )]
    NonFinite {
        /// The layer where the value appeared ("input" for the batch itself, "loss"
        /// for the output stage).
        layer: String,
        /// Which value, where, and what it was.
        what: String,
    },

    /// Every arena of an inference pool was in use (or, batched, its queue was full)
    /// and the caller asked not to wait (the `try_` forms). Nothing was run.
    #[error(
        "inference pool: all {arenas} arenas are in use (or the batch queue is full); nothing was run. Wait \
         (`output`), wait at most a while (`output_timeout`), or give the pool more workers"
    )]
    PoolBusy {
        /// The pool's arenas (workers).
        arenas: usize,
    },

    /// No arena of an inference pool came free (or, batched, the request's batch did not
    /// run) within the caller's timeout. Nothing was run, or its result was dropped.
    #[error("inference pool: the request waited {waited:?}, longer than its timeout, for one of {arenas} arenas")]
    Timeout {
        /// The pool's arenas (workers).
        arenas: usize,
        /// How long the caller waited.
        waited: std::time::Duration,
    },

    /// Every slot of a [`StreamBatch`](crate::nn::serve::StreamBatch) stayed in use for
    /// as long as the caller asked to wait for one. No stream was started.
    #[error(
        "stream batch: all {slots} slots stayed in use for {waited:?}; no stream was started. Wait longer, drop a \
         finished stream, or give the batch more slots"
    )]
    BatchFull {
        /// The batch's slots.
        slots: usize,
        /// How long the caller waited.
        waited: std::time::Duration,
    },

    /// The inference pool was closed (or dropped) before the request ran.
    #[error("inference pool is closed: the request was not run (the pool was closed or dropped while it waited)")]
    PoolClosed,

    /// A layer panicked during a request. That request failed; its arena was left clean
    /// (every scope closed, the iteration abandoned) and the pool goes on serving.
    #[error("a layer panicked during inference: {message}; this request failed, the pool goes on serving")]
    Panicked {
        /// The panic's message.
        message: String,
    },

    /// A data-parallel worker failed a training step ([`crate::nn::parallel::DataParallel`]):
    /// `worker` is its rank (its shard of the batch), `layer` the layer it failed in
    /// ("input, loss or update" outside the layers), `source` its error. The step was
    /// abandoned by every worker before any weight or updater state changed.
    #[error(
        "data-parallel worker {worker} failed at '{layer}': {source}. The step was abandoned by every worker; the \
         weights and updater state are as before it"
    )]
    Worker {
        /// The worker's rank (its shard of the batch).
        worker: usize,
        /// The layer it failed in.
        layer: String,
        /// Its error.
        #[source]
        source: Box<Error>,
    },

    /// The workers of a data-parallel trainer could not reduce: buckets of different
    /// lengths, a reducer that left the sum elsewhere than the worker's share, or a group
    /// that a worker abandoned (a panic in the middle of a step's collective calls: the
    /// trainer cannot train on; `into_network` still gives back its weights, those of
    /// the last step every worker finished).
    #[error("data-parallel reduction failed: {message}")]
    Reduction {
        /// What happened.
        message: String,
    },

    /// A layer panicked during a training step of a data-parallel worker; the panic was
    /// caught, and the step failed.
    #[error("the layer panicked: {message}")]
    LayerPanicked {
        /// The panic's message.
        message: String,
    },

    /// The batch a request of a batched [`InferencePool`](crate::nn::serve::InferencePool)
    /// ran in failed (other than by a panic: a workspace error, say): the server's
    /// failure, not the request's. The pool goes on serving.
    #[error("the batch this request ran in failed: {message}; the pool goes on serving")]
    BatchFailed {
        /// Why the batch failed.
        message: String,
    },

    /// A model file that cannot be read as a model: not safetensors, truncated, a header
    /// that lies about its lengths, a missing tensor or one of the wrong shape or type.
    #[error("model file {path}: {reason}")]
    ModelFile {
        /// The file.
        path: String,
        /// The tensor at fault, when one is.
        tensor: Option<String>,
        /// What is wrong, naming the tensor.
        reason: String,
    },
}

impl From<async_iter::Error> for Error {
    fn from(error: async_iter::Error) -> Self {
        Error::Data { source: Box::new(error) }
    }
}

/// Constructors for layer authors: the errors a custom layer's `forward`, `backward`
/// or shape method returns, without spelling out a variant's fields.
///
/// ```
/// use carve::Error;
///
/// fn check_width(layer: &str, inputs: usize) -> carve::Result<usize> {
///     if inputs % 2 != 0 {
///         return Err(Error::invalid_config(format!("layer '{layer}' pairs its inputs: {inputs} is odd")));
///     }
///     Ok(inputs / 2)
/// }
/// assert!(matches!(check_width("pairs", 3), Err(Error::InvalidConfig { .. })));
/// let err = Error::shape_mismatch("layer 'pairs' input", [4, 2], [4, 3]);
/// assert_eq!(err.to_string(), "layer 'pairs' input: expected shape [4, 2], got [4, 3]");
/// assert_eq!(Error::invalid_input("an empty batch").to_string(), "an empty batch");
/// ```
impl Error {
    /// [`Error::InvalidConfig`]: a configuration that contradicts itself or cannot be
    /// built; `reason` says what is wrong and how to fix it.
    pub fn invalid_config(reason: impl Into<String>) -> Error {
        Error::InvalidConfig { reason: reason.into() }
    }

    /// [`Error::ShapeMismatch`]: `context` (who complains, about which array) expected
    /// `expected` and was handed `actual`.
    pub fn shape_mismatch(
        context: impl Into<String>,
        expected: impl Into<Vec<usize>>,
        actual: impl Into<Vec<usize>>,
    ) -> Error {
        Error::ShapeMismatch { context: context.into(), expected: expected.into(), actual: actual.into() }
    }

    /// [`Error::InvalidInput`]: a value out of range, described by `message`.
    pub fn invalid_input(message: impl Into<String>) -> Error {
        Error::InvalidInput(message.into())
    }

    /// The workspace error inside, if this is one.
    pub fn as_workspace(&self) -> Option<&workspace_core::Error> {
        match self {
            Error::Workspace(error) => Some(error),
            _ => None,
        }
    }

    /// The prefetcher's error inside, if this is a data error that came from one.
    pub fn as_prefetch(&self) -> Option<&async_iter::Error> {
        match self {
            Error::Data { source } => source.downcast_ref(),
            _ => None,
        }
    }
}

/// The message, as for `Display`: what `main` prints for an error it returns.
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
