//! Device and pinned arenas behind the core's [`ArenaBackend`]: the host engine's cycle,
//! learning, spill and statistics logic runs unchanged over them.
//!
//! A [`DeviceBackend`] hands out device allocations ordered on its workspace's stream;
//! giving one back frees it in that stream's order, after everything the workspace
//! issued (the workspace joins every other stream that used the memory into its own
//! before a cycle closes). When a stream could not be joined, blocks given back wait in
//! a graveyard until the workspace has ordered it. A [`PinnedBackend`] hands out page-locked host memory; since
//! the host frees that at once, a block given back while transfers may still use it
//! waits in a graveyard until the pinned workspace has waited for them.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use workspace_core::backend::{ArenaBackend, Block};
use workspace_core::BackendError;

use crate::device::{Device, DEVICE_ALIGNMENT, PINNED_ALIGNMENT};
use crate::ledger::Ledger;

/// Device memory for a workspace bound to one stream.
#[derive(Debug)]
pub struct DeviceBackend<D: Device> {
    device: D,
    stream: D::Stream,
    graveyard: Arc<Mutex<Graveyard<D>>>,
    /// For a device plan group's arena: the streams that use it, which every new arena
    /// is published to and every free waits for.
    ledger: Option<Arc<Ledger<D>>>,
}

/// Blocks a device backend was given back while another stream that may still use them
/// was not ordered before its stream (freeing them would free them under that use).
#[derive(Debug)]
pub(crate) struct Graveyard<D: Device> {
    /// Whether blocks given back are kept rather than freed.
    pub(crate) holding: bool,
    pub(crate) blocks: Vec<DeviceBlock<D>>,
}

/// Locks a device graveyard, ignoring poisoning (nothing panics while holding it).
pub(crate) fn lock_graveyard<D: Device>(shared: &Mutex<Graveyard<D>>) -> std::sync::MutexGuard<'_, Graveyard<D>> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<D: Device> DeviceBackend<D> {
    /// A backend allocating on `stream` of `device`.
    pub fn new(device: D, stream: D::Stream) -> DeviceBackend<D> {
        let graveyard = Arc::new(Mutex::new(Graveyard { holding: false, blocks: Vec::new() }));
        DeviceBackend { device, stream, graveyard, ledger: None }
    }

    /// The backend of a device plan group's arena, on `stream`, ordered with the other
    /// streams of the group through `ledger`.
    pub(crate) fn for_group(device: D, stream: D::Stream, ledger: Arc<Ledger<D>>) -> DeviceBackend<D> {
        DeviceBackend { ledger: Some(ledger), ..DeviceBackend::new(device, stream) }
    }

    /// The graveyard this backend shares with its workspace, which decides when blocks
    /// given back may be freed.
    pub(crate) fn graveyard(&self) -> Arc<Mutex<Graveyard<D>>> {
        self.graveyard.clone()
    }

    fn block(&self, bytes: usize, align: usize) -> Result<DeviceBlock<D>, BackendError> {
        let oom = || BackendError::OutOfMemory { bytes, align };
        // Allocations are aligned to `DEVICE_ALIGNMENT`, which is all an arena needs. A
        // larger alignment, or a driver that gives less, takes padding (and a second try).
        for padding in [align.saturating_sub(DEVICE_ALIGNMENT), align - 1] {
            let total = bytes.checked_add(padding).ok_or_else(oom)?;
            let memory = self.device.alloc(&self.stream, total).map_err(|e| e.into_backend(align))?;
            let address = D::memory_address(&memory);
            let base = address.checked_next_multiple_of(align as u64).ok_or_else(oom)?;
            if base - address <= padding as u64 {
                return Ok(DeviceBlock { memory, base, len: bytes });
            }
        }
        Err(oom())
    }
}

/// One device allocation of a [`DeviceBackend`]; dropping it frees it in its stream's
/// order.
#[derive(Debug)]
pub struct DeviceBlock<D: Device> {
    memory: D::Memory,
    /// Invariant: `base..base + len` lies inside `memory`.
    base: u64,
    len: usize,
}

impl<D: Device> DeviceBlock<D> {
    /// The allocation itself.
    pub fn memory(&self) -> &D::Memory {
        &self.memory
    }
}

// SAFETY: `base..base + len` lies inside `memory` (invariant), one device allocation
// this block owns and frees only when dropped; neither field changes after construction.
unsafe impl<D: Device> Block for DeviceBlock<D> {
    type Base = u64;

