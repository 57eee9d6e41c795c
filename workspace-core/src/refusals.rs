//! Growths a backend refused, and when to ask for them again: the one back-off that a
//! workspace's arena (counted in cycles) and a plan group's arena (counted in starts
//! that needed a growth) share.
//!
//! The first refusal since the last growth that succeeded is the one to report; later
//! ones are only counted. A size refused, or a larger one, is asked for again only after
//! a back-off that doubles with each refusal in a row (2, 4, 8, … ticks, at most
//! 2^[`MAX_SHIFT`]), so an arena the machine can never back is neither asked for every
//! tick nor reported every other one; a smaller size is tried at once. A growth to the
//! smallest size refused, or more, forgets the refusals.

/// The back-off after `n` refusals in a row is `2^min(n, MAX_SHIFT)` ticks.
pub(crate) const MAX_SHIFT: u32 = 16;

/// The refusals since the last growth that covered them; see the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Refusals {
    /// The smallest size refused; `None` when nothing was.
    smallest: Option<usize>,
    /// Refusals in a row (the back-off's exponent).
    in_a_row: u32,
    /// The tick from which a refused size may be asked for again.
    retry_at: u64,
}

impl Refusals {
    /// Whether a refusal stands.
    pub(crate) fn stand(&self) -> bool {
        self.smallest.is_some()
    }

    /// Whether asking for `bytes` at tick `now` waits: that size or a smaller one was
    /// refused and the back-off has not run out.
    pub(crate) fn defers(&self, bytes: usize, now: u64) -> bool {
        self.smallest.is_some_and(|smallest| bytes >= smallest) && now < self.retry_at
    }

    /// The backend refused `bytes` at tick `now`. Whether this is the first refusal
    /// since the last growth (the one to report).
    pub(crate) fn refused(&mut self, bytes: usize, now: u64) -> bool {
        let first = self.smallest.is_none();
        self.smallest = Some(self.smallest.map_or(bytes, |smallest| smallest.min(bytes)));
        self.in_a_row = self.in_a_row.saturating_add(1);
        self.retry_at = now.saturating_add(1 << self.in_a_row.min(MAX_SHIFT));
        first
    }

    /// The backend gave `bytes`. Whether that forgot the refusals (it covers the
    /// smallest size refused; a smaller growth leaves them standing).
    pub(crate) fn granted(&mut self, bytes: usize) -> bool {
        let covered = self.smallest.is_some_and(|smallest| bytes >= smallest);
        if covered {
            *self = Refusals::default();
        }
        covered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_back_off_doubles_and_a_covering_growth_forgets() {
        let mut r = Refusals::default();
        assert!(!r.stand() && !r.defers(100, 0));
        assert!(r.refused(100, 10), "the first is the one to report");
        assert!(r.defers(100, 11) && r.defers(200, 11) && !r.defers(99, 11), "a smaller size is tried at once");
        assert!(!r.defers(100, 12), "after 2 ticks");
        assert!(!r.refused(100, 12));
        assert!(r.defers(100, 15) && !r.defers(100, 16), "then after 4");
        assert!(!r.granted(50), "a smaller growth leaves the refusals");
        assert!(r.stand() && r.granted(100) && !r.stand());
        for now in 0..40 {
            r.refused(1, now);
        }
        assert!(r.defers(1, 39 + (1 << MAX_SHIFT) - 1) && !r.defers(1, 39 + (1 << MAX_SHIFT)), "capped");
    }
}
