//! The device ring of a [`DevicePrefetcher`](super::DevicePrefetcher): an
//! [`async_iter::slot_ring::SlotRing`] over device memory, whose fences are events
//! recorded on the consumer's stream. The slots, their sizing from the first batch and
//! the growth into a new block for a larger batch are the slot ring's, as for the host
//! ring.
//!
//! Three streams meet here. The ring is allocated on the consumer's stream, so freeing
//! it is ordered after everything the consumer did with its batches. Copies into a slot
//! run on the copy stream, behind a wait for the event recorded on the consumer's
//! stream when the slot's previous lease ended: a copy never overwrites a batch that a
//! kernel may still read. And before any block is freed, the consumer's stream waits for
//! the copy stream, so no copy writes into freed memory.

use async_iter::slot_ring::{Placement, RingError, SlotMemory, SlotRing};

use crate::device::{Device, DEVICE_ALIGNMENT};
use crate::error::DeviceError;

/// Where one batch was placed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Place {
    /// Device address of the slot.
    pub(super) address: u64,
    /// The slot ring's placement.
    placement: Placement,
}

/// The device and its two streams, as the memory of a [`SlotRing`].
pub(super) struct DeviceSlots<D: Device> {
    pub(super) device: D,
    /// The consumer's stream: batches are used, and the ring is allocated and freed, here.
    pub(super) consumer: D::Stream,
    /// The stream the host-to-device copies run on.
    pub(super) copy: D::Stream,
}

// SAFETY: `Device::alloc` returns `bytes` bytes of device memory aligned to
// DEVICE_ALIGNMENT (which `slot_align` always returns), owned by the `D::Memory` until
// it is dropped, which `release` does only after ordering the consumer's stream after
// every copy issued so far (or never, when that fails). `wait` makes the copy stream,
// where every write into a slot is issued, wait for the fence's event.
unsafe impl<D: Device> SlotMemory for DeviceSlots<D> {
    type Block = D::Memory;
    type Fence = D::Event;
    type Error = DeviceError;

    fn slot_align(&self) -> usize {
        DEVICE_ALIGNMENT
    }

    fn allocate_ring(&mut self, bytes: usize) -> Result<D::Memory, DeviceError> {
        let memory = self.device.alloc(&self.consumer, bytes)?;
        // The allocation is ordered on the consumer's stream; copies into it are not.
        let allocated = self.device.record(&self.consumer)?;
        self.device.wait(&self.copy, &allocated)?;
        Ok(memory)
    }

    fn wait(&mut self, released: &D::Event) -> Result<(), DeviceError> {
        self.device.wait(&self.copy, released)
    }

    /// Frees `blocks` in the consumer's stream order, after every copy issued so far.
    fn release(&mut self, blocks: impl Iterator<Item = D::Memory>) {
        let ordered = self
            .device
            .record(&self.copy)
            .and_then(|copied| self.device.wait(&self.consumer, &copied))
            .or_else(|_| self.device.synchronize(&self.copy));
        match ordered {
            Ok(()) => blocks.for_each(drop),
            Err(error) => {
                // A copy may still write the memory: keep it rather than free it under it.
                self.device.defer_error(error);
                blocks.for_each(std::mem::forget);
            }
        }
    }
}

/// See the module docs.
pub(super) struct DeviceRing<D: Device> {
    ring: SlotRing<DeviceSlots<D>>,
    pub(super) copies: u64,
    pub(super) bytes_copied: u64,
}

impl<D: Device> DeviceRing<D> {
    pub(super) fn new(device: D, consumer: D::Stream, copy: D::Stream, slots: usize, headroom: f64) -> Self {
        let ring = SlotRing::new(DeviceSlots { device, consumer, copy }, slots, headroom, None);
        DeviceRing { ring, copies: 0, bytes_copied: 0 }
    }

    /// The device, the consumer's stream and the copy stream.
    pub(super) fn memory(&self) -> &DeviceSlots<D> {
        self.ring.memory()
    }

    /// Bytes of one slot now (0 before the first batch).
    pub(super) fn slot_bytes(&self) -> usize {
        self.ring.slot_bytes()
    }

    /// Bytes of the ring now.
    pub(super) fn ring_bytes(&self) -> usize {
        self.ring.ring_bytes()
    }

    /// Times a batch larger than a slot grew the ring.
    pub(super) fn growths(&self) -> u64 {
        self.ring.growths()
    }

    /// A slot for a batch of `bytes` bytes, with the copy stream already waiting until
    /// the slot's previous lease has ended on the consumer's stream.
    pub(super) fn place(&mut self, bytes: usize) -> Result<Place, DeviceError> {
        let (memory, placement) = self.ring.place(bytes).map_err(|error| match error {
            RingError::TooLarge { .. } => DeviceError::OutOfMemory { bytes: usize::MAX, what: "device" },
            RingError::Memory(error) => error,
        })?;
        Ok(Place { address: D::memory_address(memory) + placement.offset as u64, placement })
    }

    /// The lease of the batch at `place` ended; `released` was recorded on the consumer's
    /// stream after it (`None`: the consumer's stream was synchronised instead).
    pub(super) fn returned(&mut self, place: Place, released: Option<D::Event>) {
        self.ring.returned(place.placement, released);
    }

    /// Every batch placed so far is gone (the epoch was stopped): their slots were never
    /// leased, or their leases ended.
    pub(super) fn all_returned(&mut self) {
        self.ring.all_returned();
    }
}
