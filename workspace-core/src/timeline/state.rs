//! The recording state of the thread's timeline: the scripts (each distinct iteration's
//! events, stored once), the iteration in progress (a position in the script it is
//! expected to repeat, or its own events from the first one that differs), and the
//! bounded records of past iterations.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::{IterationRecord, ScriptStats, NO_LAYER};

/// Iterations kept with their times, most recent last.
pub(super) const RECENT: usize = 4096;
/// Iterations kept as a sample of the whole run (every `stride`-th; the stride doubles
/// when the sample is full).
pub(super) const SAMPLES: usize = 1024;
/// Distinct iterations stored: an iteration unlike all of them is counted, not stored.
pub(super) const MAX_SCRIPTS: usize = 1024;
/// Events all stored scripts hold together, at most.
pub(super) const MAX_STORED_EVENTS: usize = 1 << 21;

/// One event of an iteration, as compared with the script it is expected to repeat:
/// three words, compared as three words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Step {
    /// Bytes of an allocation, padded to the workspace's alignment unit (0 for a close).
    pub(crate) bytes: u64,
    /// Bytes the allocation asked for.
    pub(crate) requested: u64,
    /// The layer allocating (bits 0-31: a [`LayerLabel`](super::LayerLabel)'s index,
    /// `NO_LAYER`: none), the workspace (32-47: its index in the timeline), the owner's
    /// level (48-54: 0 for the cycle, a frame's level, at most 127), whether it is a
    /// close (55) and the role of the cycle (56-63: `ArrayType::index`, `NO_ROLE`: none).
    key: u64,
}

impl Step {
    #[inline]
    pub(crate) fn new(bytes: u64, requested: u64, workspace: u16, level: u32, role: u8, close: bool) -> Step {
        let key = u64::from(NO_LAYER)
            | u64::from(workspace) << 32
            | u64::from(level.min(127)) << 48
            | u64::from(close) << 55
            | u64::from(role) << 56;
        Step { bytes, requested, key }
    }

    #[inline]
    fn with_layer(self, layer: u32) -> Step {
        Step { key: (self.key & !0xffff_ffff) | u64::from(layer), ..self }
    }

    pub(crate) fn layer(&self) -> u32 {
        self.key as u32
    }

    pub(crate) fn workspace(&self) -> u16 {
        (self.key >> 32) as u16
    }

    pub(crate) fn level(&self) -> u8 {
        (self.key >> 48) as u8 & 0x7f
    }

    pub(crate) fn close(&self) -> bool {
        self.key >> 55 & 1 == 1
    }

    pub(crate) fn role(&self) -> u8 {
        (self.key >> 56) as u8
    }
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
    pub(crate) times: Vec<u32>,
    /// The recorded iteration's duration.
    pub(crate) duration_ns: u64,
    /// The most bytes (as asked for) live at once.
    pub(crate) lower_bound: u64,
    /// The most bytes (padded) live at once.
    pub(crate) peak_bytes: u64,
}

impl Script {
    fn new(steps: Vec<Step>, times: Vec<u32>, duration_ns: u64) -> Script {
        let (mut lower_bound, mut peak_bytes) = (0, 0);
        live_walk(&steps, |live| {
            let (requested, bytes) = live.iter().fold((0, 0), |(r, b), s| (r + s.requested, b + s.bytes));
            lower_bound = lower_bound.max(requested);
            peak_bytes = peak_bytes.max(bytes);
        });
        Script { steps, times, duration_ns, lower_bound, peak_bytes }
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.steps.capacity() * std::mem::size_of::<Step>() + self.times.capacity() * 4
    }
}

/// Walks `steps`, calling `each` with the allocations live after each one.
pub(crate) fn live_walk(steps: &[Step], mut each: impl FnMut(&[Step])) {
    let mut live: Vec<Step> = Vec::new();
    for step in steps {
        if step.close() {
            // The close of a cycle ends its frames too.
            live.retain(|s| s.workspace() != step.workspace() || s.level() < step.level());
        } else {
            live.push(*step);
        }
        each(&live);
    }
}

/// What a thread's timeline holds while it records.
pub(crate) struct State {
    pub(super) id: u32,
    pub(super) started: Instant,
    pub(super) workspaces: Vec<Arc<str>>,
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
    /// This iteration's events from the first that did not match (with the matched
    /// prefix copied in front).
    diverged: bool,
    scratch: Vec<Step>,
    scratch_times: Vec<u32>,
    iteration_start_ns: u64,
    pub(super) iterations: u64,
    pub(super) events: u64,
    pub(super) unstored: u64,
    pub(super) recent: VecDeque<IterationRecord>,
    pub(super) samples: Vec<IterationRecord>,
    pub(super) stride: u64,
}

impl State {
    pub(super) fn new(id: u32) -> State {
        State {
            id,
            started: Instant::now(),
            workspaces: Vec::new(),
            layer: NO_LAYER,
            scripts: Vec::new(),
            stats: Vec::new(),
            by_hash: HashMap::new(),
            stored_events: 0,
            expected: None,
            expected_script: None,
            pos: 0,
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

    pub(super) fn add_workspace(&mut self, name: Arc<str>) -> Option<u16> {
        if let Some(at) = self.workspaces.iter().position(|w| *w == name) {
            return u16::try_from(at).ok();
        }
        let at = u16::try_from(self.workspaces.len()).ok()?;
        self.workspaces.push(name);
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
        let now = self.now_ns().saturating_sub(self.iteration_start_ns);
        self.scratch.push(step);
        self.scratch_times.push(u32::try_from(now).unwrap_or(u32::MAX));
    }

    /// From here on the iteration keeps its own events: the matched prefix first.
    #[cold]
    fn diverge(&mut self) {
        self.diverged = true;
        self.scratch.clear();
        self.scratch_times.clear();
        if let Some(expected) = self.expected {
            let script = &self.scripts[expected as usize];
            self.scratch.extend_from_slice(&script.steps[..self.pos]);
            self.scratch_times.extend_from_slice(&script.times[..self.pos]);
        }
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
            self.store(duration_ns)
        };
        let events = match script {
            Some(s) => self.scripts[s as usize].steps.len(),
            None => self.scratch.len(),
        };
        self.events += events as u64;
        let record = IterationRecord {
            index: self.iterations,
            script,
            start_ns: self.iteration_start_ns,
            duration_ns,
            events: events as u64,
        };
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
        let scratch = self.scratch.capacity() * std::mem::size_of::<Step>() + self.scratch_times.capacity() * 4;
        let names: usize = self.workspaces.iter().map(|n| n.len() + 48).sum();
        let index = self.by_hash.capacity() * 40 + self.stats.capacity() * std::mem::size_of::<ScriptStats>();
        scripts + records + scratch + names + index
    }
}
