//! [`Role`]: what an array of a batch is for. A leaf: the layout and the errors both
//! name it.

use std::fmt;

use serde::Serialize;

/// The role of an array in a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Role {
    /// The inputs (required).
    Features,
    /// The targets.
    Labels,
    /// Which feature entries are real (padding masks of variable-length inputs).
    FeaturesMask,
    /// Which label entries count in the loss.
    LabelsMask,
}

impl Role {
    /// Every role, in layout order.
    pub const ALL: [Role; 4] = [Role::Features, Role::Labels, Role::FeaturesMask, Role::LabelsMask];

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Features => "features",
            Role::Labels => "labels",
            Role::FeaturesMask => "features mask",
            Role::LabelsMask => "labels mask",
        })
    }
}
