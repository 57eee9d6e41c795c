//! The per-thread workspace registry, as ND4J's workspace manager.
//!
//! Each thread has its own registry; a [`WorkspaceManager`] is a cheap handle to the
//! current thread's. Workspaces are found by id, created on first use, and destroyed
//! one by one, all at once, or when the thread exits.

use std::cell::{Cell, RefCell};
use std::fmt::Write as _;
use std::rc::Rc;

use crate::config::WorkspaceConfig;
use crate::engine::WorkspaceStats;
use crate::error::{Error, Result};
use crate::scope::Scope;
use crate::workspace::{DebugMode, Workspace};

#[derive(Debug)]
struct Registry {
    workspaces: RefCell<Vec<Rc<Workspace>>>,
    /// The debug mode for new workspaces, or the error from reading it.
    debug: RefCell<Result<DebugMode>>,
    /// Whether `set_debug_mode` overrode the environment.
    overridden: Cell<bool>,
    /// A registry of [`WorkspaceManager::shape_only`]: not the thread's, its workspaces
    /// shape-only.
    shape_only: bool,
    /// The thread's registry of heap workspaces ([`WorkspaceManager::heaps`]).
    heap: bool,
}

thread_local! {
    static REGISTRY: Rc<Registry> = Rc::new(Registry {
        workspaces: RefCell::new(Vec::new()),
        debug: RefCell::new(DebugMode::from_env()),
        overridden: Cell::new(false),
        shape_only: false,
        heap: false,
    });
    static HEAPS: Rc<Registry> = Rc::new(Registry {
        workspaces: RefCell::new(Vec::new()),
        debug: RefCell::new(Ok(DebugMode::SpillEverything)),
        overridden: Cell::new(true),
        shape_only: false,
        heap: true,
    });
}

/// A handle to the current thread's workspace registry.
///
/// `!Send`: it always speaks for the thread that made it.
///
/// ```
/// use workspace_core::{WorkspaceManager, WorkspaceConfig};
///
/// let manager = WorkspaceManager::current();
/// let config = WorkspaceConfig::default();
/// let ws = manager.get_or_create("LOOP", &config)?;
/// {
///     let scope = manager.enter("LOOP")?;
///     scope.zeros::<f32, _>(1024)?;
/// }
/// assert_eq!(ws.stats().cycles, 1);
/// println!("{}", workspace_core::stats_table(&manager.stats()));
/// manager.destroy("LOOP")?;
/// # Ok::<(), workspace_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct WorkspaceManager {
    registry: Rc<Registry>,
}

impl WorkspaceManager {
    /// The registry of the calling thread.
    pub fn current() -> WorkspaceManager {
        WorkspaceManager { registry: REGISTRY.with(Rc::clone) }
    }

    /// A registry of its own (not the thread's), whose workspaces are shape-only
    /// ([`Workspace::is_shape_only`]): for a dry run of code that finds its workspaces
    /// by name, as a network's do, without touching the thread's. Its debug mode is the
    /// calling thread's now.
    ///
    /// ```
    /// use workspace_core::{WorkspaceManager, WorkspaceConfig};
    ///
    /// let dry = WorkspaceManager::shape_only();
    /// let ws = dry.get_or_create("LOOP", &WorkspaceConfig::default())?;
    /// assert!(ws.is_shape_only());
    /// assert!(!WorkspaceManager::current().exists("LOOP"));
    /// # Ok::<(), workspace_core::Error>(())
    /// ```
    pub fn shape_only() -> WorkspaceManager {
        let debug = WorkspaceManager::current().debug_mode();
        WorkspaceManager {
            registry: Rc::new(Registry {
                workspaces: RefCell::new(Vec::new()),
                debug: RefCell::new(debug),
                overridden: Cell::new(true),
                shape_only: true,
                heap: false,
            }),
        }
    }

