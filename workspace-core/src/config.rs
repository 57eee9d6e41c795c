//! Typed workspace policies and their validation.
//!
//! A [`WorkspaceConfig`] is built once with [`WorkspaceConfig::builder`], validated by
//! [`WorkspaceConfigBuilder::build`], and never changes afterwards. The defaults suit a
//! training loop: learn the size from the first cycle, over-allocate by 30 %, spill what
//! does not fit to the heap and grow the arena to the largest cycle seen (so a loop
//! whose sizes vary stops spilling once its largest cycle has run), and reset when the
//! outermost scope closes.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::roles::WorkspaceMode;

/// How the arena capacity follows from the learned size.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum AllocationPolicy {
    /// Capacity is exactly the learned size (rounded up to the alignment).
    Strict,
    /// Capacity is the learned size × (1 + factor); `factor` must be finite and ≥ 0.
    Overallocate(f64),
}

/// How a workspace learns its size.
///
/// Cycles that allocate nothing are not counted: they teach nothing about the size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LearningPolicy {
    /// No learning: the arena has `initial_size` bytes.
    None,
    /// The arena is sized from the bytes allocated in the first cycle. On host RAM
    /// that cycle runs in a reservation of address space which then becomes the
    /// arena, so the pages it touched are the ones later cycles reuse.
    FirstLoop,
    /// The arena is sized from the largest cycle among the first `cycles` cycles.
    OverTime {
        /// How many cycles to watch; at least 1.
        cycles: u32,
    },
}

/// What happens to an allocation that does not fit in the arena.
///
/// While a workspace is still learning its size, overflow always spills to
/// separate blocks, whatever the policy: learning needs to see every size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpillPolicy {
    /// Goes to a separate block that is freed at the next reset; the arena never grows.
    External,
    /// As `External`, and the arena grows to the new maximum when the cycle ends.
    Reallocate,
    /// Returns [`Error::Exhausted`]; the workspace stays unchanged and usable.
    Fail,
}

/// When the arena's memory is reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResetPolicy {
    /// Reset when the last scope of a cycle closes (scoped; the default).
    BlockLeft,
    /// Keep allocating across cycles and wrap at the end of the buffer (circular).
    ///
    /// ND4J's `ENDOFBUFFER_REACHED`, for code ported from ND4J that keeps data across
    /// cycles in one fixed buffer (usually with `LearningPolicy::None` and an
    /// `initial_size`): each cycle allocates where the last one stopped, and what an
    /// earlier cycle wrote stays in the buffer until the wrap reaches it. Memory handed
    /// out since the workspace was last opened is never wrapped over: an allocation that
    /// would do so, or that is larger than the buffer, goes by the [`SpillPolicy`].
    /// carve's prefetchers do not use it: they keep batches in equal slots
    /// (`async_iter::slot_ring`), which regions of varying size in a circular buffer
    /// would fragment.
    EndOfBuffer,
}

/// Where the arena's memory lives.
///
/// A location that is deserialized can be `Ram` or `MmapAnonymous` only: a file-backed
/// location needs the promise of [`MappedFile::new`], which data cannot make.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Location {
    /// Host RAM (bumpalo chunk, advised to use transparent huge pages).
    Ram,
    /// A memory-mapped file, created or extended to `initial_size`; its contents
    /// survive closing and reopening the workspace (read them back with
    /// [`Scope::retained`](crate::Scope::retained)). Made with the `unsafe`
    /// [`Location::mmap`] (or [`MappedFile::new`]), whose `# Safety` section says what
    /// the caller promises about the file. While a workspace maps the file it holds an
    /// exclusive lock on it, so a second workspace on the same file (in this process or
    /// another) gets [`BackendError::FileInUse`](crate::BackendError::FileInUse).
    #[serde(skip_deserializing)]
    Mmap(MappedFile),
    /// An anonymous memory mapping (zero-filled, not backed by a file).
    MmapAnonymous,
}

