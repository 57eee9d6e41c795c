//! A timeline of a whole run's workspace memory, at a bounded cost.
//!
//! A [`Timeline`] records every allocation and every close of the workspaces attached
//! to it, labelled with the role of the cycle ([`ArrayType`], from
//! [`LayerWorkspaceMgr::enter`](crate::LayerWorkspaceMgr::enter)) and the layer that
//! made it ([`layer`]). The run is cut into *iterations* by
//! [`Timeline::end_iteration`] (a network calls it after each step).
//!
//! A steady iteration repeats one before it, so the history stores each distinct
//! iteration once, as a *script* of events, and every iteration as a reference to its
//! script: while an iteration matches the script it is expected to repeat, recording
//! an event is a comparison and nothing is stored; from the first event that differs
//! the iteration keeps its own events, and at its end they are found among the stored
//! scripts or stored as a new one. The records of past iterations are bounded (the
//! last 4,096 with their times, and a sample of the whole run that thins itself as the
//! run grows), so the history's memory does not grow with the run's length; a steady
//! iteration allocates nothing.
//!
//! [`Timeline::snapshot`] copies the history (the scripts are shared, not copied);
//! [`TimelineSnapshot::write_chrome_trace`] exports it in the Chrome trace-event
//! format, which Perfetto (<https://ui.perfetto.dev>) and `chrome://tracing` open: a
//! counter track of live bytes per workspace and a slice per allocation, named by its
//! role and layer.
//!
//! ```
//! use workspace_core::timeline::{self, Timeline};
//! use workspace_core::{ArrayType, LayerWorkspaceMgr, WorkspaceConfig};
//!
//! let mgr = LayerWorkspaceMgr::builder()
//!     .with(ArrayType::Activations, "TL_DOC_ACT", WorkspaceConfig::default())
//!     .default_workspace("TL_DOC_WORKING", WorkspaceConfig::default())
//!     .build()?;
//! let timeline = Timeline::start()?;
//! timeline.attach_mgr(&mgr)?;
//! for _ in 0..100 {
//!     let act = mgr.enter(ArrayType::Activations)?;
//!     let _dense = timeline::layer("dense");
//!     let _x = act.zeros::<f32, _>((32, 64))?;
//!     let working = mgr.enter(ArrayType::FfWorkingMem)?;
//!     let _tmp = working.zeros::<f32, _>(1024)?;
//!     drop(working);
//!     drop(act);
//!     timeline.end_iteration();
//! }
//! let snapshot = timeline.snapshot();
//! assert_eq!(snapshot.iterations_recorded(), 100);
//! assert_eq!(snapshot.scripts().len(), 1); // one distinct iteration, stored once
//! let mut trace = Vec::new();
//! snapshot.write_chrome_trace(&mut trace)?;
//! assert!(String::from_utf8(trace).unwrap().contains("\"traceEvents\""));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A timeline belongs to the thread that started it, as workspaces do: it records the
//! events of its workspaces on that thread, and one timeline records on a thread at a
//! time. Times inside an iteration that repeated a script are the script's, scaled to
//! the iteration's duration (reading the clock at every allocation would cost more than
//! the recording); the order of the events, their sizes and labels are exact.

mod chrome;
mod report;
mod state;

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;

use crate::engine::{Observer, Tap};
use crate::error::{Error, Result};
use crate::layer::LayerWorkspaceMgr;
use crate::plan::{Event, FRAME_LEVEL_SHIFT};
use crate::roles::{ArrayType, NO_ROLE};
use crate::workspace::Workspace;

pub use crate::memory_report::{Holder, MemoryReport, HOLDERS};
pub use chrome::{ChromeTraceSummary, EXPORTED_ITERATIONS};
pub(crate) use state::Step;
use state::{Script, State};

/// No layer is allocating.
pub(crate) const NO_LAYER: u32 = (1 << 24) - 1;

static NEXT_TIMELINE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static STATE: RefCell<Option<Box<State>>> = const { RefCell::new(None) };
}

/// Runs `f` on this thread's slot of the recording timeline, unless the thread is
/// ending or the slot is borrowed (a hook never runs inside another).
#[inline]
fn with_slot<R>(f: impl FnOnce(&mut Option<Box<State>>) -> R) -> Option<R> {
    STATE.try_with(|cell| cell.try_borrow_mut().ok().map(|mut slot| f(&mut slot))).ok().flatten()
}

