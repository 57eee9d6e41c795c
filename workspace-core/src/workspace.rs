//! The host workspace: one arena engine over a host backend, plus debug modes.

use std::cell::Cell;

use crate::backend::HostBackend;
use crate::config::{LearningPolicy, SpillPolicy, WorkspaceConfig};
use crate::error::{Error, Result};
use crate::shell::Shell;

/// Name of the environment variable that sets the [`DebugMode`] of new workspaces.
pub const DEBUG_ENV: &str = "CARVE_WORKSPACE_DEBUG";

/// Debugging aids that change where allocations go, and nothing else.
///
/// Under a debug mode every allocation gets a heap block of its own, freed at the
/// next reset, so an array that escapes its cycle shows up in valgrind as a use after
/// free and an overrun as an invalid write. The workspace's accounting runs exactly
/// as without it (cycles, generations, learning, the budget, the spill policy, which
/// workspace an array belongs to), so every call succeeds or fails, and returns, what
/// it would with the mode off; only the memory's address differs. (The learned arena
/// exists in the accounting only and takes no memory while a mode is on. A file-backed
/// arena is the exception: its memory is the file's data, which the program reads
/// back, so it keeps serving allocations.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum DebugMode {
    /// Normal operation.
    #[default]
    Disabled,
    /// Every allocation gets its own heap block, freed at the next reset.
    SpillEverything,
    /// ND4J's name for workspaces switched off. Here it is the same as
    /// `SpillEverything` (every array on the heap), because a debug mode may not
    /// change which calls succeed: the workspaces' checks keep running.
    BypassEverything,
}

impl DebugMode {
    /// Reads [`DEBUG_ENV`]: unset or empty means `Disabled`; otherwise `disabled`,
    /// `spill_everything` or `bypass_everything` (case and `-`/`_` do not matter).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidDebugMode`] for any other value.
    pub fn from_env() -> Result<DebugMode> {
        match std::env::var(DEBUG_ENV) {
            Ok(value) => DebugMode::parse(&value),
            Err(std::env::VarError::NotPresent) => Ok(DebugMode::Disabled),
            Err(std::env::VarError::NotUnicode(value)) => {
                Err(Error::InvalidDebugMode { value: value.to_string_lossy().into_owned() })
            }
        }
    }

    /// Parses a debug mode name as [`DebugMode::from_env`] does.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidDebugMode`] for an unknown name.
    pub fn parse(value: &str) -> Result<DebugMode> {
        let key: String = value.chars().filter(|c| *c != '_' && *c != '-').flat_map(char::to_lowercase).collect();
        match key.as_str() {
            "" | "disabled" | "off" | "none" => Ok(DebugMode::Disabled),
            "spilleverything" => Ok(DebugMode::SpillEverything),
            "bypasseverything" => Ok(DebugMode::BypassEverything),
            _ => Err(Error::InvalidDebugMode { value: value.to_string() }),
        }
    }
}

/// A host workspace: a reusable bump arena with cycles, generations, learning,
/// spilling and statistics.
///
/// `Send` and `!Sync`: one thread uses it at a time. Allocate through the [`Scope`](crate::Scope)
/// that [`Workspace::enter`] returns; the arena resets when the last scope closes.
///
/// ```
/// use workspace_core::{Workspace, WorkspaceConfig};
///
/// let ws = Workspace::new("LOOP", WorkspaceConfig::default())?;
/// for _ in 0..3 {
///     let scope = ws.enter()?;
///     let mut x = scope.zeros::<f32, _>((4, 8))?;
///     x.fill(1.0);
///     assert_eq!(x.sum(), 32.0);
/// } // reset here, in O(1)
/// assert!(ws.capacity() >= 128);
/// # Ok::<(), workspace_core::Error>(())
/// ```
///
/// The arena is `!Sync`:
///
/// ```compile_fail,E0277
/// fn needs_sync<T: Sync>() {}
/// needs_sync::<workspace_core::Workspace>();
/// ```
#[derive(Debug)]
pub struct Workspace {
    pub(crate) shell: Shell<HostBackend>,
    debug: Cell<DebugMode>,
    /// Made for a dry run: see [`Workspace::is_shape_only`].
    shape_only: bool,
}

/// The accessors every kind of workspace shares (name, generation, capacity,
/// statistics, `contains`, ...) are the [`Shell`]'s.
impl std::ops::Deref for Workspace {
    type Target = Shell<HostBackend>;

