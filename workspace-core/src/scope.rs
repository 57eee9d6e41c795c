//! Scopes: the open cycle that arrays borrow.
//!
//! A [`Scope`] is the guard of one enter, nested enter or borrow of a workspace (or
//! of the heap, when scoped out). Allocation takes `&self` and returns ndarray views
//! that borrow the scope, so the compiler rejects any use after the scope closes:
//!
//! ```compile_fail,E0505
//! use workspace_core::{Workspace, WorkspaceConfig};
//! let ws = Workspace::new("W", WorkspaceConfig::default()).unwrap();
//! let scope = ws.enter().unwrap();
//! let view = scope.zeros::<f32, _>(16).unwrap();
//! drop(scope); // the reset happens here...
//! println!("{}", view[0]); // ...so this does not compile
//! ```
//!
//! The arena resets when the *last* scope over it closes, whichever order scopes
//! close in; that count is what proves no view is alive.

use std::marker::PhantomData;
use std::mem::{align_of, size_of, MaybeUninit};
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::Arc;

use bytemuck::Pod;
use ndarray::{Array, ArrayBase, ArrayView, ArrayViewMut, Data, Dimension, ShapeBuilder};

use crate::engine::FrameMark;
use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::shell::{checked_bytes, Placement, ScopeKind};
use crate::workspace::Workspace;

/// How a scope came to be, and what keeps its workspace alive besides the `'ws`
/// borrow: nothing, an `Rc` (`enter_shared`: the scope owns one strong count, taken
/// with `Rc::into_raw`), or a `Box` (a heap scope's private workspace, taken with
/// `Box::into_raw`). Both raw pointers are the workspace's own address, so the scope
/// needs no second pointer and stays two words: it is returned in registers, and
/// moving it never copies through memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
enum Tag {
    Opened,
    Nested,
    Borrowed,
    /// Owns the `Box`.
    Heap,
    /// Own one count of the `Rc`.
    SharedOpened,
    SharedNested,
    SharedBorrowed,
}

impl Tag {
    /// The tag of a scope over a workspace: `shared` when it owns a count of an `Rc`.
    /// (A heap scope is built by [`Scope::heap`] alone.)
    #[inline(always)]
    fn new(kind: ScopeKind, shared: bool) -> Tag {
        match (kind, shared) {
            (ScopeKind::Opened, false) => Tag::Opened,
            (ScopeKind::Nested, false) => Tag::Nested,
            (ScopeKind::Borrowed, false) => Tag::Borrowed,
            (ScopeKind::Opened, true) => Tag::SharedOpened,
            (ScopeKind::Nested, true) => Tag::SharedNested,
            (ScopeKind::Borrowed, true) => Tag::SharedBorrowed,
            (ScopeKind::Heap, _) => unreachable!("a heap scope is built by Scope::heap"),
        }
    }

    /// Whether the scope owns what keeps its workspace alive (a `Box` or an `Rc`
    /// count), to be given back when it closes.
    #[inline(always)]
    fn owns(self) -> bool {
        !matches!(self, Tag::Opened | Tag::Nested | Tag::Borrowed)
    }

    fn kind(self) -> ScopeKind {
        match self {
            Tag::Opened | Tag::SharedOpened => ScopeKind::Opened,
            Tag::Nested | Tag::SharedNested => ScopeKind::Nested,
            Tag::Borrowed | Tag::SharedBorrowed => ScopeKind::Borrowed,
            Tag::Heap => ScopeKind::Heap,
        }
    }
}

/// Lets a heap scope's or a shared scope's workspace go, out of line: the common
/// scope holds nothing, and keeping this off its drop keeps that drop small enough
/// to inline.
///
/// # Safety
///
/// `ws` and `tag` come from a scope that is being dropped, whose engine has already
/// counted it out, and that is not used again.
#[cold]
#[inline(never)]
unsafe fn release(ws: NonNull<Workspace>, tag: Tag) {
    if tag == Tag::Heap {
        // SAFETY: a heap scope's `ws` came from `Box::into_raw`, and the box is freed
        // once, here.
        drop(unsafe { Box::from_raw(ws.as_ptr()) });
    } else {
        // SAFETY: a shared scope's `ws` came from `Rc::into_raw` and owns that count,
        // given back once, here.
        drop(unsafe { Rc::from_raw(ws.as_ptr()) });
    }
}