    /// The calling thread's registry of heap workspaces: workspaces that spill
    /// everything ([`DebugMode::SpillEverything`], in RAM whatever their
    /// configuration's location), so that every array is a heap block of its own, freed
    /// when the workspace's outermost scope closes. What
    /// [`LayerWorkspaceMgrBuilder::workspaces_off`](crate::LayerWorkspaceMgrBuilder::workspaces_off)
    /// finds its workspaces in, by name, as managers with workspaces on find theirs in
    /// [`WorkspaceManager::current`]: managers that name the same workspace share it.
    ///
    /// ```
    /// use workspace_core::{DebugMode, WorkspaceConfig, WorkspaceManager};
    ///
    /// let heaps = WorkspaceManager::heaps();
    /// let ws = heaps.get_or_create("ACT (heap)", &WorkspaceConfig::default())?;
    /// assert_eq!(ws.debug_mode(), DebugMode::SpillEverything);
    /// assert!(!WorkspaceManager::current().exists("ACT (heap)"));
    /// # Ok::<(), workspace_core::Error>(())
    /// ```
    pub fn heaps() -> WorkspaceManager {
        WorkspaceManager { registry: HEAPS.with(Rc::clone) }
    }

    /// A registry of heap workspaces of its own: as [`WorkspaceManager::heaps`], but
    /// shared with nothing else. Managers built with
    /// [`workspaces_off`](crate::LayerWorkspaceMgrBuilder::workspaces_off) and
    /// [`in_manager`](crate::LayerWorkspaceMgrBuilder::in_manager) of it share its
    /// workspaces by name among themselves, and neither see nor leave anything in the
    /// thread's (a tool that runs a user's layer as a network with workspaces off
    /// would, without clashing with the user's own networks' configurations).
    ///
    /// ```
    /// use workspace_core::{WorkspaceConfig, WorkspaceManager};
    ///
    /// let own = WorkspaceManager::private_heaps();
    /// own.get_or_create("ACT (heap)", &WorkspaceConfig::default())?;
    /// assert!(own.is_heaps() && own.exists("ACT (heap)"));
    /// assert!(!WorkspaceManager::heaps().exists("ACT (heap)"));
    /// # Ok::<(), workspace_core::Error>(())
    /// ```
    pub fn private_heaps() -> WorkspaceManager {
        WorkspaceManager {
            registry: Rc::new(Registry {
                workspaces: RefCell::new(Vec::new()),
                debug: RefCell::new(Ok(DebugMode::SpillEverything)),
                overridden: Cell::new(true),
                shape_only: false,
                heap: true,
            }),
        }
    }

    /// Whether this is a registry of heap workspaces ([`WorkspaceManager::heaps`],
    /// [`WorkspaceManager::private_heaps`]).
    pub fn is_heaps(&self) -> bool {
        self.registry.heap
    }

    /// The thread's heap workspaces, when this is the thread's own registry (whose
    /// workspaces they stand in for with workspaces off) and they are still there (not
    /// while the thread's locals are being destroyed).
    fn heaps_of_thread(&self) -> Option<WorkspaceManager> {
        if self.registry.heap || self.registry.shape_only {
            return None;
        }
        HEAPS.try_with(Rc::clone).ok().map(|registry| WorkspaceManager { registry })
    }

    /// The first open workspace of this registry: `(name, depth)`.
    fn first_open(&self) -> Option<(std::sync::Arc<str>, usize)> {
        self.registry
            .workspaces
            .borrow()
            .iter()
            .find(|ws| ws.is_open())
            .map(|ws| (ws.name().clone(), ws.engine().depth()))
    }

    /// Whether this registry makes shape-only workspaces (see
    /// [`WorkspaceManager::shape_only`]).
    pub fn is_shape_only(&self) -> bool {
        self.registry.shape_only
    }

    fn find(&self, id: &str) -> Option<Rc<Workspace>> {
        self.registry.workspaces.borrow().iter().find(|ws| &**ws.name() == id).cloned()
    }