    #[inline(always)]
    fn base(&self) -> u64 {
        self.base
    }

    #[inline(always)]
    fn len(&self) -> usize {
        self.len
    }
}

// SAFETY: every block is a fresh device allocation, padded so that its base is aligned
// to the requested alignment (at least `DEVICE_ALIGNMENT`) and `bytes` long.
unsafe impl<D: Device> ArenaBackend for DeviceBackend<D> {
    type Block = DeviceBlock<D>;

    fn kind(&self) -> &'static str {
        D::ARENA_KIND
    }

    fn base_alignment(&self) -> usize {
        DEVICE_ALIGNMENT
    }

    fn allocate_arena(&mut self, bytes: usize, align: usize) -> Result<DeviceBlock<D>, BackendError> {
        let block = self.block(bytes, align.max(DEVICE_ALIGNMENT))?;
        if let Some(ledger) = &self.ledger {
            // Allocated in this stream's order: other streams wait for it before using it.
            if let Err(error) = ledger.arena_allocated(block.base, block.base + block.len as u64) {
                // Never handed out: freed in this stream's order, which no one else uses.
                drop(block);
                return Err(error.into_backend(align));
            }
        }
        Ok(block)
    }

    fn allocate_spill(&mut self, bytes: usize, align: usize) -> Result<DeviceBlock<D>, BackendError> {
        self.block(bytes, align.max(DEVICE_ALIGNMENT))
    }

    fn release(&mut self, block: DeviceBlock<D>) {
        if let Some(ledger) = &self.ledger {
            if !ledger.before_free(block.base, block.base + block.len as u64) {
                // Another stream that may still use it could not be ordered before the
                // free: leaked (its error is kept for the device's next report).
                std::mem::forget(block);
                return;
            }
        }
        let mut graveyard = lock_graveyard(&self.graveyard);
        if graveyard.holding {
            graveyard.blocks.push(block);
        } else {
            drop(graveyard);
            drop(block); // freed in the stream's order
        }
    }
}

/// What a pinned workspace and its backend share: the transfers that may still use the
/// workspace's memory, and the blocks given back meanwhile.
#[derive(Debug)]
pub(crate) struct InFlight<D: Device> {
    /// Events recorded after transfers from or to the workspace's memory.
    pub(crate) events: Vec<D::Event>,
    /// Blocks given back while `events` was not empty: freed once the events completed.
    pub(crate) graveyard: Vec<PinnedBlock<D>>,
    /// Pinned allocations made so far (arenas and spills).
    pub(crate) allocations: u64,
}

impl<D: Device> InFlight<D> {
    pub(crate) fn new() -> InFlight<D> {
        InFlight { events: Vec::new(), graveyard: Vec::new(), allocations: 0 }
    }
}

/// Locks the shared pinned state, ignoring poisoning (nothing panics while holding it).
pub(crate) fn lock_in_flight<D: Device>(shared: &Mutex<InFlight<D>>) -> std::sync::MutexGuard<'_, InFlight<D>> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Page-locked host memory for staging transfers.
#[derive(Debug)]
pub struct PinnedBackend<D: Device> {
    device: D,
    shared: Arc<Mutex<InFlight<D>>>,
}

impl<D: Device> PinnedBackend<D> {
    pub(crate) fn new(device: D, shared: Arc<Mutex<InFlight<D>>>) -> PinnedBackend<D> {
        PinnedBackend { device, shared }
    }

    fn block(&self, bytes: usize, align: usize) -> Result<PinnedBlock<D>, BackendError> {
        let oom = || BackendError::OutOfMemory { bytes, align };
        // As for device blocks: padding for alignments beyond a page, or a second try.
        for padding in [align.saturating_sub(PINNED_ALIGNMENT), align - 1] {
            let total = bytes.checked_add(padding).ok_or_else(oom)?;
            let memory = self.device.alloc_pinned(total).map_err(|e| e.into_backend(align))?;
            let offset = D::pinned_address(&memory).align_offset(align);
            if offset <= padding {
                lock_in_flight(&self.shared).allocations += 1;
                return Ok(PinnedBlock { memory, offset, len: bytes });
            }
        }
        Err(oom())
    }
}

/// One page-locked allocation of a [`PinnedBackend`].
#[derive(Debug)]
pub struct PinnedBlock<D: Device> {
    memory: D::PinnedMemory,
    /// Invariant: `offset + len` bytes fit in `memory`.
    offset: usize,
    len: usize,
}