/// Runs `f` on the state of the timeline recording on this thread, if one does.
#[inline]
fn with_any_state<R>(f: impl FnOnce(&mut State) -> R) -> Option<R> {
    with_slot(|slot| slot.as_deref_mut().map(f)).flatten()
}

/// Runs `f` on the state of timeline `id` if it records on this thread.
#[inline]
fn with_state<R>(id: u64, f: impl FnOnce(&mut State) -> R) -> Option<R> {
    with_any_state(|state| (state.id == id).then(|| f(state))).flatten()
}

/// The index a step keeps of `label` (`NO_LAYER`: none).
#[inline]
fn layer_index(label: Option<LayerLabel>) -> u32 {
    label.map_or(NO_LAYER, |l| l.0)
}

/// What the timeline is to the workspaces it taps: an observer of their events, which
/// records them into the state of the timeline of the tap's `recording` id while it
/// records on this thread.
struct Tapping;

/// The one observer every tap of a timeline names.
static TAPPING: Tapping = Tapping;

impl Observer for Tapping {
    #[inline]
    fn observe(&self, tap: Tap, event: Event, requested: usize, role: u8) -> bool {
        let step = match event {
            Event::Alloc { owner, bytes, .. } => {
                Step::new(bytes as u64, requested as u64, tap.index, level_of(owner), role, false)
            }
            Event::Close { owner } => Step::new(0, 0, tap.index, level_of(owner), NO_ROLE, true),
        };
        with_state(tap.recording, |state| state.event(step)).is_some()
    }

    fn fill(&self, tap: Tap, report: &mut MemoryReport) -> bool {
        with_state(tap.recording, |state| report::fill(report, state, tap.index)).is_some()
    }
}

/// The level of an owner of the engine's events: 0 for the cycle, a frame's level.
#[inline]
fn level_of(owner: u64) -> u32 {
    (owner >> FRAME_LEVEL_SHIFT) as u32
}

/// The names of layer labels, process-wide: a label is an index into them.
struct Names {
    list: Vec<Arc<str>>,
    index: HashMap<Arc<str>, u32, BuildHasherDefault<std::collections::hash_map::DefaultHasher>>,
}

static NAMES: Mutex<Names> =
    Mutex::new(Names { list: Vec::new(), index: HashMap::with_hasher(BuildHasherDefault::new()) });

fn names() -> std::sync::MutexGuard<'static, Names> {
    NAMES.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The name of label `id`, if there is one.
pub(crate) fn label_name(id: u32) -> Option<Arc<str>> {
    names().list.get(id as usize).cloned()
}

/// A layer's name, interned once (process-wide), to label allocations without
/// comparing strings at each step ([`labelled`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerLabel(u32);

impl LayerLabel {
    /// The label of layer `name` (the same label for the same name, on any thread).
    pub fn new(name: &str) -> LayerLabel {
        let mut names = names();
        if let Some(&id) = names.index.get(name) {
            return LayerLabel(id);
        }
        // Past 16,777,214 names, the last label stands for every later one.
        let id = u32::try_from(names.list.len()).unwrap_or(NO_LAYER - 1).min(NO_LAYER - 1);
        if id == NO_LAYER - 1 && names.list.len() > id as usize {
            return LayerLabel(id);
        }
        let name: Arc<str> = name.into();
        names.list.push(name.clone());
        names.index.insert(name, id);
        LayerLabel(id)
    }

    /// The layer's name.
    pub fn name(self) -> Arc<str> {
        label_name(self.0).unwrap_or_else(|| "?".into())
    }
}

/// Labels what the thread allocates, until the guard drops, as made by the layer of
/// `label` (when a timeline records on this thread; otherwise it does nothing and
/// costs a thread-local read). Guards nest: dropping one restores the label before it.
#[must_use = "the label holds until the guard drops"]
#[inline]
pub fn labelled(label: LayerLabel) -> LayerGuard {
    let previous = with_any_state(|state| (state.id, std::mem::replace(&mut state.layer, label.0)));
    LayerGuard { previous, _thread: PhantomData }
}

/// Labels what the thread allocates from now on as made by the layer of `label`
/// (`None`: no layer), until the next call or guard: [`labelled`] without a guard, for
/// code that labels each part of a step in turn and clears the label at its end.
#[inline]
pub fn set_layer(label: Option<LayerLabel>) {
    with_any_state(|state| state.layer = layer_index(label));
}