/// The allocation methods of [`Scope`] and [`Frame`], written once: each
/// type gives `workspace_ref` (the workspace allocated in) and `alloc_bytes` (which
/// path reserves the bytes).
macro_rules! allocation_methods {
    () => {
        /// The name of the allocation target (a heap workspace's ends in "(heap)"; a
        /// standalone heap scope's is "heap").
        pub fn target_name(&self) -> &Arc<str> {
            self.workspace_ref().name()
        }

        /// Where the memory at `ptr` lives relative to this scope's arena.
        pub fn placement<T>(&self, ptr: *const T) -> Placement {
            self.workspace_ref().placement(ptr.cast::<u8>())
        }

        /// Whether `array`'s memory lies in this scope's allocation target (the workspace:
        /// for a heap workspace, the blocks it holds in its open cycle; for a standalone
        /// heap scope, its own blocks).
        pub fn holds<T, S: ndarray::RawData<Elem = T>, Dim: Dimension>(&self, array: &ArrayBase<S, Dim>) -> bool {
            let (ptr, bytes) = extent(array);
            self.workspace_ref().contains(ptr, bytes)
        }

        /// Reserves memory for `dim` elements of `T`.
        #[inline(always)]
        pub(crate) fn alloc_elements<T, Dim: Dimension>(&self, dim: &Dim, zeroed: bool) -> Result<NonNull<T>> {
            let ws = self.workspace_ref();
            let bytes = checked_bytes::<T, Dim>(dim, || ws.name().clone())?;
            if size_of::<T>() == 0 {
                // No memory: ndarray only needs the element count to fit in `isize`.
                return Ok(NonNull::dangling());
            }
            Ok(self.alloc_bytes(bytes, align_of::<T>(), zeroed)?.cast())
        }

        /// A zero-filled array in this scope.
        ///
        /// # Errors
        ///
        /// [`Error::ZeroLength`] for an empty shape, [`Error::ShapeOverflow`] when the
        /// byte size overflows, and the workspace's allocation errors
        /// ([`Error::Exhausted`], [`Error::BudgetExceeded`], [`Error::Backend`]).
        #[inline]
        #[doc(alias = "create")]
        pub fn zeros<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh) -> Result<ArrayViewMut<'_, T, Sh::Dim>> {
            let shape = shape.into_shape_with_order();
            let ptr = self.alloc_elements::<T, _>(shape.raw_dim(), true)?;
            // SAFETY: `ptr` points to `shape.size()` zeroed (hence valid, `T: Pod`)
            // elements, aligned for `T`, exclusively ours until the scope closes; the view
            // borrows `self`, so it cannot outlive the scope.
            Ok(unsafe { ArrayViewMut::from_shape_ptr(shape, ptr.as_ptr()) })
        }

        /// An array filled with `value`.
        ///
        /// # Errors
        ///
        /// As [`Scope::zeros`].
        #[inline]
        pub fn filled<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh, value: T) -> Result<ArrayViewMut<'_, T, Sh::Dim>> {
            let mut view = self.uninit::<T, Sh>(shape)?;
            view.fill(MaybeUninit::new(value));
            // SAFETY: every element was just written.
            Ok(unsafe { view.assume_init() })
        }

        /// An array whose elements are `f(index)`, in logical order.
        ///
        /// # Errors
        ///
        /// As [`Scope::zeros`].
        pub fn from_shape_fn<T: Pod, Sh: ShapeBuilder, F>(
            &self,
            shape: Sh,
            mut f: F,
        ) -> Result<ArrayViewMut<'_, T, Sh::Dim>>
        where
            F: FnMut(<Sh::Dim as Dimension>::Pattern) -> T,
        {
            let mut view = self.uninit::<T, Sh>(shape)?;
            for (index, slot) in view.indexed_iter_mut() {
                *slot = MaybeUninit::new(f(index));
            }
            // SAFETY: every element was just written.
            Ok(unsafe { view.assume_init() })
        }

        /// An uninitialised array: its elements are `MaybeUninit<T>`, so safe code cannot
        /// read them before writing. Once every element is written, `assume_init` (unsafe)
        /// gives the initialised view; [`Scope::filled`] and [`Scope::from_shape_fn`] do
        /// this safely.
        ///
        /// # Errors
        ///
        /// As [`Scope::zeros`].
        #[inline]
        pub fn uninit<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh) -> Result<ArrayViewMut<'_, MaybeUninit<T>, Sh::Dim>> {
            let shape = shape.into_shape_with_order();
            let ptr = self.alloc_elements::<T, _>(shape.raw_dim(), false)?;
            // SAFETY: as in `zeros`; `MaybeUninit<T>` needs no initialisation and has the
            // layout of `T`.
            Ok(unsafe { ArrayViewMut::from_shape_ptr(shape, ptr.cast::<MaybeUninit<T>>().as_ptr()) })
        }

        /// A copy of `source` in this scope, in standard (row-major) layout.
        ///
        /// # Errors
        ///
        /// As [`Scope::zeros`].
        #[doc(alias = "dup")]
        pub fn copy_of<T: Pod, S: Data<Elem = T>, Dim: Dimension>(
            &self,
            source: &ArrayBase<S, Dim>,
        ) -> Result<ArrayViewMut<'_, T, Dim>> {
            let mut view = self.uninit::<T, _>(source.raw_dim())?;
            match (source.as_slice(), view.as_slice_mut()) {
                (Some(from), Some(to)) => {
                    // One memcpy: an element-wise loop here compiles to a 16-byte SSE loop
                    // (LLVM cannot rule out overlap), 0.84–0.9× memcpy at 64 KiB.
                    assert_eq!(from.len(), to.len(), "the copy has the source's shape");
                    // SAFETY: both slices hold `from.len()` elements (checked above);
                    // `to` is borrowed mutably and `from` shared, so they do not overlap;
                    // `T: Pod` is `Copy`, so copying its bytes into the `MaybeUninit<T>`
                    // slots initialises them as `MaybeUninit::new(*value)` would.
                    unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), to.as_mut_ptr().cast::<T>(), from.len()) };
                }
                _ => view.zip_mut_with(source, |slot, value| *slot = MaybeUninit::new(*value)),
            }
            // SAFETY: every element was just written (same shape).
            Ok(unsafe { view.assume_init() })
        }

        /// `f` of every element of `source`, in standard (row-major) layout: one pass
        /// (where [`copy_of`](Self::copy_of) then an in-place map takes two).
        ///
        /// # Errors
        ///
        /// As [`Scope::zeros`].
        pub fn map_of<T: Pod, U: Pod, S: Data<Elem = T>, Dim: Dimension>(
            &self,
            source: &ArrayBase<S, Dim>,
            mut f: impl FnMut(T) -> U,
        ) -> Result<ArrayViewMut<'_, U, Dim>> {
            let mut view = self.uninit::<U, _>(source.raw_dim())?;
            match (source.as_slice(), view.as_slice_mut()) {
                (Some(from), Some(to)) => {
                    for (slot, &value) in to.iter_mut().zip(from) {
                        *slot = MaybeUninit::new(f(value));
                    }
                }
                _ => view.zip_mut_with(source, |slot, &value| *slot = MaybeUninit::new(f(value))),
            }
            // SAFETY: every element was just written (same shape).
            Ok(unsafe { view.assume_init() })
        }

        /// `rows` copies of `row`, one per row: `[rows, row.len()]` (a bias broadcast
        /// over a batch, say).
        ///
        /// # Errors
        ///
        /// As [`Scope::zeros`].
        pub fn rows_of<T: Pod, S: Data<Elem = T>>(
            &self,
            row: &ArrayBase<S, ndarray::Ix1>,
            rows: usize,
        ) -> Result<ArrayViewMut<'_, T, ndarray::Ix2>> {
            let mut view = self.uninit::<T, _>((rows, row.len()))?;
            for mut out in view.rows_mut() {
                out.zip_mut_with(row, |slot, &value| *slot = MaybeUninit::new(value));
            }
            // SAFETY: every element of every row was just written.
            Ok(unsafe { view.assume_init() })
        }

        /// A zero-filled slice (for scratch buffers that are not arrays).
        ///
        /// # Errors
        ///
        /// As [`Scope::zeros`].
        #[inline]
        #[allow(clippy::mut_from_ref)] // each call hands out fresh, disjoint memory
        pub fn slice_zeroed<T: Pod>(&self, len: usize) -> Result<&mut [T]> {
            let ptr = self.alloc_elements::<T, _>(&ndarray::Ix1(len), true)?;
            // SAFETY: an empty slice is refused above (`ZeroLength`).
            unsafe { std::hint::assert_unchecked(len > 0) };
            // SAFETY: `len` zeroed, aligned, exclusively owned elements, borrowed from `self`.
            Ok(unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) })
        }

        /// A slice whose element `i` is `f(i)`, computed in index order.
        ///
        /// # Errors
        ///
        /// As [`Scope::zeros`].
        #[inline]
        #[allow(clippy::mut_from_ref)] // each call hands out fresh, disjoint memory
        pub fn slice_from_fn<T: Pod>(&self, len: usize, mut f: impl FnMut(usize) -> T) -> Result<&mut [T]> {
            let slots = self.slice_uninit::<T>(len)?;
            for (i, slot) in slots.iter_mut().enumerate() {
                slot.write(f(i));
            }
            // SAFETY: every one of the `len` slots was written just above; `MaybeUninit<T>`
            // and `T` have the same layout.
            Ok(unsafe { &mut *(slots as *mut [MaybeUninit<T>] as *mut [T]) })
        }

        /// An uninitialised slice.
        ///
        /// # Errors
        ///
        /// As [`Scope::zeros`].
        #[inline]
        #[allow(clippy::mut_from_ref)] // each call hands out fresh, disjoint memory
        pub fn slice_uninit<T: Pod>(&self, len: usize) -> Result<&mut [MaybeUninit<T>]> {
            let ptr = self.alloc_elements::<T, _>(&ndarray::Ix1(len), false)?;
            // SAFETY: an empty slice is refused above (`ZeroLength`, also for zero-sized
            // `T`); telling the optimiser lets it drop the caller's bounds test on the first
            // element.
            unsafe { std::hint::assert_unchecked(len > 0) };
            // SAFETY: as in `slice_zeroed`; `MaybeUninit` needs no initialisation.
            Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<MaybeUninit<T>>().as_ptr(), len) })
        }
    };
}
/// An open scope of a workspace (or of the heap); see the module docs.
///
/// `!Send` and `!Sync`: it closes on the thread that opened it.
#[derive(Debug)]
pub struct Scope<'ws> {
    /// The workspace allocated in. Invariant: valid for the scope's life (borrowed for
    /// `'ws`, or kept alive by what `tag` says the scope owns), and its engine counts
    /// this scope as open.
    ws: NonNull<Workspace>,
    tag: Tag,
    _borrow: PhantomData<&'ws Workspace>,
}