impl Location {
    /// A file-backed location: see [`MappedFile::new`].
    ///
    /// ```no_run
    /// use workspace_core::{LearningPolicy, Location, Workspace, WorkspaceConfig};
    ///
    /// // SAFETY: nothing else truncates, resizes or writes `weights.ws` while the
    /// // workspace lives.
    /// let location = unsafe { Location::mmap("weights.ws") };
    /// let config = WorkspaceConfig::builder()
    ///     .learning(LearningPolicy::None)
    ///     .initial_size(1 << 20)
    ///     .location(location)
    ///     .build()?;
    /// let ws = Workspace::new("FILE", config)?;
    /// # Ok::<(), workspace_core::Error>(())
    /// ```
    ///
    /// # Safety
    ///
    /// As for [`MappedFile::new`].
    #[allow(unsafe_code)] // an `unsafe fn` only to carry the caller's promise
    pub unsafe fn mmap(path: impl Into<PathBuf>) -> Location {
        // SAFETY: the caller makes the promise of `MappedFile::new`.
        Location::Mmap(unsafe { MappedFile::new(path) })
    }
}

/// The file behind a file-backed workspace, and the caller's promise about it.
///
/// A workspace hands out views straight into the mapped file, so the memory safety of
/// every view depends on what other code does with the file: truncating it kills the
/// process with `SIGBUS` when a view reads past the new end, and writing to it changes
/// the data under a view that Rust assumes nobody else changes. No safe API can rule
/// that out (the memmap2 crate makes mapping a file `unsafe` for the same reason), so
/// this value can only be made with the `unsafe` [`MappedFile::new`].
///
/// What the workspace itself rules out: two workspaces mapping one file. It takes an
/// exclusive lock on the file for the life of the mapping (advisory, so it binds
/// carve workspaces and other programs that lock, not a program that ignores locks).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct MappedFile {
    path: PathBuf,
}

impl MappedFile {
    /// Names the file to back a workspace with; it is created or extended to the
    /// workspace's `initial_size` when the workspace is made.
    ///
    /// # Safety
    ///
    /// For as long as any workspace made with this location is alive, no code (in this
    /// process or any other) may truncate or shrink the file, map it in a way that
    /// writes to it, or write to it other than through the workspace's views. The
    /// workspace's exclusive lock keeps other carve workspaces away; the caller is
    /// responsible for everything else.
    #[allow(unsafe_code)] // an `unsafe fn` only to carry the caller's promise
    pub unsafe fn new(path: impl Into<PathBuf>) -> MappedFile {
        MappedFile { path: path.into() }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Default alignment of every allocation, in bytes (one cache line).
pub const DEFAULT_ALIGNMENT: usize = 64;

/// Largest configurable alignment (1 GiB).
pub const MAX_ALIGNMENT: usize = 1 << 30;

/// Longest cycle history a workspace keeps ([`WorkspaceConfigBuilder::cycle_history_len`]):
/// a million cycles (8 MiB of sizes, reserved when the workspace is made so that
/// recording never allocates).
pub const MAX_CYCLE_HISTORY: usize = 1 << 20;

/// The former name of [`MAX_CYCLE_HISTORY`].
#[deprecated(note = "renamed MAX_CYCLE_HISTORY: it bounds the ring of the last cycles' sizes, not a timeline")]
pub const MAX_TIMELINE_LEN: usize = MAX_CYCLE_HISTORY;

/// A file mapping starts at the file's first byte, which the kernel maps at a page
/// boundary: file-backed arenas are aligned to a page and no more.
const FILE_ALIGNMENT: usize = 4096;

/// A validated workspace configuration.
///
/// ```
/// use workspace_core::{WorkspaceConfig, LearningPolicy, SpillPolicy};
///
/// let config = WorkspaceConfig::builder()
///     .learning(LearningPolicy::FirstLoop)
///     .spill(SpillPolicy::Reallocate)
///     .max_size(256 << 20)
///     .build()?;
/// assert_eq!(config.alignment(), 64);
/// # Ok::<(), workspace_core::Error>(())
/// ```
///
/// A deserialized configuration is validated like a built one (a file-backed location
/// cannot be deserialized; see [`Location`]):
///
/// ```
/// use workspace_core::WorkspaceConfig;
///
/// let json = serde_json::to_string(&WorkspaceConfig::default()).unwrap();
/// let back: WorkspaceConfig = serde_json::from_str(&json).unwrap();
/// assert_eq!(back, WorkspaceConfig::default());
/// let bad = json.replace("\"alignment\":64", "\"alignment\":48");
/// let err = serde_json::from_str::<WorkspaceConfig>(&bad).unwrap_err();
/// assert!(err.to_string().contains("power of two"), "{err}");
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "Fields")]
pub struct WorkspaceConfig {
    initial_size: usize,
    min_size: usize,
    max_size: usize,
    alignment: usize,
    allocation: AllocationPolicy,
    learning: LearningPolicy,
    spill: SpillPolicy,
    reset: ResetPolicy,
    location: Location,
    /// Serialized under its former name, so that saved configurations still load.
    #[serde(rename = "timeline_len")]
    cycle_history_len: usize,
}