/// [`labelled`] by name: the name is interned (under a process-wide lock) only while a
/// timeline records on this thread. Code that labels at every step keeps a
/// [`LayerLabel`] instead.
#[must_use = "the label holds until the guard drops"]
pub fn layer(name: &str) -> LayerGuard {
    if !is_active() {
        return LayerGuard { previous: None, _thread: PhantomData };
    }
    labelled(LayerLabel::new(name))
}

/// Restores the layer label before it when dropped (see [`layer`]).
#[derive(Debug)]
pub struct LayerGuard {
    previous: Option<(u64, u32)>,
    _thread: PhantomData<*const ()>,
}

impl Drop for LayerGuard {
    fn drop(&mut self) {
        if let Some((id, previous)) = self.previous {
            with_state(id, |state| state.layer = previous);
        }
    }
}

/// A timeline's identity ([`Timeline::id`]): what code that does not hold the
/// timeline keeps to act on it, and on no other, while it records on this thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TimelineId(u64);

impl TimelineId {
    /// [`Timeline::end_iteration`], if the timeline still records on this thread.
    pub fn end_iteration(self) {
        with_state(self.0, State::end_iteration);
    }

    /// [`set_layer`], if the timeline still records on this thread.
    #[inline]
    pub fn set_layer(self, label: Option<LayerLabel>) {
        with_state(self.0, |state| state.layer = layer_index(label));
    }

    /// Whether the timeline records on this thread.
    pub fn is_recording(self) -> bool {
        with_state(self.0, |_| ()).is_some()
    }
}

/// Pauses the timeline recording on this thread, if one does, until the guard drops:
/// nothing that happens meanwhile is recorded (its workspaces' events are dropped), and
/// another timeline may record meanwhile (a dry run sizes a network under one of its
/// own this way). A guard that is forgotten (`mem::forget`) ends the paused timeline's
/// recording for good: it is dropped with the thread.
#[must_use = "the timeline is paused until the guard drops"]
pub fn suspend() -> Suspended {
    let paused = with_slot(Option::take).flatten();
    Suspended { paused, _thread: PhantomData }
}

/// A paused timeline ([`suspend`]), recording again when this drops (unless another
/// records on the thread then: the paused one is then dropped).
pub struct Suspended {
    paused: Option<Box<State>>,
    _thread: PhantomData<*const ()>,
}

impl std::fmt::Debug for Suspended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Suspended").field("paused", &self.paused.is_some()).finish()
    }
}

impl Drop for Suspended {
    fn drop(&mut self) {
        if let Some(paused) = self.paused.take() {
            with_slot(|slot| {
                if slot.is_none() {
                    *slot = Some(paused);
                }
            });
        }
    }
}

/// The timeline recording `workspace` on this thread, if one does.
pub fn recording(workspace: &Workspace) -> Option<TimelineId> {
    let tap = workspace.shell.engine().tap()?;
    let id = TimelineId(tap.recording);
    id.is_recording().then_some(id)
}

/// Ends the iteration of the timeline recording on this thread, if one does (what
/// [`Timeline::end_iteration`] does, for code that does not hold the timeline).
pub fn end_iteration() {
    with_any_state(State::end_iteration);
}

/// Whether a timeline records on this thread.
pub fn is_active() -> bool {
    STATE.try_with(|cell| cell.try_borrow().map(|s| s.is_some()).unwrap_or(true)).unwrap_or(false)
}

/// The recording timeline of this thread; see the module docs.
///
/// Dropping it ends the recording: its workspaces leave it at their next cycle.
#[derive(Debug)]
pub struct Timeline {
    id: u64,
    _thread: PhantomData<*const ()>,
}

impl Timeline {
    /// Starts recording on this thread (no workspace is attached yet).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when a timeline already records on this thread.
    pub fn start() -> Result<Timeline> {
        let id = NEXT_TIMELINE.fetch_add(1, Ordering::Relaxed);
        let started = with_slot(|slot| match slot {
            Some(_) => Err(Error::InvalidInput(
                "a timeline already records on this thread: drop it (or take its snapshot and drop it) before \
                 starting another"
                    .into(),
            )),
            None => {
                *slot = Some(Box::new(State::new(id)));
                Ok(())
            }
        });
        started.ok_or_else(busy)??;
        Ok(Timeline { id, _thread: PhantomData })
    }

    /// Its identity.
    pub fn id(&self) -> TimelineId {
        TimelineId(self.id)
    }

    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> Result<R> {
        with_state(self.id, f).ok_or_else(busy)
    }

