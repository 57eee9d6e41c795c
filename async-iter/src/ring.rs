//! The host ring: the memory batches are filled into, a [`SlotRing`] over blocks of an
//! [`ArenaBackend`].
//!
//! Batch `i` of an epoch goes to the next slot of the ring (see
//! [`slot_ring`](crate::slot_ring) for the slots, their sizing from the first batch and
//! growth). The hand-off ([`handoff`](crate::handoff)) lets the producer at batch `i`
//! only once batch `i - slots` is released, and within a block batch `i` takes the slot
//! of batch `i - slots`: a slot is never written while its previous batch is queued or
//! leased, so the host needs no fence.
//!
//! **`WorkspaceMode::None`.** Every batch gets a fresh block of its own size from the
//! backend's spill path (the heap on the host), freed once the batch is released:
//! the allocating baseline that workspaces are measured against.
//!
//! Every batch's bytes are zeroed before the source fills them, so a source that
//! leaves part of an array alone never exposes an earlier batch's data.

use std::ptr::NonNull;
use std::sync::atomic::Ordering;

use workspace_core::backend::{ArenaBackend, Block};
use workspace_core::{BackendError, WorkspaceMode};

use crate::error::Error;
use crate::layout::ARRAY_ALIGN;
use crate::slot_ring::{RingError, SlotMemory, SlotRing};
use crate::stats::ProducerCounters;
use crate::sync::UnsafeCell;

/// Where one batch lives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region {
    /// Aligned to [`ARRAY_ALIGN`]; the batch's bytes start here.
    pub(crate) base: NonNull<u8>,
    /// The lifetime token of the block the batch lives in (see [`Buffer::token`]).
    pub(crate) token: NonNull<UnsafeCell<()>>,
}

/// One block from the backend, boxed so that the token's address, which regions point
/// to, never moves.
struct Buffer<K> {
    block: K,
    /// A ring block of a fixed-size backend (a file mapping), which cannot have a
    /// second one while this one lives.
    fixed: bool,
    /// Loom's view of the block's lifetime: a lease holds a shared access to it for as
    /// long as it lives, and giving the block back takes a unique access, so a block
    /// freed under a lease fails the model. With std it is a zero-sized cell.
    token: UnsafeCell<()>,
}

/// The backend as the memory of a [`SlotRing`].
struct HostSlots<B: ArenaBackend> {
    backend: B,
    /// Bytes of the ring block of a fixed-size backend while one is held: growing would
    /// map its file a second time.
    fixed_ring: Option<usize>,
    /// The first byte of a block (`Block::base`, where it is a host pointer).
    base: fn(&B::Block) -> NonNull<u8>,
}

// SAFETY: every block is checked (`checked`) to hold the bytes asked for at an address
// aligned to ARRAY_ALIGN, which `slot_align` always returns; the backend's contract
// (`ArenaBackend`, `Block`) makes those bytes the block's own until it is released, and
// boxing the block moves no memory. The fence is `()`: the hand-off orders every write
// into a slot after the release of its previous batch.
unsafe impl<B: ArenaBackend> SlotMemory for HostSlots<B> {
    type Block = Box<Buffer<B::Block>>;
    type Fence = ();
    type Error = BackendError;

    fn slot_align(&self) -> usize {
        ARRAY_ALIGN
    }

    fn allocate_ring(&mut self, bytes: usize) -> Result<Self::Block, BackendError> {
        let fixed = self.backend.fixed_size();
        if let (true, Some(capacity)) = (fixed, self.fixed_ring) {
            // A batch larger than the ring's slots: the ring would grow into a second
            // mapping of the file it already maps.
            return Err(BackendError::FixedSize { backend: self.backend.kind(), capacity, requested: bytes });
        }
        let block = self.backend.allocate_arena(bytes, ARRAY_ALIGN.max(self.backend.base_alignment()))?;
        let mut buffer = self.checked(block, bytes)?;
        if fixed {
            buffer.fixed = true;
            self.fixed_ring = Some(buffer.block.len());
        }
        Ok(buffer)
    }

    fn allocate_batch(&mut self, bytes: usize) -> Result<Self::Block, BackendError> {
        let block = self.backend.allocate_spill(bytes, ARRAY_ALIGN)?;
        self.checked(block, bytes)
    }

    fn wait(&mut self, (): &()) -> Result<(), BackendError> {
        Ok(())
    }