    /// The workspace `id`, created with `config` if it does not exist yet.
    ///
    /// # Errors
    ///
    /// [`Error::ConfigMismatch`] when `id` exists with another configuration;
    /// [`Error::InvalidDebugMode`] when `CARVE_WORKSPACE_DEBUG` is not understood;
    /// [`Error::Backend`] when the initial arena cannot be reserved.
    pub fn get_or_create(&self, id: &str, config: &WorkspaceConfig) -> Result<Rc<Workspace>> {
        if self.registry.heap {
            // The thread's debug mode is read as a workspace's creation reads it (an
            // unknown `CARVE_WORKSPACE_DEBUG` is the same error with workspaces off).
            WorkspaceManager::current().debug_mode()?;
            return find_or_create(&self.registry.workspaces, id, config, || {
                Workspace::create_heap(id, config.clone())
            });
        }
        find_or_create(&self.registry.workspaces, id, config, || {
            Workspace::create(id, config.clone(), self.debug_mode()?, self.registry.shape_only)
        })
    }

    /// The workspace of `of`'s name in this registry; when there is none, a new one of
    /// `of`'s configuration and debug mode that starts where `of` is now: its arena of
    /// `of`'s size and its learning as far as `of`'s ([`Sizing`](crate::Sizing)). From
    /// there the two size their arenas alike, cycle for cycle. In a
    /// [`WorkspaceManager::shape_only`] registry the twin is shape-only: a dry run's
    /// copy of a workspace that other code on the thread has already taught.
    ///
    /// ```
    /// use workspace_core::{Workspace, WorkspaceConfig, WorkspaceManager};
    ///
    /// let ws = Workspace::new("ACT", WorkspaceConfig::default())?;
    /// for n in [100, 300] {
    ///     let scope = ws.enter()?;
    ///     scope.zeros::<f32, _>(n)?;
    /// }
    /// let dry = WorkspaceManager::shape_only();
    /// let twin = dry.twin(&ws)?;
    /// assert!(twin.is_shape_only());
    /// assert_eq!((twin.capacity(), twin.sizing()), (ws.capacity(), ws.sizing()));
    /// # Ok::<(), workspace_core::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] while `of` is open (a cycle under way has not taught it yet);
    /// [`Error::ConfigMismatch`] when this registry has a workspace of that name with
    /// another configuration; [`Error::Backend`] when the twin's arena cannot be had.
    pub fn twin(&self, of: &Workspace) -> Result<Rc<Workspace>> {
        if of.is_open() {
            return Err(Error::StillOpen {
                workspace: of.name().clone(),
                depth: of.engine().depth(),
                action: "making a twin of it",
            });
        }
        find_or_create(&self.registry.workspaces, of.name(), of.config(), || {
            let twin = match self.registry.heap {
                true => Workspace::create_heap(of.name(), of.config().clone())?,
                false => Workspace::create(of.name(), of.config().clone(), of.debug_mode(), self.registry.shape_only)?,
            };
            twin.engine().adopt_sizing(of.sizing())?;
            Ok(twin)
        })
    }

    /// The workspace `id`.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownWorkspace`] when there is none on this thread.
    pub fn get(&self, id: &str) -> Result<Rc<Workspace>> {
        self.find(id).ok_or_else(|| Error::UnknownWorkspace { workspace: id.to_string() })
    }

    /// Whether `id` exists on this thread.
    pub fn exists(&self, id: &str) -> bool {
        self.find(id).is_some()
    }

