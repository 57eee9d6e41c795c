//! Device workspaces for carve: the host workspace semantics of `workspace-core` on CUDA
//! device memory, ordered by streams and events, tested without a GPU.
//!
//! # Host concepts and their device counterparts
//!
//! | host (`workspace-core`) | device (this crate) |
//! |---|---|
//! | [`Workspace`]: one arena, `Send + !Sync` | [`DeviceWorkspace<D>`]: one device arena, bound to one stream |
//! | [`Scope`]: the open cycle | [`DeviceScope`]: the open cycle; its reset is ordered on the stream |
//! | [`Frame`]: a release point inside a cycle | [`DeviceFrame`]: the same, its bytes reused only after every stream that used them |
//! | [`PlanGroup`]: one planned arena for an iteration's workspaces | [`DevicePlanGroup`]: one device allocation; reuse across members' streams ordered by events |
//! | `ArrayViewMut<'scope, T, D>` | [`DeviceViewMut`], [`DeviceView`], [`DeviceUninit`] (same lifetimes) |
//! | [`Handle`]: checked on every access | [`DeviceHandle`]: the same checks, the same errors |
//! | `detach()` → `ndarray::Array` | [`DeviceView::detach`] → [`DeviceArray`]; [`DeviceView::to_host`] |
//! | `leverage_to(&outer_scope)` | [`DeviceView::leverage_to`], [`DeviceHandle::leverage_to_workspace`] |
//! | threads: one at a time | streams: others only through [`DeviceScope::on_stream`] ([`OnStream`]) |
//! | [`HostBackend`] under the [`Engine`] | [`DeviceBackend`], [`PinnedBackend`] under the same engine |
//! | host RAM | page-locked staging: [`PinnedWorkspace`], [`PinnedArray`]; copies named `htod`/`dtoh` |
//! | async-iter's [`Prefetcher`] and [`Lease`] | [`DevicePrefetcher`] and [`DeviceLease`]: batches staged in pinned memory, copied into a device ring ahead of use |
//! | — | the device layer: [`Device`], [`CudaDevice`] (cudarc), [`SimDevice`] (host memory; [`device::sim`]), [`probe()`] |
//!
//! [`SimDevice`]: device::sim::SimDevice
//! [`Workspace`]: workspace_core::Workspace
//! [`Scope`]: workspace_core::Scope
//! [`Frame`]: workspace_core::Frame
//! [`PlanGroup`]: workspace_core::planned::PlanGroup
//! [`Handle`]: workspace_core::Handle
//! [`HostBackend`]: workspace_core::backend::HostBackend
//! [`Engine`]: workspace_core::backend::Engine
//! [`Prefetcher`]: async_iter::Prefetcher
//! [`Lease`]: async_iter::Lease
//!
//! Configuration, learning, spilling, circular reset, budgets, generations and
//! statistics are those of the host engine, unchanged: the device arena is one more
//! backend under it. Offsets are aligned to 256 bytes, or to the configured alignment
//! when that is larger (up to [`MAX_DEVICE_ALIGNMENT`]).
//!
//! # A tour (on the simulated device, so it runs anywhere)
//!
//! ```
//! use workspace_cuda::device::sim::SimDevice;
//! use workspace_cuda::{Device, DeviceWorkspace, PinnedWorkspace};
//! use workspace_core::WorkspaceConfig;
//!
//! let gpu = SimDevice::new()?; // or CudaDevice::new(0)? where there is one
//! let ws = DeviceWorkspace::new("TRAIN", WorkspaceConfig::default(), &gpu, &gpu.default_stream())?;
//! let staging = PinnedWorkspace::for_transfers("STAGE", &gpu, 64 * 1024)?;
//! let mut kept = Vec::new();
//! for step in 0..5 {
//!     let stage = staging.enter()?;
//!     let batch = stage.filled::<f32, _>((32, 64), step as f32)?; // pinned host memory
//!     let scope = ws.enter()?; // one iteration
//!     let x = scope.htod_pinned(&batch)?; // asynchronous copy on the workspace's stream
//!     let mut h = scope.zeros::<f32, _>((32, 64))?;
//!     h.copy_from(&x)?; // a kernel would go here
//!     kept.push(h.detach()?); // an owned device array that outlives the reset
//! } // reset: O(1), ordered on the stream
//! assert_eq!(kept[4].to_host()?.sum(), 4.0 * 32.0 * 64.0);
//! let stats = ws.stats();
//! assert_eq!((stats.cycles, stats.growth_events), (5, 1)); // learned in the first cycle
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! On a machine without CUDA, [`CudaDevice::new`] and [`probe()`] say why, as values:
//!
//! ```
//! match workspace_cuda::CudaDevice::new(0) {
//!     Ok(gpu) => println!("{}", gpu.name()),
//!     Err(err) => println!("{err}"), // no CUDA device: <reason>
//! }
//! ```
//!
//! # Safety and ordering
//!
//! Views borrow their scope, so no safe code uses device memory after its reset. The
//! reset itself is stream-ordered: work issued to the workspace's stream runs before
//! anything that reuses the memory, and every other stream that used it (declared with
//! [`DeviceScope::on_stream`], or by a copy across workspaces on different streams) is
//! made to finish first by an event the workspace's stream waits for. Within a cycle,
//! work on another stream is recorded when it is issued, and the workspace's stream
//! waits for it before touching the same memory, so none of this rests on a destructor
//! running: leaking an [`OnStream`] or a scope with `mem::forget` may keep memory
//! longer, never hand it out or overwrite it early. Pinned memory is
//! handed out again only after the transfers that used it have completed. The
//! [`SimDevice`] runs each stream on its own thread and can hold or delay streams, so
//! the tests show both that the waits are there and that a missing wait would be seen.
//!
//! Unsafe code lives in a few modules, each behind safe methods: `device` (driver calls
//! and the simulator, behind the sealed [`Device`] trait), `backend` (the `unsafe impl`s
//! of the core's backend traits), `transfer` (every copy and fill a workspace issues: the
//! only caller of the device's unsafe copies, behind the views' and [`OnStream`]'s
//! methods), `view` (the views' unsafe constructors, reached through safe ones that carry
//! their proof: a fresh reservation in a scope, and a borrowed array or a checked handle,
//! whose `view` methods are in `array` and `handle`, next to the invariants they rest
//! on), `pinned` (host views of page-locked memory), `prefetch` (the staging copy into
//! the device ring, and views of its slots), `probe` (loading the driver) and `planned`
//! (joining a device workspace to a plan group, whose reuse the ledger orders);
//! `workspace` declares its stream-ordering hooks `unsafe fn` (only the shell runs them)
//! without unsafe code in them. Streams hold none, and scopes only the `unsafe impl`s of
//! the reservation contract views rest on: a scope holds the shell's
//! [`Open`](workspace_core::backend::Open) count, whose drop closes it. Every block says
//! why it is sound.