    #[inline(always)]
    fn deref(&self) -> &Shell<HostBackend> {
        &self.shell
    }
}

impl Workspace {
    /// Creates a workspace; the debug mode comes from [`DEBUG_ENV`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidDebugMode`] for a bad environment value; [`Error::Backend`] when
    /// the initial arena cannot be reserved (out of memory, unwritable mmap path).
    pub fn new(name: &str, config: WorkspaceConfig) -> Result<Workspace> {
        Workspace::with_debug_mode(name, config, DebugMode::from_env()?)
    }

    /// Creates a workspace with an explicit debug mode.
    ///
    /// # Errors
    ///
    /// As [`Workspace::new`], except the environment is not read.
    pub fn with_debug_mode(name: &str, config: WorkspaceConfig, mode: DebugMode) -> Result<Workspace> {
        Workspace::create(name, config, mode, false)
    }

    /// A workspace, shape-only or not (see [`Workspace::is_shape_only`]).
    pub(crate) fn create(name: &str, config: WorkspaceConfig, mode: DebugMode, shape_only: bool) -> Result<Workspace> {
        let backend = match shape_only {
            // Where memory comes from (RAM, without a first-cycle reservation or
            // prefaulting; never a file the configuration names): the accounting is the
            // configuration's.
            true => HostBackend::ShapeOnly,
            false => HostBackend::for_location(config.location()),
        };
        Workspace::over(name, config, backend, mode, shape_only)
    }

    /// A heap workspace ([`WorkspaceManager::heaps`](crate::WorkspaceManager::heaps)):
    /// `config` as given (its location included, for comparisons), its memory from RAM
    /// whatever that location, every allocation a heap block of its own
    /// ([`DebugMode::SpillEverything`]).
    pub(crate) fn create_heap(name: &str, config: WorkspaceConfig) -> Result<Workspace> {
        Workspace::over(name, config, HostBackend::Ram, DebugMode::SpillEverything, false)
    }

    /// A heap workspace of its own: what a standalone heap scope
    /// ([`Scope::heap`](crate::Scope::heap)) and a role scoped out of a manager's
    /// workspaces allocate in (no arena, nothing learned, every array spilled).
    pub(crate) fn standalone_heap(name: &str) -> Result<Workspace> {
        let config = WorkspaceConfig::builder().learning(LearningPolicy::None).spill(SpillPolicy::External).build()?;
        Workspace::create_heap(name, config)
    }

    /// A workspace over `backend` in debug mode `mode`.
    fn over(
        name: &str,
        config: WorkspaceConfig,
        backend: HostBackend,
        mode: DebugMode,
        shape_only: bool,
    ) -> Result<Workspace> {
        let shell = Shell::new(name, config, backend, ())?;
        let ws = Workspace { shell, debug: Cell::new(DebugMode::Disabled), shape_only };
        ws.set_debug_mode(mode)?;
        Ok(ws)
    }

    /// Whether this workspace serves a dry run: it allocates, accounts, learns and
    /// plans exactly as a workspace of its configuration does, and the code that
    /// allocates from it computes nothing (the layers of carve's networks skip their
    /// arithmetic when [`Scope::is_shape_only`](crate::Scope::is_shape_only) says so),
    /// so that the bytes a step would take are known before it runs. Only the
    /// registries of [`WorkspaceManager::shape_only`](crate::WorkspaceManager::shape_only)
    /// and the groups of [`PlanGroup::shape_only`](crate::planned::PlanGroup::shape_only)
    /// make such workspaces.
    pub fn is_shape_only(&self) -> bool {
        self.shape_only
    }

    /// The current debug mode.
    pub fn debug_mode(&self) -> DebugMode {
        self.debug.get()
    }

    /// Changes the debug mode.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while a scope is open.
    pub fn set_debug_mode(&self, mode: DebugMode) -> Result<()> {
        self.shell.engine().set_spill_everything(mode != DebugMode::Disabled)?;
        self.debug.set(mode);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_mode_names() {
        assert_eq!(DebugMode::parse("spill_everything").unwrap(), DebugMode::SpillEverything);
        assert_eq!(DebugMode::parse("BypassEverything").unwrap(), DebugMode::BypassEverything);
        assert_eq!(DebugMode::parse("").unwrap(), DebugMode::Disabled);
        let err = DebugMode::parse("loud").unwrap_err();
        assert!(err.to_string().contains("'loud'"), "{err}");
    }
}
