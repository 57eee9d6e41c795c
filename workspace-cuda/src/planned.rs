//! Plan groups of device workspaces: the role workspaces of an iteration served from one
//! device allocation, at offsets planned from the lifetimes of a recorded iteration.
//!
//! The planning, the replay and its checks are the host's
//! ([`workspace_core::planned`]): a [`DevicePlanGroup`] is a
//! [`Group`] over device memory, and its members join
//! it through the engine's member seam, as host workspaces do. What the device adds is
//! the order of reuse: a plan lets an allocation take bytes that an earlier, dead one
//! held, and on a device the work issued on the dead one may still be queued. On the
//! member's own stream that work runs first anyway. When the members are on different
//! streams, each close of a member's cycle or frame records an event on its stream,
//! and a member on another stream waits for it before it is handed overlapping bytes
//! (the crate's `ledger` module); the arena is freed (a larger plan, `trim`, the group
//! dropped) only after every stream that used it. With every member on the group's
//! stream nothing is recorded (stream order is enough), unless a stream that used a
//! member's memory could not be ordered when it closed: then every reuse waits for that
//! stream on the host first.
//!
//! ```
//! use workspace_cuda::device::sim::SimDevice;
//! use workspace_cuda::{Device, DevicePlanGroup};
//! use workspace_core::{LearningPolicy, SpillPolicy, WorkspaceConfig};
//!
//! let gpu = SimDevice::new()?;
//! let stream = gpu.default_stream();
//! let config = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build()?;
//! let group = DevicePlanGroup::new("STEP", &gpu, &stream)?;
//! let act = group.workspace("ACT", &config, &stream)?;
//! let work = group.workspace("WORK", &config, &stream)?;
//! for _ in 0..4 {
//!     group.iteration(0, || {
//!         let a = act.enter()?;
//!         let x = a.zeros::<f32, _>(1024)?; // 4 KiB, live to the end of the iteration
//!         for _ in 0..3 {
//!             let w = work.enter()?; // each cycle's 2 x 16 KiB die at its end
//!             let src = w.zeros::<f32, _>(4096)?;
//!             let mut t = w.zeros::<f32, _>(4096)?;
//!             t.copy_from(&src)?; // a kernel reading `x` would go here
//!         }
//!         Ok::<_, workspace_cuda::Error>(())
//!     })?;
//! }
//! let stats = group.stats();
//! assert_eq!((stats.plans, stats.planned_iterations, stats.divergences), (1, 3, 0));
//! assert_eq!(stats.plan_bytes, 4096 + 2 * 16384); // the lower bound
//! assert_eq!(stats.plan_bytes, stats.lower_bound_bytes);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::marker::PhantomData;
use std::sync::Arc;

use workspace_core::planned::{Group, PlannedStats, DEFAULT_PLANS};
use workspace_core::WorkspaceConfig;

use crate::backend::DeviceBackend;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::ledger::Ledger;
use crate::workspace::{DeviceWorkspace, GroupLink};

/// A group of device workspaces planned together; see the module docs.
///
/// The arena is allocated on the group's stream. Members may be on any stream of the
/// same device. Cloning gives another handle to the same group. `!Send`: a group belongs
/// to the thread that made it (a member moved to another thread allocates there as an
/// unplanned workspace).
pub struct DevicePlanGroup<D: Device> {
    group: Group<DeviceBackend<D>>,
    ledger: Arc<Ledger<D>>,
    device: D,
    stream: D::Stream,
    _thread: PhantomData<*const ()>,
}

impl<D: Device> Clone for DevicePlanGroup<D> {
    fn clone(&self) -> Self {
        DevicePlanGroup {
            group: self.group.clone(),
            ledger: self.ledger.clone(),
            device: self.device.clone(),
            stream: self.stream.clone(),
            _thread: PhantomData,
        }
    }
}

impl<D: Device> DevicePlanGroup<D> {
    /// A group named `name` whose arena is allocated on `stream` of `device`, keeping up
    /// to [`DEFAULT_PLANS`] plans.
    ///
    /// # Errors
    ///
    /// [`Error::StreamMismatch`] when `stream` belongs to another device.
    pub fn new(name: &str, device: &D, stream: &D::Stream) -> Result<DevicePlanGroup<D>> {
        DevicePlanGroup::with_plans(name, device, stream, DEFAULT_PLANS)
    }