/// What a serialized [`WorkspaceConfig`] holds, before validation.
#[derive(Deserialize)]
struct Fields {
    initial_size: usize,
    min_size: usize,
    max_size: usize,
    alignment: usize,
    allocation: AllocationPolicy,
    learning: LearningPolicy,
    spill: SpillPolicy,
    reset: ResetPolicy,
    location: Location,
    #[serde(rename = "timeline_len", alias = "cycle_history_len")]
    cycle_history_len: usize,
}

impl TryFrom<Fields> for WorkspaceConfig {
    type Error = Error;

    fn try_from(f: Fields) -> Result<WorkspaceConfig> {
        WorkspaceConfigBuilder {
            config: WorkspaceConfig {
                initial_size: f.initial_size,
                min_size: f.min_size,
                max_size: f.max_size,
                alignment: f.alignment,
                allocation: f.allocation,
                learning: f.learning,
                spill: f.spill,
                reset: f.reset,
                location: f.location,
                cycle_history_len: f.cycle_history_len,
            },
            spill_chosen: true,
        }
        .build()
    }
}

impl Default for WorkspaceConfig {
    fn default() -> Self {
        WorkspaceConfigBuilder::default().build().expect("the default configuration is valid")
    }
}

impl WorkspaceConfig {
    /// Starts a builder with the defaults.
    pub fn builder() -> WorkspaceConfigBuilder {
        WorkspaceConfigBuilder::default()
    }

    /// Bytes the arena has before any learning.
    pub fn initial_size(&self) -> usize {
        self.initial_size
    }
    /// Smallest capacity learning or `trim()` may choose.
    pub fn min_size(&self) -> usize {
        self.min_size
    }
    /// Budget: the most bytes the workspace may hold, arena and spilled blocks together.
    pub fn max_size(&self) -> usize {
        self.max_size
    }
    /// Alignment of every allocation in bytes.
    pub fn alignment(&self) -> usize {
        self.alignment
    }
    /// How capacity follows from the learned size.
    pub fn allocation(&self) -> AllocationPolicy {
        self.allocation
    }
    /// How the size is learned.
    pub fn learning(&self) -> LearningPolicy {
        self.learning
    }
    /// What happens to allocations that do not fit.
    pub fn spill(&self) -> SpillPolicy {
        self.spill
    }
    /// When memory is reused.
    pub fn reset(&self) -> ResetPolicy {
        self.reset
    }
    /// Where memory lives.
    pub fn location(&self) -> &Location {
        &self.location
    }
    /// How many of the last cycles' sizes the workspace keeps, in a ring, for plots
    /// (0: none; see [`Workspace::cycle_history`](crate::Workspace)).
    pub fn cycle_history_len(&self) -> usize {
        self.cycle_history_len
    }
    /// The former name of [`WorkspaceConfig::cycle_history_len`].
    #[deprecated(note = "renamed cycle_history_len: the ring of the last cycles' sizes is not a Timeline")]
    pub fn timeline_len(&self) -> usize {
        self.cycle_history_len
    }

