//! The policy table, written once for every backend.
//!
//! Each test is a function generic over a [`Target`]: something that makes workspaces from
//! a [`WorkspaceConfig`], enters them and allocates in them. Two test binaries include this
//! file with `#[path]` and instantiate the table with [`policy_suite!`]:
//!
//! - `workspace-core/tests/integration/policies.rs`: host RAM (`Location::Ram`), anonymous mmap
//!   (`Location::MmapAnonymous`), and host RAM workspaces that are members of a plan
//!   group, each cycle an iteration of its own (recorded: the member allocates as an
//!   unplanned workspace of its configuration, and must give the same outcomes);
//! - `workspace-cuda/tests/device/main.rs`: the simulated device and a real GPU (skipped,
//!   with a line on stderr, where there is none).
//!
//! Expected numbers depend on the target's allocation unit (its default alignment: 64 bytes
//! on the host, 256 on a device). Each is written out for both units with [`by_unit`], so
//! that a test asserts literal numbers, never a formula the engine shares.
//!
//! Tests that need the arena to learn or to be reallocated are in the `learning` group:
//! a memory-mapped workspace has the size it is created with, so the anonymous mmap target
//! runs the `fixed` group only. What only one kind of backend has (debug modes, files, the
//! manager, streams, pinned memory, handles) stays in that backend's own test file.

use std::fmt::{Debug, Display};
use std::panic::{catch_unwind, AssertUnwindSafe};

use bytemuck::Pod;
use ndarray::{Array, Array1, Dimension, Ix1, ShapeBuilder};
use workspace_core::backend::{Placement, ScopeKind};
use workspace_core::{
    AllocationPolicy, Error as CoreError, LearningPolicy, ResetPolicy, SpillPolicy, WorkspaceConfig,
    WorkspaceConfigBuilder, WorkspaceStats,
};

/// A backend the policy table runs on.
pub(crate) trait Target: Sized {
    /// The workspace type.
    type Ws: 'static;
    /// An entered (or borrowed) cycle of a workspace.
    type Scope<'w>
    where
        Self: 'w;
    /// An array allocated in a scope.
    type Array<'s, E: Pod, Dim: Dimension>
    where
        Self: 's;
    /// The error type of the backend's calls.
    type Error: Debug + Display;

    /// Bytes of the default alignment: every allocation occupies a multiple of it.
    const UNIT: usize;

    /// What `WorkspaceStats::backend` says of this target's arenas.
    fn backend(&self) -> &'static str;
    /// A builder with this target's location and nothing else changed.
    fn builder(&self) -> WorkspaceConfigBuilder;
    /// The configuration tests use when they need "any workspace": the default where the
    /// target can learn, a fixed 64 KiB arena where it cannot.
    fn default_config(&self) -> WorkspaceConfig;
    /// A workspace named `name` (debug modes off, on the host).
    fn named(&self, name: &str, config: WorkspaceConfig) -> Self::Ws;

