//! The layer API, as DL4J users know it (see the crate docs, "Layers").

use std::ops::Deref;
use std::rc::Rc;

use bytemuck::Pod;
use ndarray::{ArrayBase, ArrayView, ArrayViewMut, Data, Dimension, RawData, ShapeBuilder};

use crate::config::WorkspaceConfig;
use crate::error::{Error, Result};
use crate::manager::WorkspaceManager;
use crate::planned::PlanGroup;
use crate::roles::ArrayType;
use crate::scope::{extent, Scope};
use crate::workspace::Workspace;
use crate::WorkspaceStats;

/// Where a role's arrays go.
#[derive(Clone, Debug)]
enum Target {
    /// No workspace: each array is its own heap allocation, in a heap workspace (see
    /// [`own_heap`] and [`WorkspaceManager::heaps`]) that gives the role the scopes,
    /// cycles and handles a workspace gives, so that the calls that succeed with
    /// workspaces on succeed with them off, and those that fail fail alike.
    Heap(Rc<Workspace>),
    Workspace(Rc<Workspace>),
}

impl Target {
    /// The workspace, or the heap workspace.
    fn any(&self) -> &Rc<Workspace> {
        match self {
            Target::Heap(ws) | Target::Workspace(ws) => ws,
        }
    }

    /// The workspace; `None` for a heap workspace.
    fn workspace(&self) -> Option<&Rc<Workspace>> {
        match self {
            Target::Heap(_) => None,
            Target::Workspace(ws) => Some(ws),
        }
    }
}

/// A scoped-out role's heap workspace of the manager's own ("heap (`ty`)"): no arena,
/// every allocation its own heap block, freed when the outermost scope closes (as a
/// workspace's arena is reset then); nested scopes, [`LayerWorkspaceMgr::borrow_open`],
/// [`LayerWorkspaceMgr::leverage_to`] and handles behave as with a workspace.
fn own_heap(ty: ArrayType) -> Result<Target> {
    Ok(Target::Heap(Rc::new(Workspace::standalone_heap(&format!("heap ({ty:?})"))?)))
}

/// Maps every [`ArrayType`] to a workspace or to no workspace, opens them, and checks
/// where arrays live. See the crate documentation, "Layers, as DL4J users know them".
///
/// Workspaces are created in the calling thread's [`WorkspaceManager`] by name, so
/// two managers naming the same workspace share it (with the same configuration, or
/// building the second fails with [`Error::ConfigMismatch`]). Like workspaces, a
/// manager belongs to the thread that built it.
#[derive(Clone, Debug)]
pub struct LayerWorkspaceMgr {
    targets: [Target; 9],
    helpers: Vec<(String, Target)>,
    group: Option<PlanGroup>,
}

/// Builder of a [`LayerWorkspaceMgr`]; every array type must be mapped, explicitly or
/// through [`LayerWorkspaceMgrBuilder::default_workspace`].
#[derive(Clone, Debug, Default)]
pub struct LayerWorkspaceMgrBuilder {
    /// `None`: not mapped yet; `Some(None)`: no workspace.
    entries: [Option<Option<(String, WorkspaceConfig)>>; 9],
    default: Option<(String, WorkspaceConfig)>,
    helpers: Vec<(String, WorkspaceConfig)>,
    group: Option<PlanGroup>,
    /// Where unplanned workspaces are found or created: the thread's registry unless
    /// [`LayerWorkspaceMgrBuilder::in_manager`] named another.
    manager: Option<WorkspaceManager>,
    /// [`LayerWorkspaceMgrBuilder::workspaces_off`].
    off: bool,
}

impl LayerWorkspaceMgrBuilder {
    /// Arrays of type `ty` go to workspace `name`, created with `config`.
    pub fn with(mut self, ty: ArrayType, name: &str, config: WorkspaceConfig) -> Self {
        self.entries[ty.index()] = Some(Some((name.to_string(), config)));
        self
    }

    /// Arrays of type `ty` are ordinary heap allocations, in a heap workspace of the
    /// type's own in this manager (see [`LayerWorkspaceMgr::no_workspaces`]).
    pub fn scoped_out(mut self, ty: ArrayType) -> Self {
        self.entries[ty.index()] = Some(None);
        self
    }

    /// Types not mapped otherwise go to workspace `name`.
    pub fn default_workspace(mut self, name: &str, config: WorkspaceConfig) -> Self {
        self.default = Some((name.to_string(), config));
        self
    }

    /// Declares a named helper workspace: scratch a layer keeps between calls (for
    /// example a cache that lives across iterations and is reset when the layer says).
    pub fn helper(mut self, name: &str, config: WorkspaceConfig) -> Self {
        self.helpers.push((name.to_string(), config));
        self
    }