    /// Records the events of `workspace` from its next cycle on.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while the workspace is open; [`Error::InvalidInput`] for a
    /// 65,537th workspace.
    pub fn attach(&self, workspace: &Workspace) -> Result<()> {
        let index = self.with(|state| state.add_workspace(workspace.id(), workspace.name()))?;
        let Some(index) = index else {
            return Err(Error::InvalidInput("a timeline records 65,536 workspaces at most".into()));
        };
        workspace.shell.engine().set_tap(Some(Tap { observer: &TAPPING, recording: self.id, index }))
    }

    /// Records the events of every workspace of `mgr` (each once).
    ///
    /// # Errors
    ///
    /// As [`Timeline::attach`].
    pub fn attach_mgr(&self, mgr: &LayerWorkspaceMgr) -> Result<()> {
        mgr.workspaces().try_for_each(|ws| self.attach(ws))
    }

    /// Stops recording `workspace` (its events so far stay in the history).
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while the workspace is open.
    pub fn detach(&self, workspace: &Workspace) -> Result<()> {
        workspace.shell.engine().set_tap(None)
    }

    /// Ends the iteration in progress: the events since the last call are one
    /// iteration of the history.
    pub fn end_iteration(&self) {
        let _ = self.with(State::end_iteration);
    }

    /// Iterations ended so far.
    pub fn iterations(&self) -> u64 {
        self.with(|s| s.iterations).unwrap_or(0)
    }

    /// Events of the iterations ended so far.
    pub fn events(&self) -> u64 {
        self.with(|s| s.events).unwrap_or(0)
    }

    /// Bytes of heap the history holds: the scripts, the records of past iterations,
    /// the names and the iteration in progress. Flat once every distinct iteration of a
    /// run has been seen, however long the run.
    pub fn history_bytes(&self) -> usize {
        self.with(|s| s.heap_bytes()).unwrap_or(0)
    }

    /// A copy of the history now (the scripts shared, not copied).
    pub fn snapshot(&self) -> TimelineSnapshot {
        self.with(|state| TimelineSnapshot {
            workspaces: state.workspaces.clone(),
            layers: names().list.clone(),
            scripts: state.scripts.clone(),
            stats: state.stats.clone(),
            records: merged_records(state),
            iterations: state.iterations,
            events: state.events,
            unstored: state.unstored,
            history_bytes: state.heap_bytes(),
        })
        .unwrap_or_else(|_| TimelineSnapshot::default())
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        with_slot(|slot| {
            if slot.as_ref().is_some_and(|s| s.id == self.id) {
                *slot = None;
            }
        });
    }
}

fn busy() -> Error {
    Error::InvalidInput("the timeline is not recording on this thread (or is in use by the call that asks)".into())
}

/// The sample of the whole run and the recent iterations, in order, each once.
fn merged_records(state: &State) -> Vec<IterationRecord> {
    let mut records: Vec<IterationRecord> = Vec::with_capacity(state.samples.len() + state.recent.len());
    let first_recent = state.recent.front().map_or(u64::MAX, |r| r.index);
    records.extend(state.samples.iter().filter(|r| r.index < first_recent));
    records.extend(state.recent.iter());
    records
}

/// The moment of an iteration with the most bytes live ([`TimelineSnapshot::peak`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Peak {
    /// Bytes live then (padded to each workspace's alignment unit).
    pub bytes: u64,
    /// Bytes live then, as asked for.
    pub requested: u64,
    /// The five largest holders then, most bytes first.
    pub holders: Vec<Holder>,
}

/// One iteration of the history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IterationRecord {
    /// Its place in the run, from 0.
    pub index: u64,
    /// The script it repeated (`None`: unlike every stored script, and the store was
    /// full).
    pub script: Option<u32>,
    /// Nanoseconds from the timeline's start to the iteration's start.
    pub start_ns: u64,
    /// Its duration in nanoseconds.
    pub duration_ns: u64,
    /// Its events.
    pub events: u64,
}

/// The figures of one script (a distinct iteration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScriptStats {
    /// Its id (its place among the scripts).
    pub script: u32,
    /// Its events.
    pub events: usize,
    /// The most bytes, as asked for, live at once in it.
    pub lower_bound: u64,
    /// The most bytes, padded, live at once in it.
    pub peak_bytes: u64,
    /// The first and the last iteration that repeated it.
    pub first_iteration: u64,
    /// See `first_iteration`.
    pub last_iteration: u64,
    /// Iterations that repeated it.
    pub iterations: u64,
    /// Their total duration in nanoseconds.
    pub total_ns: u64,
}

