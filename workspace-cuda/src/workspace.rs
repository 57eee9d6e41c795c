//! The device workspace: the host engine over device memory, bound to one stream.
//!
//! # Why a reset is safe on the device
//!
//! The engine reuses memory when the last scope of a cycle closes; on the host that
//! proves no view is alive. On the device, work that used the memory may still be
//! queued. Work issued to the workspace's own stream runs before anything issued later
//! to that stream, so for it the reset is ordered for free: it is *stream-ordered*,
//! like `cudaFreeAsync`. Work on any other stream is declared ([`DeviceScope::on_stream`],
//! or a copy into a workspace on another stream), and every such stream is noted in
//! `foreign`. When the cycle closes, the workspace makes its own stream wait for an
//! event recorded on each of them, before the engine resets; from then on, everything
//! that reuses the memory (new allocations, spill frees, a new arena) is issued to the
//! workspace's stream behind those waits. If the driver cannot order a stream, the
//! workspace waits for it on the host; if that fails too, the stream is kept in
//! `unjoined` and the workspace refuses to open until it is ordered.
//!
//! # Why use on another stream is safe within a cycle, whatever is dropped
//!
//! Within a cycle, the views an [`OnStream`] was given stay borrowed until it ends, and
//! ending it makes the workspace's stream wait for the other stream. But `mem::forget`
//! ends the borrows without that wait, so safety cannot rest on it. Instead every use
//! of the workspace's memory on another stream is recorded in `uses` when it is issued
//! (the stream, the byte range, and whether it writes). Before the workspace's stream
//! writes a range that another stream may still read or write, or reads a range that
//! another stream may still write, it waits for that stream ([`order_home_use`]); a
//! stream it has waited for has its uses dropped. So an `OnStream` that ends normally
//! costs one wait, and one that is forgotten costs the same wait later, at the first
//! conflicting use, and never a race. Work on the other stream is ordered after the
//! workspace stream's work the same way: each operation issued through an `OnStream`
//! first makes its stream wait for the workspace's stream (and for any third stream
//! whose unordered use conflicts with it).
//!
//! When the workspace is dropped while a cycle is still open (its scope forgotten),
//! every stream that used the memory is ordered before the frees, as at a reset.
//!
//! [`DeviceScope::on_stream`]: crate::DeviceScope::on_stream
//! [`OnStream`]: crate::OnStream
//! [`order_home_use`]: StreamOrder::order_home_use

use std::cell::{Cell, RefCell};
use std::sync::{Arc, Mutex};

use workspace_core::backend::{CycleHooks, Shell};
use workspace_core::{Location, WorkspaceConfig};

use crate::backend::{lock_graveyard, DeviceBackend, Graveyard};
use crate::device::{ordered_with, Device, DEVICE_ALIGNMENT, MAX_DEVICE_ALIGNMENT, PINNED_ALIGNMENT};
use crate::error::{DeviceError, Error, Result};
use crate::ledger::Ledger;

/// No bytes of a group's arena.
const NONE_TOUCHED: (u64, u64) = (u64::MAX, 0);

/// A workspace in device memory, bound to one stream; see the module docs.
///
/// Same configuration, cycles, generations, learning, spilling and statistics as a host
/// [`Workspace`](workspace_core::Workspace). Every allocation is aligned to 256 bytes
/// ([`DEVICE_ALIGNMENT`]), or to the configured alignment when that is larger: a
/// configured alignment below 256 is raised to it, and one above
/// [`MAX_DEVICE_ALIGNMENT`] is refused.
///
/// ```
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::{Device, DeviceWorkspace};
/// use workspace_core::WorkspaceConfig;
///
/// let sim = SimDevice::new()?;
/// let ws = DeviceWorkspace::new("ACT", WorkspaceConfig::default(), &sim, &sim.default_stream())?;
/// for step in 0..3 {
///     let scope = ws.enter()?;
///     let x = scope.htod(&ndarray::Array2::<f32>::from_elem((4, 8), step as f32))?;
///     assert_eq!(x.to_host()?.sum(), 32.0 * step as f32);
/// } // reset here, ordered on the workspace's stream
/// assert_eq!(ws.stats().growth_events, 1);
/// assert_eq!(ws.config().alignment(), 256);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// `Send` and `!Sync`, like the host workspace:
///
/// ```compile_fail
/// fn needs_sync<T: Sync>() {}
/// needs_sync::<workspace_cuda::DeviceWorkspace<workspace_cuda::device::sim::SimDevice>>();
/// ```
///
/// Its engine is not exposed (its `enter` would open a cycle without ordering the other
/// streams first):
///
/// ```compile_fail,E0599
/// use workspace_cuda::device::sim::SimDevice;
/// use workspace_cuda::{Device, DeviceWorkspace};
/// let sim = SimDevice::new().unwrap();
/// let ws = DeviceWorkspace::new("W", Default::default(), &sim, &sim.default_stream()).unwrap();
/// ws.engine().enter().unwrap();
/// ```
pub struct DeviceWorkspace<D: Device> {
    shell: Shell<DeviceBackend<D>, StreamOrder<D>>,
}

