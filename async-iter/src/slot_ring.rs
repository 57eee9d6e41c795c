//! The slot ring: the bookkeeping of a prefetch ring, shared by the host ring of a
//! [`Prefetcher`](crate::Prefetcher) and the device ring of `workspace-cuda`'s
//! `DevicePrefetcher`.
//!
//! A ring is `slots` equal slots in one block of memory; consecutive batches go to
//! consecutive slots, round and round. **Sizing**: the first batch sizes the ring: a
//! slot is its bytes times `1 + headroom`, rounded up to the memory's slot alignment
//! (and trimmed to the budget, if any), and the block is `slots` of them (a prefetcher
//! uses `depth + 1` slots: the batches queued or being filled ahead, plus the one the
//! consumer holds). **Growth**: a later batch larger than a slot gets a new block,
//! sized from that batch the same way, and the batches after it follow it there. The
//! old block is *retired*: it is kept, untouched, until every batch placed in it is
//! returned, then given back to the memory; batches are never moved or copied. The
//! ring never shrinks by itself.
//!
//! **When a slot may be written again.** Batch `n` reuses the slot of batch
//! `n - slots`. On the host the hand-off between producer and consumer guarantees that
//! batch is released before batch `n` is placed, so there is nothing to wait for
//! ([`SlotMemory::Fence`] is `()`). On a device the consumer's kernels may still read a
//! slot after its lease ended on the host: the slot's *fence* is an event recorded on
//! the consumer's stream, and the ring has the memory [`wait`](SlotMemory::wait) for it
//! before the slot is handed out again.
//!
//! Equal slots cannot fragment the way variable regions in a circular buffer do (see
//! `workspace_core::ResetPolicy::EndOfBuffer`): the last, smaller batch of an epoch and
//! batches of varying size all fit as long as they fit a slot.
//!
//! [`SlotRing`] only does the bookkeeping and computes offsets; what a block is, and
//! how to wait for a fence, is its [`SlotMemory`]'s.

use std::collections::VecDeque;
use std::fmt;

use crate::layout::align_up;

/// The memory a [`SlotRing`] cuts into slots: blocks, and fences that say when a slot
/// may be written again.
///
/// # Safety
///
/// Users of a [`SlotRing`] access memory at the offsets it computes, trusting that:
///
/// - a block returned by [`allocate_ring`](Self::allocate_ring) or
///   [`allocate_batch`](Self::allocate_batch) for `bytes` bytes holds at least `bytes`
///   bytes, starting at an address aligned to [`slot_align`](Self::slot_align), that
///   belong to the block alone until it is passed to [`release`](Self::release) or
///   [`release_all`](Self::release_all) (moving the block value does not move them);
/// - [`slot_align`](Self::slot_align) is a power of two and the same at every call;
/// - once [`wait`](Self::wait) returned `Ok`, writes into a slot issued after it are
///   ordered after the work that `fence` stands for.
pub unsafe trait SlotMemory {
    /// One allocation.
    type Block;
    /// What must be waited for before a slot is written again (`()` where the caller's
    /// own protocol guarantees it, as on the host).
    type Fence;
    /// The memory's error.
    type Error;

    /// The alignment of the block and of every slot: a power of two.
    fn slot_align(&self) -> usize;

    /// A block of at least `bytes` (> 0) bytes to cut into slots.
    ///
    /// # Errors
    ///
    /// The memory's, when it has none to give; the ring is unchanged then.
    fn allocate_ring(&mut self, bytes: usize) -> Result<Self::Block, Self::Error>;

    /// A block of at least `bytes` (> 0) bytes for one batch alone (see
    /// [`SlotRing::place_alone`]). Defaults to [`allocate_ring`](Self::allocate_ring).
    ///
    /// # Errors
    ///
    /// As [`allocate_ring`](Self::allocate_ring).
    fn allocate_batch(&mut self, bytes: usize) -> Result<Self::Block, Self::Error> {
        self.allocate_ring(bytes)
    }

    /// Orders the next writes into a slot after `fence`.
    ///
    /// # Errors
    ///
    /// The memory's; the slot is not handed out then, and the fence is kept.
    fn wait(&mut self, fence: &Self::Fence) -> Result<(), Self::Error>;