/// One event of a script, as a user reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimelineEvent {
    /// The workspace's name.
    pub workspace: Arc<str>,
    /// What happened.
    pub kind: EventKind,
    /// 0 for the cycle, the frame's level for a frame (levels past 32,767 share it).
    pub level: u16,
    /// The role of the cycle (an allocation's; `None` for a close, or a workspace not
    /// entered through a [`LayerWorkspaceMgr`]).
    pub role: Option<ArrayType>,
    /// The layer that was allocating ([`layer`]), if any.
    pub layer: Option<Arc<str>>,
    /// Nanoseconds from the start of the iteration the script was recorded in.
    pub time_ns: u64,
}

/// What an event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// An allocation.
    Alloc {
        /// Bytes it takes (padded to the workspace's alignment unit).
        bytes: u64,
        /// Bytes it asked for.
        requested: u64,
    },
    /// The close of the cycle (level 0) or a frame: what it allocated is dead.
    Close,
}

/// A copy of a timeline's history (see [`Timeline::snapshot`]).
#[derive(Clone, Default)]
pub struct TimelineSnapshot {
    workspaces: Vec<Arc<str>>,
    layers: Vec<Arc<str>>,
    scripts: Vec<Arc<Script>>,
    stats: Vec<ScriptStats>,
    records: Vec<IterationRecord>,
    iterations: u64,
    events: u64,
    unstored: u64,
    history_bytes: usize,
}

impl std::fmt::Debug for TimelineSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimelineSnapshot")
            .field("workspaces", &self.workspaces)
            .field("scripts", &self.scripts.len())
            .field("iterations", &self.iterations)
            .field("events", &self.events)
            .finish()
    }
}

impl TimelineSnapshot {
    /// Iterations the run had when the snapshot was taken.
    pub fn iterations_recorded(&self) -> u64 {
        self.iterations
    }

    /// Events of those iterations.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Iterations unlike every stored script when the store was full (counted only).
    pub fn unstored_iterations(&self) -> u64 {
        self.unstored
    }

    /// Bytes the history held (see [`Timeline::history_bytes`]).
    pub fn history_bytes(&self) -> usize {
        self.history_bytes
    }

    /// The workspaces recorded, in the order they were attached.
    pub fn workspaces(&self) -> &[Arc<str>] {
        &self.workspaces
    }

    /// The figures of every script.
    pub fn scripts(&self) -> &[ScriptStats] {
        &self.stats
    }

    /// The iterations kept: a sample of the whole run, then the most recent ones, in
    /// order.
    pub fn records(&self) -> &[IterationRecord] {
        &self.records
    }

    /// The events of script `id` (empty for an unknown id).
    pub fn script_events(&self, id: u32) -> Vec<TimelineEvent> {
        let Some(script) = self.scripts.get(id as usize) else { return Vec::new() };
        script.steps.iter().zip(&script.times).map(|(step, &time_ns)| self.event(step, time_ns)).collect()
    }

    fn event(&self, step: &Step, time_ns: u64) -> TimelineEvent {
        TimelineEvent {
            workspace: self.workspaces.get(usize::from(step.workspace())).cloned().unwrap_or_else(|| "?".into()),
            kind: match step.close() {
                true => EventKind::Close,
                false => EventKind::Alloc { bytes: step.bytes, requested: step.requested },
            },
            level: step.level(),
            role: ArrayType::from_index(step.role()),
            layer: self.layer_name(step.layer()),
            time_ns,
        }
    }

    /// The moment of script `id` with the most bytes live, and the five largest holders
    /// then by workspace, role and layer (`None` for an unknown id).
    pub fn peak(&self, id: u32) -> Option<Peak> {
        let script = self.scripts.get(id as usize)?;
        // The first moment with the most bytes live, then the holders at it.
        let (mut at, mut most) = (0, 0);
        let mut live = state::LiveSet::default();
        for (i, step) in script.steps.iter().enumerate() {
            live.apply(step);
            if live.bytes > most {
                (at, most) = (i, live.bytes);
            }
        }
        let mut live = state::LiveSet::default();
        script.steps.iter().take(at + 1).for_each(|s| live.apply(s));
        let steps: Vec<Step> = live.steps().copied().collect();
        let peak =
            Peak { bytes: live.bytes, requested: live.requested, holders: report::holders(&steps, &self.workspaces) };
        Some(peak)
    }

    fn layer_name(&self, layer: u32) -> Option<Arc<str>> {
        self.layers.get(layer as usize).cloned()
    }
}