    fn release(&mut self, blocks: impl Iterator<Item = Self::Block>) {
        for buffer in blocks {
            // The unique access tells loom that no lease of this block is alive.
            buffer.token.with_mut(|_| ());
            if buffer.fixed {
                self.fixed_ring = None;
            }
            self.backend.release(buffer.block);
        }
    }

    fn release_all(&mut self, blocks: impl Iterator<Item = Self::Block>) {
        // No lease is alive: the ring is dropped with the prefetcher once its producer
        // thread handed it back, or by a detached producer thread after the prefetcher
        // is gone (a lease borrows the prefetcher). So every block can go.
        for buffer in blocks {
            self.backend.release(buffer.block);
        }
        self.fixed_ring = None;
    }
}

impl<B: ArenaBackend> HostSlots<B> {
    /// `block` if it has `bytes` bytes aligned to [`ARRAY_ALIGN`], as the views of a
    /// batch need; a backend that breaks its contract gets an error, not a misaligned
    /// view.
    fn checked(&mut self, block: B::Block, bytes: usize) -> Result<Box<Buffer<B::Block>>, BackendError> {
        let base = (self.base)(&block);
        if block.len() >= bytes && (base.as_ptr() as usize).is_multiple_of(ARRAY_ALIGN) {
            return Ok(Box::new(Buffer { block, fixed: false, token: UnsafeCell::new(()) }));
        }
        let detail = format!(
            "the {} backend returned {} bytes at {base:p} for a request of {bytes} bytes aligned to {ARRAY_ALIGN}",
            self.backend.kind(),
            block.len(),
        );
        self.backend.release(block);
        Err(BackendError::Other(detail))
    }
}

/// The producer's ring; see the module docs.
pub(crate) struct Ring<B: ArenaBackend> {
    slots: SlotRing<HostSlots<B>>,
    mode: WorkspaceMode,
    /// Sequence (in the slot ring) of the epoch's first batch.
    epoch_start: u64,
    /// Whether the first batch was seen (it sizes the ring).
    sized: bool,
}

impl<B> Ring<B>
where
    B: ArenaBackend,
    B::Block: Block<Base = NonNull<u8>>,
{
    pub(crate) fn new(backend: B, mode: WorkspaceMode, slots: usize, headroom: f64, max_bytes: Option<usize>) -> Self {
        debug_assert!(slots >= 2 && headroom.is_finite() && headroom >= 0.0);
        let memory = HostSlots { backend, fixed_ring: None, base: |block: &B::Block| block.base() };
        Ring { slots: SlotRing::new(memory, slots, headroom, max_bytes), mode, epoch_start: 0, sized: false }
    }

    /// The region for batch `index` of `epoch`, of `bytes` (> 0, a multiple of
    /// [`ARRAY_ALIGN`]) bytes, zeroed. The caller has waited until batch
    /// `index - slots` is released.
    ///
    /// # Errors
    ///
    /// [`Error::BatchTooLarge`] past `max_bytes`, [`Error::Backend`] when the backend
    /// has no memory; the ring is unchanged.
    pub(crate) fn reserve(
        &mut self,
        epoch: u64,
        index: usize,
        bytes: usize,
        stats: &ProducerCounters,
    ) -> Result<Region, Error> {
        debug_assert!(bytes > 0 && bytes.is_multiple_of(ARRAY_ALIGN));
        debug_assert_eq!(self.slots.placed() - self.epoch_start, index as u64, "batches are placed in order");
        let (ring_bytes, growths) = (self.slots.ring_bytes(), self.slots.growths());
        let placed =
            if self.mode == WorkspaceMode::None { self.slots.place_alone(bytes) } else { self.slots.place(bytes) };
        let (buffer, placement) = placed.map_err(|error| match error {
            RingError::TooLarge { ring_bytes, max_ring_bytes } => {
                Error::BatchTooLarge { epoch, batch: index, batch_bytes: bytes, ring_bytes, max_ring_bytes }
            }
            RingError::Memory(source) => Error::Backend { epoch, batch: index, source },
        })?;
        // The first batch placed sized the ring (one refused did not).
        if !self.sized {
            self.sized = true;
            stats.first_batch_bytes.store(bytes, Ordering::Relaxed);
        }
        // SAFETY: the slot ring places the batch's `bytes` bytes (at most a slot) at
        // `offset` inside the block, which holds at least the bytes asked for
        // (`HostSlots` is a `SlotMemory`); so the pointer stays inside the block.
        let base = unsafe { buffer.block.base().add(placement.offset) };
        // SAFETY: `base..base + bytes` lies in the block, which the ring owns and hands
        // to one batch at a time: the hand-off lets the producer reuse a slot only after
        // its previous batch was released. Every byte is writable; zeroing makes the
        // region initialised before anyone views it.
        unsafe { std::ptr::write_bytes(base.as_ptr(), 0, bytes) };
        let region = Region { base, token: NonNull::from(&buffer.token) };
        if self.slots.ring_bytes() != ring_bytes {
            stats.ring_bytes.store(self.slots.ring_bytes(), Ordering::Relaxed);
            stats.slot_bytes.store(self.slots.slot_bytes(), Ordering::Relaxed);
            let grown = self.slots.growths() - growths;
            stats.ring_growths.fetch_add(grown, Ordering::Relaxed);
        }
        Ok(region)
    }

    /// Gives back the retired blocks whose batches are all released (`released`
    /// batches of this epoch are).
    pub(crate) fn free_released(&mut self, released: usize) {
        self.slots.returned_until(self.epoch_start + released as u64);
    }

    /// Gives back every retired block: the epoch is over and no batch of it is alive.
    pub(crate) fn end_epoch(&mut self) {
        self.slots.all_returned();
        self.epoch_start = self.slots.placed();
    }
}

