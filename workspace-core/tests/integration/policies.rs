//! The policy table (`common/policy_suite.rs`, shared with the device suite) on host RAM
//! (`ram::`) and on anonymous mmap (`mmap_anon::`, the tests that need no learning); then
//! what only host workspaces have: debug modes, file-backed arenas, the manager, handles,
//! the allocator API, the engine, heap scopes and page faults.

use bytemuck::Pod;
use ndarray::{Array, Array1, Array2, ArrayViewMut, Dimension, Ix1, ShapeBuilder};
use workspace_core::backend::{Placement, ScopeKind};
use workspace_core::{
    AllocationPolicy, DebugMode, Error, LearningPolicy, Location, Scope, SpillPolicy, Workspace, WorkspaceArrayExt,
    WorkspaceConfig, WorkspaceConfigBuilder, WorkspaceManager, WorkspaceStats,
};

use crate::policy_suite::Target;

/// Host workspaces in one location: `Location::Ram` or `Location::MmapAnonymous`.
struct Host {
    location: Location,
}

/// Runs a test of the policy table on host RAM.
fn on_ram(test: fn(&Host)) {
    test(&Host { location: Location::Ram });
}

/// Runs a test of the policy table on anonymous mmap.
fn on_mmap_anon(test: fn(&Host)) {
    test(&Host { location: Location::MmapAnonymous });
}

impl Target for Host {
    type Ws = Workspace;
    type Scope<'w> = Scope<'w>;
    type Array<'s, E: Pod, Dim: Dimension> = ArrayViewMut<'s, E, Dim>;
    type Error = Error;

    const UNIT: usize = 64;

    fn backend(&self) -> &'static str {
        match self.location {
            Location::Ram => "ram",
            Location::MmapAnonymous => "mmap-anon",
            _ => "mmap-file",
        }
    }

    fn builder(&self) -> WorkspaceConfigBuilder {
        WorkspaceConfig::builder().location(self.location.clone())
    }

    fn default_config(&self) -> WorkspaceConfig {
        match self.location {
            Location::Ram => WorkspaceConfig::default(),
            // A mapping cannot learn: a fixed arena, as large as the tests need.
            _ => self.builder().learning(LearningPolicy::None).initial_size(1 << 16).build().unwrap(),
        }
    }

    fn named(&self, name: &str, config: WorkspaceConfig) -> Workspace {
        assert_eq!(config.location(), &self.location, "the test built its configuration from the target's builder");
        Workspace::with_debug_mode(name, config, DebugMode::Disabled).unwrap()
    }

    fn enter<'w>(ws: &'w Workspace) -> Result<Scope<'w>, Error>
    where
        Self: 'w,
    {
        ws.enter()
    }

    fn borrow_open<'w>(ws: &'w Workspace) -> Result<Scope<'w>, Error>
    where
        Self: 'w,
    {
        ws.borrow_open()
    }

    fn trim(ws: &Workspace) -> Result<(), Error> {
        ws.trim()
    }

    fn generation(ws: &Workspace) -> u64 {
        ws.generation()
    }

    fn is_open(ws: &Workspace) -> bool {
        ws.is_open()
    }

    fn capacity(ws: &Workspace) -> usize {
        ws.capacity()
    }

    fn bytes_in_use(ws: &Workspace) -> usize {
        ws.bytes_in_use()
    }

    fn stats(ws: &Workspace) -> WorkspaceStats {
        ws.stats()
    }

    fn reset_peak(ws: &Workspace) {
        ws.reset_peak()
    }

    fn cycle_history(ws: &Workspace) -> Vec<usize> {
        ws.cycle_history()
    }

    fn config(ws: &Workspace) -> &WorkspaceConfig {
        ws.config()
    }

    fn kind(scope: &Scope<'_>) -> ScopeKind {
        scope.kind()
    }

    fn zeros<'s, E: Pod, Sh: ShapeBuilder>(
        scope: &'s Scope<'_>,
        shape: Sh,
    ) -> Result<ArrayViewMut<'s, E, Sh::Dim>, Error>
    where
        Self: 's,
    {
        scope.zeros(shape)
    }

    fn uninit_address<E: Pod>(scope: &Scope<'_>, len: usize) -> Result<usize, Error> {
        scope.uninit::<E, _>(len).map(|v| v.as_ptr() as usize)
    }

    fn from_host<'s, E: Pod>(scope: &'s Scope<'_>, values: &Array1<E>) -> Result<ArrayViewMut<'s, E, Ix1>, Error>
    where
        Self: 's,
    {
        scope.copy_of(values)
    }

    fn write<E: Pod, Dim: Dimension>(array: &mut ArrayViewMut<'_, E, Dim>, values: &Array<E, Dim>) {
        array.assign(values);
    }

    fn to_host<E: Pod, Dim: Dimension>(array: &ArrayViewMut<'_, E, Dim>) -> Array<E, Dim> {
        array.to_owned()
    }

    fn address<E: Pod, Dim: Dimension>(array: &ArrayViewMut<'_, E, Dim>) -> usize {
        array.as_ptr() as usize
    }

    fn placement<E: Pod, Dim: Dimension>(scope: &Scope<'_>, array: &ArrayViewMut<'_, E, Dim>) -> Placement {
        scope.placement(array.as_ptr())
    }

    fn core(err: &Error) -> Option<&Error> {
        Some(err)
    }
}

