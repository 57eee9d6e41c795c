//! The DL4J vocabulary of the layer API: whether a network uses workspaces
//! ([`WorkspaceMode`]) and the roles an array can play in a layer ([`ArrayType`]),
//! which decide when its memory may be reused. [`LayerWorkspaceMgr`](crate::LayerWorkspaceMgr)
//! maps each role to a workspace.

use std::fmt;

/// Whether a network uses workspaces, set separately for training and inference.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkspaceMode {
    /// Arrays live in workspaces, reset at the end of their cycle (the default).
    #[default]
    Enabled,
    /// Every array is its own heap allocation, in heap workspaces of the same names
    /// ([`LayerWorkspaceMgrBuilder::workspaces_off`](crate::LayerWorkspaceMgrBuilder::workspaces_off)):
    /// every call succeeds or fails as with workspaces on.
    None,
    /// The role workspaces of an iteration (a training step, or an inference) are
    /// planned together into one arena, sized to the bytes live at once
    /// ([`crate::planned`]); where nothing is planned (the prefetch ring), as `Enabled`.
    Planned,
}

impl WorkspaceMode {
    /// The mode's name, as [`FromStr`](std::str::FromStr) reads it: `enabled`, `none`
    /// or `planned`.
    pub const fn name(self) -> &'static str {
        match self {
            WorkspaceMode::Enabled => "enabled",
            WorkspaceMode::None => "none",
            WorkspaceMode::Planned => "planned",
        }
    }
}

impl fmt::Display for WorkspaceMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The role an array plays in a layer, which decides when its memory may be
/// invalidated (the workspace it maps to is reset).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ArrayType {
    /// The network's input batch: valid for the whole iteration (forward and
    /// backward); invalidated when the iteration ends.
    Input,
    /// A layer's forward output: kept for backpropagation, so valid until the
    /// iteration's backward pass is done; invalidated when the iteration ends.
    Activations,
    /// The gradient with respect to a layer's input (epsilon): valid while the layer
    /// below consumes it; invalidated once the layer below has produced its own.
    ActivationGrad,
    /// Scratch of one layer's forward pass: invalidated as soon as the layer returns.
    FfWorkingMem,
    /// Scratch of one layer's backward pass: invalidated as soon as the layer returns.
    BpWorkingMem,
    /// Scratch of one time step of a recurrent forward loop: invalidated at the end
    /// of the step.
    RnnFfLoopWorkingMem,
    /// Scratch of one time step of a recurrent backward loop: invalidated at the end
    /// of the step.
    RnnBpLoopWorkingMem,
    /// Scratch of the updater (momentum, Adam): invalidated after the parameter
    /// update of the iteration.
    UpdaterWorkingMem,
    /// Forward results a layer caches for its backward pass beyond its activations:
    /// valid until the iteration's backward pass is done.
    FfCache,
}

impl ArrayType {
    /// All nine roles, in declaration order.
    pub const ALL: [ArrayType; 9] = [
        ArrayType::Input,
        ArrayType::Activations,
        ArrayType::ActivationGrad,
        ArrayType::FfWorkingMem,
        ArrayType::BpWorkingMem,
        ArrayType::RnnFfLoopWorkingMem,
        ArrayType::RnnBpLoopWorkingMem,
        ArrayType::UpdaterWorkingMem,
        ArrayType::FfCache,
    ];

    pub(crate) const fn index(self) -> usize {
        self as usize
    }

    /// The role of index `index` ([`ArrayType::index`]; `None` for [`NO_ROLE`] or any
    /// other index past the roles).
    pub(crate) fn from_index(index: u8) -> Option<ArrayType> {
        ArrayType::ALL.get(usize::from(index)).copied()
    }
}

/// The role index of a cycle entered without a role (a workspace not entered through a
/// [`LayerWorkspaceMgr`](crate::LayerWorkspaceMgr)).
pub(crate) const NO_ROLE: u8 = u8::MAX;
