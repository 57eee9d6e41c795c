//! Async prefetch for carve (not built yet).
//!
//! This crate will hold the prefetch iterator whose batches live in a ring workspace
//! (`ResetPolicy::EndOfBuffer` in `workspace-core`), with leases that borrow the
//! iterator and a loom-checked hand-off. Until then it exports nothing.

#![forbid(unsafe_code)]
