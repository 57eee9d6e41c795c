//! The one error type of workspace-core.
//!
//! Every message says what happened, to which workspace, and what to do about it; `{:?}`
//! prints the same message, so an error returned from `main` reads as one.

use std::fmt;
use std::sync::Arc;

/// Errors from configuring, entering and allocating in workspaces.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration contradicts itself; nothing was created.
    #[error("invalid workspace configuration: {reason}")]
    InvalidConfig {
        /// What is contradictory, and how to fix it.
        reason: String,
    },

    /// An allocation of zero elements was requested.
    #[error(
        "zero-length allocation in workspace '{workspace}': shape {shape:?} has no elements; \
         an empty array needs no workspace memory, create it with `ndarray::Array::zeros` instead"
    )]
    ZeroLength {
        /// The workspace asked.
        workspace: Arc<str>,
        /// The requested shape.
        shape: Vec<usize>,
    },

    /// The byte size of a requested shape does not fit in `usize`.
    #[error(
        "shape {shape:?} of {element_size}-byte elements overflows the address space \
         (workspace '{workspace}'): check the dimensions"
    )]
    ShapeOverflow {
        /// The workspace asked.
        workspace: Arc<str>,
        /// The requested shape.
        shape: Vec<usize>,
        /// Size of one element in bytes.
        element_size: usize,
    },

    /// An allocation did not fit and the workspace uses [`SpillPolicy::Fail`](crate::SpillPolicy::Fail).
    #[error(
        "workspace '{workspace}' is full: {requested} bytes requested, {available} of {capacity} \
         bytes free, and its spill policy is Fail; the workspace is unchanged and still usable. \
         Raise `initial_size`, use a learning policy, or choose SpillPolicy::External. Memory: {report}"
    )]
    Exhausted {
        /// The workspace asked.
        workspace: Arc<str>,
        /// Bytes requested (including alignment padding).
        requested: usize,
        /// Bytes still free in the arena.
        available: usize,
        /// Arena capacity in bytes.
        capacity: usize,
        /// What held the memory: the iteration's lower bound so far, padding,
        /// fragmentation and the largest live holders by role and layer.
        report: Box<crate::memory_report::MemoryReport>,
    },

    /// Granting an allocation would take the workspace past its `max_size`.
    #[error(
        "workspace '{workspace}' would exceed its budget: {requested} more bytes requested, \
         {in_use} bytes in use this cycle in an arena of {arena} bytes and spills, max_size is \
         {max_size}; the workspace is unchanged and still usable. Raise `max_size` or allocate \
         less per cycle. Memory: {report}"
    )]
    BudgetExceeded {
        /// The workspace asked.
        workspace: Arc<str>,
        /// Bytes requested.
        requested: usize,
        /// Bytes handed out in the open cycle, arena and spills, each allocation taking
        /// whole units of the configured alignment.
        in_use: usize,
        /// The arena's capacity: held whether or not it is in use, so it counts
        /// against the budget.
        arena: usize,
        /// The configured budget.
        max_size: usize,
        /// What held the memory (see [`MemoryReport`](crate::timeline::MemoryReport)).
        report: Box<crate::memory_report::MemoryReport>,
    },

    /// A stored handle was used after its workspace was reset.
    #[error(
        "array from workspace '{workspace}' is outdated: it was allocated in generation \
         {array_generation}, the workspace is now at generation {workspace_generation} and its \
         memory has been reset. Keep data across cycles with `detach()` before the cycle ends, \
         or `leverage_to` a workspace that stays open"
    )]
    StaleHandle {
        /// The workspace the handle was allocated in.
        workspace: Arc<str>,
        /// Generation the handle was allocated in.
        array_generation: u64,
        /// Generation the workspace is at now.
        workspace_generation: u64,
    },

    /// A handle was accessed through a scope of a different workspace (or, made by a
    /// standalone heap scope, [`Scope::heap`](crate::Scope::heap), a scope other than
    /// the one that made it: each such scope is its own).
    #[error("{}", wrong_workspace(array_workspace, scope_workspace))]
    WrongWorkspace {
        /// The workspace the array lives in.
        array_workspace: Arc<str>,
        /// The workspace of the scope that was passed.
        scope_workspace: Arc<str>,
    },

    /// An operation needs an open workspace and this one is closed.
    #[error(
        "workspace '{workspace}' is not open: {action} needs an open cycle; enter it with \
         `enter()` first (leveraging to a closed workspace is an error, never a silent no-op)"
    )]
    NotOpen {
        /// The workspace.
        workspace: Arc<str>,
        /// What was attempted.
        action: &'static str,
    },

    /// An operation needs a closed workspace and this one is open.
    #[error(
        "workspace '{workspace}' is open ({depth} scope(s) alive): {action} needs it closed; \
         drop every scope of it first"
    )]
    StillOpen {
        /// The workspace.
        workspace: Arc<str>,
        /// Number of scopes alive.
        depth: usize,
        /// What was attempted.
        action: &'static str,
    },

    /// No workspace with this id exists for the current thread.
    #[error(
        "no workspace '{workspace}' on this thread: create it with \
         `WorkspaceManager::get_or_create` first (workspaces are per thread)"
    )]
    UnknownWorkspace {
        /// The id asked for.
        workspace: String,
    },

    /// A layer's array is not where its [`ArrayType`](crate::ArrayType) says it must be.
    #[error(
        "layer '{layer}' produced {array_type:?} in {actual}, but {array_type:?} must live in {expected}: \
         allocate it from the {array_type:?} scope the layer was given (`ctx.activations` for a forward \
         output), or copy it there with `TypedScope::copy_of` (`TypedScope::leverage` copies only what \
         does not live there already: a layer that passes its input on returns `ctx.activations.leverage(x)?`)"
    )]
    WrongLocation {
        /// The layer that produced the array.
        layer: String,
        /// The array's role.
        array_type: crate::roles::ArrayType,
        /// Where arrays of this type belong (a workspace, or a heap workspace, whose
        /// name ends in "(heap)").
        expected: String,
        /// Where this array is.
        actual: String,
    },

    /// A value handed to the workspace is out of range (an alignment that is not a
    /// power of two).
    #[error("{0}")]
    InvalidInput(String),

    /// A helper workspace that a layer asked for was never declared.
    #[error(
        "layer workspace manager has no helper workspace '{helper}': declare it with \
         `LayerWorkspaceMgrBuilder::helper(\"{helper}\", config)` (declared: {declared:?})"
    )]
    UnknownHelper {
        /// The helper asked for.
        helper: String,
        /// The helpers that exist.
        declared: Vec<String>,
    },

    /// `get_or_create` was called with a configuration that differs from the existing one.
    #[error(
        "workspace '{workspace}' already exists with a different configuration: existing \
         {existing}, requested {requested}; use one configuration per id, or destroy the \
         workspace first"
    )]
    ConfigMismatch {
        /// The id.
        workspace: String,
        /// The configuration it has.
        existing: String,
        /// The configuration that was asked for.
        requested: String,
    },

    /// The value of `CARVE_WORKSPACE_DEBUG` is not understood.
    #[error(
        "environment variable CARVE_WORKSPACE_DEBUG is '{value}': expected one of \
         'disabled', 'spill_everything', 'bypass_everything'"
    )]
    InvalidDebugMode {
        /// The value found.
        value: String,
    },

    /// `retained()` was asked of memory that holds no initialised contents.
    #[error(
        "workspace '{workspace}' cannot give retained contents: only the arena of a memory-mapped \
         workspace holds initialised bytes (this one is {backend}, or the request spilled); use \
         `zeros` or `uninit` instead"
    )]
    NotInitialised {
        /// The workspace.
        workspace: Arc<str>,
        /// Its backend kind.
        backend: &'static str,
    },

    /// The memory backend could not provide memory.
    #[error("workspace '{workspace}': {source}{}", memory_of(.source, .report))]
    Backend {
        /// The workspace.
        workspace: Arc<str>,
        /// What the backend reported.
        #[source]
        source: BackendError,
        /// What held the memory when the backend refused (see
        /// [`MemoryReport`](crate::timeline::MemoryReport)).
        report: Box<crate::memory_report::MemoryReport>,
    },

    /// A check for heap allocations failed: the code checked made some, or the counting
    /// allocator is not installed (see [`alloc_check`](crate::alloc_check)).
    #[error(transparent)]
    AllocationCheck(#[from] crate::alloc_check::failure::AllocationError),
}