/// The policy table on host RAM.
mod ram {
    crate::policy_suite::policy_suite!(crate::policies::on_ram, crate::policies::Host, learning);
}

/// The policy table on anonymous mmap: the tests that need no learning.
mod mmap_anon {
    crate::policy_suite::policy_suite!(crate::policies::on_mmap_anon, crate::policies::Host, fixed);
}

/// Host RAM workspaces that are members of a plan group of their own, every cycle an
/// iteration with a key of its own: each is recorded, so the member allocates as an
/// unplanned workspace of its configuration would, and the table's outcomes must hold
/// as they are. (Replayed and diverging iterations are compared with unplanned
/// workspaces in `planned.rs`: there memory comes from the group's arena.)
struct Member;

/// A member and its group; the next iteration's key.
struct MemberWs {
    group: workspace_core::planned::PlanGroup,
    ws: std::rc::Rc<Workspace>,
    key: std::cell::Cell<u64>,
}

/// A scope of a member; the one that opened its cycle ends the iteration after it.
struct MemberScope<'w> {
    scope: Option<Scope<'w>>,
    iteration: Option<&'w workspace_core::planned::PlanGroup>,
}

impl<'w> MemberScope<'w> {
    fn scope(&self) -> &Scope<'w> {
        self.scope.as_ref().expect("the scope lives as long as this")
    }
}

impl Drop for MemberScope<'_> {
    fn drop(&mut self) {
        drop(self.scope.take());
        if let Some(group) = self.iteration {
            group.finish_iteration().expect("an iteration ends");
        }
    }
}

fn on_member(test: fn(&Member)) {
    test(&Member);
}

impl Target for Member {
    type Ws = MemberWs;
    type Scope<'w> = MemberScope<'w>;
    type Array<'s, E: Pod, Dim: Dimension> = ArrayViewMut<'s, E, Dim>;
    type Error = Error;

    const UNIT: usize = 64;

