//! The circular workspace (`ResetPolicy::EndOfBuffer`) as a user porting ND4J code
//! uses it: ND4J's `ResetPolicy.ENDOFBUFFER_REACHED` with `LearningPolicy.NONE`, a
//! fixed `initialSize` and a `SpillPolicy`. Nothing in carve itself uses it (the
//! prefetchers use equal slots, see `async_iter::slot_ring`); these tests pin down what
//! such a user gets:
//!
//! - every cycle allocates where the last one stopped, and wraps to the start of the
//!   buffer when the end is reached;
//! - what earlier cycles wrote stays in the buffer until the wrap reaches it (readable
//!   with `Scope::retained` on a memory-mapped workspace);
//! - the wrap never overwrites memory handed out since the workspace was opened: such
//!   an allocation, and one larger than the buffer, goes by the spill policy;
//! - the statistics count wraps, spills and growth.
//!
//! ```text
//! // ND4J
//! WorkspaceConfiguration conf = WorkspaceConfiguration.builder()
//!     .initialSize(1024).policyAllocation(AllocationPolicy.STRICT)
//!     .policyLearning(LearningPolicy.NONE).policyReset(ResetPolicy.ENDOFBUFFER_REACHED)
//!     .policySpill(SpillPolicy.EXTERNAL).build();
//! try (MemoryWorkspace ws = Nd4j.getWorkspaceManager().getAndActivateWorkspace(conf, "CIRC")) { ... }
//! ```

use workspace_core::backend::Placement;
use workspace_core::{
    AllocationPolicy, DebugMode, Error, LearningPolicy, Location, ResetPolicy, SpillPolicy, Workspace, WorkspaceConfig,
};

/// ND4J's circular configuration: a fixed buffer of `bytes`, no learning, reset at the
/// end of the buffer, `spill` for what does not fit.
fn circular(bytes: usize, spill: SpillPolicy, location: Location) -> Workspace {
    let config = WorkspaceConfig::builder()
        .allocation(AllocationPolicy::Strict)
        .learning(LearningPolicy::None)
        .initial_size(bytes)
        .reset(ResetPolicy::EndOfBuffer)
        .spill(spill)
        .location(location)
        .build()
        .unwrap();
    Workspace::with_debug_mode("CIRC", config, DebugMode::Disabled).unwrap()
}

/// One cycle (ND4J: one `try (MemoryWorkspace ws = ...)` block) allocating `sizes`
/// bytes as u8 arrays; where each one went.
fn cycle(ws: &Workspace, sizes: &[usize]) -> Vec<Placement> {
    let scope = ws.enter().unwrap();
    sizes.iter().map(|&n| scope.placement(scope.zeros::<u8, _>(n).unwrap().as_ptr())).collect()
}

#[test]
fn cycles_continue_where_the_last_one_stopped_and_wrap_at_the_end_of_the_buffer() {
    let ws = circular(1024, SpillPolicy::External, Location::Ram);
    assert_eq!(ws.capacity(), 1024, "the buffer is allocated up front");
    let placements: Vec<_> = (0..6).map(|_| cycle(&ws, &[256])[0]).collect();
    let offsets = [0, 256, 512, 768, 0, 256].map(Placement::Arena);
    assert_eq!(placements, offsets, "a scoped workspace would give offset 0 every time");
    let stats = ws.stats();
    assert_eq!((stats.cycles, stats.wraps), (6, 1));
    assert_eq!((stats.capacity, stats.growth_events, stats.external_allocations), (1024, 0, 0));
    assert_eq!(stats.bytes_in_use, 256, "the bytes of the last open period, kept after it closed");
    assert_eq!((stats.last_cycle_bytes, stats.peak_bytes), (256, 256));

    // An allocation that does not fit at the end wraps; the tail is skipped, not split.
    assert_eq!(cycle(&ws, &[512, 512]), [Placement::Arena(512), Placement::Arena(0)]);
    let stats = ws.stats();
    assert_eq!((stats.wraps, stats.external_allocations), (2, 0));
    assert_eq!((stats.bytes_in_use, stats.last_cycle_bytes), (1024, 1024));
}

