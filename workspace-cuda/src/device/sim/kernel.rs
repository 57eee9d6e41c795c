//! Kernels on the simulator: host code that runs in a stream's order on simulated
//! device memory, reached through [`SimAccess`], which checks every range it hands out.
//!
//! A kernel is plain data ([`SimKernel`]: `Copy`, at most [`MAX_KERNEL_BYTES`]) stored
//! in the stream's queue as bytes next to a function that reads it back as its type, so
//! a launch allocates nothing (a queue that has grown to its steady length does not
//! grow again): the simulated step counts no heap allocations a real one would not.
//!
//! Every range a kernel touches is checked against the allocation registry under the
//! memory lock, as the copies are: out of bounds or after free is a fault (the
//! simulator's `CUDA_ERROR_ILLEGAL_ADDRESS`), never host memory that is gone. A range
//! written must overlap no other range of the same call (CUDA's `__restrict__`), which
//! is what lets the slices be handed out together. A kernel that panics is a fault too,
//! and the stream goes on.

use std::mem::{align_of, size_of, MaybeUninit};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use super::memory::Memory;

/// The largest kernel (its arguments) a launch carries inline.
pub const MAX_KERNEL_BYTES: usize = 128;

/// Work the simulator runs on a stream, in its order, on simulated device memory.
///
/// The arguments are the value itself: device addresses (`u64`), sizes and scalars.
/// [`SimKernel::run`] asks [`SimAccess::io`] for the ranges it reads and writes and
/// computes on them; an `Err` is recorded as a fault of the stream (as
/// [`SimDevice::faults`](super::SimDevice::faults) reports), and so is a panic.
pub trait SimKernel: Copy + Send + Sync + 'static {
    /// The kernel's name in faults.
    fn name(&self) -> &'static str;
    /// Runs the kernel.
    ///
    /// # Errors
    ///
    /// A message naming what went wrong: a range [`SimAccess::io`] refused, a size
    /// that does not add up.
    fn run(&self, memory: &mut SimAccess<'_>) -> Result<(), String>;
}

/// A range of simulated device memory a kernel reads or writes: its address and its
/// length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes {
    /// The first byte's device address.
    pub address: u64,
    /// The number of bytes.
    pub len: usize,
}

impl Bytes {
    /// `count` values of `T` at `address`; `None` when the byte count overflows.
    pub fn of<T>(address: u64, count: usize) -> Option<Bytes> {
        Some(Bytes { address, len: count.checked_mul(size_of::<T>())? })
    }

    fn end(self) -> u64 {
        self.address.saturating_add(self.len as u64)
    }

    fn overlaps(self, other: Bytes) -> bool {
        self.len > 0 && other.len > 0 && self.address < other.end() && other.address < self.end()
    }
}

/// The simulated device memory, for the duration of one kernel.
pub struct SimAccess<'m> {
    memory: &'m mut Memory,
}

