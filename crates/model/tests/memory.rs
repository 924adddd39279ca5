//! The allocator's in-use figure (its own process: no other test allocates meanwhile).

use arl_model::ops::{heap_in_use_bytes, retain_freed_memory};

#[test]
fn the_heap_in_use_follows_what_is_held_not_what_was_once_held() {
    let Some(before) = heap_in_use_bytes() else {
        eprintln!("this allocator reports no in-use figure (not glibc); nothing to check");
        return;
    };
    // As the trainer runs: freed memory stays in the process, so RSS would not fall.
    retain_freed_memory();
    const MIB: u64 = 1 << 20;
    // Small blocks (from the arenas) and one large one.
    let small: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 1 << 20]).collect();
    let large = vec![1u8; 64 << 20];
    let held = heap_in_use_bytes().unwrap();
    assert!(
        held >= before + 120 * MIB,
        "holding 128 MiB: {} MiB in use, {} before",
        held / MIB,
        before / MIB
    );
    drop(small);
    drop(large);
    let after = heap_in_use_bytes().unwrap();
    assert!(
        after < before + 8 * MIB,
        "after freeing: {} MiB in use, {} before",
        after / MIB,
        before / MIB
    );
}
