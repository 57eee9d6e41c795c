//! The recording state of the thread's timeline: the scripts (each distinct iteration's
//! events, stored once), the iteration in progress (a position in the script it is
//! expected to repeat, or its own events from the first one that differs), and the
//! bounded records of past iterations.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::{IterationRecord, ScriptStats, NO_LAYER};
use crate::plan::{self, Event, FRAME_LEVEL_SHIFT};

/// Iterations kept with their times, most recent last.
pub(super) const RECENT: usize = 4096;
/// Iterations kept as a sample of the whole run (every `stride`-th; the stride doubles
/// when the sample is full).
pub(super) const SAMPLES: usize = 1024;
/// Distinct iterations stored: an iteration unlike all of them is counted, not stored.
pub(super) const MAX_SCRIPTS: usize = 1024;
/// Events all stored scripts hold together, at most.
pub(super) const MAX_STORED_EVENTS: usize = 1 << 21;
/// Events one iteration keeps, at most (an iteration never ended, or a very long one,
/// has the rest counted only: it is not stored).
pub(super) const MAX_ITERATION_EVENTS: usize = 1 << 18;

/// One event of an iteration, as compared with the script it is expected to repeat:
/// three words, compared as three words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Step {
    /// Bytes of an allocation, padded to the workspace's alignment unit (0 for a close).
    pub(crate) bytes: u64,
    /// Bytes the allocation asked for.
    pub(crate) requested: u64,
    /// The layer allocating (bits 0-23: a [`LayerLabel`](super::LayerLabel)'s index,
    /// `NO_LAYER`: none), the workspace (24-39: its index in the timeline), the
    /// owner's level (40-54: 0 for the cycle, a frame's level, at most `MAX_LEVEL`),
    /// whether it is a close (55) and the role of the cycle (56-63: `ArrayType::index`,
    /// `NO_ROLE`: none).
    key: u64,
}

/// The deepest frame level a step tells apart (deeper levels share it).
pub(crate) const MAX_LEVEL: u32 = (1 << 15) - 1;

impl Step {
    #[inline]
    pub(crate) fn new(bytes: u64, requested: u64, workspace: u16, level: u32, role: u8, close: bool) -> Step {
        let key = u64::from(NO_LAYER)
            | u64::from(workspace) << 24
            | u64::from(level.min(MAX_LEVEL)) << 40
            | u64::from(close) << 55
            | u64::from(role) << 56;
        Step { bytes, requested, key }
    }

    #[inline]
    fn with_layer(self, layer: u32) -> Step {
        Step { key: (self.key & !0xff_ffff) | u64::from(layer.min(NO_LAYER)), ..self }
    }

    pub(crate) fn layer(&self) -> u32 {
        self.key as u32 & NO_LAYER
    }

    pub(crate) fn workspace(&self) -> u16 {
        (self.key >> 24) as u16
    }

    pub(crate) fn level(&self) -> u16 {
        (self.key >> 40) as u16 & 0x7fff
    }

    pub(crate) fn close(&self) -> bool {
        self.key >> 55 & 1 == 1
    }

    /// Whether `self`, a close, ends `alloc`: the close of a cycle ends everything its
    /// workspace allocated; a frame's close what that frame allocated (frames may close
    /// out of order: one below the top ends only its own).
    #[inline]
    pub(crate) fn ends(&self, alloc: &Step) -> bool {
        alloc.workspace() == self.workspace() && (self.level() == 0 || alloc.level() == self.level())
    }

    pub(crate) fn role(&self) -> u8 {
        (self.key >> 56) as u8
    }

    /// The step as an event of the plan's vocabulary, of `bytes` bytes if an
    /// allocation: its owner is the workspace's cycle (level 0) or the frame of its
    /// level, so that a close ends what [`Step::ends`] says it ends.
    #[inline]
    pub(crate) fn event(&self, bytes: u64) -> Event {
        let owner = u64::from(self.workspace()) | u64::from(self.level()) << FRAME_LEVEL_SHIFT;
        match self.close() {
            true => Event::Close { owner },
            false => Event::Alloc { owner, bytes: usize::try_from(bytes).unwrap_or(usize::MAX), align: 1 },
        }
    }
}

