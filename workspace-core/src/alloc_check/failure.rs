//! What a failed allocation check reports: the allocations it saw and the error, in a
//! module of their own that the crate's error type can name without the checker.

use std::fmt;

/// What kind of call an allocation was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllocationKind {
    /// `alloc`.
    Alloc,
    /// `alloc_zeroed`.
    AllocZeroed,
    /// `realloc` (a container growing, typically).
    Realloc,
}

/// One heap allocation a guard saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllocationSample {
    /// The bytes asked for (a `realloc`'s new size).
    pub size: usize,
    /// Their alignment.
    pub align: usize,
    /// The call.
    pub kind: AllocationKind,
}

impl AllocationSample {
    /// An empty slot.
    pub(crate) const NONE: AllocationSample = AllocationSample { size: 0, align: 1, kind: AllocationKind::Alloc };
}

impl fmt::Display for AllocationSample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            AllocationKind::Alloc => "alloc",
            AllocationKind::AllocZeroed => "alloc_zeroed",
            AllocationKind::Realloc => "realloc",
        };
        write!(f, "{} bytes ({kind}, align {})", self.size, self.align)
    }
}

/// An allocation check that failed, inside [`Error::AllocationCheck`](crate::Error).
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AllocationError {
    /// Code checked for heap allocations made some.
    HeapAllocation {
        /// The heap allocations (`alloc`, `alloc_zeroed` and `realloc` calls) made.
        allocations: u64,
        /// The bytes they asked for.
        bytes: u64,
        /// Where the check was begun (`file:line:column`).
        location: String,
        /// The first allocations (at most [`SAMPLES`](super::SAMPLES)).
        first: Vec<AllocationSample>,
        /// For a traced check: the stack of the first allocation, one frame a line
        /// (empty where it could not be walked).
        trace: Option<Vec<String>>,
    },

    /// [`CountingAllocator`](super::CountingAllocator) is not the global allocator, so no allocation could be
    /// counted.
    NotInstalled {
        /// Where the check was begun (`file:line:column`).
        location: String,
    },
}

impl fmt::Display for AllocationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocationError::HeapAllocation { allocations, bytes, location, first, trace } => {
                let plural = if *allocations == 1 { "" } else { "s" };
                write!(
                    f,
                    "{allocations} heap allocation{plural} ({bytes} bytes) on this thread in the check begun at \
                     {location}, which expects none"
                )?;
                write_samples(f, first, *allocations)?;
                write!(
                    f,
                    ". Take every array of the step from its workspace scope (`scope.zeros`, \
                     `ctx.working.zeros`, `TypedScope::copy_of`) and write results into it (`assign`, \
                     `zip_mut_with`, `general_mat_mul`, the `*_inplace` methods) instead of calling ndarray \
                     methods that return owned arrays (`&a + &b`, `dot`, `sum_axis`, `mapv`, `to_owned`) or \
                     growing heap containers"
                )?;
                write_trace(f, trace.as_deref())
            }
            AllocationError::NotInstalled { location } => write!(
                f,
                "cannot check for heap allocations at {location}: carve's counting allocator is not this \
                 program's global allocator, so no allocation would be seen. Install it in the binary that runs \
                 the check (the test file, example or main.rs): `#[global_allocator] static ALLOC: \
                 carve::alloc_check::CountingAllocator = carve::alloc_check::CountingAllocator::system();`"
            ),
        }
    }
}

/// The message, as for `Display`.
impl fmt::Debug for AllocationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for AllocationError {}

fn write_samples(f: &mut fmt::Formatter<'_>, first: &[AllocationSample], allocations: u64) -> fmt::Result {
    for (i, sample) in first.iter().enumerate() {
        write!(f, "{}{sample}", if i == 0 { "; the first: " } else { ", " })?;
    }
    if !first.is_empty() && allocations > first.len() as u64 {
        write!(f, ", ...")?;
    }
    Ok(())
}

fn write_trace(f: &mut fmt::Formatter<'_>, trace: Option<&[String]>) -> fmt::Result {
    match trace {
        None => Ok(()),
        Some([]) => write!(
            f,
            ". No stack of the first allocation: this platform cannot walk it without allocating, or a nested \
             check kept its own"
        ),
        Some(lines) => {
            write!(f, ". The first allocation was made at (innermost first, the allocator's own frames on top):")?;
            for line in lines {
                write!(f, "\n    {line}")?;
            }
            // One command per object file, which names the frames' functions and lines.
            let mut objects: Vec<&str> = Vec::new();
            for (object, _) in lines.iter().filter_map(|line| line.rsplit_once(" +")) {
                if !objects.contains(&object) {
                    objects.push(object);
                }
            }
            for object in objects {
                write!(f, "\n  `addr2line -Cfipe {object}")?;
                for (_, offset) in lines.iter().filter_map(|line| line.rsplit_once(" +")).filter(|(o, _)| *o == object)
                {
                    write!(f, " {offset}")?;
                }
                write!(f, "` names them")?;
            }
            Ok(())
        }
    }
}
