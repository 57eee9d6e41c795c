//! carve's integration tests that need no counting allocator, in one binary (one
//! link, one start under valgrind): each file a module. The tests that count heap
//! allocations install the counting allocator as the global one and stay binaries of
//! their own (`nn_prefetch_allocs`, `nn_soak`, `planned`, `sequences_allocs`).

mod examples_cli;
mod nn;
mod nn_prefetch;
mod sequences;
mod sequences_prefetch;
mod train_digits_cli;
