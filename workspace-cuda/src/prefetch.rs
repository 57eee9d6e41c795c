//! Device prefetch: batches filled ahead in pinned host memory by an
//! [`async_iter::Prefetcher`], copied into a ring of device slots on a copy stream of
//! their own, and lent to the training loop as typed device views.
//!
//! See [`DevicePrefetcher`] for the pipeline and its ordering rules.

mod batch;
mod ring;

use std::mem::{self, ManuallyDrop};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_iter::{BatchSource, PrefetchStats, Prefetcher, Threading};

use batch::{BatchInfo, Leased};
pub use batch::{DeviceBatch, DeviceLease};
use ring::{DeviceRing, DeviceSlots};

use crate::backend::{InFlight, PinnedBackend};
use crate::device::Device;
use crate::error::{DeviceError, Error, Result};
use crate::memory::RING;

/// Configures a [`DevicePrefetcher`]; from [`DevicePrefetcher::builder`].
///
/// ```
/// use std::time::Duration;
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::{Device, DevicePrefetcher};
/// # use async_iter::{BatchLayout, BatchMut, BatchSource, SourceError};
/// # struct Empty;
/// # impl BatchSource for Empty {
/// #     fn next_layout(&mut self, _: usize) -> Result<Option<BatchLayout>, SourceError> { Ok(None) }
/// #     fn fill(&mut self, _: &mut BatchMut<'_>) -> Result<(), SourceError> { Ok(()) }
/// # }
///
/// let gpu = SimDevice::new()?;
/// let compute = gpu.new_stream()?;
/// let batches = DevicePrefetcher::builder(Empty, &gpu)
///     .depth(3)                  // batches ready ahead (default 2); both rings have depth + 1 slots
///     .headroom(0.25)            // slots 25% larger than the first batch
///     .max_ring_bytes(1 << 30)   // bound on the pinned host ring
///     .stream(&compute)          // where the batches are used (default: the device's default stream)
///     .join_timeout(Duration::from_secs(1)) // longest wait for a source stuck in a call
///     .build()?;                 // the copy stream is a new stream unless `.copy_stream(..)` names one
/// assert_eq!(batches.stats().host.slots, 4);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until `build()`"]
pub struct DevicePrefetcherBuilder<S, D: Device> {
    source: S,
    device: D,
    stream: Option<D::Stream>,
    copy_stream: Option<D::Stream>,
    depth: usize,
    headroom: f64,
    max_ring_bytes: Option<usize>,
    threading: Threading,
    join_timeout: Option<Duration>,
}

impl<S: BatchSource, D: Device> DevicePrefetcherBuilder<S, D> {
    /// Batches the producer may have ready ahead (default 2; as
    /// [`PrefetcherBuilder::depth`](async_iter::PrefetcherBuilder::depth)). The host ring
    /// and the device ring have `depth + 1` slots each.
    pub fn depth(mut self, depth: usize) -> Self {
        self.depth = depth;
        self
    }

    /// Extra room per slot of both rings, as a fraction of the first batch (default 0).
    pub fn headroom(mut self, headroom: f64) -> Self {
        self.headroom = headroom;
        self
    }

    /// The largest pinned host ring allowed, in bytes (default: no limit). Page-locked
    /// memory cannot be paged out, so bound it where batches may be large.
    pub fn max_ring_bytes(mut self, bytes: usize) -> Self {
        self.max_ring_bytes = Some(bytes);
        self
    }

    /// Background producer thread (default), or [`Threading::Shield`] to fill batches
    /// inline in `next()` while debugging a source.
    pub fn threading(mut self, threading: Threading) -> Self {
        self.threading = threading;
        self
    }

    /// How long stopping, resetting or dropping waits for the producer thread (default
    /// 5 s; as [`PrefetcherBuilder::join_timeout`](async_iter::PrefetcherBuilder::join_timeout)).
    /// See [`DevicePrefetcher`] for a source that does not return in time.
    pub fn join_timeout(mut self, timeout: Duration) -> Self {
        self.join_timeout = Some(timeout);
        self
    }

