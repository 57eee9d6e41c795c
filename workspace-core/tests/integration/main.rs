//! workspace-core's integration tests that need no counting allocator, in one binary
//! (one link, one start under valgrind): each file a module. The tests that count heap
//! allocations install the counting allocator as the global one and stay binaries of
//! their own (`alloc_check`, `alloc_check_uninstalled`, `frames`, `soak`, `threads`).

#[path = "../common/program.rs"]
mod program;
#[path = "../common/random.rs"]
mod random;

/// What the modules share, under the name the other test binaries give it.
mod common {
    pub(crate) use super::{program, random};
}

#[path = "../common/policy_suite.rs"]
mod policy_suite;

mod circular;
mod hostile;
mod layer_mgr;
mod model;
mod plan;
mod planned;
mod policies;
mod portable;
mod timeline;
