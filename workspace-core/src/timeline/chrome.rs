//! Export in the Chrome trace-event format (the JSON object form), which Perfetto and
//! `chrome://tracing` open: thread 0 holds a slice per iteration, thread `w + 1` a
//! slice per allocation of workspace `w`'s cycles (from the allocation to the close
//! that ends it), a thread of its own each frame level that allocated ("NAME frame
//! L"), and each workspace has a counter track of its live bytes. Times are whole
//! nanoseconds printed as microseconds, so slices that nest nest as printed.

use std::io::{self, Write};

use super::state::Step;
use super::{IterationRecord, TimelineSnapshot};
use crate::roles::ArrayType;

/// Iterations [`TimelineSnapshot::write_chrome_trace`] exports at most.
pub const EXPORTED_ITERATIONS: usize = 256;

/// What an export wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChromeTraceSummary {
    /// Iterations exported (each a slice on thread 0).
    pub iterations: usize,
    /// Allocation slices.
    pub slices: usize,
    /// Counter events.
    pub counters: usize,
}

impl TimelineSnapshot {
    /// Writes the history as a Chrome trace: the most recent iterations and a sample
    /// of the whole run, [`EXPORTED_ITERATIONS`] at most (see
    /// [`TimelineSnapshot::write_chrome_trace_of`]).
    ///
    /// # Errors
    ///
    /// The writer's.
    pub fn write_chrome_trace(&self, writer: impl Write) -> io::Result<ChromeTraceSummary> {
        self.write_chrome_trace_of(writer, EXPORTED_ITERATIONS)
    }

    /// As [`TimelineSnapshot::write_chrome_trace`], with at most `iterations`
    /// iterations: the most recent half of them, and the rest spread evenly over the
    /// earlier ones the snapshot keeps. Each exported iteration lays its script's
    /// events over its own start and duration.
    ///
    /// # Errors
    ///
    /// The writer's.
    pub fn write_chrome_trace_of(&self, writer: impl Write, iterations: usize) -> io::Result<ChromeTraceSummary> {
        let mut w = io::BufWriter::new(writer);
        let chosen = choose(&self.records, iterations);
        let mut summary = ChromeTraceSummary::default();
        write!(
            w,
            "{{\"displayTimeUnit\":\"ns\",\"otherData\":{{\"iterations\":{},\"events\":{},\"scripts\":{},\
             \"history_bytes\":{},\"exported_iterations\":{}}},\"traceEvents\":[",
            self.iterations,
            self.events,
            self.scripts.len(),
            self.history_bytes,
            chosen.len()
        )?;
        write!(w, "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"args\":{{\"name\":\"carve workspaces\"}}}}")?;
        write!(
            w,
            ",{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":0,\"args\":{{\"name\":\"iterations\"}}}}"
        )?;
        for (i, ws) in self.workspaces.iter().enumerate() {
            write!(
                w,
                ",{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":{},\"args\":{{\"name\":{}}}}}",
                i + 1,
                json(ws)
            )?;
        }
        let mut live = vec![0u64; self.workspaces.len()];
        let (mut ends, mut ended) = (Vec::new(), Vec::new());
        // A track per workspace (its cycles' allocations, tid `w + 1`) and per frame
        // level it used (frames' allocations may end before a cycle allocation made
        // while the frame was open: on one track their slices would not nest).
        let mut frame_tracks: Vec<((u16, u16), usize)> = Vec::new();
        for record in chosen {
            let (start, duration) = (record.start_ns, record.duration_ns);
            write!(
                w,
                ",{{\"name\":\"iteration {}\",\"cat\":\"iteration\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":1,\
                 \"tid\":0,\"args\":{{\"iteration\":{},\"script\":{},\"events\":{}}}}}",
                record.index,
                Us(start),
                Us(duration),
                record.index,
                record.script.map_or("null".to_string(), |s| s.to_string()),
                record.events
            )?;
            summary.iterations += 1;
            let Some(script) = record.script.and_then(|s| self.scripts.get(s as usize)) else { continue };
            // The script's times scaled to this iteration's duration, within it; whole
            // nanoseconds, so that slices that nest in time nest as printed.
            let at = |i: usize| {
                let t = u128::from(script.times.get(i).copied().unwrap_or(0));
                let scaled = match script.duration_ns {
                    0 => t,
                    d => t * u128::from(duration) / u128::from(d),
                };
                start + (scaled.min(u128::from(duration)) as u64)
            };
            end_of_each(&script.steps, &mut ends, &mut ended);
            live.iter_mut().for_each(|l| *l = 0);
            for (i, step) in script.steps.iter().enumerate() {
                let ws = usize::from(step.workspace());
                let ts = at(i);
                if step.close() {
                    // What the close ends is no longer live.
                    live[ws] = live[ws].saturating_sub(ended[i]);
                } else {
                    let end = ends[i].map_or(start + duration, at).max(ts);
                    let tid = match step.level() {
                        0 => ws + 1,
                        level => {
                            let key = (step.workspace(), level);
                            match frame_tracks.iter().find(|(k, _)| *k == key) {
                                Some(&(_, tid)) => tid,
                                None => {
                                    let tid = self.workspaces.len() + 1 + frame_tracks.len();
                                    frame_tracks.push((key, tid));
                                    let name = format!("{} frame {level}", self.workspaces[ws]);
                                    write!(
                                        w,
                                        ",{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":{tid},\"args\":{{\"name\":{}}}}}",
                                        json(&name)
                                    )?;
                                    tid
                                }
                            }
                        }
                    };
                    let role =
                        ArrayType::from_index(step.role()).map_or("unlabelled".to_string(), |r| format!("{r:?}"));
                    let layer = self.layer_name(step.layer());
                    let name = match &layer {
                        Some(layer) => format!("{role} · {layer}"),
                        None => role.clone(),
                    };
                    write!(
                        w,
                        ",{{\"name\":{},\"cat\":\"alloc\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":1,\"tid\":{},\
                         \"args\":{{\"workspace\":{},\"role\":{},\"layer\":{},\"bytes\":{},\"requested\":{},\
                         \"level\":{},\"iteration\":{},\"event\":{}}}}}",
                        json(&name),
                        Us(ts),
                        Us(end - ts),
                        tid,
                        json(&self.workspaces[ws]),
                        json(&role),
                        layer.as_deref().map_or("null".to_string(), json),
                        step.bytes,
                        step.requested,
                        step.level(),
                        record.index,
                        i
                    )?;
                    summary.slices += 1;
                    live[ws] += step.bytes;
                }
                write!(
                    w,
                    ",{{\"name\":{},\"ph\":\"C\",\"ts\":{},\"pid\":1,\"args\":{{\"bytes\":{}}}}}",
                    json(&format!("{} live bytes", self.workspaces[ws])),
                    Us(ts),
                    live[ws]
                )?;
                summary.counters += 1;
            }
        }
        write!(w, "]}}")?;
        w.flush()?;
        Ok(summary)
    }
}