    /// The consumer's stream: where the batches are used (default: the device's
    /// default stream).
    pub fn stream(mut self, stream: &D::Stream) -> Self {
        self.stream = Some(stream.clone());
        self
    }

    /// The stream the copies run on (default: a new stream). It must differ from the
    /// consumer's stream, or the copies could not overlap the consumer's work.
    pub fn copy_stream(mut self, stream: &D::Stream) -> Self {
        self.copy_stream = Some(stream.clone());
        self
    }

    /// Builds the prefetcher and starts the first epoch.
    ///
    /// # Errors
    ///
    /// [`Error::Prefetch`] with `InvalidConfig` for a bad depth or headroom, or a copy
    /// stream equal to the consumer's stream, and with `Spawn` when the producer thread
    /// cannot start; [`Error::StreamMismatch`] for a stream of another device;
    /// [`Error::Device`] when the copy stream cannot be created.
    pub fn build(self) -> Result<DevicePrefetcher<S, D>> {
        let device = self.device;
        let consumer = self.stream.unwrap_or_else(|| device.default_stream());
        let copy = match self.copy_stream {
            Some(stream) => stream,
            None => device.new_stream().map_err(|source| Error::Device {
                workspace: RING.into(),
                action: "creating the copy stream",
                source,
            })?,
        };
        for stream in [&consumer, &copy] {
            if !device.owns_stream(stream) {
                return Err(Error::StreamMismatch {
                    workspace: RING.into(),
                    action: "building a device prefetcher",
                    detail: format!("{stream:?} does not belong to {}", device.describe()),
                });
            }
        }
        if consumer == copy {
            let reason = format!(
                "the copy stream is the consumer's stream ({copy:?}), so copies could not overlap the \
                 consumer's work; leave `copy_stream` unset for a new stream"
            );
            return Err(async_iter::Error::InvalidConfig { reason }.into());
        }
        let backend = PinnedBackend::new(device.clone(), Arc::new(Mutex::new(InFlight::new())));
        let mut host = Prefetcher::builder(self.source)
            .depth(self.depth)
            .headroom(self.headroom)
            .threading(self.threading)
            .backend(backend);
        if let Some(bytes) = self.max_ring_bytes {
            host = host.max_ring_bytes(bytes);
        }
        if let Some(timeout) = self.join_timeout {
            host = host.join_timeout(timeout);
        }
        let host = host.build()?;
        let ring = DeviceRing::new(device, consumer, copy, self.depth + 1, self.headroom);
        Ok(DevicePrefetcher {
            host: ManuallyDrop::new(host),
            side: Side { ring, ahead: Ahead::Start, leased: None, broken: None },
        })
    }
}

/// Statistics of a [`DevicePrefetcher`]: the host prefetcher's, and the device ring's.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct DevicePrefetchStats {
    /// The host side: pinned ring, batches produced and consumed, waits.
    pub host: PrefetchStats,
    /// Bytes of the device ring now (0 before the first batch).
    pub device_ring_bytes: usize,
    /// Bytes of one device slot now.
    pub device_slot_bytes: usize,
    /// Times a batch larger than a device slot grew the device ring (the first sizing is
    /// not counted).
    pub device_ring_growths: u64,
    /// Host-to-device copies issued, over all epochs (one per batch).
    pub copies_issued: u64,
    /// Bytes those copies moved.
    pub bytes_copied: u64,
}