    /// The capacity for a learned size: the allocation policy applied, clamped to
    /// `min_size..=max_size` and rounded up to the alignment, except where that would
    /// pass `max_size`: then it is `max_size` itself, never less (a cycle that fit the
    /// budget must fit the arena learned from it).
    pub fn capacity_for(&self, learned: usize) -> usize {
        let grown = match self.allocation {
            AllocationPolicy::Strict => learned,
            AllocationPolicy::Overallocate(factor) => {
                let scaled = (learned as f64 * (1.0 + factor)).ceil();
                if scaled >= usize::MAX as f64 {
                    usize::MAX
                } else {
                    scaled as usize
                }
            }
        };
        let clamped = grown.max(self.min_size).min(self.max_size);
        match clamped.checked_next_multiple_of(self.alignment) {
            Some(rounded) if rounded <= self.max_size => rounded,
            _ => clamped,
        }
    }
}

impl fmt::Display for WorkspaceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{{initial {}, min {}, max {}, align {}, {:?}, {:?}, {:?}, {:?}, {:?}}}",
            self.initial_size,
            self.min_size,
            if self.max_size == usize::MAX { "unbounded".to_string() } else { self.max_size.to_string() },
            self.alignment,
            self.allocation,
            self.learning,
            self.spill,
            self.reset,
            self.location
        )
    }
}

/// Builder for [`WorkspaceConfig`]; see there for an example.
#[derive(Clone, Debug)]
pub struct WorkspaceConfigBuilder {
    config: WorkspaceConfig,
    /// Whether `spill` was chosen; otherwise `build` picks the default for the location.
    spill_chosen: bool,
}

impl Default for WorkspaceConfigBuilder {
    fn default() -> Self {
        WorkspaceConfigBuilder {
            config: WorkspaceConfig {
                initial_size: 0,
                min_size: 0,
                max_size: usize::MAX,
                alignment: DEFAULT_ALIGNMENT,
                allocation: AllocationPolicy::Overallocate(0.3),
                learning: LearningPolicy::FirstLoop,
                spill: SpillPolicy::External,
                reset: ResetPolicy::BlockLeft,
                location: Location::Ram,
                cycle_history_len: 0,
            },
            spill_chosen: false,
        }
    }
}

impl WorkspaceConfigBuilder {
    /// Bytes the arena has before any learning (default 0).
    pub fn initial_size(mut self, bytes: usize) -> Self {
        self.config.initial_size = bytes;
        self
    }
    /// Smallest capacity learning or `trim()` may choose (default 0).
    pub fn min_size(mut self, bytes: usize) -> Self {
        self.config.min_size = bytes;
        self
    }
    /// Budget for arena and spilled blocks together (default: unbounded).
    pub fn max_size(mut self, bytes: usize) -> Self {
        self.config.max_size = bytes;
        self
    }
    /// Alignment of every allocation; a power of two (default 64). Allocations are
    /// aligned to at least 16 bytes whatever this says.
    pub fn alignment(mut self, bytes: usize) -> Self {
        self.config.alignment = bytes;
        self
    }
    /// How capacity follows from the learned size (default `Overallocate(0.3)`).
    pub fn allocation(mut self, policy: AllocationPolicy) -> Self {
        self.config.allocation = policy;
        self
    }
    /// How the size is learned (default `FirstLoop`).
    pub fn learning(mut self, policy: LearningPolicy) -> Self {
        self.config.learning = policy;
        self
    }
    /// What happens to allocations that do not fit. The default is `Reallocate` (the
    /// arena grows to the largest cycle seen, so a loop whose sizes vary reaches zero
    /// spills once its largest cycle has run), or `External` for memory maps, which
    /// cannot grow.
    pub fn spill(mut self, policy: SpillPolicy) -> Self {
        self.config.spill = policy;
        self.spill_chosen = true;
        self
    }
    /// When memory is reused (default `BlockLeft`).
    pub fn reset(mut self, policy: ResetPolicy) -> Self {
        self.config.reset = policy;
        self
    }
    /// Where memory lives (default `Ram`).
    pub fn location(mut self, location: Location) -> Self {
        self.config.location = location;
        self
    }
    /// Keep the sizes of the last `cycles` cycles, in a ring, for plots (default 0:
    /// off; at most [`MAX_CYCLE_HISTORY`]).
    pub fn cycle_history_len(mut self, cycles: usize) -> Self {
        self.config.cycle_history_len = cycles;
        self
    }
    /// The former name of [`WorkspaceConfigBuilder::cycle_history_len`].
    #[deprecated(note = "renamed cycle_history_len: the ring of the last cycles' sizes is not a Timeline")]
    pub fn timeline_len(self, cycles: usize) -> Self {
        self.cycle_history_len(cycles)
    }