/// Errors reported by an [`ArenaBackend`](crate::backend::ArenaBackend).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The system allocator refused.
    #[error("out of memory: {bytes} bytes with alignment {align} could not be allocated")]
    OutOfMemory {
        /// Bytes requested.
        bytes: usize,
        /// Alignment requested.
        align: usize,
    },
    /// A memory-mapped file could not be opened, sized or mapped.
    #[error("memory-mapped file {path}: {source}; check that the directory exists and is writable")]
    Mmap {
        /// The file.
        path: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The backend has a fixed size and cannot provide another arena.
    #[error("{backend} arenas have a fixed size of {capacity} bytes and cannot grow to {requested}")]
    FixedSize {
        /// The backend kind.
        backend: &'static str,
        /// Its size.
        capacity: usize,
        /// The size asked for.
        requested: usize,
    },
    /// The backend cannot align an arena's base as the workspace's configuration asks.
    #[error(
        "{kind} arenas can only be aligned to {guaranteed} bytes, not {align}; configure an \
         alignment of at most {guaranteed} for this location"
    )]
    Unaligned {
        /// The backend kind.
        kind: &'static str,
        /// The alignment asked for.
        align: usize,
        /// The alignment the backend can give.
        guaranteed: usize,
    },
    /// The file of a file-backed workspace is mapped by another workspace (in this
    /// process or another one).
    #[error(
        "memory-mapped file {path} is already in use by another file-backed workspace (in this \
         or another process); two workspaces on one file would hand out the same memory twice, \
         so give each its own path or drop the other workspace first"
    )]
    FileInUse {
        /// The file.
        path: String,
    },
    /// A backend-specific failure (device drivers report here).
    #[error("{0}")]
    Other(String),
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The message, as for `Display`: what `main` prints for an error it returns.
///
/// ```
/// let err = workspace_core::DebugMode::parse("bogus").unwrap_err();
/// assert_eq!(format!("{err:?}"), format!("{err}"));
/// assert!(format!("{err:?}").contains("'bogus'"));
/// ```
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The report of a backend's error, for the refusals of memory (an out-of-memory, a
/// fixed arena too small); nothing for the others (a file that cannot be mapped).
fn memory_of(source: &BackendError, report: &crate::memory_report::MemoryReport) -> String {
    match source {
        BackendError::OutOfMemory { .. } | BackendError::FixedSize { .. } => format!(". Memory: {report}"),
        _ => String::new(),
    }
}

/// [`Error::WrongWorkspace`]'s words: two workspaces of the same name are two standalone
/// heap scopes (or two workspaces given one name), whose arrays are each its own.
fn wrong_workspace(array_workspace: &str, scope_workspace: &str) -> String {
    if array_workspace == scope_workspace {
        return format!(
            "array belongs to another '{array_workspace}' than the scope it was accessed through: two workspaces \
             go by that name (two `no_workspaces()` managers, or two standalone heap scopes, `Scope::heap()`, each \
             read only through itself); keep an owned copy (`detach()`) to read it elsewhere"
        );
    }
    format!(
        "array belongs to workspace '{array_workspace}' but was accessed through a scope of '{scope_workspace}': \
         pass a scope of '{array_workspace}', or `leverage_to` the array into '{scope_workspace}' first"
    )
}
