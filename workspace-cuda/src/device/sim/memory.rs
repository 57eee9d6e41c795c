//! The simulator's memory: device allocations at made-up addresses, checked on every
//! access, and the pinned host memory it knows about.

use std::alloc::Layout;
use std::collections::BTreeMap;

use crate::device::PINNED_ALIGNMENT;

/// The simulated device memory.
pub(super) struct Memory {
    /// Allocations by start address.
    pub(super) regions: BTreeMap<u64, Vec<u8>>,
    /// Next unused address; addresses are never reused.
    pub(super) next: u64,
    pub(super) live_bytes: usize,
    pub(super) limit: usize,
    /// Pinned host allocations: start address → length.
    pub(super) pinned: BTreeMap<usize, usize>,
    pub(super) live_pinned: usize,
}

impl Memory {
    pub(super) fn region(&self, address: u64, len: usize) -> Result<(u64, usize), String> {
        let found = self.regions.range(..=address).next_back();
        let Some((&start, data)) = found else {
            return Err(format!("no allocation at {address:#x}: use after free or out of bounds"));
        };
        let offset = usize::try_from(address - start).unwrap_or(usize::MAX);
        if offset.checked_add(len).is_none_or(|end| end > data.len()) {
            return Err(format!(
                "{len} bytes at {address:#x} are not inside one allocation (the nearest starts at {start:#x} \
                 and has {} bytes): use after free or out of bounds",
                data.len()
            ));
        }
        Ok((start, offset))
    }

    pub(super) fn bytes(&self, address: u64, len: usize) -> Result<&[u8], String> {
        let (start, offset) = self.region(address, len)?;
        Ok(&self.regions[&start][offset..offset + len])
    }

    pub(super) fn bytes_mut(&mut self, address: u64, len: usize) -> Result<&mut [u8], String> {
        let (start, offset) = self.region(address, len)?;
        let data = self.regions.get_mut(&start).ok_or_else(|| format!("no allocation at {start:#x}"))?;
        Ok(&mut data[offset..offset + len])
    }

    pub(super) fn check_pinned(&self, address: usize, len: usize) -> Result<(), String> {
        match self.pinned.range(..=address).next_back() {
            Some((&start, &size)) if address - start + len <= size => Ok(()),
            _ => Err(format!("{len} bytes of host memory at {address:#x} are not live pinned memory of this device")),
        }
    }
}

/// The layout of a simulated pinned allocation of `bytes` bytes: one spare
/// [`PINNED_ALIGNMENT`] in front, the start aligned to twice that, so that the bytes
/// handed out (after the spare) are aligned to [`PINNED_ALIGNMENT`] and no more.
pub(super) fn pinned_layout(bytes: usize) -> Option<Layout> {
    Layout::from_size_align(bytes.checked_add(PINNED_ALIGNMENT)?, 2 * PINNED_ALIGNMENT).ok()
}