/// Nanoseconds written as microseconds, exactly (three decimals).
struct Us(u64);

impl std::fmt::Display for Us {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{:03}", self.0 / 1000, self.0 % 1000)
    }
}

/// A JSON string.
fn json(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"?\"".into())
}

/// The records to export: all when they fit, else the most recent half and the rest
/// spread evenly over the earlier ones.
fn choose(records: &[IterationRecord], most: usize) -> Vec<IterationRecord> {
    if records.len() <= most {
        return records.to_vec();
    }
    let recent = most / 2;
    let (earlier, last) = records.split_at(records.len() - recent);
    let spread = most - recent;
    let mut chosen: Vec<IterationRecord> = (0..spread).map(|k| earlier[k * earlier.len() / spread.max(1)]).collect();
    chosen.dedup_by_key(|r| r.index);
    chosen.extend_from_slice(last);
    chosen
}

/// For each allocation of `steps`, the step of the close that ends it (`None`: it
/// outlives the iteration); for each close, the bytes it ends.
fn end_of_each(steps: &[Step], ends: &mut Vec<Option<usize>>, ended: &mut Vec<u64>) {
    ends.clear();
    ends.resize(steps.len(), None);
    ended.clear();
    ended.resize(steps.len(), 0);
    let mut open: Vec<usize> = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        if step.close() {
            let ended_bytes = &mut *ended;
            open.retain(|&a| {
                let s = &steps[a];
                let ended = step.ends(s);
                if ended {
                    ends[a] = Some(i);
                    ended_bytes[i] += s.bytes;
                }
                !ended
            });
        } else {
            open.push(i);
        }
    }
}