#[cfg(test)]
mod tests {
    use workspace_core::backend::HostBackend;

    use super::*;

    fn ring(mode: WorkspaceMode, headroom: f64, max: Option<usize>) -> Ring<HostBackend> {
        Ring::new(HostBackend::Ram, mode, 3, headroom, max)
    }

    #[test]
    fn first_batch_sizes_the_ring_and_slots_cycle() {
        let stats = ProducerCounters::default();
        let mut ring = ring(WorkspaceMode::Enabled, 0.5, None);
        let bases: Vec<_> = (0..4).map(|i| ring.reserve(0, i, 128, &stats).unwrap().base).collect();
        assert_eq!(stats.slot_bytes.load(Ordering::Relaxed), 192);
        assert_eq!(stats.ring_bytes.load(Ordering::Relaxed), 576);
        assert_eq!(stats.first_batch_bytes.load(Ordering::Relaxed), 128);
        assert_eq!(bases[1].as_ptr() as usize - bases[0].as_ptr() as usize, 192);
        assert_eq!(bases[3], bases[0], "batch 3 reuses slot 0");
        // A batch that fits the headroom does not grow the ring; a larger one does.
        ring.reserve(0, 4, 192, &stats).unwrap();
        assert_eq!(stats.ring_growths.load(Ordering::Relaxed), 0);
        let grown = ring.reserve(0, 5, 256, &stats).unwrap();
        assert_eq!(stats.ring_growths.load(Ordering::Relaxed), 1);
        assert_eq!(stats.ring_bytes.load(Ordering::Relaxed), 3 * 384);
        assert!(!bases.contains(&grown.base));
        assert_eq!(ring.slots.retired_blocks(), 1, "the old block waits for its batches");
        ring.free_released(4);
        assert_eq!(ring.slots.retired_blocks(), 1, "batch 4 still lives in it");
        ring.free_released(5);
        assert!(ring.slots.retired_blocks() == 0);
    }

    #[test]
    fn regions_are_zeroed() {
        let stats = ProducerCounters::default();
        let mut ring = ring(WorkspaceMode::Enabled, 0.0, None);
        let region = ring.reserve(0, 0, 64, &stats).unwrap();
        // SAFETY: the region is 64 writable bytes owned by this test.
        unsafe { std::ptr::write_bytes(region.base.as_ptr(), 0xAB, 64) };
        for index in 1..=3 {
            let region = ring.reserve(0, index, 64, &stats).unwrap();
            // SAFETY: as above; reading initialised bytes.
            let bytes = unsafe { std::slice::from_raw_parts(region.base.as_ptr(), 64) };
            assert!(bytes.iter().all(|&b| b == 0), "slot {} was zeroed", index % 3);
        }
    }

    #[test]
    fn heap_mode_allocates_every_batch_and_frees_released_ones() {
        let stats = ProducerCounters::default();
        let mut ring = ring(WorkspaceMode::None, 0.0, None);
        let a = ring.reserve(0, 0, 64, &stats).unwrap();
        let b = ring.reserve(0, 1, 64, &stats).unwrap();
        assert_ne!(a.base, b.base);
        assert_eq!(stats.ring_bytes.load(Ordering::Relaxed), 0);
        assert_eq!(ring.slots.retired_blocks(), 2);
        ring.free_released(1);
        assert_eq!(ring.slots.retired_blocks(), 1);
        ring.end_epoch();
        assert!(ring.slots.retired_blocks() == 0);
    }

