//! `--timeline FILE` in the demos: the run's timeline written as a Chrome trace, and
//! its figures for the report and the JSON.

use std::error::Error;
use std::path::Path;
use std::time::Instant;

use carve::workspace_core::timeline::Timeline;

/// What the timeline of a run held, and what writing it took.
pub(crate) struct TimelineFigures {
    /// Events of the iterations recorded.
    pub(crate) events: u64,
    /// Bytes of heap the history holds.
    pub(crate) bytes: usize,
    pub(crate) iterations: u64,
    /// Distinct iterations, each stored once.
    pub(crate) scripts: usize,
    pub(crate) snapshot_us: f64,
    pub(crate) slices: usize,
    /// With the timeline on in odd epochs and off in even ones: the median iteration
    /// time of the odd epochs from 3 on over that of the even ones.
    pub(crate) ratio: Option<f64>,
}

/// Writes `timeline`'s snapshot to `path`; `ratio`: the first mode's
/// [`on_over_off`], where the timeline was toggled.
pub(crate) fn export(timeline: &Timeline, path: &Path, ratio: Option<f64>) -> Result<TimelineFigures, Box<dyn Error>> {
    let t0 = Instant::now();
    let snapshot = timeline.snapshot();
    let snapshot_us = t0.elapsed().as_secs_f64() * 1e6;
    let file = std::fs::File::create(path).map_err(|e| format!("writing the timeline to {}: {e}", path.display()))?;
    let summary =
        snapshot.write_chrome_trace(file).map_err(|e| format!("writing the timeline to {}: {e}", path.display()))?;
    Ok(TimelineFigures {
        events: snapshot.events(),
        bytes: snapshot.history_bytes(),
        iterations: snapshot.iterations_recorded(),
        scripts: snapshot.scripts().len(),
        snapshot_us,
        slices: summary.slices,
        ratio,
    })
}

/// The median iteration time of the odd epochs from 3 on (timeline on) over that of
/// the even ones (off), from a run's iteration times and its iterations per epoch.
pub(crate) fn on_over_off(iter_ns: &[u64], per_epoch: usize) -> Option<f64> {
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for (i, chunk) in iter_ns.chunks(per_epoch.max(1)).enumerate() {
        match i + 1 {
            1 => {} // learning
            e if e % 2 == 1 => on.extend_from_slice(chunk),
            _ => off.extend_from_slice(chunk),
        }
    }
    Some(median(on)? / median(off)?)
}

/// The keys of one mode's object: the events its network's iterations recorded, the
/// history's bytes (the one timeline's), and its own on-over-off ratio.
pub(crate) fn add_to_mode(mode: &mut serde_json::Value, events: u64, bytes: usize, ratio: Option<f64>) {
    mode["timeline_events"] = events.into();
    mode["timeline_bytes"] = bytes.into();
    mode["iter_time_ratio_timeline_over_off"] = ratio.into();
}

fn median(mut v: Vec<u64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    Some(v[v.len() / 2] as f64)
}

impl TimelineFigures {
    /// The report's line.
    pub(crate) fn line(&self, path: &Path) -> String {
        let ratio = match self.ratio {
            Some(r) => format!("; iteration time with it on over off {r:.3}"),
            None => String::new(),
        };
        format!(
            "timeline written to {} ({} iterations, {} events, {} distinct iterations stored once, history {} \
             bytes, snapshot {:.0} µs{ratio}); open it in https://ui.perfetto.dev or chrome://tracing",
            path.display(),
            self.iterations,
            self.events,
            self.scripts,
            self.bytes,
            self.snapshot_us
        )
    }

    /// Adds the figures to the demo's JSON object.
    pub(crate) fn add_to(&self, object: &mut serde_json::Value) {
        object["timeline_events"] = self.events.into();
        object["timeline_bytes"] = self.bytes.into();
        object["timeline_iterations"] = self.iterations.into();
        object["timeline_scripts"] = self.scripts.into();
        object["timeline_snapshot_us"] = self.snapshot_us.into();
        object["timeline_slices_exported"] = self.slices.into();
        object["iter_time_ratio_timeline_over_off"] = self.ratio.into();
    }
}