    /// Takes the workspaces from `group` (creating them there) instead of the thread's
    /// [`WorkspaceManager`]: they are planned together ([`crate::planned`]). The caller
    /// marks the iterations on the group ([`PlanGroup::start_iteration`]). Names,
    /// validation and its messages are those of unplanned workspaces.
    pub fn planned(mut self, group: &PlanGroup) -> Self {
        self.group = Some(group.clone());
        self
    }

    /// Every type and helper mapped as given, but scoped out: each name a heap workspace
    /// (named "`name` (heap)", of the name's configuration in RAM, every array a heap
    /// block of its own) found or created in [`WorkspaceManager::heaps`] (or the heap
    /// registry given to [`in_manager`](Self::in_manager)), so that managers and types
    /// naming one workspace share it, and a handle read, a `borrow_open`, a
    /// `leverage_to`, a budget or a second configuration succeeds or fails as it would
    /// with the workspaces on. [`WorkspaceMode::None`](crate::WorkspaceMode::None)
    /// builds a network's managers so. The heap workspaces are left out of
    /// [`LayerWorkspaceMgr::workspaces`] and its sums (they hold no arena).
    ///
    /// [`build`](Self::build) refuses it with [`planned`](Self::planned) (a plan is
    /// one arena) and with a registry of workspaces rather than of heap workspaces.
    pub fn workspaces_off(mut self) -> Self {
        self.off = true;
        self
    }

    /// Finds or creates the unplanned workspaces in `manager` rather than in the
    /// thread's registry: a [`WorkspaceManager::shape_only`] registry gives a manager
    /// for a dry run, whose workspaces share names as the real ones do.
    pub fn in_manager(mut self, manager: &WorkspaceManager) -> Self {
        self.manager = Some(manager.clone());
        self
    }

    /// Creates (or finds, on this thread or in the manager given to
    /// [`LayerWorkspaceMgrBuilder::in_manager`]) the workspaces and builds the manager.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when a type is mapped nowhere and there is no default,
    /// a helper is declared twice, or [`workspaces_off`](Self::workspaces_off) meets a
    /// plan group or a registry that is not of heap workspaces;
    /// [`Error::ConfigMismatch`] when a name is used with two configurations; the errors
    /// of [`WorkspaceManager::get_or_create`].
    pub fn build(self) -> Result<LayerWorkspaceMgr> {
        let manager = match (self.off, self.manager.clone()) {
            (false, Some(manager)) if manager.is_heaps() => {
                return Err(Error::InvalidConfig {
                    reason: "a registry of heap workspaces (`WorkspaceManager::heaps()`) serves managers with their \
                             workspaces off: add `workspaces_off()`"
                        .into(),
                })
            }
            (false, manager) => manager.unwrap_or_else(WorkspaceManager::current),
            (true, _) if self.group.is_some() => {
                return Err(Error::InvalidConfig {
                    reason: "a planned manager (`planned`) lays its workspaces out in its group's arena: it cannot \
                             have them off (`workspaces_off`); build it without `planned`"
                        .into(),
                })
            }
            (true, None) => WorkspaceManager::heaps(),
            (true, Some(manager)) if manager.is_heaps() => manager,
            (true, Some(_)) => {
                return Err(Error::InvalidConfig {
                    reason: "`workspaces_off` finds its heap workspaces in a registry of heap workspaces \
                             (`WorkspaceManager::heaps()`), not in the registry given to `in_manager`"
                        .into(),
                })
            }
        };
        let get = |name: &str, config: &WorkspaceConfig| -> Result<Target> {
            if self.off {
                // The name's heap workspace, shared by the managers that name it.
                return Ok(Target::Heap(manager.get_or_create(&format!("{name} (heap)"), config)?));
            }
            Ok(Target::Workspace(match &self.group {
                Some(group) => group.workspace(name, config)?,
                None => manager.get_or_create(name, config)?,
            }))
        };
        let mut targets: Vec<Target> = Vec::with_capacity(ArrayType::ALL.len());
        for ty in ArrayType::ALL {
            let entry = match &self.entries[ty.index()] {
                Some(entry) => entry.as_ref(),
                None => match &self.default {
                    Some(default) => Some(default),
                    None => {
                        return Err(Error::InvalidConfig {
                            reason: format!(
                                "array type {ty:?} is mapped to no workspace and there is no default: use \
                                 `with(ArrayType::{ty:?}, name, config)`, `scoped_out(ArrayType::{ty:?})` or \
                                 `default_workspace(name, config)`"
                            ),
                        })
                    }
                },
            };
            targets.push(match entry {
                Some((name, config)) => get(name, config)?,
                None => own_heap(ty)?,
            });
        }
        let targets: [Target; 9] = targets.try_into().expect("one target per array type, in `ALL`'s order");
        let mut helpers: Vec<(String, Target)> = Vec::with_capacity(self.helpers.len());
        for (name, config) in &self.helpers {
            if helpers.iter().any(|(n, _)| n == name) {
                return Err(Error::InvalidConfig { reason: format!("helper workspace '{name}' is declared twice") });
            }
            helpers.push((name.clone(), get(name, config)?));
        }
        Ok(LayerWorkspaceMgr { targets, helpers, group: self.group.clone() })
    }
}