    /// Gives back blocks (at least one) whose batches are all returned.
    fn release(&mut self, blocks: impl Iterator<Item = Self::Block>);

    /// Gives back every block of a ring being dropped (at least one). Defaults to
    /// [`release`](Self::release).
    fn release_all(&mut self, blocks: impl Iterator<Item = Self::Block>) {
        self.release(blocks);
    }
}

/// Where a [`SlotRing`] placed one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Placement {
    /// Batches placed before this one, over the life of the ring.
    pub sequence: u64,
    /// The slot in its block (`None` for a batch placed alone).
    pub slot: Option<usize>,
    /// Bytes from the block's start to the batch's first byte.
    pub offset: usize,
}

/// Why a [`SlotRing`] could not place a batch; the ring is unchanged.
#[derive(Debug, PartialEq, Eq)]
pub enum RingError<E> {
    /// A ring whose slots hold the batch would exceed the budget (or the address space).
    TooLarge {
        /// Bytes of the smallest such ring (`usize::MAX` past the address space).
        ring_bytes: usize,
        /// The budget (`usize::MAX` for none).
        max_ring_bytes: usize,
    },
    /// The memory's error.
    Memory(E),
}

impl<E: fmt::Display> fmt::Display for RingError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RingError::TooLarge { ring_bytes, max_ring_bytes } => {
                write!(f, "a ring of {ring_bytes} bytes would exceed the limit of {max_ring_bytes} bytes")
            }
            RingError::Memory(error) => error.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for RingError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RingError::TooLarge { .. } => None,
            RingError::Memory(error) => Some(error),
        }
    }
}

/// The block new batches go to.
struct Current<M: SlotMemory> {
    block: M::Block,
    slot_bytes: usize,
    /// Sequence of the first batch placed in it.
    start: u64,
    /// Per slot: what to wait for before writing it again.
    fences: Box<[Option<M::Fence>]>,
}

/// A block no new batch goes to.
struct Retired<K> {
    block: K,
    /// Every batch placed in it has a smaller sequence.
    free_after: u64,
}

/// Equal slots in a block, sized from the first batch, growing into a new block for a
/// larger one; see the [module docs](self).
///
/// The ring guarantees its users that the `slot_bytes()` bytes at a placement's
/// `offset` lie inside the block returned with it (`offset + slot_bytes() <=` the
/// bytes asked of [`SlotMemory::allocate_ring`]; a batch placed alone has its block to
/// itself), and that a block is given back only once every batch placed in it was
/// returned ([`returned`](Self::returned), [`returned_until`](Self::returned_until),
/// [`all_returned`](Self::all_returned)), or when the ring is dropped. Within one block
/// batch `n` takes the slot of batch `n - slots`, after waiting for the fence that
/// batch was returned with.
pub struct SlotRing<M: SlotMemory> {
    memory: M,
    slots: usize,
    headroom: f64,
    max_ring_bytes: Option<usize>,
    /// `None` before the first batch (and while batches are placed alone).
    current: Option<Current<M>>,
    /// In order of `free_after`.
    retired: VecDeque<Retired<M::Block>>,
    /// Batches placed so far.
    placed: u64,
    /// Every batch before this one was returned.
    returned: u64,
    growths: u64,
}

impl<M: SlotMemory> SlotRing<M> {
    /// A ring of `slots` (≥ 1) slots, each `1 + headroom` (finite, ≥ 0) times the batch
    /// that sized it, in blocks of at most `max_ring_bytes` (`None`: no limit). It
    /// allocates nothing before the first batch.
    ///
    /// # Panics
    ///
    /// When `slots` is 0 or `headroom` is negative or not finite.
    pub fn new(memory: M, slots: usize, headroom: f64, max_ring_bytes: Option<usize>) -> Self {
        assert!(slots >= 1, "a ring needs a slot");
        assert!(headroom.is_finite() && headroom >= 0.0, "headroom {headroom} is not finite and at least 0");
        SlotRing {
            memory,
            slots,
            headroom,
            max_ring_bytes,
            current: None,
            retired: VecDeque::new(),
            placed: 0,
            returned: 0,
            growths: 0,
        }
    }

    /// The memory.
    pub fn memory(&self) -> &M {
        &self.memory
    }