impl<'ws> Scope<'ws> {
    /// # Safety
    ///
    /// The engine of `ws` must have counted this scope as open (via `enter` or
    /// `borrow_open`), and `ws` must stay alive for `'ws`.
    #[inline(always)]
    pub(crate) unsafe fn over(ws: &Workspace, kind: ScopeKind) -> Scope<'ws> {
        Scope { ws: NonNull::from(ws), tag: Tag::new(kind, false), _borrow: PhantomData }
    }

    /// A scope that keeps `ws` alive through the `Rc` it takes.
    ///
    /// # Safety
    ///
    /// The engine of `ws` must have counted this scope as open.
    #[inline(always)]
    pub(crate) unsafe fn over_shared(ws: Rc<Workspace>, kind: ScopeKind) -> Scope<'static> {
        let ws = NonNull::new(Rc::into_raw(ws).cast_mut()).expect("an Rc is not null");
        Scope { ws, tag: Tag::new(kind, true), _borrow: PhantomData }
    }

    /// A scope that allocates on the heap: each array is its own allocation, freed
    /// when the scope closes ("scoping out" of workspaces).
    ///
    /// ```
    /// let scope = workspace_core::Scope::heap();
    /// let x = scope.filled::<f64, _>(3, 2.0)?;
    /// assert_eq!(x.sum(), 6.0);
    /// # Ok::<(), workspace_core::Error>(())
    /// ```
    pub fn heap() -> Scope<'static> {
        let own =
            Box::new(Workspace::standalone_heap("heap").expect("a workspace without an arena reserves no memory"));
        own.open_raw().expect("a new workspace has nothing pending");
        // The scope owns the box (entered just above) until `release` frees it.
        let ws = NonNull::new(Box::into_raw(own)).expect("a box is not null");
        Scope { ws, tag: Tag::Heap, _borrow: PhantomData }
    }

    #[inline(always)]
    fn workspace_ref(&self) -> &Workspace {
        // SAFETY: `ws` invariant: valid for the scope's life.
        unsafe { self.ws.as_ref() }
    }

    /// The workspace this scope allocates in (a role's heap workspace when the role is
    /// scoped out; `None` for a standalone heap scope, [`Scope::heap`]).
    pub fn workspace(&self) -> Option<&Workspace> {
        (self.tag != Tag::Heap).then(|| self.workspace_ref())
    }

    /// Whether this scope serves a dry run ([`Workspace::is_shape_only`]): allocate
    /// as the real code does and compute nothing. A heap scope never is.
    #[inline]
    pub fn is_shape_only(&self) -> bool {
        self.workspace().is_some_and(Workspace::is_shape_only)
    }

    /// How this scope came to be.
    pub fn kind(&self) -> ScopeKind {
        self.tag.kind()
    }

    /// `(owner id, generation)` that handles allocated here carry.
    #[inline]
    pub(crate) fn identity(&self) -> (u64, u64) {
        let ws = self.workspace_ref();
        (ws.id(), ws.generation())
    }

    /// The generation this scope allocates in.
    pub fn generation(&self) -> u64 {
        self.identity().1
    }

    /// Reserves `size` (> 0) bytes aligned to `align`.
    #[inline(always)]
    pub(crate) fn alloc_bytes(&self, size: usize, align: usize, zeroed: bool) -> Result<NonNull<u8>> {
        let placed = match self.workspace_ref().engine().try_alloc_fast(size, align) {
            Some(placed) => placed,
            None => self.workspace_ref().engine().alloc_slow(size, align)?,
        };
        Ok(place(placed, size, zeroed))
    }

    allocation_methods!();

    /// The next array in the arena *with its current contents*: for memory-mapped
    /// workspaces, whose bytes come from the file (or are zero) and survive closing and
    /// reopening a file-backed workspace. Allocating the same shapes in the same order
    /// finds the same data again.
    ///
    /// # Safety
    ///
    /// Every byte of the returned range must be initialised: either untouched since
    /// the mapping was created (file contents or zeros), or last written with
    /// initialised values. Writing `MaybeUninit::uninit()` through an
    /// [`uninit`](Scope::uninit) view, or through an allocator-api2 container of
    /// `MaybeUninit`, makes those bytes uninitialised again.
    ///
    /// # Errors
    ///
    /// [`Error::NotInitialised`] for RAM workspaces, heap scopes and requests that
    /// spill; otherwise as [`Scope::zeros`].
    pub unsafe fn retained<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh) -> Result<ArrayViewMut<'_, T, Sh::Dim>> {
        let not_initialised = |backend| Error::NotInitialised { workspace: self.target_name().clone(), backend };
        let ws = self.workspace_ref();
        if !ws.engine().arena_is_initialised() {
            return Err(not_initialised(ws.engine().backend_kind()));
        }
        let shape = shape.into_shape_with_order();
        let ptr = self.alloc_elements::<T, _>(shape.raw_dim(), false)?;
        if shape.size() > 0 && size_of::<T>() > 0 && !matches!(self.placement(ptr.as_ptr()), Placement::Arena(_)) {
            return Err(not_initialised("a spill block"));
        }
        // SAFETY: the elements lie in the arena of a memory map, whose bytes the caller
        // guarantees are initialised, and any bit pattern is a valid `T: Pod`; the rest
        // as in `zeros`.
        Ok(unsafe { ArrayViewMut::from_shape_ptr(shape, ptr.as_ptr()) })
    }

    /// A zero-filled array behind a [`Handle`] that can be stored (in a layer, a
    /// cache) and is checked against this workspace's generation on every access.
    ///
    /// # Errors
    ///
    /// As [`Scope::zeros`].
    pub fn zeros_handle<T: Pod, Sh: ShapeBuilder>(&self, shape: Sh) -> Result<Handle<T, Sh::Dim>> {
        let shape = shape.into_shape_with_order();
        let dim = shape.raw_dim().clone();
        let ptr = self.alloc_elements::<T, _>(&dim, true)?;
        Ok(self.handle(ptr, dim))
    }

    /// An array behind a [`Handle`] whose elements `init` writes, as
    /// [`zeros_handle`](Scope::zeros_handle) but with the filling left to the caller (a
    /// fill split across threads, a copy, values computed in place): `init` gets the
    /// new array uninitialised and gives back the same elements initialised (what
    /// `assume_init` of its argument gives once every element is written). The array is
    /// in standard (row-major) layout whatever order `shape` asks for.
    ///
    /// # Errors
    ///
    /// As [`Scope::zeros`].
    ///
    /// # Panics
    ///
    /// When `init` gives back a view of other elements, or of the same elements in
    /// another shape or layout (nothing then reaches the array).
    pub fn handle_with<T: Pod, Sh: ShapeBuilder>(
        &self,
        shape: Sh,
        init: impl for<'v> FnOnce(ArrayViewMut<'v, MaybeUninit<T>, Sh::Dim>) -> ArrayViewMut<'v, T, Sh::Dim>,
    ) -> Result<Handle<T, Sh::Dim>> {
        self.try_handle_with(shape, |fresh| Ok(init(fresh)))
    }

    /// [`handle_with`](Scope::handle_with) whose `init` may fail: its error is returned
    /// and no handle made (the elements stay allocated, unread, until the scope ends).
    /// For a fill that runs code which can refuse (a layer's backward pass writing the
    /// gradient of its input).
    ///
    /// # Errors
    ///
    /// As [`Scope::zeros`], and `init`'s error.
    ///
    /// # Panics
    ///
    /// As [`handle_with`](Scope::handle_with): when `init` gives back a view of other
    /// elements, or of the same elements in another shape or layout.
    pub fn try_handle_with<T: Pod, Sh: ShapeBuilder, E: From<Error>>(
        &self,
        shape: Sh,
        init: impl for<'v> FnOnce(ArrayViewMut<'v, MaybeUninit<T>, Sh::Dim>) -> Result<ArrayViewMut<'v, T, Sh::Dim>, E>,
    ) -> Result<Handle<T, Sh::Dim>, E> {
        let shape = shape.into_shape_with_order();
        let dim = shape.raw_dim().clone();
        let ptr = self.alloc_elements::<T, _>(&dim, false)?;
        // SAFETY: as in `uninit`: fresh, exclusively owned memory for `dim` elements,
        // in standard layout (`dim` alone: whatever order `shape` asked for).
        let fresh = unsafe { ArrayViewMut::from_shape_ptr(dim.clone(), ptr.cast::<MaybeUninit<T>>().as_ptr()) };
        let done = init(fresh)?;
        // A view of `T`s is initialised by its type; being of these very elements, in
        // standard layout and this shape, it covers every one of them.
        assert!(
            std::ptr::eq(done.as_ptr(), ptr.as_ptr()) && done.raw_dim() == dim && done.is_standard_layout(),
            "handle_with: `init` gives back the array it was given, initialised"
        );
        drop(done);
        Ok(self.handle(ptr, dim))
    }

    /// A copy of `source` behind a [`Handle`].
    ///
    /// # Errors
    ///
    /// As [`Scope::zeros`].
    pub fn copy_handle<T: Pod, S: Data<Elem = T>, Dim: Dimension>(
        &self,
        source: &ArrayBase<S, Dim>,
    ) -> Result<Handle<T, Dim>> {
        let view = self.copy_of(source)?;
        let ptr = NonNull::new(view.as_ptr().cast_mut()).expect("views are never null");
        Ok(self.handle(ptr, source.raw_dim()))
    }

    fn handle<T: Pod, Dim: Dimension>(&self, ptr: NonNull<T>, dim: Dim) -> Handle<T, Dim> {
        let (owner, generation) = self.identity();
        // SAFETY: `ptr` holds `dim.size()` initialised elements allocated in this
        // scope's target at `generation`, and no view of them is alive.
        unsafe { Handle::new(ptr, dim, owner, generation, self.target_name().clone()) }
    }
}