/// The accessors every kind of workspace shares (name, generation, capacity,
/// statistics, `trim`, ...) are the [`Shell`]'s.
impl<D: Device> std::ops::Deref for DeviceWorkspace<D> {
    type Target = Shell<DeviceBackend<D>, StreamOrder<D>>;

    #[inline(always)]
    fn deref(&self) -> &Self::Target {
        &self.shell
    }
}

/// What a device workspace does around the engine's cycles (its [`CycleHooks`]): it
/// orders every other stream that used the memory before its own stream, which every
/// reuse of the memory is issued to (module docs).
pub struct StreamOrder<D: Device> {
    /// The workspace's name, for errors.
    name: Arc<str>,
    device: D,
    stream: D::Stream,
    /// Streams other than `stream` that used this workspace's memory in the open cycle.
    foreign: RefCell<Vec<D::Stream>>,
    /// Streams that could be ordered neither on the device nor on the host when their
    /// cycle closed; opening orders them first and fails until it can.
    unjoined: RefCell<Vec<D::Stream>>,
    /// An ordering error from a place that cannot return one (closing a scope, ending a
    /// stream use), reported by the next `enter`.
    pending: RefCell<Option<DeviceError>>,
    /// Uses of this workspace's memory by work on other streams that the workspace's
    /// stream is not yet ordered after (module docs). Every stream here is in `foreign`.
    uses: RefCell<Vec<ForeignUse<D>>>,
    /// Shared with the backend: while `unjoined` is not empty, blocks the engine gives
    /// back are kept here instead of freed, and freed once every stream is ordered.
    graveyard: Arc<Mutex<Graveyard<D>>>,
    /// The device plan group this workspace is a member of, if any: its arena's bytes
    /// are reused across streams in the order its ledger keeps.
    group: RefCell<Option<GroupLink<D>>>,
    /// The bytes of the group's arena this cycle was handed (`(u64::MAX, 0)`: none),
    /// released to the group's other streams when the cycle or one of its frames closes.
    touched: Cell<(u64, u64)>,
}

/// A workspace's membership of a device plan group: the group's ledger and the lane of
/// the workspace's stream in it.
pub(crate) struct GroupLink<D: Device> {
    pub(crate) ledger: Arc<Ledger<D>>,
    pub(crate) lane: usize,
}

/// Work on another stream that reads or writes `start..end` of a workspace's memory.
struct ForeignUse<D: Device> {
    stream: D::Stream,
    start: u64,
    end: u64,
    writes: bool,
}

impl<D: Device> ForeignUse<D> {
    /// Whether an access to `start..end` (a write when `writes`) must wait for this use.
    fn conflicts(&self, start: u64, end: u64, writes: bool) -> bool {
        (writes || self.writes) && start < self.end && self.start < end
    }
}

/// Unordered uses kept per workspace before every stream is ordered at once (so that a
/// long-lived `OnStream` does not make each check slower).
const MAX_USES: usize = 256;

/// The configuration a device workspace runs with: `config` with its alignment raised to
/// [`DEVICE_ALIGNMENT`]; an error for a file location or an alignment beyond
/// [`MAX_DEVICE_ALIGNMENT`].
pub(crate) fn device_config(name: &str, config: WorkspaceConfig, what: &str) -> Result<WorkspaceConfig> {
    if !matches!(config.location(), Location::Ram) {
        return Err(workspace_core::Error::InvalidConfig {
            reason: format!(
                "{what} workspaces have no file or mapping behind them ({:?}); use Location::Ram (the default)",
                config.location()
            ),
        }
        .into());
    }
    check_alignment(name, &config, what)?;
    if config.alignment() >= DEVICE_ALIGNMENT {
        return Ok(config);
    }
    Ok(WorkspaceConfig::builder()
        .initial_size(config.initial_size())
        .min_size(config.min_size())
        .max_size(config.max_size())
        .alignment(DEVICE_ALIGNMENT)
        .allocation(config.allocation())
        .learning(config.learning())
        .spill(config.spill())
        .reset(config.reset())
        .cycle_history_len(config.cycle_history_len())
        .build()?)
}