/// Batches prefetched into device memory.
///
/// A producer thread fills batches into a host ring of page-locked memory (the
/// prefetcher's ring over a [`PinnedBackend`]). When [`DevicePrefetcher::next`] hands out
/// batch `k`, it first issues the host-to-device copy of batch `k + 1` on the copy stream
/// if the producer has it ready, so that copy runs while the consumer's kernels work on
/// batch `k`:
///
/// ```text
/// producer thread   fill k+2    fill k+3    fill k+4     (pinned host ring, depth ahead)
/// copy stream       copy k+1    copy k+2    copy k+3     (pinned slot -> device slot)
/// consumer stream   use k       use k+1     use k+2      (kernels read the device slot)
/// ```
///
/// A batch `k + 1` that is not ready yet is not waited for: `k` is handed out at once, and
/// the copy of `k + 1` is issued by the next call (so a source that produces a batch only
/// after the consumer has used the one before it never deadlocks; such a batch's copy
/// does not overlap the work on the batch before it).
///
/// # Ordering
///
/// - The consumer's stream waits for the event recorded after a batch's copy before the
///   lease is handed out.
/// - A device slot is written again only after an event recorded on the consumer's
///   stream when the lease of its previous batch ended: the copy stream waits for it, so
///   a copy never overwrites memory a kernel may still read.
/// - A pinned host slot goes back to the producer only once its copy's event has
///   completed (the host waits for it in the next `next()`, by which time it has usually
///   long completed); stopping, resetting and dropping wait for the copy in flight first.
/// - The device ring is allocated and freed on the consumer's stream, and is freed only
///   after the consumer's stream has waited for the copy stream.
///
/// The device ring has `depth + 1` slots sized from the first batch; a larger batch grows it
/// into a new block (counted in [`DevicePrefetchStats::device_ring_growths`]), and the
/// old block is freed once its last batch is handed back.
///
/// # A source that does not return
///
/// As with the host [`Prefetcher`]: stopping, resetting and dropping wait for the copy
/// in flight, then at most the [`join_timeout`](DevicePrefetcherBuilder::join_timeout)
/// for the producer thread. A source still inside a call then makes
/// [`stop`](Self::stop) and [`reset`](Self::reset) return
/// [`async_iter::Error::SourceStuck`] (in [`Error::Prefetch`]); a later `reset` works
/// once the source has returned. Dropping returns all the same, leaving the thread
/// detached: it owns the pinned host ring it fills, which stays allocated until the
/// thread ends and is freed then. No copy reads that ring any more (the copy in flight
/// was waited for), and the thread never touches the device ring, which is freed in
/// the consumer's stream order as usual.
///
/// # Example
///
/// ```
/// use async_iter::{BatchLayout, BatchMut, BatchSource, SourceError};
/// use ndarray::{Ix1, Ix2};
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::DevicePrefetcher;
///
/// /// 5 batches of 32 rows of 8 features; the last has 4 rows.
/// struct Rows;
///
/// impl BatchSource for Rows {
///     fn next_layout(&mut self, index: usize) -> Result<Option<BatchLayout>, SourceError> {
///         let rows = match index {
///             0..=3 => 32,
///             4 => 4,
///             _ => return Ok(None),
///         };
///         Ok(Some(BatchLayout::new().features::<f32, _>((rows, 8)).labels::<u32, _>(rows)))
///     }
///
///     fn fill(&mut self, batch: &mut BatchMut<'_>) -> Result<(), SourceError> {
///         let index = batch.index();
///         batch.features::<f32, Ix2>()?.fill(index as f32);
///         batch.labels::<u32, Ix1>()?.fill(index as u32);
///         Ok(())
///     }
/// }
///
/// let gpu = SimDevice::new()?; // or CudaDevice::new(0)?
/// let mut batches = DevicePrefetcher::builder(Rows, &gpu).depth(2).build()?;
/// for epoch in 0..2 {
///     while let Some(batch) = batches.next() {
///         let batch = batch?; // the copy of the next batch is already under way
///         let x = batch.features::<f32, Ix2>()?; // a device view, used on batch.stream()
///         let y = batch.labels::<u32, Ix1>()?;
///         // launch kernels on x.device_ptr(), y.device_ptr() here
///         assert_eq!(x.to_host()?[[0, 0]], batch.index() as f32);
///         assert_eq!(y.len(), if batch.index() == 4 { 4 } else { 32 });
///     } // dropping the lease lets the copy stream reuse its slot after the kernels
///     if epoch == 0 {
///         batches.reset()?; // a new epoch, in the same rings
///     }
/// }
/// let stats = batches.stats();
/// assert_eq!((stats.copies_issued, stats.device_ring_growths), (10, 0));
/// assert_eq!(stats.device_ring_bytes, 3 * 1280); // depth + 1 slots of the first batch
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DevicePrefetcher<S, D: Device> {
    /// Dropped by hand: leaked instead when a copy from its pinned memory could not be
    /// waited for.
    host: ManuallyDrop<Prefetcher<S, PinnedBackend<D>>>,
    side: Side<D>,
}