    fn enter<'w>(ws: &'w Self::Ws) -> Result<Self::Scope<'w>, Self::Error>
    where
        Self: 'w;
    fn borrow_open<'w>(ws: &'w Self::Ws) -> Result<Self::Scope<'w>, Self::Error>
    where
        Self: 'w;
    fn trim(ws: &Self::Ws) -> Result<(), Self::Error>;
    fn generation(ws: &Self::Ws) -> u64;
    fn is_open(ws: &Self::Ws) -> bool;
    fn capacity(ws: &Self::Ws) -> usize;
    fn bytes_in_use(ws: &Self::Ws) -> usize;
    fn stats(ws: &Self::Ws) -> WorkspaceStats;
    fn reset_peak(ws: &Self::Ws);
    fn cycle_history(ws: &Self::Ws) -> Vec<usize>;
    fn config(ws: &Self::Ws) -> &WorkspaceConfig;

    fn kind(scope: &Self::Scope<'_>) -> ScopeKind;
    fn zeros<'s, E: Pod, Sh: ShapeBuilder>(
        scope: &'s Self::Scope<'_>,
        shape: Sh,
    ) -> Result<Self::Array<'s, E, Sh::Dim>, Self::Error>
    where
        Self: 's;
    fn uninit_address<E: Pod>(scope: &Self::Scope<'_>, len: usize) -> Result<usize, Self::Error>;
    /// A 1-D array holding `values`, copied in.
    fn from_host<'s, E: Pod>(
        scope: &'s Self::Scope<'_>,
        values: &Array1<E>,
    ) -> Result<Self::Array<'s, E, Ix1>, Self::Error>
    where
        Self: 's;
    /// Overwrites the array with `values` (of its shape).
    fn write<E: Pod, Dim: Dimension>(array: &mut Self::Array<'_, E, Dim>, values: &Array<E, Dim>);
    fn to_host<E: Pod, Dim: Dimension>(array: &Self::Array<'_, E, Dim>) -> Array<E, Dim>;
    /// The array's first byte: a host or a device address.
    fn address<E: Pod, Dim: Dimension>(array: &Self::Array<'_, E, Dim>) -> usize;
    fn placement<E: Pod, Dim: Dimension>(scope: &Self::Scope<'_>, array: &Self::Array<'_, E, Dim>) -> Placement;
    /// The workspace engine's error inside the backend's, if it is one.
    fn core(err: &Self::Error) -> Option<&CoreError>;
}

/// `host` where the target's unit is 64 bytes, `device` where it is 256.
pub(crate) fn by_unit<T: Target>(host: usize, device: usize) -> usize {
    match T::UNIT {
        64 => host,
        256 => device,
        other => panic!("no expected numbers for a {other}-byte allocation unit"),
    }
}

fn core<T: Target>(err: &T::Error) -> &CoreError {
    T::core(err).unwrap_or_else(|| panic!("expected a workspace error, got {err:?}"))
}

fn ws<T: Target>(t: &T, config: WorkspaceConfig) -> T::Ws {
    t.named("T", config)
}

fn strict<T: Target>(t: &T) -> WorkspaceConfigBuilder {
    t.builder().allocation(AllocationPolicy::Strict)
}

fn fixed<T: Target>(t: &T, bytes: usize) -> WorkspaceConfig {
    strict(t).learning(LearningPolicy::None).initial_size(bytes).build().unwrap()
}

fn filled<'s, T: Target, E: Pod>(
    scope: &'s T::Scope<'_>,
    len: usize,
    value: E,
) -> Result<T::Array<'s, E, Ix1>, T::Error> {
    T::from_host(scope, &Array1::from_elem(len, value))
}

fn sum<T: Target, Dim: Dimension>(array: &T::Array<'_, u8, Dim>) -> usize {
    T::to_host(array).iter().map(|&x| x as usize).sum()
}

/// Runs one cycle allocating `sizes` bytes (as zeroed u8 arrays) and returns where they went.
fn cycle<T: Target>(ws: &T::Ws, sizes: &[usize]) -> Vec<Placement> {
    let scope = T::enter(ws).unwrap();
    sizes
        .iter()
        .map(|&n| {
            let v = T::zeros::<u8, _>(&scope, n).unwrap();
            assert_eq!(T::address(&v) % T::UNIT, 0, "allocations start on the target's alignment");
            assert_eq!(sum::<T, _>(&v), 0, "zeros are zero");
            T::placement(&scope, &v)
        })
        .collect()
}

/// Runs `cycles` and checks the capacity after each; returns the learned size.
fn learning_case<T: Target>(
    t: &T,
    config: WorkspaceConfig,
    cycles: &[&[usize]],
    capacities: &[usize],
) -> Option<usize> {
    let w = ws(t, config);
    for (i, sizes) in cycles.iter().enumerate() {
        cycle::<T>(&w, sizes);
        assert_eq!(T::capacity(&w), capacities[i], "capacity after cycle {}", i + 1);
    }
    T::stats(&w).learned_size
}

// ----- learning: targets whose arenas learn and grow ------------------------------------