/// An error unless `config`'s alignment is at most [`MAX_DEVICE_ALIGNMENT`].
pub(crate) fn check_alignment(name: &str, config: &WorkspaceConfig, what: &str) -> Result<()> {
    if config.alignment() <= MAX_DEVICE_ALIGNMENT {
        return Ok(());
    }
    Err(workspace_core::Error::InvalidConfig {
        reason: format!(
            "{what} workspace '{name}' asks for alignment {}, more than the {MAX_DEVICE_ALIGNMENT} bytes \
             (MAX_DEVICE_ALIGNMENT) a {what} workspace can honour: the driver aligns allocations to {} bytes, \
             so every block would be padded by up to the alignment; use an alignment of at most \
             {MAX_DEVICE_ALIGNMENT}",
            config.alignment(),
            if what == "pinned" { PINNED_ALIGNMENT } else { DEVICE_ALIGNMENT },
        ),
    }
    .into())
}

impl<D: Device> DeviceWorkspace<D> {
    /// Creates a workspace on `stream` of `device` and reserves `initial_size` bytes.
    ///
    /// # Errors
    ///
    /// [`Error::Workspace`] for a file location, an alignment beyond
    /// [`MAX_DEVICE_ALIGNMENT`], a configuration that the raised alignment contradicts,
    /// or an initial arena the device cannot provide;
    /// [`Error::StreamMismatch`] when `stream` belongs to another device.
    pub fn new(name: &str, config: WorkspaceConfig, device: &D, stream: &D::Stream) -> Result<DeviceWorkspace<D>> {
        if !device.owns_stream(stream) {
            return Err(Error::StreamMismatch {
                workspace: Arc::from(name),
                action: "creating the workspace",
                detail: format!("{stream:?} does not belong to {}", device.describe()),
            });
        }
        let config = device_config(name, config, "device")?;
        let backend = DeviceBackend::new(device.clone(), stream.clone());
        let order = StreamOrder {
            name: Arc::from(name),
            device: device.clone(),
            stream: stream.clone(),
            foreign: RefCell::new(Vec::new()),
            unjoined: RefCell::new(Vec::new()),
            pending: RefCell::new(None),
            uses: RefCell::new(Vec::new()),
            graveyard: backend.graveyard(),
            group: RefCell::new(None),
            touched: Cell::new(NONE_TOUCHED),
        };
        Ok(DeviceWorkspace { shell: Shell::new(name, config, backend, order)? })
    }

    /// Blocks until all work issued to the workspace's stream is complete.
    ///
    /// # Errors
    ///
    /// A device error.
    pub fn synchronize(&self) -> Result<()> {
        let order = self.order();
        order.device.synchronize(&order.stream).map_err(|e| self.device_error("synchronising its stream", e))
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.order().device
    }
    /// The stream the workspace belongs to.
    pub fn stream(&self) -> &D::Stream {
        &self.order().stream
    }

    /// How this workspace orders other streams' use of its memory.
    pub(crate) fn order(&self) -> &StreamOrder<D> {
        self.shell.hooks()
    }

    pub(crate) fn device_error(&self, action: &'static str, source: DeviceError) -> Error {
        device_error(self.name(), action, source)
    }

    /// Runs `op` on `stream` with this workspace's memory, ordered after the workspace
    /// stream's work so far and before its later work; the stream is also joined when
    /// the cycle closes.
    pub(crate) fn run_on(
        &self,
        stream: &D::Stream,
        action: &'static str,
        op: impl FnOnce(&D::Stream) -> Result<(), DeviceError>,
    ) -> Result<()> {
        let order = self.order();
        order.note_foreign(stream);
        ordered_with(&order.device, stream, &order.stream, op).map_err(|e| {
            // The operation may have been issued without the workspace's stream being
            // ordered after it: until that stream is waited for, it counts as writing
            // all of the workspace's memory (every later use, a frame's close and the
            // reset wait for it first).
            if *stream != order.stream {
                order.uses.borrow_mut().push(ForeignUse {
                    stream: stream.clone(),
                    start: 0,
                    end: u64::MAX,
                    writes: true,
                });
            }
            self.device_error(action, e)
        })
    }
}