    fn backend(&self) -> &'static str {
        "ram"
    }

    fn builder(&self) -> WorkspaceConfigBuilder {
        WorkspaceConfig::builder()
    }

    fn default_config(&self) -> WorkspaceConfig {
        WorkspaceConfig::default()
    }

    fn named(&self, name: &str, config: WorkspaceConfig) -> MemberWs {
        let group = workspace_core::planned::PlanGroup::new("MEMBERS");
        let ws = group.workspace(name, &config).unwrap();
        MemberWs { group, ws, key: std::cell::Cell::new(0) }
    }

    fn enter<'w>(ws: &'w MemberWs) -> Result<MemberScope<'w>, Error>
    where
        Self: 'w,
    {
        let opens = !ws.ws.is_open();
        if opens {
            ws.key.set(ws.key.get() + 1);
            ws.group.start_iteration(ws.key.get())?;
        }
        match ws.ws.enter() {
            Ok(scope) => Ok(MemberScope { scope: Some(scope), iteration: opens.then_some(&ws.group) }),
            Err(err) => {
                if opens {
                    ws.group.abandon_iteration()?;
                }
                Err(err)
            }
        }
    }

    fn borrow_open<'w>(ws: &'w MemberWs) -> Result<MemberScope<'w>, Error>
    where
        Self: 'w,
    {
        Ok(MemberScope { scope: Some(ws.ws.borrow_open()?), iteration: None })
    }

    fn trim(ws: &MemberWs) -> Result<(), Error> {
        ws.ws.trim()
    }

    fn generation(ws: &MemberWs) -> u64 {
        ws.ws.generation()
    }

    fn is_open(ws: &MemberWs) -> bool {
        ws.ws.is_open()
    }

    fn capacity(ws: &MemberWs) -> usize {
        ws.ws.capacity()
    }

    fn bytes_in_use(ws: &MemberWs) -> usize {
        ws.ws.bytes_in_use()
    }

    fn stats(ws: &MemberWs) -> WorkspaceStats {
        ws.ws.stats()
    }

    fn reset_peak(ws: &MemberWs) {
        ws.ws.reset_peak()
    }

    fn cycle_history(ws: &MemberWs) -> Vec<usize> {
        ws.ws.cycle_history()
    }

    fn config(ws: &MemberWs) -> &WorkspaceConfig {
        ws.ws.config()
    }

    fn kind(scope: &MemberScope<'_>) -> ScopeKind {
        <Host as Target>::kind(scope.scope())
    }

    fn zeros<'s, E: Pod, Sh: ShapeBuilder>(
        scope: &'s MemberScope<'_>,
        shape: Sh,
    ) -> Result<ArrayViewMut<'s, E, Sh::Dim>, Error>
    where
        Self: 's,
    {
        <Host as Target>::zeros(scope.scope(), shape)
    }

    fn uninit_address<E: Pod>(scope: &MemberScope<'_>, len: usize) -> Result<usize, Error> {
        <Host as Target>::uninit_address::<E>(scope.scope(), len)
    }

    fn from_host<'s, E: Pod>(scope: &'s MemberScope<'_>, values: &Array1<E>) -> Result<ArrayViewMut<'s, E, Ix1>, Error>
    where
        Self: 's,
    {
        <Host as Target>::from_host(scope.scope(), values)
    }

    fn write<E: Pod, Dim: Dimension>(array: &mut ArrayViewMut<'_, E, Dim>, values: &Array<E, Dim>) {
        <Host as Target>::write(array, values)
    }

    fn to_host<E: Pod, Dim: Dimension>(array: &ArrayViewMut<'_, E, Dim>) -> Array<E, Dim> {
        <Host as Target>::to_host(array)
    }

    fn address<E: Pod, Dim: Dimension>(array: &ArrayViewMut<'_, E, Dim>) -> usize {
        <Host as Target>::address(array)
    }

    fn placement<E: Pod, Dim: Dimension>(scope: &MemberScope<'_>, array: &ArrayViewMut<'_, E, Dim>) -> Placement {
        <Host as Target>::placement(scope.scope(), array)
    }

    fn core(err: &Error) -> Option<&Error> {
        <Host as Target>::core(err)
    }
}

/// The policy table on plan group members, each cycle recorded.
mod member {
    crate::policy_suite::policy_suite!(crate::policies::on_member, crate::policies::Member, member);
}

fn ws(config: WorkspaceConfig) -> Workspace {
    Workspace::with_debug_mode("T", config, DebugMode::Disabled).unwrap()
}

fn strict() -> workspace_core::WorkspaceConfigBuilder {
    WorkspaceConfig::builder().allocation(AllocationPolicy::Strict)
}

/// Runs one cycle allocating `sizes` bytes (as u8 arrays) and returns their placements.
fn cycle(ws: &Workspace, sizes: &[usize]) -> Vec<Placement> {
    let scope = ws.enter().unwrap();
    sizes
        .iter()
        .map(|&n| {
            let v = scope.zeros::<u8, _>(n).unwrap();
            scope.placement(v.as_ptr())
        })
        .collect()
}