impl Drop for Scope<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: the workspace is alive (`ws` invariant) and counted this scope; every
        // view borrowed from this scope has ended (they borrow `self`), and handles are
        // checked against the generation before any access.
        unsafe { self.workspace_ref().close_raw() };
        // Only now may the `Rc` or the box (if any) let the workspace go.
        if self.tag.owns() {
            // SAFETY: counted out just above, and the scope is not used after.
            unsafe { release(self.ws, self.tag) };
        }
    }
}

/// A release point inside an open scope: arrays allocated from the frame live until
/// the frame closes, and then the bytes they took are handed out again in the same
/// cycle, by whatever allocates next (the scope, or the next frame). Opened with
/// [`Scope::frame`] (or [`Frame::frame`], nested).
///
/// The views borrow the frame as they borrow a scope, so the compiler proves them dead
/// when it closes:
///
/// ```compile_fail,E0505
/// use workspace_core::{Workspace, WorkspaceConfig};
/// let ws = Workspace::new("W", WorkspaceConfig::default()).unwrap();
/// let scope = ws.enter().unwrap();
/// let frame = scope.frame().unwrap();
/// let tmp = frame.zeros::<f32, _>(16).unwrap();
/// drop(frame); // its bytes are handed out again here...
/// println!("{}", tmp[0]); // ...so this does not compile
/// ```
///
/// What the scope allocates stays when a frame closes, whatever the order:
///
/// ```
/// use workspace_core::{Workspace, WorkspaceConfig};
///
/// let ws = Workspace::new("UPDATER", WorkspaceConfig::builder().initial_size(1 << 20).build()?)?;
/// let scope = ws.enter()?;
/// let mut total = scope.zeros::<f32, _>(4)?; // lives to the end of the scope
/// for step in 0..3 {
///     let frame = scope.frame()?;
///     let update = frame.filled::<f32, _>(1 << 16, step as f32)?; // 256 KiB, given back each time
///     total[0] += update.sum();
/// }
/// assert_eq!(total[0], (1 << 16) as f32 * 3.0);
/// // Three updates of 256 KiB, but never more than one at once.
/// drop(scope);
/// assert!(ws.stats().peak_bytes < 2 * 256 * 1024);
/// # Ok::<(), workspace_core::Error>(())
/// ```
///
/// A frame makes no handles (a handle outlives the views' borrow, and a frame's bytes
/// are reused before its cycle ends). What a frame gives back is arena bytes: in a
/// cycle that spilled (a first, learning cycle, or an arena too small), the spill
/// blocks stay held, and counted against `max_size`, to the end of the cycle (under
/// `DebugMode::SpillEverything` each allocation's block is freed with its frame). Closing frames out of order, allocating from the
/// scope while a frame is open, or forgetting a frame (`mem::forget`) are all safe:
/// bytes are then given back later (at the close of the frame below, or at the end of
/// the cycle), never while anything may still use them. In a plan group
/// ([`planned`](crate::planned)) each frame is an owner of its own, so the plan lets
/// later arrays share its bytes.
///
/// `!Send` and `!Sync`, like its scope.
pub struct Frame<'s> {
    /// The scope the frame is in (which keeps its workspace alive and open).
    scope: &'s Scope<'s>,
    mark: FrameMark,
}