/// Where arrays of a type go when it has no workspace, in messages.
const NO_WORKSPACE: &str = "no workspace (heap)";

impl LayerWorkspaceMgr {
    /// A builder; every type must be mapped or covered by a default workspace.
    pub fn builder() -> LayerWorkspaceMgrBuilder {
        LayerWorkspaceMgrBuilder::default()
    }

    /// Every type scoped out to the heap, each in a heap workspace of its own: its
    /// arrays are heap allocations, freed when the type's outermost scope closes, and its
    /// scopes, handles, `borrow_open` and `leverage_to` behave as those of a workspace
    /// of its own would. ([`WorkspaceMode::None`](crate::WorkspaceMode::None) builds a
    /// network's managers with [`LayerWorkspaceMgrBuilder::workspaces_off`], which
    /// keeps the types that share a workspace sharing a heap workspace.)
    pub fn no_workspaces() -> LayerWorkspaceMgr {
        let targets = ArrayType::ALL.map(|ty| own_heap(ty).expect("a heap workspace reserves no memory"));
        LayerWorkspaceMgr { targets, helpers: Vec::new(), group: None }
    }

    /// The plan group the workspaces belong to (see [`LayerWorkspaceMgrBuilder::planned`]).
    pub fn plan_group(&self) -> Option<&PlanGroup> {
        self.group.as_ref()
    }

    /// The workspace of `ty`, `None` when it is scoped out.
    pub fn workspace(&self, ty: ArrayType) -> Option<&Rc<Workspace>> {
        self.targets[ty.index()].workspace()
    }

    /// The name of `ty`'s workspace, `None` when it is scoped out.
    pub fn workspace_name(&self, ty: ArrayType) -> Option<&str> {
        self.workspace(ty).map(|ws| &**ws.name())
    }

    /// Whether arrays of `ty` are heap allocations.
    pub fn is_scoped_out(&self, ty: ArrayType) -> bool {
        self.workspace(ty).is_none()
    }

    /// Opens `ty`'s workspace: a new cycle, or nested when it is already open (see
    /// [`Workspace::enter`]); its heap workspace alike when `ty` is scoped out.
    ///
    /// # Errors
    ///
    /// Those of [`Workspace::enter`].
    #[inline]
    pub fn enter(&self, ty: ArrayType) -> Result<TypedScope> {
        let ws = self.targets[ty.index()].any();
        let scope = ws.enter_shared()?;
        ws.shell.engine().note_role(ty);
        Ok(TypedScope { ty, scope })
    }

    /// Allocates in `ty`'s workspace, which something else holds open, without
    /// nesting a cycle (see [`Workspace::borrow_open`]); in its heap workspace alike
    /// when `ty` is scoped out.
    ///
    /// # Errors
    ///
    /// [`Error::NotOpen`] when the workspace (or the heap workspace) is closed: nothing
    /// is allocated in a closed workspace behind the caller's back.
    pub fn borrow_open(&self, ty: ArrayType) -> Result<TypedScope> {
        let scope = self.targets[ty.index()].any().borrow_open_shared()?;
        Ok(TypedScope { ty, scope })
    }

    /// The helper workspace `name`.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownHelper`] when it was not declared in the builder.
    pub fn helper(&self, name: &str) -> Result<&Rc<Workspace>> {
        self.helpers.iter().find(|(n, _)| n == name).map(|(_, ws)| ws.any()).ok_or_else(|| Error::UnknownHelper {
            helper: name.to_string(),
            declared: self.helpers.iter().map(|(n, _)| n.clone()).collect(),
        })
    }