#[test]
fn borrowing_an_open_workspace_and_scoping_out() {
    let outer_ws = ws(WorkspaceConfig::default());
    let inner_ws = Workspace::with_debug_mode("INNER", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    // Borrowing a closed workspace is an error: `borrowing_a_closed_workspace_is_an_error`.
    let outer = outer_ws.enter().unwrap();
    let generation = outer_ws.generation();
    let result = {
        let inner = inner_ws.enter().unwrap();
        let x = inner.filled::<f64, _>((3, 3), 2.0).unwrap();
        let borrowed = outer_ws.borrow_open().unwrap();
        assert_eq!(borrowed.kind(), ScopeKind::Borrowed);
        let kept = borrowed.copy_handle(&x).unwrap();
        drop(borrowed);
        assert_eq!(outer_ws.generation(), generation, "borrowing does not reset or open a generation");
        kept
    };
    assert_eq!(result.detach(&outer).unwrap().sum(), 18.0);

    let heap = Scope::heap();
    assert_eq!(heap.kind(), ScopeKind::Heap);
    let h = heap.filled::<i32, _>(4, 3).unwrap();
    assert_eq!(heap.placement(h.as_ptr()), Placement::Elsewhere);
    assert_eq!(h.sum(), 12);
    let before = outer_ws.bytes_in_use();
    let _ = WorkspaceManager::current().scope_out().zeros::<u8, _>(10).unwrap();
    assert_eq!(outer_ws.bytes_in_use(), before, "scoped-out allocations do not touch workspaces");
}

#[test]
fn stale_and_foreign_handles_name_the_fix() {
    let a = Workspace::with_debug_mode("ALPHA", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    let b = Workspace::with_debug_mode("BETA", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    let mut h = {
        let s = a.enter().unwrap();
        let mut h = s.zeros_handle::<f32, _>((2, 3)).unwrap();
        h.view_mut(&s).unwrap().fill(1.0);
        assert_eq!(h.view(&s).unwrap().sum(), 6.0);
        h
    };
    let s = a.enter().unwrap();
    let err = h.view_mut(&s).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::StaleHandle { array_generation: 1, workspace_generation: 2, .. }));
    for needle in ["'ALPHA'", "generation 1", "generation 2", "detach()", "leverage_to"] {
        assert!(msg.contains(needle), "message lacks {needle}: {msg}");
    }
    let sb = b.enter().unwrap();
    let h2 = s.zeros_handle::<f32, _>(4).unwrap();
    let err = h2.view(&sb).unwrap_err();
    assert!(matches!(err, Error::WrongWorkspace { .. }));
    assert!(err.to_string().contains("'ALPHA'") && err.to_string().contains("'BETA'"), "{err}");
    let moved = h2.leverage_to(&s, &sb).unwrap();
    assert_eq!(moved.view(&sb).unwrap().shape(), &[4]);
    assert_eq!(moved.workspace_name().as_ref(), "BETA");
}

#[test]
fn detach_and_leverage_copy_exact_values() {
    let w = ws(WorkspaceConfig::default());
    let target = Workspace::with_debug_mode("OUT", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    let out = target.enter().unwrap();
    let (owned, lev) = {
        let s = w.enter().unwrap();
        let x = s.from_shape_fn((3, 4), |(i, j)| (i * 10 + j) as f32).unwrap();
        let t = x.t(); // a non-contiguous view copies in logical order
        (t.detach(), t.leverage_to(&out).unwrap())
    };
    let expected = Array2::from_shape_fn((4, 3), |(i, j)| (j * 10 + i) as f32);
    assert_eq!(owned, expected);
    assert_eq!(lev, expected);
    assert!(lev.is_standard_layout());
}

#[test]
fn spill_everything_sends_each_allocation_to_its_own_block() {
    let w =
        Workspace::with_debug_mode("DBG", strict().initial_size(1 << 16).build().unwrap(), DebugMode::SpillEverything)
            .unwrap();
    {
        let s = w.enter().unwrap();
        let a = s.filled::<u8, _>(100, 1).unwrap();
        let b = s.filled::<u8, _>(100, 2).unwrap();
        assert_eq!(s.placement(a.as_ptr()), Placement::Elsewhere);
        assert_eq!(s.placement(b.as_ptr()), Placement::Elsewhere);
        assert_eq!(a.sum() as u32 + b.sum() as u32, 300);
        assert_eq!(w.stats().external_allocations, 2);
        assert!(matches!(w.set_debug_mode(DebugMode::Disabled), Err(Error::StillOpen { .. })));
    }
    w.set_debug_mode(DebugMode::Disabled).unwrap();
    assert_eq!(cycle(&w, &[100]), vec![Placement::Arena(0)]);
}

#[test]
fn bypass_everything_puts_every_array_on_the_heap_and_changes_nothing_else() {
    let w = Workspace::with_debug_mode("OFF", WorkspaceConfig::default(), DebugMode::BypassEverything).unwrap();
    let s = w.enter().unwrap();
    assert_eq!(s.kind(), ScopeKind::Opened, "the workspace still opens a cycle");
    let x = s.filled::<u16, _>(5, 2).unwrap();
    assert_eq!(x.sum(), 10);
    assert_eq!(s.placement(x.as_ptr()), Placement::Elsewhere, "on the heap, not in an arena");
    assert!(s.holds(&x), "yet it belongs to the workspace");
    drop(s);
    let stats = w.stats();
    // Counted as the arena counts it, as with the mode off: 10 bytes take 64.
    assert_eq!((stats.cycles, stats.peak_bytes, stats.external_allocations), (1, 64, 1));
    assert_eq!(stats.learned_size, Some(64), "the size is learned as with the mode off");
    assert_eq!(w.capacity(), 128, "in the accounting only: no arena memory is held");
    w.set_debug_mode(DebugMode::Disabled).unwrap();
    assert_eq!(cycle(&w, &[10]), vec![Placement::Arena(0)], "the learned arena is made when the mode goes off");
}

/// Shapes with no elements or too many bytes: `bad_shapes_are_a_typed_error`.
#[test]
fn bad_input_is_a_typed_error() {
    let w = ws(WorkspaceConfig::default());
    let s = w.enter().unwrap();
    let err = s.slice_zeroed::<u64>(0).unwrap_err();
    assert!(matches!(err, Error::ZeroLength { .. }));
    // Huge but representable: the backend says no, as an error.
    let err = s.zeros::<u8, _>(isize::MAX as usize).unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    // Zero-sized element types need no memory at all.
    assert_eq!(s.zeros::<(), _>(Ix1(10)).unwrap().len(), 10);
    drop(s);
    let err = Workspace::new(
        "FILE",
        WorkspaceConfig::builder()
            .learning(LearningPolicy::None)
            .initial_size(4096)
            // SAFETY: the file cannot be created, so nothing is ever mapped.
            .location(unsafe { Location::mmap("/nonexistent-dir/carve.ws") })
            .build()
            .unwrap(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::Backend { .. }), "{err:?}");
    assert!(err.to_string().contains("/nonexistent-dir/carve.ws"), "{err}");
}

#[test]
fn file_backed_workspace_keeps_its_contents() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.ws");
    let config = WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .initial_size(1 << 16)
        // SAFETY: the file is in a fresh temporary directory nothing else touches.
        .location(unsafe { Location::mmap(&path) })
        .build()
        .unwrap();
    {
        let w = Workspace::with_debug_mode("FILE", config.clone(), DebugMode::Disabled).unwrap();
        assert_eq!(w.stats().backend, "mmap-file");
        let s = w.enter().unwrap();
        let mut v = s.zeros::<u32, _>(1000).unwrap();
        v.iter_mut().enumerate().for_each(|(i, x)| *x = i as u32 * 3);
        assert_eq!(s.placement(v.as_ptr()), Placement::Arena(0));
    }
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 16);
    let w = Workspace::with_debug_mode("FILE", config, DebugMode::Disabled).unwrap();
    let s = w.enter().unwrap();
    // SAFETY: the file's bytes were written above with initialised `u32`s.
    let restored = unsafe { s.retained::<u32, _>(1000) }.unwrap();
    assert!(restored.iter().enumerate().all(|(i, &x)| x == i as u32 * 3));
    let anon = ws(WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .initial_size(8192)
        .location(Location::MmapAnonymous)
        .build()
        .unwrap());
    assert_eq!(cycle(&anon, &[100, 100]), vec![Placement::Arena(0), Placement::Arena(128)]);
    let s = ws(WorkspaceConfig::default());
    let scope = s.enter().unwrap();
    // SAFETY: the call fails before handing out anything.
    assert!(matches!(unsafe { scope.retained::<u8, _>(4) }.unwrap_err(), Error::NotInitialised { .. }));
}

