//! The engine's observers: everything that is told what a workspace does, in one list
//! with one emit.
//!
//! Three kinds of observer watch a workspace, each set on its own terms:
//!
//! - the *recorder* ([`Engine::record_into`]), a [`Member`] that appends every event to
//!   a trace; the fast path is off while it is set, so it sees every allocation;
//! - the *member* ([`Engine::join`]), a plan group's [`Member`]; it lends windows and
//!   decides misses (`window.rs`), and is told every event but those it knows already:
//!   the allocations its windows serve on the fast path (its plan placed them) and its
//!   cycle's close, which it hears with its windows ([`Member::cycle_closed`]);
//! - the *tap*, an [`Observer`] that is told every allocation (on the fast path too)
//!   and every close, and fills in the report of a failure: what a
//!   [`Timeline`](crate::timeline::Timeline) sets on the workspaces attached to it.
//!
//! Each event is emitted once, by [`Engine::emit`], to the observers set. The engine
//! knows them through these traits only: nothing under `engine/` names a timeline, a
//! plan group or a trace recorder's owner.
//!
//! # Cost
//!
//! A workspace that nothing observes pays one predictable branch per allocation on the
//! fast path (the tap's test, as `fast_limit` already covers the recorder and the
//! member's own decisions) and nothing else. A tapped workspace keeps its bump
//! allocation and tells its tap out of line.

use std::cell::{Cell, RefCell};

use super::member::Member;
use super::{align_up, Engine};
use crate::backend::ArenaBackend;
use crate::error::Result;
use crate::memory_report::MemoryReport;
use crate::plan::Event;

/// What watches every allocation and close of the workspaces it taps; see the module
/// docs. Called only on the workspace's thread, from inside the engine's call, and never
/// calls back into the engine.
pub(crate) trait Observer: Sync {
    /// `event` happened in the workspace of `tap` (`requested`: the bytes an
    /// allocation asked for, before padding; `role`: the open cycle's
    /// [`ArrayType::index`](crate::ArrayType), or [`NO_ROLE`](crate::roles::NO_ROLE)).
    /// Whether the observer still watches the workspace: when it does not (a timeline
    /// that ended), the engine lets go of the tap.
    fn observe(&self, tap: Tap, event: Event, requested: usize, role: u8) -> bool;

    /// Fills in what it knows of the memory behind a failure in the workspace of `tap`
    /// (`report` has what the workspace knows alone); whether it did.
    fn fill(&self, tap: Tap, report: &mut MemoryReport) -> bool;
}

/// A workspace's place in what observes it: the observer, and the observer's own keys
/// for it (which recording, and the workspace's index in it).
#[derive(Clone, Copy)]
pub(crate) struct Tap {
    pub(crate) observer: &'static dyn Observer,
    pub(crate) recording: u64,
    pub(crate) index: u16,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap").field("recording", &self.recording).field("index", &self.index).finish()
    }
}

/// The observers of one workspace; see the module docs.
pub(super) struct Observers<B: ArenaBackend> {
    /// Whether `recorder` is set: the fast path is off meanwhile, so that every
    /// allocation passes the recorder.
    pub(super) recording: Cell<bool>,
    /// The recorder: a [`Member`] that sees every event.
    pub(super) recorder: RefCell<Option<Box<dyn Member<B>>>>,
    /// Whether this workspace is a member of a plan group (`member` is set).
    pub(super) grouped: Cell<bool>,
    /// The plan group this workspace is a member of (see `member.rs`).
    pub(super) member: RefCell<Option<Box<dyn Member<B>>>>,
    /// The tap: told every allocation (on the fast path too) and every close.
    pub(super) tap: Cell<Option<Tap>>,
}

impl<B: ArenaBackend> Observers<B> {
    pub(super) fn new() -> Observers<B> {
        Observers {
            recording: Cell::new(false),
            recorder: RefCell::new(None),
            grouped: Cell::new(false),
            member: RefCell::new(None),
            tap: Cell::new(None),
        }
    }

    /// Whether a tap is set: the one test of the fast path.
    #[inline(always)]
    pub(super) fn tapped(&self) -> bool {
        self.tap.get().is_some()
    }

    /// Whether any observer is set.
    #[inline(always)]
    pub(super) fn any(&self) -> bool {
        self.tapped() || self.recording.get() || self.grouped.get()
    }

    /// Whether an observer is set that hears of a cycle's close from
    /// [`Engine::emit`] (the member hears of it from `close_grouped`).
    #[inline(always)]
    pub(super) fn watch_closes(&self) -> bool {
        self.tapped() || self.recording.get()
    }
}

impl<B: ArenaBackend> Engine<B> {
    /// Tells the observers of `event` (`requested`: the bytes an allocation asked for),
    /// each once: the tap, the recorder, and the member unless `to_member` is false (an
    /// allocation its window served on the fast path, or its cycle's close).
    #[cold]
    #[inline(never)]
    pub(super) fn emit(&self, event: Event, requested: usize, to_member: bool) {
        let observers = &self.observers;
        if let Some(tap) = observers.tap.get() {
            if !tap.observer.observe(tap, event, requested, self.role.get()) {
                // The observer ended (or watches on another thread): let go of it.
                observers.tap.set(None);
            }
        }
        if observers.recording.get() {
            if let Some(recorder) = observers.recorder.borrow().as_ref() {
                recorder.event(event);
            }
        }
        if to_member && observers.grouped.get() {
            if let Some(member) = observers.member.borrow().as_ref() {
                member.event(event);
            }
        }
    }

    /// [`Engine::emit`] of an allocation of `size` bytes at `align` by the owner at
    /// `level`, as the cycle accounts for it: padded to the alignment unit.
    #[cold]
    #[inline(never)]
    pub(super) fn emit_alloc(&self, level: u32, size: usize, align: usize, to_member: bool) {
        let bytes = align_up(size, self.min_align).unwrap_or(usize::MAX);
        let event = Event::Alloc { owner: self.owner_at(level), bytes, align: align.max(self.min_align) };
        self.emit(event, size, to_member);
    }

    /// Makes `tap` this workspace's tap from its next cycle on (`None`: none). The fast
    /// path stays on: it tests for a tap.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`](crate::Error::StillOpen) while a scope is open.
    pub(crate) fn set_tap(&self, tap: Option<Tap>) -> Result<()> {
        self.require_closed("attaching a timeline or detaching it")?;
        self.observers.tap.set(tap);
        Ok(())
    }

    /// The tap, if one is set.
    pub(crate) fn tap(&self) -> Option<Tap> {
        self.observers.tap.get()
    }

    /// The tap fills in `report` (a failure's in this workspace), if one is set; whether
    /// it did.
    pub(super) fn fill_report(&self, report: &mut MemoryReport) -> bool {
        self.observers.tap.get().is_some_and(|tap| tap.observer.fill(tap, report))
    }
}