impl<'ws> Scope<'ws> {
    /// Opens a [`Frame`] in this scope: a release point for what it allocates.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] when 65,535 frames of this workspace are open already.
    #[inline]
    pub fn frame(&self) -> Result<Frame<'_>> {
        let mark = self.workspace_ref().engine().open_frame()?;
        Ok(Frame { scope: self, mark })
    }
}

impl<'s> Frame<'s> {
    /// Opens a frame while this one is open, as the scope's `frame` does: its level is one
    /// more than the top frame's (the newest open one, which may be another).
    ///
    /// # Errors
    ///
    /// As [`Scope::frame`].
    #[inline]
    pub fn frame(&self) -> Result<Frame<'_>> {
        let mark = self.workspace_ref().engine().open_frame()?;
        Ok(Frame { scope: self.scope, mark })
    }

    /// The frame's level in its cycle: 1 for a frame opened while no other frame of
    /// the workspace was open, one more for each frame open when it opened.
    pub fn level(&self) -> u32 {
        self.mark.level()
    }

    /// The scope this frame is in.
    pub fn scope(&self) -> &'s Scope<'s> {
        self.scope
    }

    #[inline(always)]
    fn workspace_ref(&self) -> &Workspace {
        self.scope.workspace_ref()
    }

    /// Reserves `size` (> 0) bytes aligned to `align`, at the frame's level.
    #[inline(always)]
    pub(crate) fn alloc_bytes(&self, size: usize, align: usize, zeroed: bool) -> Result<NonNull<u8>> {
        let engine = self.workspace_ref().engine();
        let level = self.mark.level();
        let placed = match engine.try_alloc_frame(level, size, align) {
            Some(placed) => placed,
            None => engine.alloc_slow_at(size, align, level)?,
        };
        Ok(place(placed, size, zeroed))
    }

    allocation_methods!();
}