#[test]
fn manager_registry() {
    let m = WorkspaceManager::current();
    let config = strict().build().unwrap();
    let a = m.get_or_create("M1", &config).unwrap();
    let again = m.get_or_create("M1", &config).unwrap();
    assert!(std::rc::Rc::ptr_eq(&a, &again));
    let other = strict().spill(SpillPolicy::Fail).initial_size(64).build().unwrap();
    let err = m.get_or_create("M1", &other).unwrap_err();
    assert!(matches!(err, Error::ConfigMismatch { .. }));
    assert!(err.to_string().contains("Fail"), "{err}");
    let err = m.enter("NOPE").unwrap_err();
    assert!(matches!(err, Error::UnknownWorkspace { .. }));
    assert!(err.to_string().contains("get_or_create"));
    {
        let scope = m.enter("M1").unwrap();
        scope.zeros::<f32, _>(100).unwrap();
        let borrowed = m.borrow_open("M1").unwrap();
        borrowed.zeros::<f32, _>(1).unwrap();
        assert!(matches!(m.destroy("M1"), Err(Error::StillOpen { depth: 2, .. })));
        assert!(matches!(m.set_debug_mode(DebugMode::SpillEverything), Err(Error::StillOpen { .. })));
    }
    assert!(matches!(m.borrow_open("M1"), Err(Error::NotOpen { .. })));
    m.get_or_create("M2", &config).unwrap();
    let table = workspace_core::stats_table(&m.stats());
    assert!(table.contains("M1") && table.contains("M2") && table.contains("capacity"), "{table}");
    // Every value sits under its own header: cells are right-aligned, so a column's
    // value ends where its header ends.
    let lines: Vec<&str> = table.lines().collect();
    let row = lines.iter().find(|l| l.starts_with("M1")).expect("a row for M1");
    let cell = |name: &str| {
        let end = lines[0].find(name).expect("a header") + name.len();
        row[..end].rsplit(' ').next().expect("a cell").to_string()
    };
    let stats = m.get("M1").unwrap().stats();
    assert_eq!(cell("cycles"), stats.cycles.to_string(), "{table}");
    assert_eq!(cell("gen"), stats.generation.to_string(), "{table}");
    assert_eq!(cell("growths"), stats.growth_events.to_string(), "{table}");
    assert_eq!(cell("spills"), stats.external_allocations.to_string(), "{table}");
    assert_eq!(cell("pinned"), "0", "{table}");
    let json: serde_json::Value = serde_json::from_str(&m.stats_json()).unwrap();
    assert_eq!(json[0]["name"], "M1");
    assert_eq!(json[0]["cycles"], 1);
    // 400 bytes, then 4 at offset 448: learned 452, rounded to 512.
    assert_eq!(json[0]["capacity"], 512);
    m.destroy("M1").unwrap();
    assert!(!m.exists("M1"));
    assert_eq!(a.stats().cycles, 1, "a held Rc keeps the workspace alive");
    m.destroy_all().unwrap();
    assert!(m.ids().is_empty());
}