pub(crate) fn learning_first_loop_strict<T: Target>(t: &T) {
    // Host: 100→128, 200→256 (aligned starts): 128 + 256 + 64 = 448. Device: spilled
    // while learning, each counted in whole 256-byte units as the arena would hold them → 768.
    let expected = by_unit::<T>(448, 768);
    let config = strict(t).build().unwrap();
    let learned = learning_case(t, config, &[&[100, 200, 64], &[100, 200, 64], &[10]], &[expected; 3]);
    assert_eq!(learned, Some(expected));
}

pub(crate) fn learning_overallocate<T: Target>(t: &T) {
    let config = t.builder().allocation(AllocationPolicy::Overallocate(0.5)).build().unwrap();
    // A cycle counts whole alignment units wherever it ran (here in spill blocks).
    assert_eq!(learning_case(t, config, &[&[1000], &[1000]], &[1536, 1536]), Some(1024));
}

pub(crate) fn learning_over_time_takes_the_largest<T: Target>(t: &T) {
    let config =
        strict(t).learning(LearningPolicy::OverTime { cycles: 3 }).spill(SpillPolicy::External).build().unwrap();
    let largest = by_unit::<T>(5056, 5120);
    let learned = learning_case(t, config, &[&[100], &[5000], &[300], &[9000]], &[0, 0, largest, largest]);
    assert_eq!(learned, Some(largest));
}

pub(crate) fn learning_is_clamped_by_min_and_max<T: Target>(t: &T) {
    let config = strict(t).min_size(4096).max_size(1 << 20).build().unwrap();
    let learned = learning_case(t, config, &[&[10], &[10]], &[4096, 4096]);
    assert_eq!(learned, Some(by_unit::<T>(64, 256)));
}

pub(crate) fn learning_never_shrinks_a_larger_arena<T: Target>(t: &T) {
    let config = strict(t).initial_size(8192).build().unwrap();
    // Served from the arena, where each allocation occupies whole alignment units.
    assert_eq!(learning_case(t, config, &[&[100]], &[8192]), Some(by_unit::<T>(128, 256)));
}

pub(crate) fn spill_reallocate_grows_at_the_end_of_the_cycle<T: Target>(t: &T) {
    spill_case(t, SpillPolicy::Reallocate, 3072, 1);
}

pub(crate) fn trim_gives_memory_back_and_relearns<T: Target>(t: &T) {
    let w = ws(t, strict(t).min_size(0).build().unwrap());
    cycle::<T>(&w, &[10_000]);
    assert_eq!(T::capacity(&w), by_unit::<T>(10_048, 10_240));
    let s = T::enter(&w).unwrap();
    let err = T::trim(&w).expect_err("still open");
    assert!(matches!(core::<T>(&err), CoreError::StillOpen { depth: 1, .. }), "{err:?}");
    drop(s);
    T::trim(&w).unwrap();
    assert_eq!(T::capacity(&w), 0);
    cycle::<T>(&w, &[3000]);
    assert_eq!(T::capacity(&w), by_unit::<T>(3008, 3072), "learned again after trim");
    let w = ws(t, strict(t).learning(LearningPolicy::None).initial_size(2048).min_size(1024).build().unwrap());
    T::trim(&w).unwrap();
    assert_eq!(T::capacity(&w), 1024);
    cycle::<T>(&w, &[1]);
    assert_eq!(T::capacity(&w), 2048, "the configured size comes back");
}

/// A cycle's peak counts what it holds as the arena holds it, wherever it is: the same
/// bytes while it spills (learning) as once it runs in the learned arena, so that a
/// loop reports one figure from its first cycle on.
pub(crate) fn a_cycle_peaks_alike_spilled_or_in_the_arena<T: Target>(t: &T) {
    let w = ws(t, strict(t).learning(LearningPolicy::OverTime { cycles: 2 }).build().unwrap());
    let mut peaks = Vec::new();
    for _ in 0..4 {
        T::reset_peak(&w);
        cycle::<T>(&w, &[10, 100, 1000, 7]);
        peaks.push(T::stats(&w).peak_bytes);
    }
    assert_eq!(T::stats(&w).external_allocations, 8, "the learning cycles spilled, the later ones did not");
    assert_eq!(peaks, vec![by_unit::<T>(64 + 128 + 1024 + 64, 256 + 256 + 1024 + 256); 4]);
}

