//! The device ring of a [`DevicePrefetcher`](super::DevicePrefetcher): one device
//! allocation cut into `depth + 1` equal slots, sized from the first batch, and the
//! events that say when each slot may be written again.
//!
//! Three streams meet here. The ring is allocated on the consumer's stream, so freeing
//! it is ordered after everything the consumer did with its batches. Copies into a slot
//! run on the copy stream, behind a wait for the event recorded on the consumer's
//! stream when the slot's previous lease ended: a copy never overwrites a batch that a
//! kernel may still read. And before any block is freed, the consumer's stream waits for
//! the copy stream, so no copy writes into freed memory.
//!
//! A batch larger than a slot grows the ring like the host ring grows: a new block with
//! larger slots takes the next batches, and the old one is retired, then freed once the
//! last batch placed in it has been handed back.

use std::collections::VecDeque;

use crate::device::{Device, DEVICE_ALIGNMENT};
use crate::error::DeviceError;

/// Where one batch was placed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Place {
    /// Device address of the slot.
    pub(super) address: u64,
    /// The slot in its block.
    pub(super) slot: usize,
    /// Batches placed before this one, over all epochs.
    pub(super) sequence: u64,
}

/// One allocation of the ring.
struct RingBlock<D: Device> {
    memory: D::Memory,
    slot_bytes: usize,
    /// Per slot: the event recorded on the consumer's stream after the slot's last lease
    /// ended. The next copy into the slot waits for it; `None` when the slot has held no
    /// leased batch since it was last written.
    released: Vec<Option<D::Event>>,
}

/// A block that no new batch goes to.
struct Retired<D: Device> {
    block: RingBlock<D>,
    /// Sequence of the last batch placed in it.
    last: u64,
}

/// See the module docs.
pub(super) struct DeviceRing<D: Device> {
    pub(super) device: D,
    /// The consumer's stream: batches are used, and the ring is allocated and freed, here.
    pub(super) consumer: D::Stream,
    /// The stream the host-to-device copies run on.
    pub(super) copy: D::Stream,
    slots: usize,
    headroom: f64,
    current: Option<RingBlock<D>>,
    retired: VecDeque<Retired<D>>,
    /// Slot of the next batch in `current`.
    cursor: usize,
    /// Batches placed so far, over all epochs.
    sequence: u64,
    /// Batches whose leases ended (or that were dropped unleased): all before this.
    returned: u64,
    pub(super) growths: u64,
    pub(super) copies: u64,
    pub(super) bytes_copied: u64,
}

impl<D: Device> DeviceRing<D> {
    pub(super) fn new(device: D, consumer: D::Stream, copy: D::Stream, slots: usize, headroom: f64) -> Self {
        DeviceRing {
            device,
            consumer,
            copy,
            slots,
            headroom,
            current: None,
            retired: VecDeque::new(),
            cursor: 0,
            sequence: 0,
            returned: 0,
            growths: 0,
            copies: 0,
            bytes_copied: 0,
        }
    }

    /// Bytes of one slot now (0 before the first batch).
    pub(super) fn slot_bytes(&self) -> usize {
        self.current.as_ref().map_or(0, |block| block.slot_bytes)
    }

    /// Bytes of the ring now.
    pub(super) fn ring_bytes(&self) -> usize {
        self.slot_bytes() * self.slots
    }

    /// A slot for a batch of `bytes` bytes, with the copy stream already waiting until
    /// the slot's previous lease has ended on the consumer's stream.
    pub(super) fn place(&mut self, bytes: usize) -> Result<Place, DeviceError> {
        if self.current.as_ref().is_none_or(|block| block.slot_bytes < bytes) {
            self.grow(bytes)?;
        }
        let slot = self.cursor;
        let block = self.current.as_mut().expect("grown above");
        if let Some(released) = &block.released[slot] {
            self.device.wait(&self.copy, released)?;
        }
        block.released[slot] = None;
        self.cursor = (slot + 1) % self.slots;
        let address = D::memory_address(&block.memory) + (slot * block.slot_bytes) as u64;
        let sequence = self.sequence;
        self.sequence += 1;
        Ok(Place { address, slot, sequence })
    }

    /// A new block whose slots hold `bytes` (plus headroom); the old one is retired.
    #[cold]
    fn grow(&mut self, bytes: usize) -> Result<(), DeviceError> {
        let oom = |bytes| DeviceError::OutOfMemory { bytes, what: "device" };
        let wanted = (bytes as f64 * (1.0 + self.headroom)).ceil() as usize; // `as` saturates
        let slot_bytes = wanted.max(bytes).checked_next_multiple_of(DEVICE_ALIGNMENT).ok_or(oom(usize::MAX))?;
        let ring_bytes = slot_bytes.checked_mul(self.slots).ok_or(oom(usize::MAX))?;
        let memory = self.device.alloc(&self.consumer, ring_bytes)?;
        // The allocation is ordered on the consumer's stream; copies into it are not.
        let allocated = self.device.record(&self.consumer)?;
        self.device.wait(&self.copy, &allocated)?;
        let block = RingBlock { memory, slot_bytes, released: (0..self.slots).map(|_| None).collect() };
        if let Some(old) = self.current.replace(block) {
            self.growths += 1;
            self.retired.push_back(Retired { block: old, last: self.sequence.saturating_sub(1) });
        }
        self.cursor = 0;
        Ok(())
    }

    /// The lease of the batch at `place` ended; `released` was recorded on the consumer's
    /// stream after it (`None`: the consumer's stream was synchronised instead).
    pub(super) fn returned(&mut self, place: Place, released: Option<D::Event>) {
        let in_current = self.retired.back().is_none_or(|retired| place.sequence > retired.last);
        if let (true, Some(block)) = (in_current, self.current.as_mut()) {
            block.released[place.slot] = released;
        }
        self.returned = self.returned.max(place.sequence + 1);
        self.free_retired();
    }

    /// Every batch placed so far is gone (the epoch was stopped): their slots were never
    /// leased, or their leases ended.
    pub(super) fn all_returned(&mut self) {
        self.returned = self.sequence;
        self.free_retired();
    }

    fn free_retired(&mut self) {
        if self.retired.front().is_some_and(|retired| retired.last < self.returned) {
            let mut done = Vec::new();
            while self.retired.front().is_some_and(|retired| retired.last < self.returned) {
                done.extend(self.retired.pop_front().map(|retired| retired.block));
            }
            self.free(done);
        }
    }

    /// Frees `blocks` in the consumer's stream order, after every copy issued so far.
    fn free(&self, blocks: Vec<RingBlock<D>>) {
        let ordered = self
            .device
            .record(&self.copy)
            .and_then(|copied| self.device.wait(&self.consumer, &copied))
            .or_else(|_| self.device.synchronize(&self.copy));
        match ordered {
            Ok(()) => drop(blocks),
            Err(error) => {
                // A copy may still write the memory: keep it rather than free it under it.
                self.device.defer_error(error);
                std::mem::forget(blocks);
            }
        }
    }
}

impl<D: Device> Drop for DeviceRing<D> {
    fn drop(&mut self) {
        let mut blocks: Vec<_> = self.retired.drain(..).map(|retired| retired.block).collect();
        blocks.extend(self.current.take());
        if !blocks.is_empty() {
            self.free(blocks);
        }
    }
}
