//! [`SharedBuf`]: the trainer's one copy of the parameters (and of the updater's
//! state), read by every worker during forward and backward and written, range by
//! range, by each worker during the update.

use std::cell::UnsafeCell;
use std::ops::Range;

/// A buffer of `f32` that several threads read at once, or write in disjoint ranges, in
/// phases that the trainer's barriers separate.
///
/// Access goes through two `unsafe fn`s whose contracts are the phases: [`read`]
/// while nothing writes, [`range_mut`] for a range nothing else touches.
///
/// [`read`]: SharedBuf::read
/// [`range_mut`]: SharedBuf::range_mut
pub(crate) struct SharedBuf(Box<[UnsafeCell<f32>]>);

// SAFETY: the cells are only reached through `read` and `range_mut`, whose callers
// promise that no element is written while another thread reads or writes it; `f32` is
// `Send`.
unsafe impl Sync for SharedBuf {}

impl SharedBuf {
    /// The buffer of `values`, moved, not copied.
    pub(crate) fn new(values: Vec<f32>) -> SharedBuf {
        let values = Box::into_raw(values.into_boxed_slice());
        // SAFETY: `UnsafeCell<f32>` has the in-memory representation of `f32`
        // (`repr(transparent)`), so a boxed slice of the one is a boxed slice of the
        // other, of the same length and allocation layout; the box is given up above.
        SharedBuf(unsafe { Box::from_raw(values as *mut [UnsafeCell<f32>]) })
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// The values.
    ///
    /// # Safety
    ///
    /// No element may be written (through [`SharedBuf::range_mut`]) while the slice
    /// lives.
    pub(crate) unsafe fn read(&self) -> &[f32] {
        // SAFETY: `UnsafeCell<f32>` has the layout of `f32`; no element is written while
        // the slice lives (the caller's promise).
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<f32>(), self.0.len()) }
    }

    /// The values of `range`, to write.
    ///
    /// # Safety
    ///
    /// No other slice of the buffer that overlaps `range` (from `read` or `range_mut`)
    /// may live while this one does.
    ///
    /// # Panics
    ///
    /// When `range` is not within the buffer.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range_mut(&self, range: Range<usize>) -> &mut [f32] {
        let cells = &self.0[range];
        // SAFETY: the cells give mutable access to their values (`UnsafeCell::get`); the
        // layout is that of `f32`; nothing else reaches this range while the slice lives
        // (the caller's promise).
        unsafe { std::slice::from_raw_parts_mut(UnsafeCell::raw_get(cells.as_ptr()), cells.len()) }
    }

    /// The values, through exclusive access.
    pub(crate) fn get_mut(&mut self) -> &mut [f32] {
        let len = self.0.len();
        // SAFETY: `&mut self` excludes every other access; the layout is that of `f32`.
        unsafe { std::slice::from_raw_parts_mut(UnsafeCell::raw_get(self.0.as_ptr()), len) }
    }

    /// The values, the buffer given up (moved, not copied).
    pub(crate) fn into_vec(self) -> Vec<f32> {
        let cells = Box::into_raw(self.0);
        // SAFETY: as in `new`, the other way round: `f32` is `UnsafeCell<f32>`'s
        // representation, and owning the box means no reference into the cells is live.
        unsafe { Box::from_raw(cells as *mut [f32]) }.into_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::SharedBuf;

    #[test]
    fn the_buffer_moves_in_and_out_without_a_copy() {
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let (at, expected) = (values.as_ptr(), values.clone());
        let mut buf = SharedBuf::new(values);
        assert_eq!((buf.len(), buf.get_mut().as_ptr()), (1000, at));
        buf.get_mut()[3] = -1.0;
        // SAFETY: nothing writes while the slice is read.
        assert_eq!(unsafe { buf.read() }[3], -1.0);
        let back = buf.into_vec();
        assert_eq!(back.as_ptr(), at);
        assert_eq!(back[..3], expected[..3]);
        assert_eq!(back[4..], expected[4..]);
    }
}