#[test]
fn what_earlier_cycles_wrote_stays_readable_until_the_wrap_overwrites_it() {
    // `Scope::retained` reads the buffer as it is; it needs a memory map, whose bytes
    // are initialised from the start.
    let ws = circular(1024, SpillPolicy::External, Location::MmapAnonymous);
    for k in 1..=4 {
        let scope = ws.enter().unwrap();
        let batch = scope.filled::<f32, _>(64, k as f32).unwrap(); // 256 bytes
        assert_eq!(scope.placement(batch.as_ptr()), Placement::Arena((k - 1) * 256));
    }
    // The buffer is full: the next cycle wraps to offset 0 and finds cycle 1's data.
    {
        let scope = ws.enter().unwrap();
        // SAFETY: the bytes of an anonymous map are zeros or f32s written above.
        let mut old = unsafe { scope.retained::<f32, _>(64) }.unwrap();
        assert_eq!(scope.placement(old.as_ptr()), Placement::Arena(0));
        assert!(old.iter().all(|&x| x == 1.0), "cycle 1's data, three cycles later");
        old.fill(5.0); // the wrap overwrites it now
    }
    assert_eq!(ws.stats().wraps, 1);
    let scope = ws.enter().unwrap();
    // SAFETY: as above.
    let (second, third, fourth, fifth) = unsafe {
        (
            scope.retained::<f32, _>(64).unwrap(),
            scope.retained::<f32, _>(64).unwrap(),
            scope.retained::<f32, _>(64).unwrap(),
            scope.retained::<f32, _>(64).unwrap(),
        )
    };
    let first = |view: &ndarray::ArrayViewMut1<'_, f32>| view[0];
    assert_eq!([first(&second), first(&third), first(&fourth)], [2.0, 3.0, 4.0], "not overwritten yet");
    assert_eq!(first(&fifth), 5.0, "wrapped again: the last cycle's data, at offset 0");
    assert_eq!(scope.placement(fifth.as_ptr()), Placement::Arena(0));
    assert_eq!(ws.stats().wraps, 2);
}

#[test]
fn the_wrap_never_overwrites_memory_handed_out_since_the_workspace_was_opened() {
    for spill in [SpillPolicy::External, SpillPolicy::Fail] {
        let ws = circular(1024, spill, Location::Ram);
        cycle(&ws, &[512]);
        let scope = ws.enter().unwrap(); // opened at 512
        let placed: Vec<_> = (0..4).map(|_| scope.placement(scope.zeros::<u8, _>(256).unwrap().as_ptr())).collect();
        // 512 and 768 to the end, then wrap to 0 and 256: up to where this cycle began.
        assert_eq!(placed, [512, 768, 0, 256].map(Placement::Arena), "{spill:?}");
        // A fifth would overwrite this cycle's first array.
        match spill {
            SpillPolicy::External => {
                let spilled = scope.zeros::<u8, _>(256).unwrap();
                assert_eq!(scope.placement(spilled.as_ptr()), Placement::Elsewhere);
                assert_eq!(ws.stats().spilled_in_use, 256);
            }
            _ => {
                let err = scope.zeros::<u8, _>(256).unwrap_err();
                assert!(
                    matches!(err, Error::Exhausted { requested: 256, available: 0, capacity: 1024, .. }),
                    "{err:?}"
                );
            }
        }
        drop(scope);
        let stats = ws.stats();
        assert_eq!(stats.wraps, 1);
        assert_eq!(stats.spilled_in_use, 0, "spills are freed when the cycle ends");
        let spilled = u64::from(spill == SpillPolicy::External);
        assert_eq!((stats.external_allocations, stats.bytes_spilled), (spilled, 256 * spilled));
        // The next cycle goes on from 512 as if nothing spilled.
        assert_eq!(cycle(&ws, &[256]), [Placement::Arena(512)], "{spill:?}");
    }
}