fn device_error(workspace: &Arc<str>, action: &'static str, source: DeviceError) -> Error {
    Error::Device { workspace: workspace.clone(), action, source }
}

impl<D: Device> StreamOrder<D> {
    /// Notes that `stream` uses this workspace's memory in the open cycle.
    pub(crate) fn note_foreign(&self, stream: &D::Stream) {
        if *stream != self.stream {
            let mut foreign = self.foreign.borrow_mut();
            if !foreign.contains(stream) {
                foreign.push(stream.clone());
            }
        }
    }

    /// Makes the workspace's stream wait for `stream`'s work so far; that stream's uses
    /// of the memory are then ordered.
    pub(crate) fn join(&self, stream: &D::Stream) -> Result<(), DeviceError> {
        let event = self.device.record(stream)?;
        self.device.wait(&self.stream, &event)?;
        self.uses.borrow_mut().retain(|u| u.stream != *stream);
        Ok(())
    }

    /// Records, before it is issued, that work on `stream` reads (or, with `writes`,
    /// writes) `bytes` bytes at `address` of this workspace's memory: until the
    /// workspace's stream waits for `stream`, conflicting work there waits first (module
    /// docs), whether or not the `OnStream` that issued it ever ends.
    ///
    /// # Errors
    ///
    /// When too many uses are recorded and ordering them all fails.
    pub(crate) fn note_use(
        &self,
        stream: &D::Stream,
        address: u64,
        bytes: usize,
        writes: bool,
    ) -> Result<(), DeviceError> {
        if *stream == self.stream {
            return Ok(());
        }
        self.note_foreign(stream);
        if self.uses.borrow().len() >= MAX_USES {
            let streams: Vec<D::Stream> = self.foreign.borrow().clone();
            for other in &streams {
                self.join_or_wait(other)?;
            }
        }
        let end = address.saturating_add(bytes as u64);
        self.uses.borrow_mut().push(ForeignUse { stream: stream.clone(), start: address, end, writes });
        Ok(())
    }

    /// Before work that reads (or, with `writes`, writes) `bytes` bytes at `address` is
    /// issued to the workspace's stream: makes that stream wait for every other stream
    /// whose recorded use conflicts, except `on` (whose own order already covers it).
    ///
    /// # Errors
    ///
    /// When a conflicting stream can be ordered neither on the device nor on the host;
    /// the work must not be issued then.
    pub(crate) fn order_home_use(
        &self,
        address: u64,
        bytes: usize,
        writes: bool,
        on: Option<&D::Stream>,
    ) -> Result<(), DeviceError> {
        if self.uses.borrow().is_empty() {
            return Ok(());
        }
        let end = address.saturating_add(bytes as u64);
        loop {
            let conflicting = self
                .uses
                .borrow()
                .iter()
                .find(|u| Some(&u.stream) != on && u.conflicts(address, end, writes))
                .map(|u| u.stream.clone());
            match conflicting {
                Some(stream) => self.join_or_wait(&stream)?,
                None => return Ok(()),
            }
        }
    }

    /// As [`StreamOrder::order_home_use`], for an infallible caller (a raw address for
    /// a kernel): when ordering on the device fails, waits for the streams on the host;
    /// when that fails too, keeps the error for the next `enter`.
    pub(crate) fn order_home_use_or_defer(&self, address: u64, bytes: usize, writes: bool) {
        if let Err(error) = self.order_home_use(address, bytes, writes, None) {
            self.defer(error);
        }
    }

    /// Makes `stream` wait for the workspace stream's work so far.
    pub(crate) fn fork(&self, stream: &D::Stream) -> Result<(), DeviceError> {
        let event = self.device.record(&self.stream)?;
        self.device.wait(stream, &event)
    }

    /// Orders `stream`'s work so far before the workspace's stream: on the device, or
    /// else by waiting for it on the host.
    fn join_or_wait(&self, stream: &D::Stream) -> Result<(), DeviceError> {
        self.join(stream).or_else(|_| {
            self.device.synchronize(stream)?;
            self.uses.borrow_mut().retain(|u| u.stream != *stream);
            Ok(())
        })
    }

    /// Keeps an error for the next `enter`.
    pub(crate) fn defer(&self, error: DeviceError) {
        self.pending.borrow_mut().get_or_insert(error);
    }

