//! Async prefetch for carve: a producer thread fills batches ahead of the training
//! loop into a ring workspace, and the loop borrows each batch in place.
//!
//! # A tour
//!
//! You implement a [`BatchSource`]: for each batch it describes the arrays
//! ([`BatchLayout`]: features, labels and optional masks of any `bytemuck::Pod`
//! element type and shape) and then fills them ([`BatchMut`]). A [`Prefetcher`] runs
//! the source on a background thread, `depth` batches ahead, in a ring whose size is
//! taken from the first batch. The loop calls [`Prefetcher::next`] and gets a
//! [`Lease`]: typed ndarray views of the batch, in the ring, with no copy.
//!
//! ```
//! use async_iter::{BatchLayout, BatchMut, BatchSource, Prefetcher, SourceError};
//! use ndarray::{Ix1, Ix2};
//!
//! /// 10 batches of 64 rows of 32 features; the last batch has 16 rows.
//! struct Synthetic;
//!
//! impl BatchSource for Synthetic {
//!     fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
//!         let rows = match index {
//!             0..=8 => 64,
//!             9 => 16,
//!             _ => return Ok(None), // end of the epoch
//!         };
//!         Ok(Some(BatchLayout::new().features::<f32, _>((rows, 32)).labels::<u32, _>(rows)))
//!     }
//!
//!     fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
//!         let index = batch.index();
//!         batch.features::<f32, Ix2>()?.fill(index as f32);
//!         batch.labels::<u32, Ix1>()?.fill(index as u32 % 10);
//!         Ok(())
//!     }
//! }
//!
//! let mut batches = Prefetcher::builder(Synthetic).depth(2).build()?;
//! for epoch in 0..3 {
//!     let mut rows = 0;
//!     while let Some(batch) = batches.next() {
//!         let batch = batch?; // a source error or panic arrives here, at its batch
//!         let x = batch.features::<f32, Ix2>()?; // a view into the ring
//!         let y = batch.labels::<u32, Ix1>()?;
//!         assert_eq!(x[[0, 0]], batch.index() as f32);
//!         rows += y.len();
//!     } // dropping the lease hands its slot back to the producer
//!     assert_eq!(rows, 9 * 64 + 16);
//!     if epoch < 2 {
//!         batches.reset()?; // the next epoch reuses the ring
//!     }
//! }
//! let stats = batches.stats();
//! assert_eq!(stats.first_batch_bytes, 64 * 32 * 4 + 256); // sized from the first batch
//! assert_eq!(stats.ring_bytes, 3 * stats.first_batch_bytes); // depth + 1 slots
//! assert_eq!(stats.ring_growths, 0);
//! assert_eq!(stats.batches_consumed, 30);
//! # Ok::<(), async_iter::Error>(())
//! ```
//!
//! | concept | type |
//! |---|---|
//! | what you implement | [`BatchSource`]: `next_layout`, `fill`, `reset`; or use [`InMemory`] (rows), [`Sequences`] (padded sequences) or [`TokenWindows`] (random windows of a token stream) |
//! | a batch's arrays | [`BatchLayout`], [`Role`], [`ElementType`] |
//! | filling a batch | [`BatchMut`] (writable views, zeroed) |
//! | configuration | [`Prefetcher::builder`] → [`PrefetcherBuilder`]: depth, workspace mode, headroom, [`Threading`], join timeout |
//! | one batch, borrowed | [`Lease`]: typed views; [`Lease::detach`] → [`DetachedBatch`] (owned); [`BatchArrays`] reads either (and a device's batches) |
//! | element types | any [`Pod`] (`bytemuck`'s, re-exported) |
//! | epochs | [`Prefetcher::next`], [`Prefetcher::reset`], [`Prefetcher::stop`] |
//! | what happened | [`PrefetchStats`], [`Error`] |
//!
//! # Guarantees
//!
//! - **No overwrite.** A lease borrows the prefetcher, so holding a batch across the
//!   next `next()` does not compile (see [`Lease`]); keep data with
//!   [`Lease::detach`]. The producer reuses a slot only after its batch was
//!   released, and a batch larger than a slot grows the ring into a new block,
//!   leaving queued and leased batches where they are.
//! - **Errors arrive.** An error or panic of the source ends the epoch and reaches the
//!   consumer as `Some(Err)` from `next()` at the batch where it happened, after every
//!   earlier batch; then `next()` returns `None` until [`Prefetcher::reset`].
//! - **Nothing hangs, nothing leaks.** Dropping the prefetcher, [`Prefetcher::stop`]
//!   and [`Prefetcher::reset`] stop the producer and join its thread; every wait of
//!   either side wakes on the other's progress, end, failure or stop. A source stuck
//!   inside a call cannot make them hang: they wait at most the
//!   [`join_timeout`](PrefetcherBuilder::join_timeout), then `stop` and `reset` return
//!   [`Error::SourceStuck`] and a drop returns all the same, leaving the thread
//!   detached; it finishes on its own, and its source and ring are released when it
//!   ends (see [`Prefetcher`]).
//! - **Panics are contained.** A panic of the source, even one whose payload panics
//!   again when dropped, is [`Error::SourcePanicked`] at its batch, and the next
//!   `reset()` starts a new epoch as after any other failure.
//! - **Flat memory.** After the first batch (and any larger one) the ring is not
//!   reallocated, and a steady epoch makes no heap allocation per batch with
//!   workspaces enabled.
//!
//! # The ring
//!
//! Batches live in a ring of `depth + 1` equal slots in one block: the batches queued
//! or being filled ahead, plus the one the consumer holds. The first batch sizes the
//! slots (its bytes times `1 + headroom`, rounded up to [`ARRAY_ALIGN`]); batch `n`
//! reuses the slot of batch `n - slots`, which the hand-off has seen released. A larger
//! batch grows the ring into a new block, and the old block is given back once its last
//! batch is released: a queued or leased batch is never moved. That bookkeeping is
//! [`SlotRing`](slot_ring::SlotRing), generic over its
//! [`SlotMemory`](slot_ring::SlotMemory), so that `workspace-cuda`'s device
//! prefetcher runs the same ring over device memory, where a slot may be written again
//! once an event recorded on the consumer's stream has passed (see [`slot_ring`]).
//!
//! The ring is not the circular workspace of `workspace_core`
//! ([`ResetPolicy::EndOfBuffer`](workspace_core::ResetPolicy::EndOfBuffer)), which is
//! ND4J's `ENDOFBUFFER_REACHED`, kept for code ported from ND4J that holds data across
//! cycles in one fixed buffer. Batches of varying size placed one after another in such
//! a buffer fragment it (a batch that does not fit the tail wastes the tail); equal
//! slots cannot, so the prefetchers do not use it.
//!
//! # Modes
//!
//! [`WorkspaceMode::None`](workspace_core::WorkspaceMode::None) gives every batch a
//! fresh heap block (the allocating baseline); [`Threading::Shield`] produces batches
//! inline in `next()` with no thread (for debugging a source), with the same API.
//!
//! # How the hand-off is checked
//!
//! The protocol between the two threads is a small piece of code (`handoff`) over a
//! `sync` module that swaps std primitives for loom's under `--cfg loom`; the loom
//! models in `tests/loom.rs` run that code (`RUSTFLAGS="--cfg loom" cargo test -p
//! async-iter --release --test loom`).

