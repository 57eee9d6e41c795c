//! Property tests: random cycles of allocations, some read on another stream while the
//! workspace moves on, under random policies. Every allocation must hold exactly what was
//! written into it, every copy out must hold what was there when it was issued, and
//! nothing may fault or leak.

use ndarray::Array1;
use proptest::prelude::*;
use workspace_core::{AllocationPolicy, LearningPolicy, ResetPolicy, SpillPolicy, WorkspaceConfig};
use workspace_cuda::device::sim::SimDevice;
use workspace_cuda::{Device, DeviceArray, DeviceWorkspace};

fn configs() -> impl Strategy<Value = WorkspaceConfig> {
    let learning = prop_oneof![
        Just(LearningPolicy::None),
        Just(LearningPolicy::FirstLoop),
        Just(LearningPolicy::OverTime { cycles: 2 })
    ];
    let spill = prop_oneof![Just(SpillPolicy::External), Just(SpillPolicy::Reallocate)];
    let reset = prop_oneof![Just(ResetPolicy::BlockLeft), Just(ResetPolicy::EndOfBuffer)];
    let allocation = prop_oneof![Just(AllocationPolicy::Strict), Just(AllocationPolicy::Overallocate(0.3))];
    (learning, spill, reset, allocation, 1usize..16_384).prop_map(|(learning, spill, reset, allocation, initial)| {
        WorkspaceConfig::builder()
            .learning(learning)
            .spill(spill)
            .reset(reset)
            .allocation(allocation)
            .initial_size(initial)
            .build()
            .expect("valid")
    })
}

/// One allocation: its size in bytes, and whether a copy stream copies it out.
fn cycles() -> impl Strategy<Value = Vec<Vec<(usize, bool)>>> {
    prop::collection::vec(prop::collection::vec((1usize..6000, any::<bool>()), 1..8), 1..6)
}

proptest! {
    #[test]
    fn every_allocation_holds_its_data_and_every_copy_its_snapshot(config in configs(), cycles in cycles()) {
        let sim = SimDevice::new().unwrap();
        let copy = sim.new_stream().unwrap();
        let ws = DeviceWorkspace::new("MODEL", config, &sim, &sim.default_stream()).unwrap();
        let mut copies = Vec::new();
        for (c, sizes) in cycles.iter().enumerate() {
            let scope = ws.enter().unwrap();
            let mut views = Vec::new();
            for (i, &(bytes, _)) in sizes.iter().enumerate() {
                let value = (c * 31 + i * 7 + 1) as u8;
                views.push((scope.htod(&Array1::from_elem(bytes, value)).unwrap(), value));
            }
            let mut outs: Vec<_> = sizes
                .iter()
                .filter(|(_, copied)| *copied)
                .map(|&(bytes, _)| DeviceArray::<_, u8>::zeros(&sim, &copy, bytes).unwrap())
                .collect();
            {
                let mut out_views: Vec<_> = outs.iter_mut().map(DeviceArray::view_mut).collect();
                let on = scope.on_stream(&copy).unwrap();
                let targets = sizes.iter().zip(&views).filter(|((_, copied), _)| *copied);
                for ((_, (view, _)), out) in targets.zip(out_views.iter_mut()) {
                    on.dtod(view, out).unwrap();
                }
            }
            copies.extend(sizes.iter().zip(&views).filter(|((_, copied), _)| *copied).map(|(_, (_, v))| *v).zip(outs));
            for (view, value) in &views {
                let back = view.to_host().unwrap();
                prop_assert!(back.iter().all(|b| b == value), "cycle {c}: an allocation was overwritten");
            }
        }
        for (value, out) in &copies {
            prop_assert!(out.to_host().unwrap().iter().all(|b| b == value), "a copy saw later data");
        }
        drop((ws, copies));
        sim.quiesce();
        prop_assert!(sim.faults().is_empty(), "{:?}", sim.faults());
        prop_assert_eq!(sim.live_device_bytes(), 0);
    }
}