#![deny(unsafe_code)]
// A link that does not resolve renders as literal brackets: an error, in private docs too.
#![deny(rustdoc::broken_intra_doc_links, rustdoc::private_intra_doc_links)]

mod array;
#[allow(unsafe_code)]
mod backend;
#[allow(unsafe_code)]
pub mod device;
mod error;
mod handle;
mod ledger;
mod memory;
#[allow(unsafe_code)]
mod pinned;
#[allow(unsafe_code)]
mod planned;
#[allow(unsafe_code)]
mod prefetch;
#[allow(unsafe_code)]
mod probe;
mod scope;
mod stream;
#[allow(unsafe_code)]
mod transfer;
#[allow(unsafe_code)]
mod view;
mod workspace;

pub use array::DeviceArray;
pub use backend::{DeviceBackend, DeviceBlock, PinnedBackend, PinnedBlock};
pub use cudarc;
pub use device::cuda::{CudaDevice, CudaMemory, CudaPinned};
pub use device::{Device, DEVICE_ALIGNMENT, MAX_DEVICE_ALIGNMENT, PINNED_ALIGNMENT};
pub use error::{DeviceError, Error, Result};
pub use handle::DeviceHandle;
pub use pinned::{PendingTransfers, PinnedArray, PinnedScope, PinnedWorkspace};
pub use planned::DevicePlanGroup;
pub use prefetch::{DeviceBatch, DeviceLease, DevicePrefetchStats, DevicePrefetcher, DevicePrefetcherBuilder};
pub use probe::{probe, Probe, DISABLE_ENV};
pub use scope::{DeviceFrame, DeviceScope};
pub use stream::OnStream;
pub use view::{DeviceUninit, DeviceView, DeviceViewMut};
pub use workspace::{DeviceWorkspace, StreamOrder};

/// The simulator's former paths at the root, kept working; its types are under [`device::sim`].
#[doc(hidden)]
pub use device::sim::{SimDevice, SimEvent, SimHold, SimMemory, SimPinned, SimStream, POISON};