    /// Slots per block.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes of one slot now (0 before the first batch).
    pub fn slot_bytes(&self) -> usize {
        self.current.as_ref().map_or(0, |current| current.slot_bytes)
    }

    /// Bytes of the current block (0 before the first batch).
    pub fn ring_bytes(&self) -> usize {
        self.slot_bytes() * self.slots
    }

    /// Times a larger batch grew the ring into a new block (the first sizing is not
    /// counted).
    pub fn growths(&self) -> u64 {
        self.growths
    }

    /// Batches placed so far: the sequence of the next one.
    pub fn placed(&self) -> u64 {
        self.placed
    }

    /// Retired blocks not given back yet.
    pub fn retired_blocks(&self) -> usize {
        self.retired.len()
    }

    /// A slot for a batch of `bytes` (> 0) bytes, in the block returned with it: the
    /// next slot of the current block, or the first of a new one when the batch does
    /// not fit (the current block is retired then). Waits for the slot's fence first.
    ///
    /// # Errors
    ///
    /// [`RingError::TooLarge`] past the budget; [`RingError::Memory`] when the memory
    /// cannot allocate or wait. Nothing is placed then.
    pub fn place(&mut self, bytes: usize) -> Result<(&M::Block, Placement), RingError<M::Error>> {
        debug_assert!(bytes > 0);
        if self.current.as_ref().is_none_or(|current| current.slot_bytes < bytes) {
            self.grow(bytes)?;
        }
        let current = self.current.as_mut().expect("grown above");
        let slot = ((self.placed - current.start) % self.slots as u64) as usize;
        if let Some(fence) = &current.fences[slot] {
            self.memory.wait(fence).map_err(RingError::Memory)?;
        }
        current.fences[slot] = None;
        let placement = Placement { sequence: self.placed, slot: Some(slot), offset: slot * current.slot_bytes };
        self.placed += 1;
        Ok((&current.block, placement))
    }

    /// A block of its own for a batch of `bytes` (> 0) bytes, from
    /// [`SlotMemory::allocate_batch`], given back once the batch is returned: the
    /// allocating baseline that rings are measured against.
    ///
    /// # Errors
    ///
    /// [`RingError::TooLarge`] when a ring of such batches would pass its budget (as
    /// [`SlotRing::place`] refuses them); [`RingError::Memory`] when the memory cannot
    /// allocate; nothing is placed then.
    pub fn place_alone(&mut self, bytes: usize) -> Result<(&M::Block, Placement), RingError<M::Error>> {
        debug_assert!(bytes > 0);
        // The budget of a ring of these batches holds here too: a mode changes where a
        // batch lives, never which batches are refused.
        self.slot_within_budget(bytes)?;
        let block = self.memory.allocate_batch(bytes).map_err(RingError::Memory)?;
        let placement = Placement { sequence: self.placed, slot: None, offset: 0 };
        self.placed += 1;
        self.retired.push_back(Retired { block, free_after: self.placed });
        Ok((&self.retired.back().expect("pushed above").block, placement))
    }

    /// The bytes of a slot that holds `bytes` (aligned), when a ring of such slots fits
    /// the budget.
    ///
    /// # Errors
    ///
    /// [`RingError::TooLarge`] otherwise.
    fn slot_within_budget(&self, bytes: usize) -> Result<usize, RingError<M::Error>> {
        let max_ring_bytes = self.max_ring_bytes.unwrap_or(usize::MAX);
        let too_large = |ring_bytes| RingError::TooLarge { ring_bytes, max_ring_bytes };
        let needed = align_up(bytes, self.memory.slot_align()).ok_or(too_large(usize::MAX))?;
        let min_ring = needed.checked_mul(self.slots).ok_or(too_large(usize::MAX))?;
        if min_ring > max_ring_bytes {
            return Err(too_large(min_ring));
        }
        Ok(needed)
    }