/// The plan's lower bound ([`plan::lower_bound`]) of `steps`: the most bytes live at
/// one moment, as asked for (`padded` false) or padded to each workspace's alignment
/// unit.
pub(crate) fn lower_bound<'a>(steps: impl IntoIterator<Item = &'a Step>, padded: bool) -> u64 {
    let events = steps.into_iter().map(|s| s.event(if padded { s.bytes } else { s.requested }));
    plan::lower_bound(events) as u64
}

/// A hash of `steps` (multiply-rotate over their words: an iteration that diverged
/// is looked up among the scripts at its end, so this is on the path of every such
/// iteration).
fn hash_steps(steps: &[Step]) -> u64 {
    let mix = |h: u64, w: u64| (h.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    steps.iter().fold(steps.len() as u64, |h, s| mix(mix(mix(h, s.bytes), s.requested), s.key))
}

/// A distinct iteration: its events, their times in the iteration it was recorded in,
/// and figures derived from them once.
pub(crate) struct Script {
    pub(crate) steps: Vec<Step>,
    /// Nanoseconds from the start of the recorded iteration, per step.
    pub(crate) times: Vec<u64>,
    /// The recorded iteration's duration.
    pub(crate) duration_ns: u64,
    /// The most bytes (as asked for) live at once.
    pub(crate) lower_bound: u64,
    /// The most bytes (padded) live at once.
    pub(crate) peak_bytes: u64,
    /// The allocations still live at its end (a cycle open across the iteration's
    /// end): the next iteration starts with them.
    pub(crate) tail: Vec<Step>,
}

impl Script {
    fn new(steps: Vec<Step>, times: Vec<u64>, duration_ns: u64) -> Script {
        let peak_bytes = lower_bound(&steps, true);
        let lower_bound = lower_bound(&steps, false);
        let tail = LiveSet::from(&steps).steps().copied().collect();
        Script { steps, times, duration_ns, lower_bound, peak_bytes, tail }
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        (self.steps.capacity() + self.tail.capacity()) * std::mem::size_of::<Step>() + self.times.capacity() * 8
    }
}

/// The allocations live at a moment of an iteration, grouped by workspace and level
/// (what a close ends is one group, or a workspace's groups), with running totals: a
/// walk over an iteration costs its events times its groups, not times what is live.
#[derive(Default)]
pub(crate) struct LiveSet {
    groups: Vec<(u16, u16, Vec<Step>)>,
    /// Bytes live, as asked for.
    pub(crate) requested: u64,
    /// Bytes live, padded.
    pub(crate) bytes: u64,
}

impl LiveSet {
    /// Those live at the start of an iteration: `before`.
    pub(crate) fn from(before: &[Step]) -> LiveSet {
        let mut live = LiveSet::default();
        before.iter().for_each(|s| live.apply(s));
        live
    }

    /// After `step`.
    pub(crate) fn apply(&mut self, step: &Step) {
        if step.close() {
            for (ws, level, list) in &mut self.groups {
                if *ws == step.workspace() && (step.level() == 0 || *level == step.level()) {
                    for s in list.drain(..) {
                        self.requested -= s.requested;
                        self.bytes -= s.bytes;
                    }
                }
            }
            return;
        }
        let key = (step.workspace(), step.level());
        let at = match self.groups.iter().position(|(ws, level, _)| (*ws, *level) == key) {
            Some(at) => at,
            None => {
                self.groups.push((key.0, key.1, Vec::new()));
                self.groups.len() - 1
            }
        };
        self.groups[at].2.push(*step);
        self.requested += step.requested;
        self.bytes += step.bytes;
    }

    /// The live allocations.
    pub(crate) fn steps(&self) -> impl Iterator<Item = &Step> {
        self.groups.iter().flat_map(|(_, _, list)| list)
    }
}

/// What a thread's timeline holds while it records.
pub(crate) struct State {
    pub(super) id: u64,
    pub(super) started: Instant,
    /// The workspaces' names as the timeline shows them (a name two workspaces share
    /// gets `#2`, `#3`... after the first), and their ids.
    pub(super) workspaces: Vec<Arc<str>>,
    workspace_ids: Vec<(u64, Arc<str>)>,
    /// The layer allocating now.
    pub(super) layer: u32,
    pub(super) scripts: Vec<Arc<Script>>,
    pub(super) stats: Vec<ScriptStats>,
    by_hash: HashMap<u64, Vec<u32>>,
    stored_events: usize,
    /// The script this iteration is expected to repeat, and how far it has.
    expected: Option<u32>,
    /// `expected`'s script.
    expected_script: Option<Arc<Script>>,
    pos: usize,
    /// The script of the iteration before (whose live allocations at its end, its
    /// `tail`, this one starts with).
    pub(super) before: Option<Arc<Script>>,
    /// Events of this iteration beyond what one iteration keeps (counted only).
    overflow: u64,
    /// This iteration's events from the first that did not match (with the matched
    /// prefix copied in front).
    diverged: bool,
    scratch: Vec<Step>,
    scratch_times: Vec<u64>,
    iteration_start_ns: u64,
    pub(super) iterations: u64,
    pub(super) events: u64,
    pub(super) unstored: u64,
    pub(super) recent: VecDeque<IterationRecord>,
    pub(super) samples: Vec<IterationRecord>,
    pub(super) stride: u64,
}

impl State {
    pub(super) fn new(id: u64) -> State {
        State {
            id,
            started: Instant::now(),
            workspaces: Vec::new(),
            workspace_ids: Vec::new(),
            layer: NO_LAYER,
            scripts: Vec::new(),
            stats: Vec::new(),
            by_hash: HashMap::new(),
            stored_events: 0,
            expected: None,
            expected_script: None,
            pos: 0,
            before: None,
            overflow: 0,
            diverged: false,
            scratch: Vec::new(),
            scratch_times: Vec::new(),
            iteration_start_ns: 0,
            iterations: 0,
            events: 0,
            unstored: 0,
            recent: VecDeque::with_capacity(RECENT),
            samples: Vec::with_capacity(SAMPLES),
            stride: 1,
        }
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The index of the workspace of id `id` and name `name`, added on first use.
    pub(super) fn add_workspace(&mut self, id: u64, name: &Arc<str>) -> Option<u16> {
        if let Some(at) = self.workspace_ids.iter().position(|(w, _)| *w == id) {
            return u16::try_from(at).ok();
        }
        let at = u16::try_from(self.workspaces.len()).ok()?;
        let shown = match self.workspace_ids.iter().filter(|(_, n)| n == name).count() {
            0 => name.clone(),
            n => format!("{name}#{}", n + 1).into(),
        };
        self.workspaces.push(shown);
        self.workspace_ids.push((id, name.clone()));
        Some(at)
    }

    /// The allocation or close `step`, now.
    #[inline]
    pub(super) fn event(&mut self, step: Step) {
        let step = step.with_layer(self.layer);
        if !self.diverged {
            if let Some(script) = &self.expected_script {
                if script.steps.get(self.pos) == Some(&step) {
                    self.pos += 1;
                    return;
                }
            }
            self.diverge();
        }
        if self.scratch.len() >= MAX_ITERATION_EVENTS {
            // One iteration keeps this many events at most; the rest are counted.
            self.overflow += 1;
            return;
        }
        let now = self.now_ns().saturating_sub(self.iteration_start_ns);
        self.scratch.push(step);
        self.scratch_times.push(now);
    }

    /// From here on the iteration keeps its own events: the matched prefix first.
    #[cold]
    fn diverge(&mut self) {
        self.diverged = true;
        self.scratch.clear();
        self.scratch_times.clear();
        if let Some(script) = &self.expected_script {
            self.scratch.extend_from_slice(&script.steps[..self.pos]);
            // The prefix's times as the script has them, scaled to this iteration's so
            // far (the script may have been recorded in a slower or faster iteration).
            let now = self.now_ns().saturating_sub(self.iteration_start_ns);
            let last = self.pos.checked_sub(1).map_or(0, |i| script.times[i]);
            let scale = |t: u64| match last {
                0 => now,
                _ => (u128::from(t) * u128::from(now) / u128::from(last)) as u64,
            };
            self.scratch_times.extend(script.times[..self.pos].iter().map(|&t| scale(t)));
        }
    }

    /// The allocations live when this iteration started (those of the iteration
    /// before that its end left open).
    pub(super) fn carried(&self) -> &[Step] {
        self.before.as_deref().map_or(&[], |s| &s.tail)
    }

    /// This iteration's events so far.
    pub(super) fn current(&self) -> &[Step] {
        match (self.diverged, self.expected) {
            (false, Some(expected)) => &self.scripts[expected as usize].steps[..self.pos],
            _ => &self.scratch,
        }
    }

    /// Ends the iteration in progress.
    pub(super) fn end_iteration(&mut self) {
        let now = self.now_ns();
        let duration_ns = now.saturating_sub(self.iteration_start_ns);
        let matched = !self.diverged && self.expected.is_some_and(|e| self.pos == self.scripts[e as usize].steps.len());
        let script = if matched {
            self.expected
        } else {
            if !self.diverged {
                self.diverge();
            }
            match self.overflow {
                0 => self.store(duration_ns),
                _ => None,
            }
        };
        let events = match script {
            Some(s) => self.scripts[s as usize].steps.len() as u64,
            None => self.scratch.len() as u64 + self.overflow,
        };
        self.overflow = 0;
        self.events += events;
        let record =
            IterationRecord { index: self.iterations, script, start_ns: self.iteration_start_ns, duration_ns, events };
        match script {
            Some(s) => {
                let stats = &mut self.stats[s as usize];
                stats.iterations += 1;
                stats.total_ns += duration_ns;
                stats.last_iteration = self.iterations;
            }
            None => self.unstored += 1,
        }
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(record);
        if self.iterations.is_multiple_of(self.stride) {
            if self.samples.len() == SAMPLES {
                // Every other sample goes: the rest are every `2 * stride`-th iteration.
                let mut keep = 0;
                for i in (0..self.samples.len()).step_by(2) {
                    self.samples[keep] = self.samples[i];
                    keep += 1;
                }
                self.samples.truncate(keep);
                self.stride *= 2;
            }
            if self.iterations.is_multiple_of(self.stride) {
                self.samples.push(record);
            }
        }
        self.iterations += 1;
        if script.is_some() && script != self.expected {
            self.expected = script;
            self.expected_script = script.map(|s| self.scripts[s as usize].clone());
        }
        // What this iteration left live, the next starts with (an unstored one's: none).
        let before = script.map(|s| &self.scripts[s as usize]).filter(|s| !s.tail.is_empty());
        if before.map(Arc::as_ptr) != self.before.as_ref().map(Arc::as_ptr) {
            self.before = before.cloned();
        }
        // A label left set (a guard forgotten, or dropped out of order) ends here.
        self.layer = NO_LAYER;
        self.pos = 0;
        self.diverged = false;
        self.scratch.clear();
        self.scratch_times.clear();
        self.iteration_start_ns = now;
    }

    /// The scratch's script: one stored already, a new one, or none when the store is
    /// full.
    fn store(&mut self, duration_ns: u64) -> Option<u32> {
        let hash = hash_steps(&self.scratch);
        if let Some(ids) = self.by_hash.get(&hash) {
            if let Some(&id) = ids.iter().find(|&&id| self.scripts[id as usize].steps == self.scratch) {
                return Some(id);
            }
        }
        if self.scripts.len() >= MAX_SCRIPTS || self.stored_events + self.scratch.len() > MAX_STORED_EVENTS {
            return None;
        }
        let id = self.scripts.len() as u32;
        self.stored_events += self.scratch.len();
        let script = Script::new(self.scratch.clone(), self.scratch_times.clone(), duration_ns);
        self.stats.push(ScriptStats {
            script: id,
            events: script.steps.len(),
            lower_bound: script.lower_bound,
            peak_bytes: script.peak_bytes,
            first_iteration: self.iterations,
            last_iteration: self.iterations,
            iterations: 0,
            total_ns: 0,
        });
        self.scripts.push(Arc::new(script));
        self.by_hash.entry(hash).or_default().push(id);
        Some(id)
    }

    /// Bytes the history holds: scripts, records, names and the scratch.
    pub(super) fn heap_bytes(&self) -> usize {
        let scripts: usize = self.scripts.iter().map(|s| s.heap_bytes() + std::mem::size_of::<Script>()).sum();
        let records = (self.recent.capacity() + self.samples.capacity()) * std::mem::size_of::<IterationRecord>();
        let scratch = self.scratch.capacity() * std::mem::size_of::<Step>() + self.scratch_times.capacity() * 8;
        let names: usize = self.workspaces.iter().map(|n| n.len() + 48).sum();
        let index = self.by_hash.capacity() * 40 + self.stats.capacity() * std::mem::size_of::<ScriptStats>();
        scripts + records + scratch + names + index
    }
}