/// A twin starts where its workspace is and then sizes its arena alike, cycle for cycle:
/// random cycles under every learning policy, the twin made at a random point (before
/// any cycle, while learning, after it, after a `trim`), then both given the same cycles.
#[test]
fn a_twin_sizes_its_arena_as_its_workspace_does() {
    let policies = [
        LearningPolicy::None,
        LearningPolicy::FirstLoop,
        LearningPolicy::OverTime { cycles: 1 },
        LearningPolicy::OverTime { cycles: 3 },
        LearningPolicy::OverTime { cycles: 16 },
    ];
    let programs = crate::random::cases().min(1000);
    for seed in 0..programs {
        let mut rng = crate::random::Rng(seed);
        let learning = policies[rng.below(policies.len() as u64) as usize];
        let spill = [SpillPolicy::Reallocate, SpillPolicy::External][rng.below(2) as usize];
        let config = WorkspaceConfig::builder().learning(learning).spill(spill).build().unwrap();
        let config = match rng.below(3) {
            0 => config,
            // Trimmed without learning: the next enter restores the configured size.
            _ => WorkspaceConfig::builder().learning(learning).spill(spill).initial_size(640).build().unwrap(),
        };
        let original = Workspace::new("TWIN", config).unwrap();
        let run = |ws: &Workspace, sizes: &[usize]| {
            ws.reset_peak();
            let scope = ws.enter().unwrap();
            for &n in sizes {
                scope.zeros::<u8, _>(n).unwrap();
            }
        };
        let sizes = |rng: &mut crate::random::Rng| -> Vec<usize> {
            (0..rng.below(4)).map(|_| 1 + rng.below(3000) as usize).collect()
        };
        let before = rng.below(24);
        for _ in 0..before {
            run(&original, &sizes(&mut rng));
        }
        if rng.below(4) == 0 {
            original.trim().unwrap();
        }
        let dry = WorkspaceManager::shape_only();
        let twin = dry.twin(&original).unwrap();
        assert!(twin.is_shape_only());
        assert!(std::rc::Rc::ptr_eq(&twin, &dry.twin(&original).unwrap()), "one twin per name and registry");
        for step in 0..rng.below(24) {
            let sizes = sizes(&mut rng);
            run(&original, &sizes);
            run(&twin, &sizes);
            let (a, b) = (original.stats(), twin.stats());
            let what =
                format!("seed {seed} ({learning:?}, {spill:?}), {before} cycles before, cycle {step}: {sizes:?}");
            assert_eq!(original.sizing(), twin.sizing(), "{what}");
            let figures = |s: &WorkspaceStats| (s.capacity, s.learned_size, s.last_cycle_bytes, s.peak_bytes);
            assert_eq!(figures(&a), figures(&b), "{what}");
        }
    }
    // An open workspace has not learned from its open cycle yet: no twin of it.
    let open = Workspace::new("OPEN", WorkspaceConfig::default()).unwrap();
    let scope = open.enter().unwrap();
    let err = WorkspaceManager::shape_only().twin(&open).unwrap_err();
    assert!(matches!(err, Error::StillOpen { depth: 1, .. }), "{err}");
    drop(scope);
}