impl Drop for Frame<'_> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: the mark is this frame's, closed once (here); every view and slice
        // allocated from the frame borrows it, so none is alive, and a frame makes no
        // handles.
        unsafe { self.workspace_ref().engine().close_frame(self.mark) };
    }
}

impl std::fmt::Debug for Frame<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frame")
            .field("workspace", self.target_name())
            .field("level", &self.mark.level())
            .finish_non_exhaustive()
    }
}

/// The pointer to a reservation, zeroed when asked.
#[inline(always)]
fn place((base, offset): (NonNull<u8>, usize), size: usize, zeroed: bool) -> NonNull<u8> {
    // SAFETY: the engine reserved `offset..offset+size` inside the block at `base`, so
    // the result stays inside one allocation.
    let ptr = unsafe { base.add(offset) };
    if zeroed {
        // SAFETY: `ptr` is valid for `size` writable bytes, handed out to nobody else
        // until the reservation's scope or frame closes.
        unsafe { ptr.as_ptr().write_bytes(0, size) };
    }
    ptr
}

/// The first byte and the byte length of the memory an array spans (its elements
/// from the lowest to the highest address; zero for an empty array).
pub(crate) fn extent<T, S: ndarray::RawData<Elem = T>, Dim: Dimension>(
    array: &ArrayBase<S, Dim>,
) -> (*const u8, usize) {
    if array.is_empty() || size_of::<T>() == 0 {
        return (array.as_ptr().cast(), 0);
    }
    let (mut low, mut high) = (0isize, 0isize);
    for (&len, &stride) in array.shape().iter().zip(array.strides()) {
        let reach = (len as isize - 1) * stride;
        if reach < 0 {
            low += reach;
        } else {
            high += reach;
        }
    }
    let elem = size_of::<T>() as isize;
    let first = (array.as_ptr() as isize + low * elem) as *const u8;
    (first, ((high - low + 1) * elem) as usize)
}