    /// Validates and returns the configuration.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when settings contradict each other: an alignment that
    /// is not a power of two or above 1 GiB (or above a page for a file-backed
    /// workspace), a `cycle_history_len` above [`MAX_CYCLE_HISTORY`], `min_size > max_size`, an initial size outside
    /// `min_size..=max_size`, a negative or non-finite over-allocation factor,
    /// `OverTime { cycles: 0 }`, a memory-mapped workspace with a learning policy or
    /// with `SpillPolicy::Reallocate` (a mapping has the size it was created with), a
    /// memory-mapped workspace of size 0, or a workspace that can never hold a byte
    /// (no learning, `initial_size` 0 and `SpillPolicy::Fail`).
    pub fn build(self) -> Result<WorkspaceConfig> {
        let mut c = self.config;
        if !self.spill_chosen {
            c.spill = match c.location {
                Location::Ram => SpillPolicy::Reallocate,
                Location::Mmap(_) | Location::MmapAnonymous => SpillPolicy::External,
            };
        }
        let invalid = |reason: String| Err(Error::InvalidConfig { reason });
        if !c.alignment.is_power_of_two() {
            return invalid(format!(
                "alignment {} is not a power of two; use 64 (a cache line) unless you need more",
                c.alignment
            ));
        }
        if c.alignment > MAX_ALIGNMENT {
            return invalid(format!("alignment {} is larger than 1 GiB", c.alignment));
        }
        if c.cycle_history_len > MAX_CYCLE_HISTORY {
            return invalid(format!(
                "cycle_history_len (\"timeline_len\" in a serialized config) {} is more than \
                 {MAX_CYCLE_HISTORY} cycles; the history is held in memory for plots, so keep the last \
                 few thousand cycles",
                c.cycle_history_len
            ));
        }
        if c.min_size > c.max_size {
            return invalid(format!("min_size {} is larger than max_size {}", c.min_size, c.max_size));
        }
        if c.initial_size > c.max_size {
            return invalid(format!("initial_size {} is larger than max_size {}", c.initial_size, c.max_size));
        }
        if let AllocationPolicy::Overallocate(factor) = c.allocation {
            if !factor.is_finite() || factor < 0.0 {
                return invalid(format!(
                    "Overallocate({factor}): the factor must be finite and at least 0 \
                     (0.3 means 30 % headroom)"
                ));
            }
        }
        if c.learning == (LearningPolicy::OverTime { cycles: 0 }) {
            return invalid("LearningPolicy::OverTime needs at least 1 cycle".into());
        }
        if matches!(c.location, Location::Mmap(_)) && c.alignment > FILE_ALIGNMENT {
            return invalid(format!(
                "alignment {} is larger than a page ({FILE_ALIGNMENT} bytes): a file-backed \
                 workspace's arena starts at the file's first byte, which is only page-aligned",
                c.alignment
            ));
        }
        if matches!(c.location, Location::Mmap(_) | Location::MmapAnonymous) {
            if c.learning != LearningPolicy::None {
                return invalid(format!(
                    "a memory-mapped workspace has the size it is created with, so it cannot \
                     learn ({:?}); use LearningPolicy::None and set initial_size",
                    c.learning
                ));
            }
            if c.spill == SpillPolicy::Reallocate {
                return invalid(
                    "a memory-mapped workspace cannot be reallocated; use SpillPolicy::External \
                     or SpillPolicy::Fail"
                        .into(),
                );
            }
            if c.initial_size == 0 {
                return invalid("a memory-mapped workspace needs initial_size > 0".into());
            }
        }
        if c.learning == LearningPolicy::None && c.initial_size == 0 && c.spill == SpillPolicy::Fail {
            return invalid(
                "with LearningPolicy::None, initial_size 0 and SpillPolicy::Fail the workspace \
                 can never hold a byte; set initial_size, learn, or allow spilling"
                    .into(),
            );
        }
        Ok(c)
    }
}