/// The device side, which a [`DeviceLease`] borrows.
struct Side<D: Device> {
    ring: DeviceRing<D>,
    ahead: Ahead<D>,
    /// The batch lent out. A lease takes it back when it ends; one still here at the
    /// next `next()` belonged to a leaked lease.
    leased: Option<Leased>,
    /// The end of a copy or of a lease could be neither recorded nor waited for: memory
    /// may be in use indefinitely, so nothing is reused and the pinned ring is leaked.
    broken: Option<DeviceError>,
}

/// What lies ahead of the consumer in the epoch.
#[allow(clippy::large_enum_variant)] // one per prefetcher; a box would allocate per batch
enum Ahead<D: Device> {
    /// Nothing staged: the next call takes the next batch from the host prefetcher (the
    /// epoch's first, or one that was not ready when the batch before was handed out).
    Start,
    /// The next batch, its copy issued; its host slot is still held.
    Staged(Staged<D>),
    /// The epoch ends after the batches handed out: `Some` failure, or the end of data.
    Finished(Option<Error>),
    /// The end was reported (or the epoch stopped).
    Over,
}

struct Staged<D: Device> {
    batch: Leased,
    /// Recorded on the copy stream after the batch's copy.
    copied: D::Event,
}

impl<S: BatchSource, D: Device> DevicePrefetcher<S, D> {
    /// A builder with the defaults: depth 2, no headroom, no ring limit, background
    /// thread, the device's default stream for the consumer and a new copy stream.
    pub fn builder(source: S, device: &D) -> DevicePrefetcherBuilder<S, D> {
        DevicePrefetcherBuilder {
            source,
            device: device.clone(),
            stream: None,
            copy_stream: None,
            depth: 2,
            headroom: 0.0,
            max_ring_bytes: None,
            threading: Threading::Background,
            join_timeout: None,
        }
    }