/// Turns a mutable view into a shared view of the same lifetime (ndarray offers only
/// the shorter reborrow): what a layer returns after filling its output.
///
/// ```
/// let scope = workspace_core::Scope::heap();
/// let mut y = scope.zeros::<f32, _>((2, 3))?;
/// y.fill(1.0);
/// let y: ndarray::ArrayView2<f32> = workspace_core::freeze(y);
/// assert_eq!(y.sum(), 6.0);
/// # Ok::<(), workspace_core::Error>(())
/// ```
pub fn freeze<'a, T, Dim: Dimension>(view: ArrayViewMut<'a, T, Dim>) -> ndarray::ArrayView<'a, T, Dim> {
    // SAFETY: `view` is consumed, so its exclusive borrow of the elements for 'a
    // becomes this shared borrow for the same 'a. The raw view keeps the pointer,
    // shape and strides (negative ones included) exactly, and every element it covers
    // is initialised and aligned, as the mutable view guaranteed.
    unsafe { view.raw_view().deref_into_view() }
}
/// Opening scopes: a workspace's cycles are entered here, where scopes are made.
impl Workspace {
    /// Opens a cycle (new generation) or, when already open, nests without resetting.
    ///
    /// # Errors
    ///
    /// A backend error recorded when the previous cycle could not grow the arena, or
    /// from re-reserving the arena after [`Shell::trim`](crate::backend::Shell::trim). Each refusal of the backend is
    /// reported once: the workspace stays usable with its previous arena (later cycles
    /// run from spill blocks) and the next `enter` succeeds; later refusals are counted
    /// in [`WorkspaceStats::failed_growths`](crate::WorkspaceStats::failed_growths).
    #[inline]
    pub fn enter(&self) -> Result<Scope<'_>> {
        let kind = self.shell.open_raw()?;
        // SAFETY: the shell counted this scope; the scope gives it back on drop.
        Ok(unsafe { Scope::over(self, kind) })
    }

    /// Makes this already open workspace an allocation target for a while, without
    /// nesting a cycle; it still resets only when its last scope closes.
    ///
    /// # Errors
    ///
    /// [`Error::NotOpen`] when the workspace is closed.
    pub fn borrow_open(&self) -> Result<Scope<'_>> {
        let kind = self.shell.open_borrowed_raw()?;
        // SAFETY: the shell counted this scope; the scope gives it back on drop.
        Ok(unsafe { Scope::over(self, kind) })
    }

    /// As [`Workspace::enter`], the scope keeping the workspace alive through an `Rc`.
    ///
    /// # Errors
    ///
    /// As [`Workspace::enter`].
    pub fn enter_shared(self: &Rc<Self>) -> Result<Scope<'static>> {
        let kind = self.shell.open_raw()?;
        // SAFETY: counted by the shell; the `Rc` keeps the workspace alive for as long
        // as the scope lives, whatever `'static` says.
        Ok(unsafe { Scope::over_shared(self.clone(), kind) })
    }

    /// As [`Workspace::borrow_open`], the scope keeping the workspace alive through an `Rc`.
    ///
    /// # Errors
    ///
    /// [`Error::NotOpen`] when the workspace is closed.
    pub fn borrow_open_shared(self: &Rc<Self>) -> Result<Scope<'static>> {
        let kind = self.shell.open_borrowed_raw()?;
        // SAFETY: as in `enter_shared`.
        Ok(unsafe { Scope::over_shared(self.clone(), kind) })
    }
}

/// Reading a handle needs a scope of its workspace, at its generation.
impl<T: Pod, Dim: Dimension> Handle<T, Dim> {
    /// Checks that `scope` belongs to this handle's workspace, at its generation.
    ///
    /// # Errors
    ///
    /// [`Error::WrongWorkspace`] or [`Error::StaleHandle`].
    pub fn check(&self, scope: &Scope<'_>) -> Result<()> {
        crate::shell::check_identity(
            (self.owner, self.generation),
            &self.workspace,
            scope.identity(),
            scope.target_name(),
        )
    }