pub(crate) fn a_panic_inside_a_scope_leaves_the_workspace_closed_and_usable<T: Target>(t: &T) {
    let w = ws(t, strict(t).build().unwrap());
    cycle::<T>(&w, &[512]);
    let result = catch_unwind(AssertUnwindSafe(|| {
        let s = T::enter(&w).unwrap();
        let _a = T::zeros::<u8, _>(&s, 256).unwrap();
        let _b = T::zeros::<u8, _>(&s, 100_000).unwrap(); // spills
        let _inner = T::enter(&w).unwrap();
        panic!("user code failed mid-iteration");
    }));
    assert!(result.is_err());
    assert!(!T::is_open(&w));
    let s = T::stats(&w);
    assert_eq!((s.open_scopes, s.spilled_in_use, s.bytes_in_use), (0, 0, 0));
    assert_eq!(cycle::<T>(&w, &[512]), vec![Placement::Arena(0)]);
    assert_eq!(T::generation(&w), 3);
}

/// Scales iteration counts down under valgrind (`CARVE_SOAK_SCALE=10` divides by 10).
fn scaled(n: usize) -> usize {
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (n / scale.max(1)).max(1)
}

pub(crate) fn a_fixed_shape_loop_keeps_memory_flat<T: Target>(t: &T) {
    let w = ws(t, t.default_config());
    let step = |w: &T::Ws| {
        let scope = T::enter(w).unwrap();
        for n in [32 * 784, 32 * 256, 256 * 10, 32 * 10, 784 * 256] {
            let at = T::uninit_address::<f32>(&scope, n).unwrap();
            assert_eq!(at % T::UNIT, 0);
        }
        T::zeros::<f32, _>(&scope, (32, 256)).unwrap();
    };
    for _ in 0..3 {
        step(&w);
    }
    let warm = T::stats(&w);
    for _ in 0..scaled(10_000) {
        step(&w);
    }
    let end = T::stats(&w);
    // Sized once, from the first cycle (whose six allocations spilled); nothing since.
    assert_eq!((warm.growth_events, warm.external_allocations), (1, 6));
    assert_eq!((end.capacity, end.growth_events, end.external_allocations), (warm.capacity, 1, 6));
    assert!(end.peak_bytes <= end.capacity);
    assert_eq!(end.cycles, warm.cycles + scaled(10_000) as u64);
}

// ----- fixed: every target, memory-mapped ones included -----------------------------------

pub(crate) fn no_learning_keeps_initial_size<T: Target>(t: &T) {
    let config =
        strict(t).learning(LearningPolicy::None).initial_size(1000).spill(SpillPolicy::External).build().unwrap();
    assert_eq!(learning_case(t, config, &[&[500], &[5000]], &[1024, 1024]), None);
}

pub(crate) fn offsets_are_aligned_and_packed<T: Target>(t: &T) {
    let w = ws(t, fixed(t, 4096));
    assert_eq!(T::config(&w).alignment(), T::UNIT, "the target's default alignment");
    let expected = match T::UNIT {
        64 => [0, 64, 128, 256],
        _ => [0, 256, 512, 768],
    };
    assert_eq!(cycle::<T>(&w, &[1, 64, 65, 10]), expected.map(Placement::Arena));
    let (alignment, expected) = match T::UNIT {
        64 => (256, [0, 256, 512]),
        _ => (512, [0, 512, 1024]),
    };
    let w = ws(t, strict(t).learning(LearningPolicy::None).initial_size(4096).alignment(alignment).build().unwrap());
    assert_eq!(cycle::<T>(&w, &[1, 1, 300]), expected.map(Placement::Arena));
    // The arena resets: the next cycle starts at 0 again.
    assert_eq!(cycle::<T>(&w, &[8]), vec![Placement::Arena(0)]);
}