#[test]
fn an_allocation_larger_than_the_buffer_goes_by_the_spill_policy() {
    // External: a block of its own, freed at the end of the cycle; the buffer stays.
    let ws = circular(1024, SpillPolicy::External, Location::Ram);
    assert_eq!(cycle(&ws, &[256, 2048, 256]), [Placement::Arena(0), Placement::Elsewhere, Placement::Arena(256)]);
    let stats = ws.stats();
    assert_eq!((stats.capacity, stats.growth_events), (1024, 0));
    assert_eq!((stats.external_allocations, stats.bytes_spilled, stats.spilled_in_use), (1, 2048, 0));
    assert_eq!(stats.cycles_spilled_after_learning, 1);
    assert_eq!(stats.peak_bytes, 512 + 2048);
    assert_eq!(cycle(&ws, &[256]), [Placement::Arena(512)], "the buffer goes on where it was");

    // Fail: an error; the workspace is unchanged and usable.
    let ws = circular(1024, SpillPolicy::Fail, Location::Ram);
    cycle(&ws, &[256]);
    {
        let scope = ws.enter().unwrap();
        let err = scope.zeros::<u8, _>(2048).unwrap_err();
        assert!(matches!(err, Error::Exhausted { requested: 2048, available: 768, capacity: 1024, .. }), "{err:?}");
        assert_eq!(scope.placement(scope.zeros::<u8, _>(256).unwrap().as_ptr()), Placement::Arena(256));
    }
    let stats = ws.stats();
    assert_eq!((stats.capacity, stats.external_allocations, stats.wraps), (1024, 0, 0));

    // Reallocate: spills in the cycle, and the buffer grows to hold that cycle when it
    // ends. The new buffer starts empty: what earlier cycles left is gone with the old.
    let ws = circular(1024, SpillPolicy::Reallocate, Location::Ram);
    cycle(&ws, &[512]);
    assert_eq!(cycle(&ws, &[256, 2048]), [Placement::Arena(512), Placement::Elsewhere]);
    let stats = ws.stats();
    assert_eq!((stats.growth_events, stats.external_allocations), (1, 1));
    assert_eq!(stats.capacity, 256 + 2048, "Strict: exactly the cycle's bytes");
    assert_eq!(cycle(&ws, &[2048]), [Placement::Arena(0)]);
    assert_eq!(cycle(&ws, &[256, 256]), [Placement::Arena(2048), Placement::Arena(0)]);
    let stats = ws.stats();
    assert_eq!((stats.wraps, stats.external_allocations, stats.growth_events), (1, 1, 1));
}

#[test]
fn a_learning_circular_workspace_sizes_its_buffer_from_the_first_cycle() {
    // As ND4J's AsyncDataSetIterator configured its circular workspace: learn the first
    // cycle, over-allocate to hold several (here 1 + 3 = 4 cycles of 256 bytes).
    let config = WorkspaceConfig::builder()
        .allocation(AllocationPolicy::Overallocate(3.0))
        .learning(LearningPolicy::FirstLoop)
        .reset(ResetPolicy::EndOfBuffer)
        .spill(SpillPolicy::External)
        .build()
        .unwrap();
    let ws = Workspace::with_debug_mode("CIRC", config, DebugMode::Disabled).unwrap();
    assert_eq!(ws.capacity(), 0, "nothing before the first cycle");
    assert_eq!(cycle(&ws, &[256]), [Placement::Elsewhere], "the first cycle is learned outside the buffer");
    assert_eq!((ws.capacity(), ws.stats().learned_size), (1024, Some(256)));
    let placements: Vec<_> = (0..5).map(|_| cycle(&ws, &[256])[0]).collect();
    assert_eq!(placements, [0, 256, 512, 768, 0].map(Placement::Arena));
    let stats = ws.stats();
    // Installing the learned buffer counts as the one growth (from no buffer to 1024).
    assert_eq!((stats.wraps, stats.growth_events, stats.external_allocations), (1, 1, 1));
}
