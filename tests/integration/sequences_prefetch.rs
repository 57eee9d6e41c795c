//! Japanese Vowels through the prefetcher: batches padded to their own longest
//! sequence arrive intact, with their masks, through the ring's growth, over several
//! epochs, with the producer on its own thread and inline; and an LSTM trains from them.

#[path = "../../examples/common/vowels.rs"]
mod vowels;

use carve::async_iter::{Prefetcher, Sequences, Threading};
use carve::nn::{Network, NetworkConfig, Updater};
use carve::WorkspaceMode;
use ndarray::{s, Ix1, Ix2, Ix3};

/// Divides counts under valgrind (`CARVE_SOAK_SCALE=5`), never below `floor`.
fn scaled(n: usize, floor: usize) -> usize {
    let scale: usize = std::env::var("CARVE_SOAK_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    (n / scale.max(1)).max(floor)
}

#[test]
fn japanese_vowels_batches_arrive_intact_through_ring_growth_in_both_threading_modes() {
    let (train, _) = vowels::load(&vowels::data_path()).unwrap();
    // The labels are the sequences' own indices, so every element of a batch can be
    // checked against its sequence.
    let ids: Vec<u32> = (0..train.sequences.len() as u32).collect();
    for threading in [Threading::Background, Threading::Shield] {
        let source = Sequences::new(train.sequences.clone(), ids.clone(), 16).unwrap().shuffled(3);
        let mut batches = Prefetcher::builder(source).threading(threading).depth(3).build().unwrap();
        let mut shapes = std::collections::BTreeSet::new();
        for epoch in 0..scaled(4, 2) {
            let mut seen = vec![false; ids.len()];
            while let Some(batch) = batches.next() {
                let batch = batch.unwrap();
                let x = batch.features::<f32, Ix3>().unwrap();
                let mask = batch.features_mask::<f32, Ix2>().unwrap().expect("sequence batches have a mask");
                let y = batch.labels::<u32, Ix1>().unwrap();
                let steps = x.shape()[1];
                shapes.insert((x.shape()[0], steps));
                let longest = y.iter().map(|&i| train.sequences[i as usize].nrows()).max().unwrap();
                assert_eq!(steps, longest, "epoch {epoch}: padded to the batch's own longest sequence");
                for (row, &id) in y.iter().enumerate() {
                    assert!(!seen[id as usize], "sequence {id} twice in epoch {epoch}");
                    seen[id as usize] = true;
                    let sequence = &train.sequences[id as usize];
                    let n = sequence.nrows();
                    assert_eq!(x.slice(s![row, ..n, ..]), sequence.view(), "sequence {id}'s data");
                    assert!(x.slice(s![row, n.., ..]).iter().all(|&v| v == 0.0), "sequence {id}'s padding");
                    assert!(mask.slice(s![row, ..n]).iter().all(|&m| m == 1.0), "sequence {id}'s mask");
                    assert!(mask.slice(s![row, n..]).iter().all(|&m| m == 0.0), "sequence {id}'s padding mask");
                }
            }
            assert!(seen.iter().all(|&s| s), "epoch {epoch} holds every sequence");
            batches.reset().unwrap();
        }
        let stats = batches.stats();
        assert!(stats.ring_growths >= 1, "{threading:?}: batches of varying size grow the ring: {stats:?}");
        assert!(shapes.len() > 4, "{threading:?}: batches of many shapes: {shapes:?}");
    }
}

#[test]
fn an_lstm_learns_the_speakers_from_prefetched_batches_with_masks() {
    let (train, test) = vowels::load(&vowels::data_path()).unwrap();
    let config = NetworkConfig::builder(vowels::FEATURES)
        .lstm(32)
        .last_step()
        .dense(vowels::CLASSES)
        .updater(Updater::adam(5e-3))
        .seed(1)
        .training_workspace_mode(WorkspaceMode::Enabled)
        .build()
        .unwrap();
    let mut net = Network::new(config).unwrap();
    // Under valgrind: 3 epochs on a third of the data, where the loss still falls.
    let (train_n, epochs) = (scaled(270, 90).min(train.labels.len()), scaled(10, 2));
    let source =
        Sequences::new(train.sequences[..train_n].to_vec(), train.labels[..train_n].to_vec(), 16).unwrap().shuffled(1);
    let mut batches = Prefetcher::builder(source).build().unwrap();
    let first = net.fit(&mut batches).unwrap();
    for _ in 1..epochs {
        net.fit(&mut batches).unwrap();
    }
    let last = net.fit(&mut batches).unwrap();
    let accuracy = {
        let mut test_batches =
            Prefetcher::builder(Sequences::new(test.sequences, test.labels, 64).unwrap()).build().unwrap();
        let accuracy = net.evaluate_batches(&mut test_batches).unwrap();
        // evaluate_batches resets the prefetcher: a second evaluation reads the same epoch.
        assert_eq!(net.evaluate_batches(&mut test_batches).unwrap(), accuracy);
        accuracy
    };
    if epochs >= 10 {
        assert!(last < first / 4.0, "the loss falls: {first} -> {last}");
        assert!(accuracy > 0.8, "11 epochs of a small LSTM already tell most speakers apart: {accuracy}");
    } else {
        assert!(last < first, "the loss falls: {first} -> {last}");
    }
}