#[test]
fn handles_are_send() {
    fn is_send<T: Send>() {}
    is_send::<workspace_core::Handle<f32, ndarray::Ix2>>();
}

#[test]
fn allocator_api2_containers_live_in_the_workspace() {
    let w = ws(strict().learning(LearningPolicy::None).initial_size(1 << 16).build().unwrap());
    let s = w.enter().unwrap();
    let mut v = allocator_api2::vec::Vec::new_in(&s);
    v.extend(0..1000u32);
    assert_eq!(v.iter().sum::<u32>(), 499_500);
    assert!(matches!(s.placement(v.as_ptr()), Placement::Arena(_)));
    let mut map = hashbrown::HashMap::new_in(&s);
    for i in 0..100u64 {
        map.insert(i, i * i);
    }
    assert_eq!(map[&9], 81);
    assert!(w.bytes_in_use() >= 4000 + 100 * 16, "vector and map live in the arena");
}

#[test]
fn the_engine_hands_out_nothing_without_an_open_scope_and_rejects_bad_requests() {
    let w = ws(strict().learning(LearningPolicy::None).initial_size(1 << 16).build().unwrap());
    let engine = w.engine();
    assert!(engine.try_alloc_fast(64, 16).is_none(), "closed: the fast path is off");
    let err = engine.alloc(64, 16).unwrap_err();
    assert!(matches!(err, Error::NotOpen { .. }), "{err:?}");
    assert!(err.to_string().contains("allocating needs an open cycle"), "{err}");
    {
        let scope = w.enter().unwrap();
        assert!(matches!(engine.alloc(0, 16), Err(Error::ZeroLength { .. })));
        let err = engine.alloc(64, 24).unwrap_err();
        assert!(err.to_string().contains("alignment 24, which is not a power of two"), "{err}");
        let (_, offset) = engine.alloc(64, 16).unwrap();
        assert_eq!(offset, 0, "the rejected requests took nothing");
        assert!(scope.zeros::<f32, _>(16).is_ok());
    }
    assert!(engine.try_alloc_fast(64, 16).is_none(), "closed again: off again");
    let scope = w.enter().unwrap();
    assert_eq!(engine.alloc(64, 16).unwrap().1, 0, "a new cycle starts at the arena's start");
    drop(scope);
    assert_eq!(w.stats().cycles, 2);
}