fn spill_case<T: Target>(t: &T, spill: SpillPolicy, capacity_after: usize, growths: u64) {
    let w = ws(t, strict(t).learning(LearningPolicy::None).initial_size(1024).spill(spill).build().unwrap());
    {
        let scope = T::enter(&w).unwrap();
        let a = filled::<T, u8>(&scope, 1000, 1).unwrap();
        assert_eq!(T::placement(&scope, &a), Placement::Arena(0));
        let b = filled::<T, u8>(&scope, 2000, 2).unwrap();
        assert_eq!(T::placement(&scope, &b), Placement::Elsewhere, "{spill:?}");
        let s = T::stats(&w);
        assert_eq!((s.spilled_in_use, s.external_allocations, s.bytes_spilled), (2000, 1, 2000), "{spill:?}");
        assert_eq!(s.bytes_in_use, 1024, "allocations occupy whole alignment units");
        // Both hold their data: the spill is a separate allocation.
        assert_eq!(sum::<T, _>(&a), 1000);
        assert_eq!(sum::<T, _>(&b), 4000);
    }
    let s = T::stats(&w);
    assert_eq!(s.spilled_in_use, 0, "{spill:?}: spill freed at reset");
    // The spilled 2000 bytes count as the arena would hold them: 2048.
    assert_eq!(s.last_cycle_bytes, 1024 + 2048, "{spill:?}");
    assert_eq!((T::capacity(&w), s.growth_events), (capacity_after, growths), "{spill:?}");
    // The same cycle again: under Reallocate it now fits.
    let placements = cycle::<T>(&w, &[1000, 2000]);
    let fits = placements == vec![Placement::Arena(0), Placement::Arena(1024)];
    assert_eq!(fits, spill == SpillPolicy::Reallocate, "{spill:?}: {placements:?}");
    assert_eq!(T::stats(&w).external_allocations, if fits { 1 } else { 2 });
}

pub(crate) fn spill_external_goes_to_separate_allocations<T: Target>(t: &T) {
    spill_case(t, SpillPolicy::External, 1024, 0);
}