    /// Installs a block whose slots hold `bytes`, retiring the current one.
    #[cold]
    #[inline(never)]
    fn grow(&mut self, bytes: usize) -> Result<(), RingError<M::Error>> {
        let align = self.memory.slot_align();
        let max_ring_bytes = self.max_ring_bytes.unwrap_or(usize::MAX);
        let needed = self.slot_within_budget(bytes)?;
        // Headroom is a wish that the budget (or the address space) may trim; the batch
        // itself fits: `needed <= max_ring_bytes / slots`, a multiple of `align`.
        let max_slot = max_ring_bytes / self.slots / align * align;
        let slot_bytes = with_headroom(needed, self.headroom, align).min(max_slot);
        debug_assert!(slot_bytes >= bytes);
        let ring_bytes = slot_bytes * self.slots; // <= max_ring_bytes: no overflow
        let block = self.memory.allocate_ring(ring_bytes).map_err(RingError::Memory)?;
        let fences = (0..self.slots).map(|_| None).collect();
        let current = Current { block, slot_bytes, start: self.placed, fences };
        if let Some(old) = self.current.replace(current) {
            // Batches before this one may live in the old block; none after will.
            self.retired.push_back(Retired { block: old.block, free_after: self.placed });
            self.growths += 1;
        }
        Ok(())
    }

    /// The batch at `placement` is returned, and every batch placed before it: its slot
    /// may be written again once `fence` is waited for (`None`: at once).
    pub fn returned(&mut self, placement: Placement, fence: Option<M::Fence>) {
        if let (Some(current), Some(slot)) = (self.current.as_mut(), placement.slot) {
            if placement.sequence >= current.start {
                current.fences[slot] = fence;
            }
        }
        self.returned_until(placement.sequence + 1);
    }

    /// Every batch whose sequence is below `sequence` is returned, and needs no fence.
    pub fn returned_until(&mut self, sequence: u64) {
        self.returned = self.returned.max(sequence);
        let returned = self.returned;
        let done = self.retired.iter().take_while(|retired| retired.free_after <= returned).count();
        if done > 0 {
            self.memory.release(self.retired.drain(..done).map(|retired| retired.block));
        }
    }

    /// Every batch placed so far is returned (an epoch ended): retired blocks go back.
    pub fn all_returned(&mut self) {
        self.returned_until(self.placed);
    }
}

impl<M: SlotMemory> Drop for SlotRing<M> {
    fn drop(&mut self) {
        if self.current.is_some() || !self.retired.is_empty() {
            let retired = self.retired.drain(..).map(|retired| retired.block);
            let blocks = retired.chain(self.current.take().map(|current| current.block));
            self.memory.release_all(blocks);
        }
    }
}

impl<M: SlotMemory> fmt::Debug for SlotRing<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotRing")
            .field("slots", &self.slots)
            .field("slot_bytes", &self.slot_bytes())
            .field("placed", &self.placed)
            .field("returned", &self.returned)
            .field("retired_blocks", &self.retired.len())
            .field("growths", &self.growths)
            .finish_non_exhaustive()
    }
}