    /// Enters workspace `id` (see [`Workspace::enter`]).
    ///
    /// # Errors
    ///
    /// [`Error::UnknownWorkspace`], or those of [`Workspace::enter`].
    pub fn enter(&self, id: &str) -> Result<Scope<'static>> {
        self.get(id)?.enter_shared()
    }

    /// Borrows the open workspace `id` as allocation target, for example to leverage
    /// an array into it.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownWorkspace`] or [`Error::NotOpen`]: never a silent no-op.
    pub fn borrow_open(&self, id: &str) -> Result<Scope<'static>> {
        self.get(id)?.borrow_open_shared()
    }

    /// A scope that allocates on the heap ("scoping out" of workspaces).
    pub fn scope_out(&self) -> Scope<'static> {
        Scope::heap()
    }

    /// Removes workspace `id` from this thread's registry; its memory is freed once no
    /// `Rc` to it is left. The thread's registry removes `id`'s heap workspace ("`id`
    /// (heap)", [`WorkspaceManager::heaps`]) with it, or alone where workspaces were off.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownWorkspace`] when neither exists, or [`Error::StillOpen`] while
    /// either has open scopes (then neither is removed).
    pub fn destroy(&self, id: &str) -> Result<()> {
        let heap_id = format!("{id} (heap)");
        let heaps = self.heaps_of_thread().filter(|heaps| heaps.exists(&heap_id));
        let Some(heaps) = heaps else { return self.remove(id) };
        let open = |registry: &WorkspaceManager, id: &str| registry.find(id).filter(|ws| ws.is_open());
        if let Some(ws) = open(self, id).or_else(|| open(&heaps, &heap_id)) {
            return Err(Error::StillOpen {
                workspace: ws.name().clone(),
                depth: ws.engine().depth(),
                action: "destroy",
            });
        }
        if self.exists(id) {
            self.remove(id)?;
        }
        heaps.remove(&heap_id)
    }

    /// Removes workspace `id` from this registry.
    fn remove(&self, id: &str) -> Result<()> {
        let mut workspaces = self.registry.workspaces.borrow_mut();
        let index = workspaces
            .iter()
            .position(|ws| &**ws.name() == id)
            .ok_or_else(|| Error::UnknownWorkspace { workspace: id.to_string() })?;
        let ws = &workspaces[index];
        if ws.is_open() {
            return Err(Error::StillOpen {
                workspace: ws.name().clone(),
                depth: ws.engine().depth(),
                action: "destroy",
            });
        }
        workspaces.remove(index);
        Ok(())
    }

    /// Destroys every closed workspace of this thread (this also happens when the
    /// thread exits). The thread's registry destroys its heap workspaces
    /// ([`WorkspaceManager::heaps`]) with its own, as they stand in for its workspaces
    /// with workspaces off.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] naming the first workspace that is open; the open ones are
    /// kept, the closed ones destroyed.
    pub fn destroy_all(&self) -> Result<()> {
        let heaps = self.heaps_of_thread().map_or(Ok(()), |heaps| heaps.destroy_all());
        let open = self.first_open();
        self.registry.workspaces.borrow_mut().retain(|ws| ws.is_open());
        match open {
            Some((workspace, depth)) => Err(Error::StillOpen { workspace, depth, action: "destroy_all" }),
            None => heaps,
        }
    }

    /// Ids of this thread's workspaces, in creation order.
    pub fn ids(&self) -> Vec<String> {
        self.registry.workspaces.borrow().iter().map(|ws| ws.name().to_string()).collect()
    }

    /// The debug mode new workspaces get.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidDebugMode`] when `CARVE_WORKSPACE_DEBUG` is not understood and
    /// no mode was set with [`WorkspaceManager::set_debug_mode`].
    pub fn debug_mode(&self) -> Result<DebugMode> {
        match &*self.registry.debug.borrow() {
            Ok(mode) => Ok(*mode),
            Err(Error::InvalidDebugMode { value }) => Err(Error::InvalidDebugMode { value: value.clone() }),
            Err(other) => Err(Error::InvalidDebugMode { value: other.to_string() }),
        }
    }

    /// Sets the debug mode of this thread's workspaces, existing and new.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`] when a workspace is open (none is changed then);
    /// [`Error::InvalidConfig`] for the registry of heap workspaces
    /// ([`WorkspaceManager::heaps`]), whose workspaces always spill everything.
    pub fn set_debug_mode(&self, mode: DebugMode) -> Result<()> {
        if self.registry.heap {
            return Err(Error::InvalidConfig {
                reason: "the heap workspaces (WorkspaceManager::heaps) always spill everything: their debug mode \
                         is not set"
                    .into(),
            });
        }
        // A heap workspace open stands for a workspace open (workspaces off).
        let open = self.first_open().or_else(|| self.heaps_of_thread().and_then(|heaps| heaps.first_open()));
        if let Some((workspace, depth)) = open {
            return Err(Error::StillOpen { workspace, depth, action: "changing the debug mode" });
        }
        for ws in self.registry.workspaces.borrow().iter() {
            ws.set_debug_mode(mode)?;
        }
        *self.registry.debug.borrow_mut() = Ok(mode);
        self.registry.overridden.set(true);
        Ok(())
    }

    /// Statistics of every workspace on this thread.
    pub fn stats(&self) -> Vec<WorkspaceStats> {
        self.registry.workspaces.borrow().iter().map(|ws| ws.stats()).collect()
    }

    /// The statistics as a table: the former way to write
    /// [`stats_table`]`(&manager.stats())`, the one function that draws the table.
    #[deprecated(note = "use the function `stats_table(&manager.stats())`: one function draws the table")]
    #[doc(hidden)]
    pub fn stats_table(&self) -> String {
        stats_table(&self.stats())
    }

    /// The statistics as a JSON array.
    pub fn stats_json(&self) -> String {
        serde_json::to_string(&self.stats()).expect("statistics serialise")
    }
}