    /// Opens the helper workspace `name` (a new cycle, or nested).
    ///
    /// # Errors
    ///
    /// [`Error::UnknownHelper`], or those of [`Workspace::enter`].
    pub fn enter_helper(&self, name: &str) -> Result<Scope<'static>> {
        self.helper(name)?.enter_shared()
    }

    /// Copies `array` into `ty`'s workspace (its heap workspace when `ty` is scoped
    /// out), which must be open (held by a scope elsewhere), as a storable
    /// [`crate::Handle`], read through any scope of that workspace until its cycle ends.
    ///
    /// # Errors
    ///
    /// [`Error::NotOpen`] when the workspace is closed; allocation errors.
    pub fn leverage_to<T: Pod, S: Data<Elem = T>, Dim: Dimension>(
        &self,
        ty: ArrayType,
        array: &ArrayBase<S, Dim>,
    ) -> Result<crate::Handle<T, Dim>> {
        let scope = self.borrow_open(ty)?;
        scope.copy_handle(array)
    }

    /// Checks that `array`, produced by `layer`, lives where arrays of type `ty` must.
    ///
    /// # Errors
    ///
    /// [`Error::WrongLocation`] naming the layer, the type, the expected and the
    /// actual workspace.
    pub fn validate<T, S: RawData<Elem = T>, Dim: Dimension>(
        &self,
        ty: ArrayType,
        layer: &str,
        array: &ArrayBase<S, Dim>,
    ) -> Result<()> {
        let (ptr, bytes) = extent(array);
        // (A heap workspace holds the blocks it allocated in its open cycle.)
        if self.targets[ty.index()].any().contains(ptr, bytes) {
            return Ok(());
        }
        Err(self.misplaced(ty, layer, ptr, bytes))
    }

    #[cold]
    fn misplaced(&self, ty: ArrayType, layer: &str, ptr: *const u8, bytes: usize) -> Error {
        // A heap workspace's name says it is one ("… (heap)").
        let expected = format!("workspace '{}'", self.targets[ty.index()].any().name());
        let actual = match self.locate(ptr, bytes) {
            Some(ws) => format!("workspace '{}'", ws.name()),
            None => "memory outside this manager's workspaces (heap, an input, or another workspace)".to_string(),
        };
        Error::WrongLocation { layer: layer.to_string(), array_type: ty, expected, actual }
    }

    /// The workspace of this manager (types and helpers, heap workspaces included) that
    /// holds the range.
    fn locate(&self, ptr: *const u8, bytes: usize) -> Option<&Rc<Workspace>> {
        self.all_targets().map(Target::any).find(|ws| ws.contains(ptr, bytes))
    }

    /// Where the types' arrays go, then the helpers'.
    fn all_targets(&self) -> impl Iterator<Item = &Target> + Clone {
        self.targets.iter().chain(self.helpers.iter().map(|(_, t)| t))
    }

    /// Where `array` lives, for messages: a workspace name, or a heap description.
    pub fn location_of<T, S: RawData<Elem = T>, Dim: Dimension>(&self, array: &ArrayBase<S, Dim>) -> String {
        let (ptr, bytes) = extent(array);
        match self.locate(ptr, bytes) {
            Some(ws) => format!("workspace '{}'", ws.name()),
            None => NO_WORKSPACE.to_string(),
        }
    }

    /// The distinct workspaces this manager uses (types first, then helpers), heap
    /// workspaces left out (they hold no arena: each array is a heap block of its own).
    pub fn workspaces(&self) -> impl Iterator<Item = &Rc<Workspace>> {
        let all = self.all_targets().filter_map(Target::workspace);
        // A workspace is listed where it first appears (the lists are short: nine
        // types plus the helpers).
        all.clone()
            .enumerate()
            .filter(move |(i, ws)| !all.clone().take(*i).any(|w| w.id() == ws.id()))
            .map(|(_, ws)| ws)
    }

    /// Statistics of the distinct workspaces this manager uses.
    pub fn stats(&self) -> Vec<WorkspaceStats> {
        self.workspaces().map(|ws| ws.stats()).collect()
    }

    /// Sum of the arena capacities of the distinct workspaces (0 with no workspaces),
    /// and of the plan group's arena when the workspaces are planned
    /// ([`LayerWorkspaceMgrBuilder::planned`]; managers that share a group, or
    /// workspaces, each count it).
    pub fn capacity(&self) -> usize {
        let planned = self.group.as_ref().map_or(0, PlanGroup::capacity);
        planned + self.workspaces().map(|ws| ws.capacity()).sum::<usize>()
    }

    /// Sum of the peaks (bytes in use, arena and spills) of the distinct workspaces
    /// since their last [`LayerWorkspaceMgr::reset_peaks`]; allocates nothing.
    pub fn peak_bytes(&self) -> usize {
        self.workspaces().map(|ws| ws.peak_bytes()).sum()
    }

    /// Restarts the peaks of the distinct workspaces.
    pub fn reset_peaks(&self) {
        self.workspaces().for_each(|ws| ws.reset_peak());
    }

    /// Sum of the bytes in use (arena and spills) of the distinct workspaces now.
    pub fn bytes_in_use(&self) -> usize {
        self.workspaces().map(|ws| ws.bytes_in_use() + ws.engine().spilled_in_use()).sum()
    }
}