    #[test]
    fn a_ring_over_a_file_mapping_says_it_cannot_grow() {
        let path = std::env::temp_dir().join(format!("carve-ring-{}.map", std::process::id()));
        // SAFETY: a file of this test's own, in the temporary directory, that nothing
        // else truncates or writes while it is mapped.
        let file = unsafe { workspace_core::MappedFile::new(&path) };
        let stats = ProducerCounters::default();
        let mut ring = Ring::new(HostBackend::MmapFile(file), WorkspaceMode::Enabled, 3, 0.0, None);
        ring.reserve(0, 0, 4096, &stats).unwrap();
        // A larger batch would grow the ring into a second mapping of the same file.
        let err = ring.reserve(0, 1, 8192, &stats).unwrap_err();
        assert!(
            matches!(err, Error::Backend { source: BackendError::FixedSize { backend: "mmap-file", requested, .. }, .. } if requested >= 8192),
            "{err:?}"
        );
        assert!(err.to_string().contains("fixed size") && !err.to_string().contains("another"), "{err}");
        // Batches that fit keep coming from the mapping.
        ring.reserve(0, 1, 4096, &stats).unwrap();
        drop(ring);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn the_budget_trims_headroom_and_refuses_what_cannot_fit() {
        let stats = ProducerCounters::default();
        let mut ring = ring(WorkspaceMode::Enabled, 1.0, Some(3 * 256));
        ring.reserve(0, 0, 192, &stats).unwrap();
        assert_eq!(stats.slot_bytes.load(Ordering::Relaxed), 256, "headroom trimmed to the budget");
        let err = ring.reserve(0, 1, 320, &stats).unwrap_err();
        assert!(matches!(err, Error::BatchTooLarge { batch: 1, batch_bytes: 320, ring_bytes: 960, .. }), "{err}");
        assert_eq!(stats.ring_bytes.load(Ordering::Relaxed), 768, "the ring is unchanged");
        let err = ring.reserve(0, 1, usize::MAX / 2 / 64 * 64, &stats).unwrap_err();
        assert!(matches!(err, Error::BatchTooLarge { ring_bytes: usize::MAX, .. }), "{err}");
    }

    /// A backend whose blocks start one byte past an aligned address.
    struct Skewed(HostBackend);

    // SAFETY: deliberately breaks the alignment promise (base alignment 1 is met, but
    // spills are not aligned to `align`) to test that the ring checks it anyway; the
    // memory itself is the inner backend's, owned and valid.
    unsafe impl ArenaBackend for Skewed {
        type Block = SkewedBlock;
        fn kind(&self) -> &'static str {
            "skewed"
        }
        fn base_alignment(&self) -> usize {
            1
        }
        fn allocate_arena(&mut self, bytes: usize, align: usize) -> Result<SkewedBlock, BackendError> {
            Ok(SkewedBlock(self.0.allocate_arena(bytes + 1, align)?))
        }
        fn allocate_spill(&mut self, bytes: usize, align: usize) -> Result<SkewedBlock, BackendError> {
            Ok(SkewedBlock(self.0.allocate_spill(bytes + 1, align)?))
        }
    }

    struct SkewedBlock(workspace_core::backend::HostBlock);

    // SAFETY: one byte into the inner block, one byte shorter: memory the inner block owns.
    unsafe impl Block for SkewedBlock {
        type Base = NonNull<u8>;
        fn base(&self) -> NonNull<u8> {
            // SAFETY: the inner block has one byte more than this one claims.
            unsafe { self.0.base().add(1) }
        }
        fn len(&self) -> usize {
            self.0.len() - 1
        }
    }

    #[test]
    fn a_misaligned_block_is_an_error_not_a_view() {
        for mode in [WorkspaceMode::Enabled, WorkspaceMode::None] {
            let stats = ProducerCounters::default();
            let mut ring = Ring::new(Skewed(HostBackend::Ram), mode, 2, 0.0, None);
            let err = ring.reserve(0, 0, 64, &stats).unwrap_err();
            assert!(err.to_string().contains("the skewed backend returned"), "{err}");
            assert!(ring.slots.ring_bytes() == 0 && ring.slots.retired_blocks() == 0);
        }
    }
}
