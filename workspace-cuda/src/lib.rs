//! Device workspaces for carve (not built yet).
//!
//! This crate will bring the workspace semantics of `workspace-core` to CUDA device
//! memory through the core's [`ArenaBackend`](workspace_core::ArenaBackend) trait:
//! a device arena on cudarc, stream-ordered resets, pinned host staging, and a
//! simulated device so that every semantic test runs without a GPU. Until then it
//! exports nothing.

#![forbid(unsafe_code)]