    /// A read-only view, borrowed from `scope`.
    ///
    /// # Errors
    ///
    /// As [`Handle::check`].
    pub fn view<'a>(&'a self, scope: &'a Scope<'_>) -> Result<ArrayView<'a, T, Dim>> {
        self.check(scope)?;
        // SAFETY: the check proves the memory is live and unchanged since allocation;
        // the view borrows `scope` (so the cycle cannot end) and `self` (so no mutable
        // view of this handle exists).
        Ok(unsafe { ArrayView::from_shape_ptr(self.dim.clone(), self.ptr.as_ptr()) })
    }

    /// A mutable view, borrowed from `scope`.
    ///
    /// # Errors
    ///
    /// As [`Handle::check`].
    pub fn view_mut<'a>(&'a mut self, scope: &'a Scope<'_>) -> Result<ArrayViewMut<'a, T, Dim>> {
        self.check(scope)?;
        // SAFETY: as in `view`; `&mut self` makes this the only view of the handle.
        Ok(unsafe { ArrayViewMut::from_shape_ptr(self.dim.clone(), self.ptr.as_ptr()) })
    }

    /// Copies the data out into an owned array that outlives every reset.
    ///
    /// # Errors
    ///
    /// As [`Handle::check`].
    pub fn detach(&self, scope: &Scope<'_>) -> Result<Array<T, Dim>> {
        Ok(self.view(scope)?.to_owned())
    }

    /// Copies the data into `target` (another open workspace, typically an outer one),
    /// returning a handle there.
    ///
    /// # Errors
    ///
    /// As [`Handle::check`] for `scope`, and `target`'s allocation errors.
    pub fn leverage_to(&self, scope: &Scope<'_>, target: &Scope<'_>) -> Result<Handle<T, Dim>> {
        target.copy_handle(&self.view(scope)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WorkspaceConfig;
    use ndarray::s;

    #[test]
    fn freeze_keeps_negative_and_transposed_strides() {
        let scope = Scope::heap();
        let mut a = scope.from_shape_fn::<f32, _, _>((3, 4), |(i, j)| (10 * i + j) as f32).unwrap();
        let expected = a.slice(s![..;-1, ..]).t().to_owned();
        let frozen = freeze(a.view_mut().slice_move(s![..;-1, ..]).reversed_axes());
        assert_eq!(frozen.strides(), &[1, -4]);
        assert_eq!(frozen, expected);
        assert_eq!(frozen[[0, 0]], 20.0);
        assert_eq!(frozen[[3, 2]], 3.0);
    }

    #[test]
    fn handle_with_keeps_what_init_wrote_and_refuses_another_array() {
        let ws = Workspace::new("handle_with", WorkspaceConfig::default()).unwrap();
        let scope = ws.enter().unwrap();
        let h = scope
            .handle_with::<f32, _>((2, 3), |mut v| {
                v.indexed_iter_mut().for_each(|((i, j), slot)| {
                    slot.write((10 * i + j) as f32);
                });
                // SAFETY: every element was just written.
                unsafe { v.assume_init() }
            })
            .unwrap();
        assert_eq!(h.view(&scope).unwrap(), ndarray::array![[0.0f32, 1.0, 2.0], [10.0, 11.0, 12.0]]);
        // A column-major shape gets a standard array all the same.
        let f = scope
            .handle_with::<f32, _>(ndarray::ShapeBuilder::f((2, 3)), |mut v| {
                assert!(v.is_standard_layout());
                v.iter_mut().for_each(|slot| {
                    slot.write(7.0);
                });
                // SAFETY: every element was just written.
                unsafe { v.assume_init() }
            })
            .unwrap();
        assert_eq!(f.view(&scope).unwrap(), ndarray::Array2::from_elem((2, 3), 7.0f32));
        let other = scope.zeros::<f32, _>((2, 3)).unwrap();
        let elsewhere = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `other`'s six zeros, initialised and alive for the call; nothing
            // reads or writes them through this view (`handle_with` refuses it).
            let _ = scope.handle_with::<f32, _>((2, 3), |_| unsafe {
                ArrayViewMut::from_shape_ptr((2, 3), other.as_ptr().cast_mut())
            });
        }));
        assert!(elsewhere.is_err(), "a view of other elements is refused");
        let reshaped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = scope.handle_with::<f32, _>((3, 3), |mut v| {
                v.iter_mut().for_each(|slot| {
                    slot.write(1.0);
                });
                // SAFETY: every element was just written.
                unsafe { v.assume_init() }.reversed_axes()
            });
        }));
        assert!(reshaped.is_err(), "the same elements in another layout are refused");
    }

    #[test]
    fn try_handle_with_returns_init_s_error_and_makes_no_handle() {
        let ws = Workspace::new("try_handle_with", WorkspaceConfig::default()).unwrap();
        let scope = ws.enter().unwrap();
        let refused = scope
            .try_handle_with::<f32, _, Error>((2, 3), |_| Err(Error::InvalidConfig { reason: "init refused".into() }));
        assert!(matches!(refused, Err(Error::InvalidConfig { ref reason }) if reason == "init refused"));
        let h = scope
            .try_handle_with::<f32, _, Error>((2, 2), |mut v| {
                v.iter_mut().for_each(|slot| {
                    slot.write(3.0);
                });
                // SAFETY: every element was just written.
                Ok(unsafe { v.assume_init() })
            })
            .unwrap();
        assert_eq!(h.view(&scope).unwrap(), ndarray::Array2::from_elem((2, 2), 3.0f32));
    }
}