impl SimAccess<'_> {
    /// The bytes of `reads` (shared) and of `writes` (exclusive), each checked to lie in
    /// one live allocation; every write range must overlap no other range of the call
    /// (reads may overlap each other). Cast them to the element types with `bytemuck`'s
    /// `try_cast_slice` (a misaligned range is then an error, not undefined behaviour).
    ///
    /// # Errors
    ///
    /// A message naming the range that is out of bounds, freed, or overlapping.
    #[allow(clippy::type_complexity)]
    pub fn io<const R: usize, const W: usize>(
        &mut self,
        reads: [Bytes; R],
        writes: [Bytes; W],
    ) -> Result<([&[u8]; R], [&mut [u8]; W]), String> {
        for (i, w) in writes.iter().enumerate() {
            let clash =
                reads.iter().chain(writes.iter().take(i)).chain(writes.iter().skip(i + 1)).find(|o| w.overlaps(**o));
            if let Some(other) = clash {
                return Err(format!(
                    "{} bytes written at {:#x} overlap {} bytes at {:#x} of the same kernel",
                    w.len, w.address, other.len, other.address
                ));
            }
        }
        // An empty range is an empty slice wherever it points (a kernel's optional
        // operand, left at address 0).
        let mut read_at = [None; R];
        for (slot, r) in read_at.iter_mut().zip(reads).filter(|(_, r)| r.len > 0) {
            *slot = Some(self.memory.region(r.address, r.len)?);
        }
        let mut write_at = [None; W];
        for (slot, w) in write_at.iter_mut().zip(writes).filter(|(_, w)| w.len > 0) {
            *slot = Some(self.memory.region(w.address, w.len)?);
        }
        // Every pointer comes from `Vec::as_mut_ptr`, which does not assert uniqueness
        // of the buffer, so deriving several from one allocation is allowed.
        let regions = &mut self.memory.regions;
        let mut base = |start: u64| regions.get_mut(&start).map(Vec::as_mut_ptr).expect("located above");
        let read_slices = std::array::from_fn(|i| {
            let Some((start, offset)) = read_at[i] else { return &[][..] };
            let len = reads[i].len;
            // SAFETY: `offset..offset + len` lies in the allocation at `start` (checked by
            // `locate`), which stays put while `self` (the memory lock) is borrowed; no
            // range written in this call overlaps it (checked above), so nothing writes
            // these bytes while the shared slice lives.
            unsafe { std::slice::from_raw_parts(base(start).add(offset).cast_const(), len) }
        });
        let write_slices = std::array::from_fn(|i| {
            let Some((start, offset)) = write_at[i] else { return &mut [][..] };
            let len = writes[i].len;
            // SAFETY: as above; the range overlaps no other range of the call, so this is
            // the only slice of these bytes.
            unsafe { std::slice::from_raw_parts_mut(base(start).add(offset), len) }
        });
        Ok((read_slices, write_slices))
    }
}

/// A kernel in the queue: its bytes and the function that reads them back as its type.
pub(super) struct QueuedKernel {
    data: MaybeUninit<[u64; MAX_KERNEL_BYTES / 8]>,
    run: fn(&MaybeUninit<[u64; MAX_KERNEL_BYTES / 8]>, &mut SimAccess<'_>) -> Result<(), String>,
    pub(super) name: &'static str,
}

impl QueuedKernel {
    pub(super) fn new<K: SimKernel>(kernel: K) -> QueuedKernel {
        const { assert!(size_of::<K>() <= MAX_KERNEL_BYTES && align_of::<K>() <= 8, "a kernel's arguments fit inline") };
        let mut data = MaybeUninit::<[u64; MAX_KERNEL_BYTES / 8]>::uninit();
        // SAFETY: the buffer is at least `size_of::<K>()` bytes and 8-aligned (checked
        // above at compile time), so a `K` fits at its start.
        unsafe { ptr::write(data.as_mut_ptr().cast::<K>(), kernel) };
        QueuedKernel { data, run: run_as::<K>, name: kernel.name() }
    }

    /// Runs the kernel; a panic is an error, not a dead stream.
    pub(super) fn run(&self, memory: &mut Memory) -> Result<(), String> {
        let mut access = SimAccess { memory };
        catch_unwind(AssertUnwindSafe(|| (self.run)(&self.data, &mut access)))
            .unwrap_or_else(|_| Err("the kernel panicked".to_string()))
    }
}

/// Reads the kernel back as `K` (what [`QueuedKernel::new`] stored with this function)
/// and runs it.
fn run_as<K: SimKernel>(
    data: &MaybeUninit<[u64; MAX_KERNEL_BYTES / 8]>,
    access: &mut SimAccess<'_>,
) -> Result<(), String> {
    // SAFETY: `QueuedKernel::new::<K>` wrote a `K` at the start of `data` and pairs it
    // with `run_as::<K>` only; `K: Copy`, so reading it out leaves nothing to drop twice.
    let kernel = unsafe { ptr::read(data.as_ptr().cast::<K>()) };
    kernel.run(access)
}
