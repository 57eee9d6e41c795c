//! What an allocation failure carries: the request, the capacity, and, where a
//! timeline records the workspace, the iteration's lower bound so far, the bytes lost to
//! padding and fragmentation and the largest live holders by role and layer.
//!
//! The report is plain data that [`Error`](crate::Error) names; the engine makes it
//! with what the workspace knows, and an observer of the workspace (a
//! [`Timeline`](crate::timeline::Timeline)) fills in what needs every allocation of the
//! iteration.

use std::fmt;
use std::sync::Arc;

use crate::roles::ArrayType;

/// Live holders a report names, at most.
pub const HOLDERS: usize = 5;

/// The memory behind an allocation failure ([`Error::Exhausted`](crate::Error::Exhausted),
/// [`Error::BudgetExceeded`](crate::Error::BudgetExceeded), an out-of-memory from a
/// backend in [`Error::Backend`](crate::Error::Backend)).
///
/// The figures that need every allocation of the iteration (the lower bound, padding,
/// fragmentation and the holders by layer) come from the [`Timeline`](crate::timeline::Timeline)
/// recording the workspace (the iteration so far, from what the iteration before left
/// live); without one, the holders are the failing workspace's open cycle, by role. A
/// plan group that cannot grow its arena to a plan reports the plan's bytes as the
/// request, its lower bound, and as fragmentation the bytes its layout takes above
/// that bound (no allocation is live then: no holders).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Bytes the failing request asked for.
    pub requested: usize,
    /// The failing workspace's capacity (its arena) in bytes.
    pub capacity: usize,
    /// Bytes the failing workspace had in use in its open cycle.
    pub in_use: usize,
    /// The most bytes (as asked for) live at once in the iteration so far, in every
    /// workspace the timeline records: what no layout can go below.
    pub lower_bound: Option<u64>,
    /// Bytes of the live allocations lost to padding them to their alignment unit.
    pub padding_bytes: Option<u64>,
    /// Bytes the failing workspace has in use beyond its live allocations: dead
    /// allocations a bump arena cannot give back before its cycle ends, and alignment
    /// gaps.
    pub fragmentation_bytes: Option<u64>,
    /// The largest live holders, most bytes first, five at most.
    pub holders: Vec<Holder>,
}

/// Bytes held by one role and layer in one workspace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The workspace.
    pub workspace: Arc<str>,
    /// The role of the cycle that allocated them (`None`: not entered by role).
    pub role: Option<ArrayType>,
    /// The layer that allocated them (`None`: no layer label).
    pub layer: Option<Arc<str>>,
    /// Bytes (padded) they take.
    pub bytes: u64,
    /// Allocations.
    pub allocations: u64,
}

impl MemoryReport {
    /// A report of what the failing workspace knows alone: its open cycle (`in_use`
    /// bytes, of role `role`) as the one holder.
    pub(crate) fn of_workspace(
        workspace: &Arc<str>,
        role: Option<ArrayType>,
        requested: usize,
        capacity: usize,
        in_use: usize,
    ) -> MemoryReport {
        let mut report = MemoryReport { requested, capacity, in_use, ..MemoryReport::default() };
        if in_use > 0 {
            report.holders.push(Holder {
                workspace: workspace.clone(),
                role,
                layer: None,
                bytes: in_use as u64,
                allocations: 0,
            });
        }
        report
    }

    /// Whether the figures come from a timeline (all of them) or from the workspace
    /// alone.
    pub fn is_recorded(&self) -> bool {
        self.lower_bound.is_some()
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.role {
            Some(role) => write!(f, "{role:?}")?,
            None => f.write_str("unlabelled")?,
        }
        if let Some(layer) = &self.layer {
            write!(f, " of layer '{layer}'")?;
        }
        write!(f, " in '{}': {} bytes", self.workspace, self.bytes)?;
        if self.allocations > 0 {
            write!(f, " in {} allocation{}", self.allocations, if self.allocations == 1 { "" } else { "s" })?;
        }
        Ok(())
    }
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {} bytes, capacity {} bytes, {} bytes in use", self.requested, self.capacity, self.in_use)?;
        match self.lower_bound {
            Some(lower_bound) => write!(f, "; lower bound of the iteration so far {lower_bound} bytes")?,
            None => f.write_str(
                "; lower bound of the iteration so far, padding and fragmentation: unknown (no timeline records this \
                 workspace: start a workspace_core::timeline::Timeline and attach the workspace to it, with \
                 Timeline::attach or attach_mgr, or Network::attach_timeline, to have them and the holders by layer)",
            )?,
        }
        match (self.padding_bytes, self.fragmentation_bytes) {
            (Some(padding), Some(fragmentation)) => {
                write!(f, "; {padding} bytes lost to padding and {fragmentation} to fragmentation")?
            }
            (None, Some(fragmentation)) => write!(f, "; {fragmentation} bytes lost to fragmentation")?,
            (Some(padding), None) => write!(f, "; {padding} bytes lost to padding")?,
            (None, None) => {}
        }
        if self.holders.is_empty() {
            return f.write_str("; no live holders");
        }
        f.write_str("; largest live holders: ")?;
        for (i, holder) in self.holders.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{holder}")?;
        }
        Ok(())
    }
}