/// Minor page faults of this thread so far: per thread, so that other tests running
/// meanwhile do not count.
#[cfg(target_os = "linux")]
fn minor_faults() -> u64 {
    // SAFETY: getrusage writes into the struct we pass; zeroed is a valid rusage.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut usage), 0, "getrusage(RUSAGE_THREAD)");
        usage.ru_minflt as u64
    }
}

/// Whether this process runs under valgrind, whose tools map their preload libraries
/// into it (`vgpreload_core`, `vgpreload_memcheck`, ...).
#[cfg(target_os = "linux")]
fn under_valgrind() -> bool {
    std::fs::read_to_string("/proc/self/maps").is_ok_and(|maps| maps.contains("/vgpreload_"))
}

#[cfg(target_os = "linux")]
#[test]
fn the_memory_of_the_first_cycle_is_the_arena_of_every_later_one() {
    // 4.35 MB: past the first huge page of the reservation, which is 4 KiB pages.
    const SIZES: [usize; 4] = [300_000, 1_000_000, 3_000_000, 50_000];
    // One cycle: the arrays' addresses, and the minor faults this thread took meanwhile.
    let run = |w: &Workspace| {
        let mut at = [0usize; SIZES.len()]; // nothing on the heap while counting
        let faults = minor_faults();
        {
            let scope = w.enter().unwrap();
            for (slot, &n) in at.iter_mut().zip(&SIZES) {
                let v = scope.zeros::<u8, _>(n).unwrap(); // writes every byte
                *slot = v.as_ptr() as usize;
            }
        }
        (at, minor_faults() - faults)
    };
    // Count only the workspace's memory: a workspace of its own first takes the code
    // of a first and of a later cycle through every page of text, data and stack it
    // needs (a page of code run for the first time faults too, as a file page). It
    // stays alive, so that its memory cannot be the measured workspace's.
    let rehearsal = Workspace::with_debug_mode("REHEARSAL", WorkspaceConfig::default(), DebugMode::Disabled).unwrap();
    for _ in 0..3 {
        run(&rehearsal);
    }

    let w = ws(WorkspaceConfig::default());
    let (first, cold) = run(&w);
    let learned = w.capacity();
    assert!(learned >= SIZES.iter().sum::<usize>(), "learned {learned}");
    let later: Vec<_> = (0..3).map(|_| run(&w)).collect();
    for (again, _) in &later {
        assert_eq!(*again, first, "later cycles are laid out where the first one was");
    }
    let stats = w.stats();
    assert_eq!((stats.capacity, stats.growth_events, stats.external_allocations), (learned, 1, 4));

    // Valgrind runs this thread's code through its own translator and shadow memory,
    // which fault in pages of their own as they go: a count that says nothing about
    // the workspace. The layout above is still checked.
    if under_valgrind() {
        eprintln!("under valgrind: page faults not counted (the tool's shadow memory faults on this thread too)");
        return;
    }
    let faults: Vec<u64> = later.iter().map(|&(_, faults)| faults).collect();
    assert!(cold > 0, "the first cycle faults its arena in");
    assert_eq!(faults, [0, 0, 0], "later cycles touch only memory the first cycle faulted in ({cold} faults)");

    // The count does see the arena: give its pages back to the system behind the
    // workspace's back, and the next cycle faults them in again.
    for (&address, &n) in first.iter().zip(&SIZES) {
        let start = address.next_multiple_of(4096);
        let end = (address + n) / 4096 * 4096;
        // SAFETY: whole pages inside arrays of the workspace, which is closed: nothing
        // refers to them, and the next cycle writes every byte it hands out.
        let given_back = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        assert_eq!(given_back, 0, "madvise");
    }
    let (again, refaulted) = run(&w);
    assert_eq!(again, first);
    assert!(refaulted > 0, "pages given back fault in again");
    drop(rehearsal);
}