// SAFETY: `offset + len` bytes fit in `memory` (invariant), one page-locked allocation
// this block owns; it is freed only when dropped, after the transfers using it.
unsafe impl<D: Device> Block for PinnedBlock<D> {
    type Base = NonNull<u8>;

    #[inline(always)]
    fn base(&self) -> NonNull<u8> {
        let start = D::pinned_address(&self.memory);
        // `offset` stays inside the allocation (invariant), so the sum is not null.
        NonNull::new(start.as_ptr().wrapping_add(self.offset)).unwrap_or(start)
    }

    #[inline(always)]
    fn len(&self) -> usize {
        self.len
    }
}

// SAFETY: every block is a fresh pinned allocation, padded so that its base is aligned
// to the requested alignment (at least `PINNED_ALIGNMENT`) and `bytes` long.
unsafe impl<D: Device> ArenaBackend for PinnedBackend<D> {
    type Block = PinnedBlock<D>;

    fn kind(&self) -> &'static str {
        D::PINNED_KIND
    }

    fn base_alignment(&self) -> usize {
        PINNED_ALIGNMENT
    }

    fn allocate_arena(&mut self, bytes: usize, align: usize) -> Result<PinnedBlock<D>, BackendError> {
        self.block(bytes, align.max(PINNED_ALIGNMENT))
    }

    fn allocate_spill(&mut self, bytes: usize, align: usize) -> Result<PinnedBlock<D>, BackendError> {
        self.block(bytes, align.max(PINNED_ALIGNMENT))
    }

    fn release(&mut self, block: PinnedBlock<D>) {
        let mut shared = lock_in_flight(&self.shared);
        if shared.events.is_empty() {
            drop(shared);
            drop(block);
        } else {
            shared.graveyard.push(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::SimDevice;

    #[test]
    fn device_blocks_are_aligned_even_beyond_the_device_alignment() {
        let sim = SimDevice::new().unwrap();
        let mut backend = DeviceBackend::new(sim.clone(), sim.default_stream());
        assert_eq!(backend.kind(), "sim-device");
        let arena = backend.allocate_arena(1000, 256).unwrap();
        assert_eq!((arena.base() % 256, arena.len()), (0, 1000));
        let spill = backend.allocate_spill(100, 4096).unwrap();
        assert_eq!(spill.base() % 4096, 0);
        let address = SimDevice::memory_address(spill.memory());
        assert!(spill.base() >= address && spill.base() + 100 <= address + 100 + 4096 - 256);
        drop((arena, spill));
        sim.synchronize(&sim.default_stream()).unwrap();
        assert_eq!(sim.live_device_bytes(), 0, "blocks free themselves in stream order");
    }

    #[test]
    fn device_out_of_memory_is_a_backend_error() {
        let sim = SimDevice::with_memory_limit(1 << 10).unwrap();
        let mut backend = DeviceBackend::new(sim.clone(), sim.default_stream());
        let err = backend.allocate_arena(1 << 20, 256).unwrap_err();
        assert!(matches!(err, BackendError::OutOfMemory { bytes: 1048576, align: 256 }), "{err:?}");
        assert!(matches!(backend.allocate_spill(usize::MAX, 512), Err(BackendError::OutOfMemory { .. })));
    }

    #[test]
    fn pinned_blocks_wait_in_the_graveyard_while_transfers_are_in_flight() {
        let sim = SimDevice::new().unwrap();
        let shared = Arc::new(Mutex::new(InFlight::new()));
        let mut backend = PinnedBackend::new(sim.clone(), shared.clone());
        let block = backend.allocate_arena(8192, PINNED_ALIGNMENT).unwrap();
        assert_eq!(block.base().as_ptr() as usize % PINNED_ALIGNMENT, 0);
        let over = backend.allocate_spill(10, 1 << 16).unwrap();
        assert_eq!(over.base().as_ptr() as usize % (1 << 16), 0);
        backend.release(over);
        assert_eq!(sim.live_pinned_bytes(), 8192, "nothing in flight: freed at once");
        lock_in_flight(&shared).events.push(sim.record(&sim.default_stream()).unwrap());
        backend.release(block);
        assert_eq!(sim.live_pinned_bytes(), 8192, "kept while a transfer may use it");
        let mut state = lock_in_flight(&shared);
        assert_eq!((state.graveyard.len(), state.allocations), (1, 2));
        state.graveyard.clear();
        drop(state);
        assert_eq!(sim.live_pinned_bytes(), 0);
    }
}