#![deny(unsafe_code)]
// A link that does not resolve renders as literal brackets: an error, in private docs too.
#![deny(rustdoc::broken_intra_doc_links, rustdoc::private_intra_doc_links)]

mod arrays;
mod detached;
mod error;
#[allow(unsafe_code)]
mod handoff;
mod in_memory;
mod layout;
#[allow(unsafe_code)]
mod lease;
mod prefetcher;
#[allow(unsafe_code)]
mod producer;
#[allow(unsafe_code)]
mod ring;
mod role;
mod sequences;
#[allow(unsafe_code)] // the `unsafe trait SlotMemory`; the ring itself has no unsafe code
pub mod slot_ring;
mod source;
mod stats;
#[allow(unsafe_code)]
#[doc(hidden)] // carve's own crates' std/loom switch, not a stable API
pub mod sync;
#[allow(unsafe_code)]
mod view;
mod windows;

/// A caught panic turned into an error: its message, and its payload dropped where a
/// panicking destructor must not escape. What the prefetcher does with a producer's
/// panic, for code of its own that catches panics of user code (carve's inference pool
/// does, for a layer's).
pub mod panics {
    pub use crate::error::{drop_quietly, panic_message};
}

pub use arrays::BatchArrays;
pub use bytemuck::Pod;
pub use detached::DetachedBatch;
pub use error::{Error, LayoutError, Result, SourceCall, SourceError};
pub use in_memory::InMemory;
pub use layout::{ArraySpec, BatchLayout, ElementType, ARRAY_ALIGN, MAX_DIMS};
pub use lease::Lease;
pub use prefetcher::{Prefetcher, PrefetcherBuilder, Threading, MAX_DEPTH};
pub use role::Role;
pub use sequences::Sequences;
pub use source::BatchSource;
pub use stats::PrefetchStats;
pub use view::BatchMut;
pub use windows::TokenWindows;