    /// A group keeping up to `plans` plans (at least one): the number of shapes of
    /// iteration it serves from a plan at once.
    ///
    /// # Errors
    ///
    /// As [`DevicePlanGroup::new`].
    pub fn with_plans(name: &str, device: &D, stream: &D::Stream, plans: usize) -> Result<DevicePlanGroup<D>> {
        if !device.owns_stream(stream) {
            return Err(Error::StreamMismatch {
                workspace: Arc::from(name),
                action: "creating the plan group",
                detail: format!("{stream:?} does not belong to {}", device.describe()),
            });
        }
        let ledger = Arc::new(Ledger::new(device.clone(), stream.clone()));
        let backend = DeviceBackend::for_group(device.clone(), stream.clone(), ledger.clone());
        Ok(DevicePlanGroup {
            group: Group::new(name, backend, plans),
            ledger,
            device: device.clone(),
            stream: stream.clone(),
            _thread: PhantomData,
        })
    }

    /// A new workspace `name` on `stream`, created with `config` and joined to the group.
    /// Members need no arena of their own (`LearningPolicy::None` and no initial size):
    /// the plan's arena serves them, and what runs off the plan spills.
    ///
    /// # Errors
    ///
    /// Those of [`DeviceWorkspace::new`] and [`DevicePlanGroup::join`].
    pub fn workspace(&self, name: &str, config: &WorkspaceConfig, stream: &D::Stream) -> Result<DeviceWorkspace<D>> {
        let ws = DeviceWorkspace::new(name, config.clone(), &self.device, stream)?;
        self.join(&ws)?;
        Ok(ws)
    }

    /// Makes `ws` a member: from the next iteration its allocations, cycles and frames
    /// are recorded and planned with the others'.
    ///
    /// # Errors
    ///
    /// [`Error::DeviceMismatch`] for a workspace of another device;
    /// [`workspace_core::Error::StillOpen`] while `ws` is open;
    /// [`workspace_core::Error::InvalidConfig`] when it is circular or a member of
    /// another group; [`Error::Device`] when its stream cannot be ordered after the
    /// group's.
    pub fn join(&self, ws: &DeviceWorkspace<D>) -> Result<()> {
        if !ws.device().same_device(&self.device) {
            return Err(Error::DeviceMismatch {
                workspace: ws.name().clone(),
                action: "joining a plan group",
                device: ws.device().describe(),
                other: self.device.describe(),
            });
        }
        let circular = ws.config().reset() != workspace_core::ResetPolicy::BlockLeft;
        if ws.is_open() || ws.group_id().is_some() || circular {
            // The group's own checks give the error (and change nothing), or, for a
            // member of this group already, join it again.
            // SAFETY: the join is refused (the workspace does not become a member), or
            // the workspace is a member of this group already, which it became only
            // through this method (`Group::join` is unsafe and private to this type
            // here), so its ledger link is set (only `leave` removes it, along with the
            // membership).
            return unsafe { self.group.join(ws) }.map_err(Error::from);
        }
        let lane = self
            .ledger
            .lane(ws.stream())
            .map_err(|error| ws.device_error("ordering its stream after the plan group's streams", error))?;
        ws.order().set_group(Some(GroupLink { ledger: self.ledger.clone(), lane }));
        // SAFETY: the workspace's hooks order every use of the group's arena through the
        // ledger linked just above. Every reservation, of a scope or a frame, raw or
        // typed, waits for the other streams that released those bytes
        // (`CycleHooks::after_alloc`, `order_reservation`). When a cycle or frame closes,
        // every other stream that used the workspace's memory is ordered before its own
        // stream, which then records the release the other streams wait for; a stream
        // that cannot be ordered is handed to the ledger as unordered, and every later
        // reservation in the arena (and its free) waits for it on the host first
        // (`before_reset`); a frame whose streams cannot be ordered keeps its bytes to
        // the end of the cycle (`before_frame_close`). A workspace dropped with a cycle
        // open releases the same way (`before_drop`). The group's backend waits for
        // every stream before it frees the arena (`DeviceBackend::for_group`), and a new
        // stream is ordered after all the group's streams' work so far (`Ledger::lane`).
        if let Err(error) = unsafe { self.group.join(ws) } {
            ws.order().set_group(None);
            return Err(error.into());
        }
        Ok(())
    }