/// A workspace mode by name (`enabled`, `planned`, `none`, any case), as configuration
/// files and command lines give it.
impl std::str::FromStr for WorkspaceMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<WorkspaceMode> {
        match s.to_ascii_lowercase().as_str() {
            "enabled" => Ok(WorkspaceMode::Enabled),
            "none" => Ok(WorkspaceMode::None),
            "planned" => Ok(WorkspaceMode::Planned),
            _ => Err(Error::InvalidConfig {
                reason: format!("unknown workspace mode '{s}': use 'enabled', 'planned' or 'none'"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(result: Result<WorkspaceConfig>) -> String {
        match result {
            Err(Error::InvalidConfig { reason }) => reason,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid_and_documented() {
        let c = WorkspaceConfig::default();
        assert_eq!(c.alignment(), 64);
        assert_eq!(c.learning(), LearningPolicy::FirstLoop);
        assert_eq!(c.spill(), SpillPolicy::Reallocate);
        let anon = WorkspaceConfig::builder().location(Location::MmapAnonymous).learning(LearningPolicy::None);
        assert_eq!(anon.initial_size(4096).build().unwrap().spill(), SpillPolicy::External, "a map cannot grow");
        assert_eq!(c.reset(), ResetPolicy::BlockLeft);
        assert_eq!(c.allocation(), AllocationPolicy::Overallocate(0.3));
        assert_eq!(c.max_size(), usize::MAX);
    }

    #[test]
    fn contradictions_are_rejected_with_reasons() {
        let b = WorkspaceConfig::builder;
        assert!(reason(b().alignment(48).build()).contains("power of two"));
        assert!(reason(b().alignment(0).build()).contains("power of two"));
        assert!(reason(b().min_size(10).max_size(5).build()).contains("min_size 10"));
        assert!(reason(b().initial_size(10).max_size(5).build()).contains("initial_size 10"));
        assert!(reason(b().allocation(AllocationPolicy::Overallocate(-0.1)).build()).contains("factor"));
        assert!(reason(b().allocation(AllocationPolicy::Overallocate(f64::NAN)).build()).contains("factor"));
        assert!(reason(b().learning(LearningPolicy::OverTime { cycles: 0 }).build()).contains("at least 1"));
        let mmap = || b().location(Location::MmapAnonymous).initial_size(4096);
        assert!(reason(mmap().build()).contains("cannot"), "mmap + FirstLoop default");
        assert!(reason(mmap().learning(LearningPolicy::None).spill(SpillPolicy::Reallocate).build())
            .contains("reallocated"));
        assert!(reason(b().location(Location::MmapAnonymous).learning(LearningPolicy::None).build())
            .contains("initial_size > 0"));
        assert!(reason(b().learning(LearningPolicy::None).spill(SpillPolicy::Fail).build()).contains("never hold"));
        assert!(mmap().learning(LearningPolicy::None).build().is_ok());
    }

    #[test]
    fn capacity_for_applies_policy_clamps_and_rounds() {
        let strict = WorkspaceConfig::builder()
            .allocation(AllocationPolicy::Strict)
            .min_size(1000)
            .max_size(10_000)
            .build()
            .unwrap();
        assert_eq!(strict.capacity_for(0), 1024);
        assert_eq!(strict.capacity_for(1500), 1536);
        assert_eq!(strict.capacity_for(1_000_000), 10_000, "the budget, not less");
        let over = WorkspaceConfig::builder().allocation(AllocationPolicy::Overallocate(0.5)).build().unwrap();
        assert_eq!(over.capacity_for(1000), 1536);
        assert_eq!(over.capacity_for(usize::MAX - 100), usize::MAX);
    }
}
