//! allocator-api2 support: an open scope is an [`Allocator`], so allocator-api2-aware
//! containers (its `Vec`, hashbrown maps) can live in workspace memory.
//!
//! ```
//! use allocator_api2::vec::Vec;
//! use workspace_core::{Workspace, WorkspaceConfig};
//!
//! let ws = Workspace::new("SCRATCH", WorkspaceConfig::default())?;
//! let scope = ws.enter()?;
//! let mut v = Vec::new_in(&scope);
//! v.extend_from_slice(&[1u32, 2, 3]);
//! assert_eq!(v.iter().sum::<u32>(), 6);
//! # Ok::<(), workspace_core::Error>(())
//! ```
//!
//! The container borrows the scope, so it cannot outlive the cycle:
//!
//! ```compile_fail,E0597
//! use workspace_core::{Workspace, WorkspaceConfig};
//! let ws = Workspace::new("SCRATCH", WorkspaceConfig::default()).unwrap();
//! let v = {
//!     let scope = ws.enter().unwrap();
//!     let mut v = allocator_api2::vec::Vec::new_in(&scope);
//!     v.push(1u8);
//!     v
//! };
//! ```

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator};

use crate::scope::{Frame, Scope};

/// `Allocator` for `&Scope` and `&Frame`, written once.
macro_rules! allocator_for {
    ($ty:ty) => {
        // SAFETY: memory returned by `allocate` comes from the scope's (or frame's)
        // target and stays valid and unaliased until the scope (or frame) closes; the
        // allocator is a shared reference to it, so every container using it borrows
        // it and is gone before that happens. `deallocate` is a no-op (the memory is
        // reclaimed in bulk at the reset or the frame's close), which the trait
        // allows. Zero-sized requests get a dangling, well-aligned pointer.
        unsafe impl Allocator for $ty {
            #[inline]
            fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
                if layout.size() == 0 {
                    let dangling =
                        NonNull::new(std::ptr::without_provenance_mut::<u8>(layout.align())).ok_or(AllocError)?;
                    return Ok(NonNull::slice_from_raw_parts(dangling, 0));
                }
                let ptr = self.alloc_bytes(layout.size(), layout.align(), false).map_err(|_| AllocError)?;
                Ok(NonNull::slice_from_raw_parts(ptr, layout.size()))
            }

            #[inline]
            unsafe fn deallocate(&self, _ptr: NonNull<u8>, _layout: Layout) {}
        }
    };
}

allocator_for!(&Scope<'_>);
allocator_for!(&Frame<'_>);