    /// Makes `ws` an unplanned workspace again.
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::StillOpen`] while `ws` is open;
    /// [`workspace_core::Error::InvalidInput`] when it is not a member of this group.
    pub fn leave(&self, ws: &DeviceWorkspace<D>) -> Result<()> {
        self.group.leave(ws)?;
        ws.order().set_group(None);
        Ok(())
    }

    /// Whether `ws` is a member of this group.
    pub fn has_member(&self, ws: &DeviceWorkspace<D>) -> bool {
        self.group.has_member(ws) && ws.order().in_group()
    }

    /// Ends the current iteration (as [`DevicePlanGroup::finish_iteration`]) and starts
    /// one of shape `key`: it replays the key's plan when there is one that has not
    /// diverged, and is recorded otherwise (as
    /// [`PlanGroup::start_iteration`](workspace_core::planned::PlanGroup::start_iteration)).
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::Backend`] when the device cannot hold the key's plan:
    /// the iteration has started all the same, off the plan (its members allocate from
    /// their own blocks).
    pub fn start_iteration(&self, key: u64) -> Result<()> {
        Ok(self.group.start_iteration(key)?)
    }

    /// Ends the current iteration: a recording is planned (and the arena grown to hold
    /// the plan). Returns whether the iteration was replayed on its plan to the end.
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::InvalidInput`] when called from inside a member's
    /// allocation, or off the group's thread.
    pub fn finish_iteration(&self) -> Result<bool> {
        Ok(self.group.finish_iteration()?)
    }

    /// Ends the current iteration without a verdict (work that failed part-way).
    ///
    /// # Errors
    ///
    /// As [`DevicePlanGroup::finish_iteration`].
    pub fn abandon_iteration(&self) -> Result<()> {
        Ok(self.group.abandon_iteration()?)
    }

    /// Runs `work` as one iteration of shape `key`: started, then finished when it
    /// returns `Ok`, abandoned when it returns `Err` or panics. Returns the work's value
    /// and whether the iteration ran on its plan to the end.
    ///
    /// # Errors
    ///
    /// `work`'s error; [`workspace_core::Error::InvalidInput`] when called from inside a
    /// member's allocation or off the group's thread.
    pub fn iteration<R, E: From<workspace_core::Error>>(
        &self,
        key: u64,
        work: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<(R, bool), E> {
        self.group.iteration(key, work)
    }

    /// Makes the group's arena at least `bytes` long now.
    ///
    /// # Errors
    ///
    /// [`workspace_core::Error::InvalidInput`] while a member's open cycle holds part of
    /// the arena; [`workspace_core::Error::Backend`] when the device cannot provide it.
    pub fn reserve(&self, bytes: usize) -> Result<()> {
        Ok(self.group.reserve(bytes)?)
    }

    /// Gives the group's arena back to the device now (freed on the group's stream after
    /// every member stream's work on it); the plans are kept.
    ///
    /// # Errors
    ///
    /// As [`DevicePlanGroup::reserve`].
    pub fn trim(&self) -> Result<()> {
        Ok(self.group.trim()?)
    }

    /// Bytes of the plan of the current (or last) iteration (0 before the first plan).
    pub fn plan_bytes(&self) -> usize {
        self.group.plan_bytes()
    }

    /// Bytes of the planned arena.
    pub fn capacity(&self) -> usize {
        self.group.capacity()
    }

    /// The group's figures.
    pub fn stats(&self) -> PlannedStats {
        self.group.stats()
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The stream the arena is allocated on.
    pub fn stream(&self) -> &D::Stream {
        &self.stream
    }

    /// The distinct streams of the group: its own and its members'.
    pub fn streams(&self) -> usize {
        self.ledger.streams()
    }

    /// Waits issued so far to order a reuse of the arena's bytes after another stream's
    /// work on them (0 while every member is on the group's stream).
    pub fn cross_stream_waits(&self) -> u64 {
        self.ledger.waits()
    }
}

impl<D: Device> std::fmt::Debug for DevicePlanGroup<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePlanGroup")
            .field("group", &self.group)
            .field("device", &self.device)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}