impl LayerWorkspaceMgr {
    /// Whether this manager is planned and nothing reaches its group or workspaces but
    /// the manager itself (see `PlanGroup::reached_only_through`): no clone of the
    /// manager, the group or a workspace exists elsewhere, and every workspace it maps
    /// is a member of its group. Allocates nothing.
    pub(crate) fn reached_only_here(&self) -> bool {
        let Some(group) = &self.group else { return false };
        // A type's heap workspace is reached by nothing else: no clone of it, strong or
        // weak, but those of its types in this manager.
        let all = || self.all_targets();
        let heaps_here = all().all(|t| match t {
            Target::Heap(ws) => {
                let uses = all().filter(|t| matches!(t, Target::Heap(w) if Rc::ptr_eq(w, ws))).count();
                Rc::strong_count(ws) == uses && Rc::weak_count(ws) == 0
            }
            Target::Workspace(_) => true,
        });
        let mapped = || all().filter_map(Target::workspace);
        let uses = |ws: &Workspace| mapped().filter(|m| std::ptr::eq(&***m, ws)).count();
        // Every mapped workspace is a member: the uses counted over the members add up
        // to all the mapped workspaces.
        heaps_here && group.reached_only_through(1, |ws| uses(ws)) && {
            let counted: usize = group.workspaces_with(|members| members.iter().map(|ws| uses(ws)).sum());
            counted == mapped().count()
        }
    }
}

/// An open scope for one [`ArrayType`]: everything [`Scope`] offers (through `Deref`),
/// plus the DL4J-style operations by type.
#[derive(Debug)]
pub struct TypedScope {
    ty: ArrayType,
    scope: Scope<'static>,
}

impl Deref for TypedScope {
    type Target = Scope<'static>;
    fn deref(&self) -> &Scope<'static> {
        &self.scope
    }
}

impl TypedScope {
    /// The role of the arrays allocated here.
    pub fn array_type(&self) -> ArrayType {
        self.ty
    }

    /// DL4J's `create`: [`Scope::zeros`], the name every scope uses.
    ///
    /// # Errors
    ///
    /// As [`Scope::zeros`].
    #[inline]
    #[deprecated(note = "use `zeros` (the name of every scope, host and device): `ctx.activations.zeros(shape)`")]
    pub fn create<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh) -> Result<ArrayViewMut<'_, T, Sh::Dim>> {
        self.scope.zeros(shape)
    }

    /// DL4J's `createUninitialized`: [`Scope::uninit`], the name every scope uses.
    ///
    /// # Errors
    ///
    /// As [`Scope::zeros`].
    #[inline]
    #[deprecated(note = "use `uninit` (the name of every scope, host and device)")]
    pub fn create_uninit<T: Pod, Sh: ShapeBuilder>(
        &self,
        shape: Sh,
    ) -> Result<ArrayViewMut<'_, std::mem::MaybeUninit<T>, Sh::Dim>> {
        self.scope.uninit(shape)
    }

    /// DL4J's `dup`: [`Scope::copy_of`], the name every scope uses.
    ///
    /// # Errors
    ///
    /// As [`Scope::zeros`].
    #[inline]
    #[deprecated(note = "use `copy_of` (the name of every scope, host and device): `ctx.activations.copy_of(&x)`")]
    pub fn dup<T: Pod, S: Data<Elem = T>, Dim: Dimension>(
        &self,
        array: &ArrayBase<S, Dim>,
    ) -> Result<ArrayViewMut<'_, T, Dim>> {
        self.scope.copy_of(array)
    }

    /// `array` itself when it already lives here (or holds no element: there is nothing
    /// to keep, in any mode), otherwise a copy here (DL4J's `leverageTo`).
    ///
    /// # Errors
    ///
    /// As [`Scope::zeros`].
    pub fn leverage<'a, T: Pod, Dim: Dimension>(
        &'a self,
        array: ArrayView<'a, T, Dim>,
    ) -> Result<ArrayView<'a, T, Dim>> {
        if array.is_empty() || (self.scope.workspace().is_some() && self.scope.holds(&array)) {
            return Ok(array);
        }
        Ok(crate::scope::freeze(self.scope.copy_of(&array)?))
    }
}