    /// The next batch of the epoch, in the device ring; the copy of the batch after it is
    /// issued first when the producer has that batch ready (it is never waited for).
    ///
    /// Returns `None` at the end of the epoch, and `Some(Err)` once when the source
    /// failed or panicked (at its batch, after every earlier batch) or the device
    /// failed, then `None` until [`reset`](Self::reset).
    ///
    /// # Errors
    ///
    /// [`Error::Prefetch`] for every error of the host prefetcher (the source's errors
    /// and panics, layouts, the pinned ring); [`Error::Device`] when a copy or the device
    /// ring fails.
    #[allow(clippy::should_implement_trait)] // a lending iterator: `Iterator` cannot lend
    pub fn next(&mut self) -> Option<Result<DeviceLease<'_, D>>> {
        self.side.end_lease();
        if let Some(error) = &self.side.broken {
            if matches!(self.side.ahead, Ahead::Over) {
                return None;
            }
            let error = self.side.device_error("handing out a batch", error.clone());
            let _ = self.halt();
            return Some(Err(error));
        }
        loop {
            match mem::replace(&mut self.side.ahead, Ahead::Over) {
                Ahead::Over => return None,
                Ahead::Finished(outcome) => return outcome.map(Err),
                Ahead::Start => self.side.ahead = self.stage(),
                Ahead::Staged(staged) => {
                    if let Err(error) = self.side.finish_copy(&staged) {
                        let _ = self.halt(); // a stuck source shows again at the next reset
                        return Some(Err(error));
                    }
                    // The copy of the batch after this one is issued now, to run while the
                    // consumer works on this one, when the host prefetcher has it ready;
                    // otherwise at the next call (the host slot of this batch goes back to
                    // the producer in there). Never waited for here: a source may produce
                    // batch k + 1 only after the consumer has used batch k.
                    self.side.ahead = if self.host.ready() { self.stage() } else { Ahead::Start };
                    let slots = self.side.ring.memory();
                    if let Err(source) = slots.device.wait(&slots.consumer, &staged.copied) {
                        let error = self.side.device_error("ordering a batch after its copy", source);
                        let _ = self.halt();
                        return Some(Err(error));
                    }
                    self.side.leased = Some(staged.batch);
                    return Some(Ok(DeviceLease { side: &mut self.side, batch: staged.batch }));
                }
            }
        }
    }

    /// Takes the next batch from the host prefetcher and issues its copy into the
    /// device ring; its host slot stays held until the copy is over.
    fn stage(&mut self) -> Ahead<D> {
        let lease = match self.host.next() {
            None => return Ahead::Finished(None),
            Some(Err(error)) => return Ahead::Finished(Some(error.into())),
            Some(Ok(lease)) => lease,
        };
        let info =
            BatchInfo { layout: *lease.layout(), index: lease.index(), epoch: lease.epoch(), bytes: lease.bytes() };
        let source = NonNull::from(lease.as_bytes()).cast::<u8>();
        let ring = &mut self.side.ring;
        let place = match ring.place(info.bytes) {
            Ok(place) => place,
            Err(error) => {
                drop(lease);
                return self.end_early(error);
            }
        };
        let DeviceSlots { device, copy, .. } = ring.memory();
        // SAFETY: `source` is the batch's region in the pinned ring: `bytes` bytes of
        // page-locked memory of this device (the ring's backend allocates it with
        // `alloc_pinned`). The host lease is forgotten below, so the producer does not
        // get the slot back before the next `host.next()`, which runs only after this
        // copy's event has completed (`finish_copy`); stopping, resetting and dropping the
        // host prefetcher (which frees ring blocks) are preceded by the same wait. The
        // slot at `place` holds `bytes` bytes of a device ring block (the slot ring
        // places a batch inside a block of at least the bytes it asked `DeviceSlots`, an
        // unsafe `SlotMemory`, for), which is freed only after the consumer's stream has
        // waited for the copy stream; the copy stream waits for the slot's last lease
        // (`place`).
        let issued = unsafe { device.copy_htod_pinned(copy, source, place.address, info.bytes) };
        match issued.and_then(|()| device.record(copy)) {
            Ok(copied) => {
                ring.copies += 1;
                ring.bytes_copied += info.bytes as u64;
                mem::forget(lease);
                Ahead::Staged(Staged { batch: Leased { info, place }, copied })
            }
            Err(error) => {
                // Without an event nobody can tell when the copy ends: wait for it here.
                match device.synchronize(copy) {
                    Ok(()) => drop(lease),
                    Err(lost) => {
                        mem::forget(lease);
                        self.side.broken = Some(lost);
                    }
                }
                self.end_early(error)
            }
        }
    }

    /// Ends the epoch after the batch being handed out, because the next one could not
    /// be copied. That batch's lease is yet to come, so its slot is not returned here.
    fn end_early(&mut self, error: DeviceError) -> Ahead<D> {
        // A source stuck meanwhile shows at the next reset; this batch's error comes first.
        let _ = self.host.stop();
        Ahead::Finished(Some(self.side.device_error("copying a batch to the device", error)))
    }

    /// Ends the current epoch, early or not, and starts the next one from its first
    /// batch, reusing both rings.
    ///
    /// # Errors
    ///
    /// [`Error::Prefetch`] from the host prefetcher's `reset` (the source's `reset`
    /// failed; call again), or with `SourceStuck` when the producer thread did not end
    /// within the join timeout (no epoch starts; call again once the source returns);
    /// [`Error::Device`] when an earlier device failure left memory that may still be in
    /// use (build a new prefetcher).
    pub fn reset(&mut self) -> Result<()> {
        let stopped = self.halt();
        if let Some(error) = &self.side.broken {
            return Err(self.side.device_error("starting a new epoch", error.clone()));
        }
        stopped?;
        self.host.reset()?;
        self.side.ahead = Ahead::Start;
        Ok(())
    }
}

impl<S, D: Device> DevicePrefetcher<S, D> {
    /// Ends the epoch early: waits for the copy in flight, stops the producer and joins
    /// its thread. `next()` then returns `None` until [`reset`](Self::reset).
    ///
    /// # Errors
    ///
    /// [`Error::Prefetch`] with `SourceStuck` when the producer thread did not end within
    /// the join timeout; the epoch is over all the same (see [`DevicePrefetcher`]).
    pub fn stop(&mut self) -> Result<()> {
        Ok(self.halt()?)
    }

