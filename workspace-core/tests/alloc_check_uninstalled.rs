//! `alloc_check` in a binary that does not install the counting allocator: checks
//! refuse with a message that shows the line to add, instead of reporting zero.

use workspace_core::alloc_check::{assert_no_alloc, AllocationError, AllocationGuard};
use workspace_core::alloc_check::{is_installed, thread_counts};
use workspace_core::Error;

#[test]
fn nothing_is_counted_and_the_allocator_knows_it() {
    let before = thread_counts();
    let v = std::hint::black_box(vec![0_u64; 100]);
    assert_eq!(thread_counts(), before);
    assert!(!is_installed());
    drop(v);
}

#[test]
fn a_guard_refuses_to_begin() {
    let line = line!() + 1;
    let error = AllocationGuard::begin().unwrap_err();
    match &error {
        Error::AllocationCheck(AllocationError::NotInstalled { location }) => {
            assert_eq!(location, &format!("{}:{line}:17", file!()));
        }
        other => panic!("wrong error: {other}"),
    }
    let message = error.to_string();
    assert!(message.contains("not this program's global allocator"), "{message}");
    assert!(message.contains("#[global_allocator]"), "{message}");
    assert!(AllocationGuard::begin_traced().is_err());
}

#[test]
fn assert_no_alloc_panics_instead_of_passing() {
    let caught = std::panic::catch_unwind(|| assert_no_alloc(|| 1 + 1));
    let payload = caught.expect_err("an unchecked region must not pass");
    let message = payload.downcast_ref::<String>().expect("a formatted message");
    assert!(message.contains("cannot check for heap allocations"), "{message}");
}
