//! The ring: the memory batches are filled into, from an [`ArenaBackend`].
//!
//! The ring is `slots` equal slots in one arena block; batch `i` of an epoch goes to
//! slot `i % slots`. The hand-off ([`handoff`](crate::handoff)) lets the producer at
//! batch `i` only once batch `i - slots` is released, so a slot is never written
//! while its previous batch is queued or leased. Equal slots cannot fragment the way
//! variable regions in a circular buffer do: the last, smaller batch of an epoch and
//! batches of varying size all fit as long as they fit a slot.
//!
//! **Sizing.** The first batch sizes the ring: a slot is its bytes times
//! `1 + headroom`, rounded up to [`ARRAY_ALIGN`], and the ring is `slots` of them
//! (`slots = depth + 1`: the batches queued or being filled ahead, plus the one the
//! consumer holds). A later batch larger than a slot *grows* the ring: a new block
//! sized from that batch the same way. The old block is kept, untouched, until every
//! batch in it is released, then given back to the backend; queued and leased batches
//! are never moved or copied. The ring never shrinks by itself.
//!
//! **`WorkspaceMode::None`.** Every batch gets a fresh block of its own size from the
//! backend's spill path (the heap on the host), freed once the batch is released:
//! the allocating baseline that workspaces are measured against.
//!
//! Every batch's bytes are zeroed before the source fills them, so a source that
//! leaves part of an array alone never exposes an earlier batch's data.

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;

use workspace_core::{ArenaBackend, BackendError, Block, WorkspaceMode};

use crate::error::Error;
use crate::layout::{align_up, ARRAY_ALIGN};
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

/// One block from the backend.
struct Buffer<K> {
    block: K,
    /// Bytes per slot (the whole block in heap mode).
    slot_bytes: usize,
    /// Loom's view of the block's lifetime: a lease holds a shared access to it for as
    /// long as it lives, and giving the block back takes a unique access, so a block
    /// freed under a lease fails the model. With std it is a zero-sized cell.
    token: UnsafeCell<()>,
}

/// A block no longer used for new batches, waiting for its last batch to be released.
struct Retired<K> {
    buffer: Box<Buffer<K>>,
    /// The block may be given back once this many batches of the epoch are released.
    free_after: usize,
}

/// The producer's ring; see the module docs.
pub(crate) struct Ring<B: ArenaBackend> {
    backend: B,
    mode: WorkspaceMode,
    slots: usize,
    headroom: f64,
    max_bytes: Option<usize>,
    /// The block new batches go to (`None` before the first batch, and in heap mode).
    /// Boxed so that the token's address, which regions point to, never moves.
    current: Option<Box<Buffer<B::Block>>>,
    /// In order of `free_after`.
    retired: VecDeque<Retired<B::Block>>,
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
        Ring { backend, mode, slots, headroom, max_bytes, current: None, retired: VecDeque::new(), sized: false }
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
        if !self.sized {
            self.sized = true;
            stats.first_batch_bytes.store(bytes, Ordering::Relaxed);
        }
        if self.mode == WorkspaceMode::None {
            return self.reserve_fresh(epoch, index, bytes);
        }
        let fits = self.current.as_ref().is_some_and(|buffer| bytes <= buffer.slot_bytes);
        if !fits {
            self.grow(epoch, index, bytes, stats)?;
        }
        let buffer = self.current.as_ref().expect("grow installs a buffer");
        let offset = (index % self.slots) * buffer.slot_bytes;
        // SAFETY: `offset + bytes <= slots * slot_bytes <= block.len()` (checked when
        // the block was allocated), so the pointer stays inside the block.
        let base = unsafe { buffer.block.base().add(offset) };
        Ok(region(buffer, base, bytes))
    }

    /// Heap mode: a block of its own for this batch.
    fn reserve_fresh(&mut self, epoch: u64, index: usize, bytes: usize) -> Result<Region, Error> {
        let block = self.backend.allocate_spill(bytes, ARRAY_ALIGN);
        let block = block.map_err(|source| Error::Backend { epoch, batch: index, source })?;
        let block = self.checked(block, bytes, epoch, index)?;
        let buffer = Box::new(Buffer { block, slot_bytes: bytes, token: UnsafeCell::new(()) });
        let region = region(&buffer, buffer.block.base(), bytes);
        self.retired.push_back(Retired { buffer, free_after: index + 1 });
        Ok(region)
    }

    /// Installs a block whose slots hold `bytes`, retiring the current one.
    #[cold]
    #[inline(never)]
    fn grow(&mut self, epoch: u64, index: usize, bytes: usize, stats: &ProducerCounters) -> Result<(), Error> {
        let too_large = |ring_bytes| Error::BatchTooLarge {
            epoch,
            batch: index,
            batch_bytes: bytes,
            ring_bytes,
            max_ring_bytes: self.max_bytes.unwrap_or(usize::MAX),
        };
        let max_ring = self.max_bytes.unwrap_or(usize::MAX);
        let min_ring = bytes.checked_mul(self.slots).ok_or_else(|| too_large(usize::MAX))?;
        if min_ring > max_ring {
            return Err(too_large(min_ring));
        }
        // Headroom is a wish that the budget (or the address space) may trim; the batch
        // itself fits: `bytes <= max_ring / slots`, and `bytes` is a multiple of
        // ARRAY_ALIGN, so `bytes <= max_slot`.
        let max_slot = max_ring / self.slots / ARRAY_ALIGN * ARRAY_ALIGN;
        let slot_bytes = with_headroom(bytes, self.headroom).min(max_slot);
        debug_assert!(slot_bytes >= bytes);
        let ring_bytes = slot_bytes * self.slots; // <= max_ring: no overflow
        let block = self
            .backend
            .allocate_arena(ring_bytes, ARRAY_ALIGN.max(self.backend.base_alignment()))
            .map_err(|source| Error::Backend { epoch, batch: index, source })?;
        let block = self.checked(block, ring_bytes, epoch, index)?;
        let buffer = Box::new(Buffer { block, slot_bytes, token: UnsafeCell::new(()) });
        if let Some(old) = self.current.replace(buffer) {
            // Batches before `index` may live in the old block; none after will.
            self.retired.push_back(Retired { buffer: old, free_after: index });
            stats.ring_growths.fetch_add(1, Ordering::Relaxed);
        }
        stats.ring_bytes.store(ring_bytes, Ordering::Relaxed);
        stats.slot_bytes.store(slot_bytes, Ordering::Relaxed);
        Ok(())
    }

    /// `block` if it has `bytes` bytes aligned to [`ARRAY_ALIGN`], as the views of a
    /// batch need; a backend that breaks its contract gets an error, not a misaligned
    /// view.
    fn checked(&mut self, block: B::Block, bytes: usize, epoch: u64, batch: usize) -> Result<B::Block, Error> {
        if block.len() >= bytes && (block.base().as_ptr() as usize).is_multiple_of(ARRAY_ALIGN) {
            return Ok(block);
        }
        let detail = format!(
            "the {} backend returned {} bytes at {:p} for a request of {bytes} bytes aligned to {ARRAY_ALIGN}",
            self.backend.kind(),
            block.len(),
            block.base()
        );
        self.backend.release(block);
        Err(Error::Backend { epoch, batch, source: BackendError::Other(detail) })
    }

    /// Gives back the retired blocks whose batches are all released (`released`
    /// batches of this epoch are).
    pub(crate) fn free_released(&mut self, released: usize) {
        while self.retired.front().is_some_and(|r| r.free_after <= released) {
            let retired = self.retired.pop_front().expect("checked above");
            self.give_back(*retired.buffer);
        }
    }

    /// Gives back every retired block: the epoch is over and no batch of it is alive.
    pub(crate) fn end_epoch(&mut self) {
        while let Some(retired) = self.retired.pop_front() {
            self.give_back(*retired.buffer);
        }
    }

    fn give_back(&mut self, buffer: Buffer<B::Block>) {
        // The unique access tells loom that no lease of this block is alive.
        buffer.token.with_mut(|_| ());
        self.backend.release(buffer.block);
    }
}