    /// Makes the workspace a member of the group of `link` (or of none).
    pub(crate) fn set_group(&self, link: Option<GroupLink<D>>) {
        *self.group.borrow_mut() = link;
    }

    /// Whether the workspace is a member of a device plan group.
    pub(crate) fn in_group(&self) -> bool {
        self.group.borrow().is_some()
    }

    /// After `bytes` at `address` were reserved in the open cycle, before the address is
    /// handed out: when they lie in the arena of the workspace's plan group, its stream
    /// waits for every other stream that used them before (see `ledger`).
    ///
    /// # Errors
    ///
    /// When such a stream can be ordered neither on the device nor on the host: the
    /// bytes must not be used.
    #[inline]
    pub(crate) fn order_reservation(&self, address: u64, bytes: usize) -> Result<(), DeviceError> {
        let group = self.group.borrow();
        let Some(link) = group.as_ref() else { return Ok(()) };
        if !link.ledger.in_arena(address) {
            return Ok(());
        }
        let (low, high) = self.touched.get();
        self.touched.set((low.min(address), high.max(address.saturating_add(bytes as u64))));
        link.ledger.order_use(link.lane, address, bytes)
    }

    /// Tells the group that the bytes of its arena this cycle was handed may be reused by
    /// its other streams after the work issued so far (every other stream that used
    /// them is ordered before the workspace's stream by now, except `unordered` ones,
    /// which the group waits for on the host before any reuse).
    fn release_group(&self, ends_cycle: bool, unordered: &[D::Stream]) {
        let touched = self.touched.get();
        if touched.0 < touched.1 {
            if let Some(link) = self.group.borrow().as_ref() {
                for stream in unordered {
                    link.ledger.unordered(stream);
                }
                link.ledger.release(link.lane, touched);
            }
        }
        if ends_cycle {
            self.touched.set(NONE_TOUCHED);
        }
    }
}

// The hooks are `unsafe fn`s because only the shell may run them (see `CycleHooks`);
// their bodies hold no unsafe code.
#[allow(unsafe_code)]
impl<D: Device> CycleHooks for StreamOrder<D> {
    type Error = Error;

    /// Orders what could not be ordered when the last cycle closed, and reports errors
    /// recorded since.
    unsafe fn before_open(&self, name: &Arc<str>) -> Result<()> {
        let mut unjoined = self.unjoined.borrow_mut();
        let mut failure = None;
        unjoined.retain(|stream| match self.join_or_wait(stream) {
            Ok(()) => false,
            Err(error) => {
                failure = Some(error);
                true
            }
        });
        drop(unjoined);
        if let Some(error) = failure {
            return Err(device_error(name, "ordering another stream's use of the last cycle's memory", error));
        }
        let buried = {
            let mut graveyard = lock_graveyard(&self.graveyard);
            graveyard.holding = false;
            std::mem::take(&mut graveyard.blocks)
        };
        // Every stream is ordered before the workspace's stream now, and the frees are
        // issued to it.
        drop(buried);
        if let Some(error) = self.pending.borrow_mut().take() {
            return Err(device_error(name, "ordering another stream's use of memory (when a scope closed)", error));
        }
        if let Some(error) = self.device.take_deferred_error() {
            return Err(device_error(name, "an earlier operation on this device (reported now)", error));
        }
        Ok(())
    }

    /// Orders every stream that used the memory in this cycle before the workspace's
    /// stream (module docs). What cannot be ordered is kept for `before_open`.
    unsafe fn before_reset(&self) {
        let foreign = std::mem::take(&mut *self.foreign.borrow_mut());
        for stream in foreign {
            if let Err(error) = self.join_or_wait(&stream) {
                self.unjoined.borrow_mut().push(stream);
                self.defer(error);
                // The reset that follows gives spill blocks back (and learning may replace
                // the arena): that stream may still use them, so they must not be freed.
                lock_graveyard(&self.graveyard).holding = true;
            }
        }
        // Every stream is ordered, or kept in `unjoined`, which `before_open` orders
        // before anything touches the memory again (and which the plan group, if any,
        // waits for before its arena's bytes are reused).
        self.uses.borrow_mut().clear();
        self.release_group(true, &self.unjoined.borrow());
    }

    /// A reservation in a plan group's arena waits for the other streams that used
    /// those bytes before (`order_reservation`); every scope and frame reserves through
    /// here, raw ones included.
    #[inline(always)]
    fn after_alloc(&self, address: u64, bytes: usize) -> Result<()> {
        self.order_reservation(address, bytes).map_err(|error| {
            device_error(&self.name, "ordering a reuse of the plan group's memory after another stream", error)
        })
    }

