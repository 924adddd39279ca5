//! Large host buffers on transparent huge pages.
//!
//! A training pass allocates gigabytes of fresh activations per step. On 4 KiB pages the
//! kernel takes one fault (and one page clear) per page, and freeing them shoots down TLBs
//! on every core: measured on SmolLM2 (24 × 140 tokens, 2 cores) that was ~45% of a
//! training step. Asking for huge pages (`MADV_HUGEPAGE`, honoured where
//! `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`) before the
//! buffer is first touched makes those faults 512× fewer. Elsewhere it is a no-op.
#![allow(unsafe_code)]

/// Buffers at least this large are advised; smaller ones come from malloc's reused heap.
const HUGE_MIN_BYTES: usize = 4 << 20;
const HUGE_PAGE: usize = 2 << 20;

/// A zero-filled buffer of `len` floats, on huge pages where the kernel offers them.
pub fn zeroed(len: usize) -> Vec<f32> {
    let buf = vec![0f32; len];
    advise_huge_pages(&buf);
    buf
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(buf: &[f32]) {
    let bytes = std::mem::size_of_val(buf);
    if bytes < HUGE_MIN_BYTES {
        return;
    }
    // The whole huge pages inside the buffer.
    let start = (buf.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
    let end = (buf.as_ptr() as usize + bytes) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: [start, end) lies inside `buf`'s allocation, which outlives the call;
        // MADV_HUGEPAGE changes only how the kernel backs those pages, never their
        // contents, and its failure (an old kernel, THP disabled) is harmless.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_buf: &[f32]) {}

/// Keeps freed memory in the process for the next allocation instead of handing it back
/// to the kernel: a training step frees gigabytes of activations that the next step
/// allocates again, and fresh pages cost a fault and a clear each (page faults were a third
/// of a CPU training step on 2 cores). glibc's defaults return any free block over 128 KiB
/// (then up to 32 MiB, adaptively) with `munmap`, and trim the heap top beyond twice that.
/// Call once at start, in processes that train or serve a model on the CPU. Elsewhere (not
/// glibc) a no-op.
///
/// Arenas are capped at `MALLOC_ARENAS`: an arena never trimmed keeps whatever its threads
/// once freed, and glibc's default of 8 arenas per core lets each of the many runtime and
/// kernel threads settle in its own, so the retained memory kept growing as work moved
/// between threads (the trainer's RSS climbed ~3 MiB/min through a 15-minute soak of
/// 220,000 trajectories; with 2 arenas, ~0.7 MiB/min over the same soak, flat by its end).
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // Blocks below 32 MiB (glibc's largest threshold) come from the heap and go back to
        // it; the heap is never trimmed. Larger ones (whole weight tensors) stay mmapped.
        // SAFETY: mallopt only changes allocator parameters; it is called with valid
        // options and values, and a rejected value leaves the defaults.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
            libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS);
        }
    }
}

/// Bytes malloc hands out now (in use in its arenas plus its own mmapped blocks): what a
/// process that retains freed memory (`retain_freed_memory`) really holds, where its RSS
/// is the high-water mark of its heap. None where the allocator cannot say (not glibc).
pub fn heap_in_use_bytes() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads the allocator's statistics (glibc ≥ 2.33).
        let info = unsafe { libc::mallinfo2() };
        Some((info.uordblks + info.hblkhd) as u64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// malloc arenas a process that retains freed memory may use (see `retain_freed_memory`).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MALLOC_ARENAS: i32 = 2;

/// Sizes the thread pool the CPU kernels run on: `threads`, or else the cores this process
/// may use (its CPU affinity and cgroup quota, as `available_parallelism` reads them — on
/// one machine shared with the other services, pin or limit the engine and the trainer and
/// their pools follow). Call at start, before any model work; returns the count. The pool
/// is the process's: where two services share a process (`arl serve trainer + inference`)
/// the first one sizes it and the second gets the count it has.
pub fn size_thread_pool(threads: Option<usize>) -> Result<usize, rayon::ThreadPoolBuildError> {
    static SIZED: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if let Some(sized) = SIZED.get() {
        return Ok(*sized);
    }
    let threads = threads
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("arl-cpu-{i}"))
        .build_global()?;
    Ok(*SIZED.get_or_init(|| threads))
}

/// What a process that trains or serves a model on the CPU sets up first: freed memory
/// kept ([`retain_freed_memory`]) and the kernels' pool sized ([`size_thread_pool`]).
pub fn prepare_process(threads: Option<usize>) -> Result<usize, rayon::ThreadPoolBuildError> {
    retain_freed_memory();
    size_thread_pool(threads)
}