impl<B: ArenaBackend> Drop for Ring<B> {
    fn drop(&mut self) {
        // No lease is alive: the ring is dropped with the prefetcher once its producer
        // thread handed it back, or by a detached producer thread after the prefetcher
        // is gone (a lease borrows the prefetcher). So every block can go.
        for retired in self.retired.drain(..) {
            self.backend.release(retired.buffer.block);
        }
        if let Some(buffer) = self.current.take() {
            self.backend.release(buffer.block);
        }
    }
}

fn region<K>(buffer: &Buffer<K>, base: NonNull<u8>, bytes: usize) -> Region {
    // SAFETY: `base..base + bytes` lies in `buffer`'s block (callers check), which
    // the ring owns and hands to one batch at a time: the hand-off lets the producer
    // reuse a slot only after its previous batch was released. Every byte is
    // writable; zeroing makes the region initialised before anyone views it.
    unsafe { std::ptr::write_bytes(base.as_ptr(), 0, bytes) };
    Region { base, token: NonNull::from(&buffer.token) }
}

/// `bytes × (1 + headroom)`, rounded up to [`ARRAY_ALIGN`]; saturates instead of
/// overflowing (the budget check follows).
fn with_headroom(bytes: usize, headroom: f64) -> usize {
    let wanted = (bytes as f64 * (1.0 + headroom)).ceil();
    // `as` saturates at usize::MAX for values beyond it.
    let wanted = (wanted as usize).max(bytes);
    align_up(wanted, ARRAY_ALIGN).unwrap_or(usize::MAX / ARRAY_ALIGN * ARRAY_ALIGN)
}

#[cfg(test)]
mod tests {
    use workspace_core::HostBackend;

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
        assert_eq!(ring.retired.len(), 1, "the old block waits for its batches");
        ring.free_released(4);
        assert_eq!(ring.retired.len(), 1, "batch 4 still lives in it");
        ring.free_released(5);
        assert!(ring.retired.is_empty());
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
        assert_eq!(ring.retired.len(), 2);
        ring.free_released(1);
        assert_eq!(ring.retired.len(), 1);
        ring.end_epoch();
        assert!(ring.retired.is_empty());
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
        let err = ring.reserve(0, 2, usize::MAX / 2 / 64 * 64, &stats).unwrap_err();
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

    struct SkewedBlock(workspace_core::HostBlock);

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
            assert!(ring.current.is_none() && ring.retired.is_empty());
        }
    }

    #[test]
    fn headroom_rounds_up_and_saturates() {
        assert_eq!(with_headroom(64, 0.0), 64);
        assert_eq!(with_headroom(64, 0.01), 128);
        assert_eq!(with_headroom(usize::MAX / 2, 4.0), usize::MAX / 64 * 64);
    }
}