    /// Orders every other stream with an unordered use of the memory before the
    /// workspace's stream, which every reuse of the frame's bytes is issued to (or
    /// waits for, in a plan group's arena). When one cannot be ordered, the frame's
    /// bytes are kept to the end of the cycle, whose close orders it or keeps it
    /// `unjoined`.
    unsafe fn before_frame_close(&self, _level: u32) -> bool {
        loop {
            let next = self.uses.borrow().first().map(|u| u.stream.clone());
            let Some(stream) = next else { break };
            if let Err(error) = self.join_or_wait(&stream) {
                self.defer(error);
                return false;
            }
        }
        self.release_group(false, &[]);
        true
    }

    /// `foreign` is empty unless a scope was forgotten and the cycle never closed: its
    /// streams may still use the memory the engine is about to free. The memory is
    /// leaked when a stream cannot be ordered.
    unsafe fn before_drop(&mut self) -> bool {
        let mut ordered = true;
        let foreign = std::mem::take(self.foreign.get_mut());
        let mut failed = Vec::new();
        for stream in foreign.iter().chain(std::mem::take(self.unjoined.get_mut()).iter()) {
            if let Err(error) = self.join_or_wait(stream) {
                self.device.defer_error(error);
                failed.push(stream.clone());
                ordered = false;
            }
        }
        if let Some(error) = self.pending.get_mut().take() {
            self.device.defer_error(error);
        }
        // The group may hand this cycle's part of its arena to another member next.
        self.release_group(true, &failed);
        let buried = {
            let mut graveyard = lock_graveyard(&self.graveyard);
            graveyard.holding = !ordered;
            std::mem::take(&mut graveyard.blocks)
        };
        if ordered {
            drop(buried);
        } else {
            // A stream that could not be ordered may still read these blocks.
            std::mem::forget(buried);
        }
        ordered
    }
}

impl<D: Device> std::fmt::Debug for DeviceWorkspace<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceWorkspace")
            .field("shell", &self.shell)
            .field("device", self.device())
            .field("stream", self.stream())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::SimDevice;

    #[test]
    fn alignment_is_raised_and_file_locations_are_refused() {
        let config =
            WorkspaceConfig::builder().alignment(workspace_core::DEFAULT_ALIGNMENT).initial_size(1000).build().unwrap();
        let raised = device_config("W", config.clone(), "device").unwrap();
        assert_eq!(raised.alignment(), DEVICE_ALIGNMENT);
        assert_eq!(
            (raised.initial_size(), raised.learning(), raised.spill()),
            (1000, config.learning(), config.spill())
        );
        let big = WorkspaceConfig::builder().alignment(4096).build().unwrap();
        assert_eq!(device_config("W", big, "device").unwrap().alignment(), 4096);
        let mapped = WorkspaceConfig::builder()
            .location(Location::MmapAnonymous)
            .learning(workspace_core::LearningPolicy::None)
            .initial_size(4096)
            .build()
            .unwrap();
        let err = device_config("W", mapped, "device").unwrap_err();
        assert!(err.to_string().contains("Location::Ram"), "{err}");
    }

    #[test]
    fn a_stream_of_another_device_is_refused() {
        let (a, b) = (SimDevice::new().unwrap(), SimDevice::new().unwrap());
        let err = DeviceWorkspace::new("W", WorkspaceConfig::default(), &a, &b.default_stream()).unwrap_err();
        assert!(matches!(err, Error::StreamMismatch { .. }), "{err:?}");
        assert!(err.to_string().contains("does not belong"), "{err}");
    }

    #[test]
    fn deferred_device_errors_are_reported_by_the_next_enter_once() {
        let sim = SimDevice::new().unwrap();
        let ws = DeviceWorkspace::new("W", WorkspaceConfig::default(), &sim, &sim.default_stream()).unwrap();
        drop(ws.enter().unwrap());
        sim.defer_error(DeviceError::Fault { op: "dtod", detail: "planted".into() });
        let err = ws.enter().unwrap_err();
        assert!(err.to_string().contains("planted") && err.to_string().contains("'W'"), "{err}");
        assert!(!ws.is_open());
        let scope = ws.enter().unwrap();
        assert_eq!(scope.generation(), 2);
    }
}
