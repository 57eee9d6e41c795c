//! A small seeded generator: the same seed gives the same weights and the same batch
//! order on every machine.
//!
//! The generator is xoshiro256** seeded through SplitMix64, from `rand_xoshiro` (the
//! generator is not carve's product); the draws on top of it (a uniform `f32` from 24
//! bits, multiply-shift ranges, Fisher–Yates) are carve's own and fixed, so that a seed's
//! weights, data and batch order never change under a dependency update. carve
//! initialises its layers with it (not a public name of `carve`); its tests, examples
//! and benchmarks draw their data with it.

use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256StarStar;

/// Deterministic pseudo-random numbers for initialisation, shuffling and test data.
#[derive(Clone, Debug)]
pub struct Rng(Xoshiro256StarStar);

impl Rng {
    /// A generator seeded with `seed` (through SplitMix64).
    pub fn new(seed: u64) -> Rng {
        Rng(Xoshiro256StarStar::seed_from_u64(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `[0, 1)`, with 24 random bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in `[low, high)`.
    pub fn uniform(&mut self, low: f32, high: f32) -> f32 {
        low + (high - low) * self.next_f32()
    }

    /// Uniform in `0..n` (`n > 0`) by multiply-shift (bias below `n / 2^64`).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    /// xoshiro256** seeded by SplitMix64, written out: the stream every seed of carve's
    /// weights and data has had.
    fn reference(seed: u64, n: usize) -> Vec<u64> {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let mut s = [next(), next(), next(), next()];
        (0..n)
            .map(|_| {
                let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
                let t = s[1] << 17;
                s[2] ^= s[0];
                s[3] ^= s[1];
                s[1] ^= s[2];
                s[0] ^= s[3];
                s[2] ^= t;
                s[3] = s[3].rotate_left(45);
                result
            })
            .collect()
    }

    #[test]
    fn the_stream_is_xoshiro256_starstar_seeded_by_splitmix64() {
        for seed in [0, 1, 7, u64::MAX] {
            let mut r = Rng::new(seed);
            let ours: Vec<u64> = (0..1000).map(|_| r.next_u64()).collect();
            assert_eq!(ours, reference(seed, 1000), "seed {seed}");
        }
    }

    #[test]
    fn same_seed_same_stream_and_uniform_range() {
        let (mut a, mut b, mut c) = (Rng::new(7), Rng::new(7), Rng::new(8));
        let xs: Vec<u64> = (0..100).map(|_| a.next_u64()).collect();
        assert!(xs.iter().all(|&x| x == b.next_u64()));
        assert!(xs.iter().any(|&x| x != c.next_u64()));
        let mut r = Rng::new(1);
        let draws: Vec<f32> = (0..10_000).map(|_| r.uniform(-2.0, 3.0)).collect();
        assert!(draws.iter().all(|&v| (-2.0..3.0).contains(&v)));
        let mean = draws.iter().sum::<f32>() / draws.len() as f32;
        assert!((mean - 0.5).abs() < 0.1, "mean {mean}");
        let mut counts = [0usize; 5];
        for _ in 0..10_000 {
            counts[r.below(5)] += 1;
        }
        assert!(counts.iter().all(|&c| (1_700..2_300).contains(&c)), "{counts:?}");
        let mut items: Vec<usize> = (0..50).collect();
        r.shuffle(&mut items);
        assert_ne!(items, (0..50).collect::<Vec<_>>());
        items.sort_unstable();
        assert_eq!(items, (0..50).collect::<Vec<_>>());
    }
}