/// The workspace named `id` in `workspaces`, or one `create` makes, added to them:
/// the lookup of a registry and of a plan group's members.
///
/// # Errors
///
/// [`Error::ConfigMismatch`] when `id` exists with another configuration; `create`'s.
pub(crate) fn find_or_create(
    workspaces: &RefCell<Vec<Rc<Workspace>>>,
    id: &str,
    config: &WorkspaceConfig,
    create: impl FnOnce() -> Result<Workspace>,
) -> Result<Rc<Workspace>> {
    if let Some(ws) = workspaces.borrow().iter().find(|ws| &**ws.name() == id) {
        if ws.config() != config {
            return Err(Error::ConfigMismatch {
                workspace: id.to_string(),
                existing: ws.config().to_string(),
                requested: config.to_string(),
            });
        }
        return Ok(ws.clone());
    }
    let ws = Rc::new(create()?);
    workspaces.borrow_mut().push(ws.clone());
    Ok(ws)
}

fn human(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Formats statistics as an aligned text table, one row per workspace. When any of
/// them is a member of a plan group ([`WorkspaceStats::planned`]), five columns more
/// give its group's plan figures: the bytes of the current plan, its lower bound, the
/// same iteration laid out per role, re-plans and divergences ("-" for the others).
pub fn stats_table(stats: &[WorkspaceStats]) -> String {
    const COLUMNS: usize = 12;
    const PLANNED: [&str; 5] = ["plan", "bound", "per role", "replans", "diverged"];
    let planned = stats.iter().any(|s| s.planned.is_some());
    let header: [&str; COLUMNS] = [
        "workspace",
        "backend",
        "capacity",
        "in use",
        "peak",
        "spilled",
        "spills",
        "pinned",
        "cycles",
        "gen",
        "growths",
        "late spills",
    ];
    let rows: Vec<Vec<String>> = stats
        .iter()
        .map(|s| {
            let mut row = vec![
                s.name.clone(),
                s.backend.to_string(),
                human(s.capacity),
                human(s.bytes_in_use + s.spilled_in_use),
                human(s.peak_bytes),
                human(usize::try_from(s.bytes_spilled).unwrap_or(usize::MAX)),
                s.external_allocations.to_string(),
                s.pinned_allocations.to_string(),
                s.cycles.to_string(),
                s.generation.to_string(),
                s.growth_events.to_string(),
                s.cycles_spilled_after_learning.to_string(),
            ];
            if planned {
                match &s.planned {
                    Some(p) => row.extend([
                        human(p.plan_bytes),
                        human(p.lower_bound_bytes),
                        human(p.per_role_bytes),
                        p.replans.to_string(),
                        p.divergences.to_string(),
                    ]),
                    None => row.extend(PLANNED.map(|_| "-".to_string())),
                }
            }
            row
        })
        .collect();
    let header: Vec<&str> = header.iter().chain(planned.then_some(&PLANNED).into_iter().flatten()).copied().collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[&str]| {
        for (i, (cell, &width)) in cells.iter().zip(&widths).enumerate() {
            if i == 0 {
                let _ = write!(out, "{cell:<width$}");
            } else {
                let _ = write!(out, "  {cell:>width$}");
            }
        }
        out.push('\n');
    };
    line(&mut out, &header);
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    line(&mut out, &rule.iter().map(String::as_str).collect::<Vec<_>>());
    for row in &rows {
        line(&mut out, &row.iter().map(String::as_str).collect::<Vec<_>>());
    }
    out
}