pub(crate) fn fail_policy_errors_and_leaves_the_workspace_usable<T: Target>(t: &T) {
    let w =
        ws(t, strict(t).learning(LearningPolicy::None).initial_size(1024).spill(SpillPolicy::Fail).build().unwrap());
    // Host: 950 bytes take 960, 64 are left. Device: 700 take 768, 256 are left.
    let (len, left, request) = (by_unit::<T>(950, 700), by_unit::<T>(64, 256), by_unit::<T>(100, 300));
    let scope = T::enter(&w).unwrap();
    let mut a = filled::<T, u8>(&scope, len, 7).unwrap();
    let err = T::zeros::<u8, _>(&scope, request).err().expect("exhausted");
    match core::<T>(&err) {
        CoreError::Exhausted { requested, available, capacity, .. } => {
            assert_eq!((*requested, *available, *capacity), (request, left, 1024));
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("'T'") && msg.contains("unchanged") && msg.contains("SpillPolicy::External"), "{msg}");
    // Unchanged: still `left` bytes free at the end, earlier data intact.
    let b = T::zeros::<u8, _>(&scope, left).unwrap();
    assert_eq!(T::placement(&scope, &b), Placement::Arena(1024 - left));
    assert!(T::to_host(&a).iter().all(|&x| x == 7), "earlier data intact");
    let mut values = Array1::from_elem(len, 7u8);
    values[0] = 1;
    T::write(&mut a, &values);
    assert_eq!(sum::<T, _>(&a), 1 + (len - 1) * 7);
    drop((a, b));
    drop(scope);
    assert_eq!(T::stats(&w).external_allocations, 0);
    assert_eq!(cycle::<T>(&w, &[1024]), vec![Placement::Arena(0)]);
}

pub(crate) fn budget_is_enforced_with_a_typed_error<T: Target>(t: &T) {
    let w = ws(t, strict(t).learning(LearningPolicy::None).initial_size(1024).max_size(4096).build().unwrap());
    let scope = T::enter(&w).unwrap();
    T::zeros::<u8, _>(&scope, 1024).unwrap();
    T::zeros::<u8, _>(&scope, 3000).unwrap();
    // Spills count as an arena would lay them out: 3000 bytes take 3008 (host) or 3072
    // (device), and in use is reported as laid out.
    let in_use = by_unit::<T>(4032, 4096);
    let err = T::zeros::<u8, _>(&scope, 100).err().expect("over budget");
    assert!(
        matches!(core::<T>(&err), CoreError::BudgetExceeded { requested: 100, in_use: u, arena: 1024, max_size: 4096, .. } if *u == in_use),
        "{err:?}"
    );
    let CoreError::BudgetExceeded { report, .. } = core::<T>(&err) else { panic!("{err:?}") };
    // The report: the request, the arena, what the open cycle holds (by role: no
    // timeline records this workspace, and it was not entered by role).
    assert_eq!((report.requested, report.capacity, report.in_use), (100, 1024, in_use), "{report:?}");
    assert_eq!(report.lower_bound, None, "no timeline records it");
    assert_eq!(report.holders.len(), 1, "{report:?}");
    assert_eq!((report.holders[0].bytes, report.holders[0].role), (in_use as u64, None), "{report:?}");
    let budget = CoreError::BudgetExceeded {
        requested: 100,
        in_use,
        arena: 1024,
        max_size: 4096,
        workspace: "T".into(),
        report: report.clone(),
    };
    assert_eq!(err.to_string(), budget.to_string());
    assert!(err.to_string().contains("request 100 bytes, capacity 1024 bytes"), "{err}");
    assert!(err.to_string().contains("max_size"), "{err}");
    // What is left fits to the byte, and not one more.
    let left = 4096 - in_use;
    let err = T::zeros::<u8, _>(&scope, left + 1).err().expect("over budget");
    assert!(matches!(core::<T>(&err), CoreError::BudgetExceeded { .. }), "{err:?}");
    if left > 0 {
        T::zeros::<u8, _>(&scope, left).unwrap();
    }
}

pub(crate) fn generations_and_nesting<T: Target>(t: &T) {
    let w = ws(t, t.default_config());
    assert_eq!(T::generation(&w), 0);
    let outer = T::enter(&w).unwrap();
    assert_eq!((T::kind(&outer), T::generation(&w)), (ScopeKind::Opened, 1));
    let a = filled::<T, f32>(&outer, 16, 1.0).unwrap();
    {
        let inner = T::enter(&w).unwrap();
        assert_eq!((T::kind(&inner), T::generation(&w)), (ScopeKind::Nested, 1), "nesting does not start a generation");
        filled::<T, f32>(&inner, 16, 2.0).unwrap();
    }
    assert_eq!(T::to_host(&a).sum(), 16.0, "a nested exit does not reset");
    assert!(T::is_open(&w));
    drop(a);
    drop(outer);
    assert!(!T::is_open(&w));
    for expected in 2..=5 {
        let _s = T::enter(&w).unwrap();
        assert_eq!(T::generation(&w), expected);
    }
    assert_eq!(T::stats(&w).cycles, 5);
}

pub(crate) fn reset_waits_for_the_last_scope_whatever_the_order<T: Target>(t: &T) {
    let w = ws(t, fixed(t, 4096));
    let outer = T::enter(&w).unwrap();
    let inner = T::enter(&w).unwrap();
    let kept = filled::<T, u32>(&inner, 8, 9).unwrap();
    drop(outer); // closing the outer guard first must not reset under `kept`
    assert!(T::is_open(&w));
    let again = T::zeros::<u32, _>(&inner, 8).unwrap();
    assert_ne!(T::placement(&inner, &again), Placement::Arena(0));
    assert_eq!(T::to_host(&kept).sum(), 72);
    drop((kept, again));
    drop(inner);
    assert!(!T::is_open(&w));
    assert_eq!(cycle::<T>(&w, &[1]), vec![Placement::Arena(0)]);
}

pub(crate) fn borrowing_a_closed_workspace_is_an_error<T: Target>(t: &T) {
    let w = ws(t, t.default_config());
    let err = T::borrow_open(&w).err().expect("closed");
    assert!(matches!(core::<T>(&err), CoreError::NotOpen { .. }), "{err:?}");
    assert!(err.to_string().contains("not open") && err.to_string().contains("never a silent no-op"), "{err}");
    let open = T::enter(&w).unwrap();
    let borrowed = T::borrow_open(&w).unwrap();
    assert_eq!((T::kind(&open), T::kind(&borrowed)), (ScopeKind::Opened, ScopeKind::Borrowed));
}

pub(crate) fn zeros_are_zero_even_over_memory_of_an_earlier_cycle<T: Target>(t: &T) {
    let w = ws(t, fixed(t, 4096));
    let first = {
        let s = T::enter(&w).unwrap();
        let x = filled::<T, u32>(&s, 1024, u32::MAX).unwrap();
        T::placement(&s, &x)
    };
    let s = T::enter(&w).unwrap();
    let z = T::zeros::<u32, _>(&s, 1024).unwrap();
    assert_eq!(T::placement(&s, &z), first);
    assert_eq!(T::to_host(&z).sum(), 0);
}

pub(crate) fn circular_workspace_wraps_without_overwriting_the_open_cycle<T: Target>(t: &T) {
    let w = ws(
        t,
        strict(t).learning(LearningPolicy::None).initial_size(1024).reset(ResetPolicy::EndOfBuffer).build().unwrap(),
    );
    assert_eq!(cycle::<T>(&w, &[256, 256]), vec![Placement::Arena(0), Placement::Arena(256)]);
    assert_eq!(T::bytes_in_use(&w), 512, "circular keeps the last cycle's bytes");
    assert_eq!(cycle::<T>(&w, &[256]), vec![Placement::Arena(512)]);
    // 768 used; 512 does not fit at the end, and it wraps to 0 (nothing handed out in
    // this open period lies there).
    assert_eq!(cycle::<T>(&w, &[512]), vec![Placement::Arena(0)], "wraps");
    assert_eq!(T::stats(&w).wraps, 1);
    // Now at 512: 256 fits at the end; the next 256 would wrap onto 0..256, which is
    // below this cycle's start (512), so it wraps; the fourth fits after it.
    let placements = cycle::<T>(&w, &[256, 256, 256, 256]);
    assert_eq!(placements, [Placement::Arena(512), Placement::Arena(768), Placement::Arena(0), Placement::Arena(256)]);
    let s = T::stats(&w);
    assert_eq!((s.wraps, s.external_allocations), (2, 0));
    // Opened at 512: 512 fits at the end, the next 512 wraps onto the previous
    // cycle's memory, and a third would overwrite this cycle, so it spills.
    let placements = cycle::<T>(&w, &[512, 512, 1]);
    assert_eq!(placements, vec![Placement::Arena(512), Placement::Arena(0), Placement::Elsewhere]);
    assert_eq!(T::stats(&w).external_allocations, 1);
}

pub(crate) fn bad_shapes_are_a_typed_error<T: Target>(t: &T) {
    let w = ws(t, t.default_config());
    let s = T::enter(&w).unwrap();
    let err = T::zeros::<f32, _>(&s, (0, 5)).err().expect("zero length");
    assert!(matches!(core::<T>(&err), CoreError::ZeroLength { shape, .. } if shape == &[0, 5]), "{err:?}");
    assert!(err.to_string().contains("no elements"), "{err}");
    let err = T::zeros::<f32, _>(&s, (usize::MAX / 2, 3)).err().expect("overflow");
    assert!(matches!(core::<T>(&err), CoreError::ShapeOverflow { element_size: 4, .. }), "{err:?}");
    let err = T::uninit_address::<f64>(&s, usize::MAX / 4).expect_err("overflow");
    assert!(matches!(core::<T>(&err), CoreError::ShapeOverflow { .. }), "{err:?}");
    let stats = T::stats(&w);
    assert_eq!((stats.bytes_in_use, stats.spilled_in_use, stats.external_allocations), (0, 0, 0), "nothing taken");
}

pub(crate) fn statistics_are_readable_while_arrays_live_and_peak_resets<T: Target>(t: &T) {
    let w = ws(t, strict(t).learning(LearningPolicy::None).initial_size(4096).cycle_history_len(3).build().unwrap());
    for n in [100usize, 2000, 300, 50] {
        let s = T::enter(&w).unwrap();
        let _a = T::zeros::<u8, _>(&s, n).unwrap();
        let live = T::stats(&w);
        assert_eq!((live.bytes_in_use, live.open_scopes), (n.next_multiple_of(T::UNIT), 1));
        assert_eq!(live.backend, t.backend());
    }
    assert_eq!(T::stats(&w).peak_bytes, 2048);
    let history = match T::UNIT {
        64 => vec![2048, 320, 64],
        _ => vec![2048, 512, 256],
    };
    assert_eq!(T::cycle_history(&w), history, "the bounded cycle history keeps the last 3");
    T::reset_peak(&w);
    cycle::<T>(&w, &[64]);
    assert_eq!(T::stats(&w).peak_bytes, by_unit::<T>(64, 256));
}

pub(crate) fn workspace_is_send_and_runs_on_another_thread<T: Target>(t: &T)
where
    T::Ws: Send,
{
    let w = ws(t, t.default_config());
    cycle::<T>(&w, &[128]);
    let moved = std::thread::spawn(move || {
        cycle::<T>(&w, &[128]);
        w
    })
    .join()
    .unwrap();
    assert_eq!(T::stats(&moved).cycles, 2);
}

/// Instantiates the policy table: one `#[test]` per function, each run as `$run(test::<$target>)`.
/// `fixed`: every target; `learning` adds the tests that need learning and reallocation;
/// `member` (a plan group's member, neither circular nor `Send`: its group belongs to a
/// thread) runs the table but for those two.
macro_rules! policy_suite {
    (@tests $run:path, $target:ty, $($name:ident),* $(,)?) => {
        $( #[test] fn $name() { $run($crate::policy_suite::$name::<$target>) } )*
    };
    ($run:path, $target:ty, fixed) => {
        $crate::policy_suite::policy_suite!($run, $target, common);
        $crate::policy_suite::policy_suite!(
            @tests $run,
            $target,
            circular_workspace_wraps_without_overwriting_the_open_cycle,
            workspace_is_send_and_runs_on_another_thread,
        );
    };
    ($run:path, $target:ty, learning) => {
        $crate::policy_suite::policy_suite!($run, $target, fixed);
        $crate::policy_suite::policy_suite!($run, $target, learned);
    };
    ($run:path, $target:ty, member) => {
        $crate::policy_suite::policy_suite!($run, $target, common);
        $crate::policy_suite::policy_suite!($run, $target, learned);
    };
    // What every target runs, plan group members included.
    ($run:path, $target:ty, common) => {
        $crate::policy_suite::policy_suite!(
            @tests $run,
            $target,
            no_learning_keeps_initial_size,
            offsets_are_aligned_and_packed,
            spill_external_goes_to_separate_allocations,
            fail_policy_errors_and_leaves_the_workspace_usable,
            budget_is_enforced_with_a_typed_error,
            generations_and_nesting,
            reset_waits_for_the_last_scope_whatever_the_order,
            borrowing_a_closed_workspace_is_an_error,
            zeros_are_zero_even_over_memory_of_an_earlier_cycle,
            bad_shapes_are_a_typed_error,
            statistics_are_readable_while_arrays_live_and_peak_resets,
        );
    };
    ($run:path, $target:ty, learned) => {
        $crate::policy_suite::policy_suite!(
            @tests $run,
            $target,
            learning_first_loop_strict,
            learning_overallocate,
            learning_over_time_takes_the_largest,
            learning_is_clamped_by_min_and_max,
            learning_never_shrinks_a_larger_arena,
            spill_reallocate_grows_at_the_end_of_the_cycle,
            trim_gives_memory_back_and_relearns,
            a_panic_inside_a_scope_leaves_the_workspace_closed_and_usable,
            a_fixed_shape_loop_keeps_memory_flat,
            a_cycle_peaks_alike_spilled_or_in_the_arena,
        );
    };
}
pub(crate) use policy_suite;