    /// Ends the epoch: the copy in flight, then the producer; the device ring's slots all
    /// come back. Fails only when the producer did not stop in time.
    fn halt(&mut self) -> std::result::Result<(), async_iter::Error> {
        if let Ahead::Staged(staged) = mem::replace(&mut self.side.ahead, Ahead::Over) {
            // An error is kept in `broken` when it matters.
            let _ = self.side.finish_copy(&staged);
        }
        // No batch of the host ring is in a copy any more, so a producer that does not
        // stop in time writes only slots that no copy reads.
        let stopped = self.host.stop();
        self.side.ring.all_returned();
        stopped
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> DevicePrefetchStats {
        let ring = &self.side.ring;
        DevicePrefetchStats {
            host: self.host.stats(),
            device_ring_bytes: ring.ring_bytes(),
            device_slot_bytes: ring.slot_bytes(),
            device_ring_growths: ring.growths(),
            copies_issued: ring.copies,
            bytes_copied: ring.bytes_copied,
        }
    }

    /// The current epoch (0 for the first).
    pub fn epoch(&self) -> u64 {
        self.host.epoch()
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.side.ring.memory().device
    }

    /// The consumer's stream, where the batches are used.
    pub fn stream(&self) -> &D::Stream {
        &self.side.ring.memory().consumer
    }

    /// The stream the copies run on.
    pub fn copy_stream(&self) -> &D::Stream {
        &self.side.ring.memory().copy
    }
}

impl<D: Device> Side<D> {
    fn device_error(&self, action: &'static str, source: DeviceError) -> Error {
        Error::Device { workspace: RING.into(), action, source }
    }

    /// Waits on the host until the copy of `staged` is over, so that its pinned slot can
    /// go back to the producer.
    fn finish_copy(&mut self, staged: &Staged<D>) -> Result<()> {
        let slots = self.ring.memory();
        let Err(error) = slots.device.event_synchronize(&staged.copied) else { return Ok(()) };
        if let Err(lost) = slots.device.synchronize(&slots.copy) {
            self.broken.get_or_insert(lost);
        }
        Err(self.device_error("copying a batch to the device", error))
    }

    /// The lease out ended (or was leaked): its slot may be written once the consumer's
    /// stream has done what was issued to it so far.
    fn end_lease(&mut self) {
        let Some(batch) = self.leased.take() else { return };
        let DeviceSlots { device, consumer, .. } = self.ring.memory();
        match device.record(consumer) {
            Ok(released) => self.ring.returned(batch.place, Some(released)),
            Err(error) => match device.synchronize(consumer) {
                Ok(()) => self.ring.returned(batch.place, None),
                Err(_) => {
                    device.defer_error(error.clone());
                    self.broken.get_or_insert(error);
                }
            },
        }
    }
}

impl<S, D: Device> Drop for DevicePrefetcher<S, D> {
    fn drop(&mut self) {
        // The copy in flight first: no copy reads the pinned ring after this.
        if let Ahead::Staged(staged) = mem::replace(&mut self.side.ahead, Ahead::Over) {
            let _ = self.side.finish_copy(&staged);
        }
        // A producer that did not stop in time at an earlier `stop` or `reset` has been
        // waited for once already: it is not waited for again (the host prefetcher's
        // drop detaches it; it keeps the pinned ring until it ends). Otherwise stop it,
        // waiting at most the join timeout.
        if !self.host.is_stuck() {
            let _ = self.host.stop();
        }
        self.side.ring.all_returned();
        if self.side.broken.is_none() {
            // SAFETY: dropped once, here; no copy from its memory is in flight (`halt`
            // waited for the last one), and nothing uses it after this.
            unsafe { ManuallyDrop::drop(&mut self.host) };
        }
    }
}

impl<S, D: Device> std::fmt::Debug for DevicePrefetcher<S, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePrefetcher").field("stats", &self.stats()).finish_non_exhaustive()
    }
}
