//! The demos' networks as the benchmarks build them (included with `#[path]`): the
//! digits MLP 64-128-64-10 and the sequences LSTM 12-64-9, Adam, seed 0, in a
//! workspace mode.

use carve::nn::{Network, NetworkConfig, Updater};
use carve::WorkspaceMode;

/// The sequences LSTM (`lstm`) or the digits MLP, in `mode` for training and inference.
pub(crate) fn network(lstm: bool, mode: WorkspaceMode) -> carve::Result<Network> {
    let builder = match lstm {
        true => NetworkConfig::builder(12).lstm(64).last_step().dense(9),
        false => NetworkConfig::builder(64).dense(128).relu().dense(64).relu().dense(10),
    };
    let config = builder
        .seed(0)
        .updater(Updater::adam(1e-3))
        .training_workspace_mode(mode)
        .inference_workspace_mode(mode)
        .build()?;
    Network::new(config)
}
