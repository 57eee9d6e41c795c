//! The timeline's part of a [`MemoryReport`]: from the iteration so far (and what the
//! iteration before left live), the lower bound, the bytes lost to padding and
//! fragmentation and the largest live holders by workspace, role and layer.

use std::sync::Arc;

use super::state::{self, LiveSet, State, Step};
use crate::memory_report::{Holder, MemoryReport, HOLDERS};
use crate::roles::{ArrayType, NO_ROLE};

/// Fills in `report`, a failure's in the workspace of index `workspace`, from `state`.
pub(super) fn fill(report: &mut MemoryReport, state: &State, workspace: u16) {
    // The iteration so far, from what the one before left live.
    let mut live = LiveSet::from(state.carried());
    state.current().iter().for_each(|step| live.apply(step));
    let last: Vec<Step> = live.steps().copied().collect();
    report.lower_bound = Some(state::lower_bound(state.carried().iter().chain(state.current()), false));
    report.padding_bytes = Some(last.iter().map(|s| s.bytes - s.requested.min(s.bytes)).sum());
    let own: u64 = last.iter().filter(|s| s.workspace() == workspace).map(|s| s.bytes).sum();
    report.fragmentation_bytes = Some((report.in_use as u64).saturating_sub(own));
    report.holders = holders(&last, &state.workspaces);
}

/// The largest holders of `live` by workspace, role and layer, most bytes first.
pub(crate) fn holders(live: &[Step], workspaces: &[Arc<str>]) -> Vec<Holder> {
    let mut holders: Vec<(u16, u8, u32, u64, u64)> = Vec::new();
    for s in live {
        match holders.iter_mut().find(|h| (h.0, h.1, h.2) == (s.workspace(), s.role(), s.layer())) {
            Some(h) => {
                h.3 += s.bytes;
                h.4 += 1;
            }
            None => holders.push((s.workspace(), s.role(), s.layer(), s.bytes, 1)),
        }
    }
    holders.sort_by_key(|h| std::cmp::Reverse(h.3));
    holders
        .into_iter()
        .take(HOLDERS)
        .map(|(ws, role, layer, bytes, allocations)| Holder {
            workspace: workspaces.get(usize::from(ws)).cloned().unwrap_or_else(|| "?".into()),
            role: if role == NO_ROLE { None } else { ArrayType::from_index(role) },
            layer: super::label_name(layer),
            bytes,
            allocations,
        })
        .collect()
}