/// `bytes × (1 + headroom)`, rounded up to `align`; saturates instead of overflowing
/// (the budget check follows).
fn with_headroom(bytes: usize, headroom: f64, align: usize) -> usize {
    let wanted = (bytes as f64 * (1.0 + headroom)).ceil();
    // `as` saturates at usize::MAX for values beyond it.
    let wanted = (wanted as usize).max(bytes);
    align_up(wanted, align).unwrap_or(usize::MAX / align * align)
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;

    #[derive(Debug, PartialEq, Eq)]
    enum Call {
        Allocate(usize),
        Alone(usize),
        Wait(u32),
        Release(Vec<usize>),
        ReleaseAll(Vec<usize>),
    }

    /// Blocks are numbers; fences are numbers; every call is logged.
    #[derive(Default)]
    struct Fake {
        calls: Vec<Call>,
        blocks: usize,
    }

    // SAFETY: no memory: tests only look at offsets and calls.
    unsafe impl SlotMemory for Fake {
        type Block = usize;
        type Fence = u32;
        type Error = Infallible;
        fn slot_align(&self) -> usize {
            64
        }
        fn allocate_ring(&mut self, bytes: usize) -> Result<usize, Infallible> {
            self.calls.push(Call::Allocate(bytes));
            self.blocks += 1;
            Ok(self.blocks)
        }
        fn allocate_batch(&mut self, bytes: usize) -> Result<usize, Infallible> {
            self.calls.push(Call::Alone(bytes));
            self.blocks += 1;
            Ok(self.blocks)
        }
        fn wait(&mut self, fence: &u32) -> Result<(), Infallible> {
            self.calls.push(Call::Wait(*fence));
            Ok(())
        }
        fn release(&mut self, blocks: impl Iterator<Item = usize>) {
            self.calls.push(Call::Release(blocks.collect()));
        }
        fn release_all(&mut self, blocks: impl Iterator<Item = usize>) {
            self.calls.push(Call::ReleaseAll(blocks.collect()));
        }
    }

    fn place(ring: &mut SlotRing<Fake>, bytes: usize) -> (usize, Placement) {
        let (block, placement) = ring.place(bytes).unwrap();
        (*block, placement)
    }

    fn calls(ring: &mut SlotRing<Fake>) -> Vec<Call> {
        std::mem::take(&mut ring.memory.calls)
    }

    #[test]
    fn slots_cycle_in_a_block_sized_from_the_first_batch() {
        let mut ring = SlotRing::new(Fake::default(), 3, 0.5, None);
        let offsets: Vec<_> = (0..4).map(|_| place(&mut ring, 100)).collect();
        // 100 × 1.5 = 150, rounded up to 64: 192 per slot.
        assert_eq!(calls(&mut ring), [Call::Allocate(3 * 192)]);
        assert_eq!((ring.slot_bytes(), ring.ring_bytes()), (192, 576));
        let slots: Vec<_> = offsets.iter().map(|(block, p)| (*block, p.slot, p.offset, p.sequence)).collect();
        assert_eq!(slots, [(1, Some(0), 0, 0), (1, Some(1), 192, 1), (1, Some(2), 384, 2), (1, Some(0), 0, 3)]);
        // Up to the headroom a batch fits.
        assert_eq!(place(&mut ring, 192).1.slot, Some(1));
        assert_eq!((ring.growths(), ring.placed()), (0, 5));
    }

    #[test]
    fn growth_retires_blocks_and_frees_them_in_order_once_their_batches_are_returned() {
        let mut ring = SlotRing::new(Fake::default(), 2, 0.0, None);
        place(&mut ring, 64); // 0 in block 1
        place(&mut ring, 64); // 1 in block 1
        let (block, grown) = place(&mut ring, 128); // 2 starts block 2 at its slot 0
        assert_eq!((block, grown.slot, grown.offset), (2, Some(0), 0));
        let (block, _) = place(&mut ring, 256); // 3 starts block 3
        assert_eq!(block, 3);
        assert_eq!(place(&mut ring, 64).0, 3, "a smaller batch stays in the larger block");
        assert_eq!(calls(&mut ring), [Call::Allocate(128), Call::Allocate(256), Call::Allocate(512)]);
        assert_eq!((ring.growths(), ring.retired_blocks()), (2, 2));

        ring.returned_until(1);
        assert!(calls(&mut ring).is_empty(), "batch 1 still lives in block 1");
        ring.returned_until(2);
        assert_eq!(calls(&mut ring), [Call::Release(vec![1])]);
        ring.returned_until(1);
        assert!(calls(&mut ring).is_empty(), "returning is monotonic");
        ring.all_returned();
        assert_eq!(calls(&mut ring), [Call::Release(vec![2])]);
        assert_eq!(ring.retired_blocks(), 0);
        drop(ring);
    }

    #[test]
    fn both_retired_blocks_go_at_once_when_the_last_batch_in_either_is_returned() {
        let mut ring = SlotRing::new(Fake::default(), 2, 0.0, None);
        place(&mut ring, 64);
        place(&mut ring, 128);
        place(&mut ring, 192);
        calls(&mut ring);
        ring.returned(Placement { sequence: 1, slot: Some(0), offset: 0 }, None);
        assert_eq!(calls(&mut ring), [Call::Release(vec![1, 2])]);
    }

    #[test]
    fn a_slot_is_handed_out_again_only_after_its_fence() {
        let mut ring = SlotRing::new(Fake::default(), 2, 0.0, None);
        let (_, first) = place(&mut ring, 64);
        let (_, second) = place(&mut ring, 64);
        ring.returned(first, Some(7));
        ring.returned(second, None);
        calls(&mut ring);
        assert_eq!(place(&mut ring, 64).1.slot, Some(0));
        assert_eq!(calls(&mut ring), [Call::Wait(7)]);
        assert_eq!(place(&mut ring, 64).1.slot, Some(1));
        assert!(calls(&mut ring).is_empty(), "returned without a fence");
        assert_eq!(place(&mut ring, 64).1.slot, Some(0));
        assert!(calls(&mut ring).is_empty(), "a fence is waited for once");
        // A fence of a batch in a retired block does not land on the new block's slot.
        let (_, old) = place(&mut ring, 64);
        let (block, new) = place(&mut ring, 128);
        assert_eq!((block, new.slot), (2, Some(0)));
        ring.returned(old, Some(8));
        ring.returned(new, Some(9));
        calls(&mut ring);
        place(&mut ring, 64);
        place(&mut ring, 64);
        assert_eq!(calls(&mut ring), [Call::Wait(9)]);
    }

    #[test]
    fn batches_placed_alone_have_their_own_blocks_until_returned() {
        let mut ring = SlotRing::new(Fake::default(), 2, 0.0, None);
        let (a, pa) = ring.place_alone(64).map(|(block, p)| (*block, p)).unwrap();
        let (b, pb) = ring.place_alone(100).map(|(block, p)| (*block, p)).unwrap();
        assert_ne!(a, b);
        assert_eq!((pa.slot, pa.offset, pb.sequence), (None, 0, 1));
        assert_eq!(ring.ring_bytes(), 0);
        ring.returned_until(1);
        assert_eq!(calls(&mut ring), [Call::Alone(64), Call::Alone(100), Call::Release(vec![a])]);
        drop(ring); // b is given back with the ring
    }

    #[test]
    fn the_ring_gives_everything_back_when_dropped() {
        let mut fake = Fake::default();
        {
            let mut ring = SlotRing::new(&mut fake, 2, 0.0, None);
            ring.place(64).unwrap();
            ring.place(128).unwrap();
        }
        assert_eq!(fake.calls.last(), Some(&Call::ReleaseAll(vec![1, 2])));
        let mut fake = Fake::default();
        drop(SlotRing::new(&mut fake, 2, 0.0, None));
        assert!(fake.calls.is_empty(), "nothing allocated, nothing released");
    }

    // SAFETY: forwards to `Fake`.
    unsafe impl SlotMemory for &mut Fake {
        type Block = usize;
        type Fence = u32;
        type Error = Infallible;
        fn slot_align(&self) -> usize {
            (**self).slot_align()
        }
        fn allocate_ring(&mut self, bytes: usize) -> Result<usize, Infallible> {
            (**self).allocate_ring(bytes)
        }
        fn wait(&mut self, fence: &u32) -> Result<(), Infallible> {
            (**self).wait(fence)
        }
        fn release(&mut self, blocks: impl Iterator<Item = usize>) {
            (**self).release(blocks);
        }
        fn release_all(&mut self, blocks: impl Iterator<Item = usize>) {
            (**self).release_all(blocks);
        }
    }

    #[test]
    fn the_budget_trims_headroom_and_refuses_what_cannot_fit() {
        let mut ring = SlotRing::new(Fake::default(), 3, 1.0, Some(3 * 256));
        place(&mut ring, 192);
        assert_eq!(ring.slot_bytes(), 256, "headroom trimmed to the budget");
        let err = ring.place(320).unwrap_err();
        assert_eq!(err, RingError::TooLarge { ring_bytes: 3 * 320, max_ring_bytes: 768 });
        assert_eq!(ring.ring_bytes(), 768, "the ring is unchanged");
        let err = ring.place(usize::MAX / 2).unwrap_err();
        assert_eq!(err, RingError::TooLarge { ring_bytes: usize::MAX, max_ring_bytes: 768 });
        let err = ring.place(usize::MAX).unwrap_err();
        assert_eq!(err, RingError::TooLarge { ring_bytes: usize::MAX, max_ring_bytes: 768 });
        assert_eq!(ring.placed(), 1);
    }

    #[test]
    fn headroom_rounds_up_and_saturates() {
        assert_eq!(with_headroom(64, 0.0, 64), 64);
        assert_eq!(with_headroom(64, 0.01, 64), 128);
        assert_eq!(with_headroom(300, 0.0, 256), 512);
        assert_eq!(with_headroom(usize::MAX / 2, 4.0, 64), usize::MAX / 64 * 64);
    }
}
