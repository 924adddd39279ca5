//! CUDA graphs for decode steps: a step's hundreds of small launches replayed as one.
//!
//! At batch 1 a decode step of a 0.5B model is a few hundred kernels of a few microseconds
//! each; launched one by one, the GPU waits on the host between them. A step of the same
//! batch launches the same kernels with the same arguments every time once three things
//! hold still, and this module makes them:
//!
//! - temporaries come from a bump **arena**: the same offsets in the same order each step;
//! - small tables (token ids, positions, the KV block lists) go to a **staging** area, host
//!   bytes uploaded in one copy before the launch, each table in a slot of the next power of
//!   two bytes, so that a block list growing by a block rarely moves the slots after it;
//! - every operation's **signature** is recorded: kernel, launch shape and every argument;
//!   memsets; products.
//!
//! [`Cuda::graphed`] first runs the step as a *plan*: the model's forward runs on the host
//! and nothing is launched; the plan fills the staging bytes and the signature. If a graph
//! captured for the same key has the same signature, every address and scalar it baked in
//! is this step's own, so it is valid: the staging bytes go up and the graph is launched.
//! Otherwise the step runs again under stream capture (the step closure starts each run
//! from the same state), the graph is kept, and launched. A step that cannot be captured
//! (anything failing while planning or capturing) runs once more, eagerly, where a real
//! failure is recorded as usual.
//!
//! A plan does the step's host-side effects for real (KV blocks taken, a shared block
//! copied before it is written): those are the step's own and come before its launch on
//! the stream. A run after the plan finds them done.

use std::sync::atomic::Ordering;
use std::thread::ThreadId;

use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, LaunchConfig, sys};

use super::{Arg, Cuda, CudaError, GpuBuf, device};

/// Alignment of arena allocations and staging slots (bytes).
const ALIGN: usize = 256;
/// The smallest staging slot (bytes).
const MIN_SLOT: usize = 64;
/// Graphs kept (one per key: a model and a batch size).
const KEPT: usize = 64;

/// What one run of a step through [`Cuda::graphed`] has recorded.
pub(super) struct Recording {
    owner: ThreadId,
    /// Capturing (launches go into a graph) rather than planning (nothing launched).
    capture: bool,
    arena_base: u64,
    arena_capacity: usize,
    arena_used: usize,
    staging_base: u64,
    staging_capacity: usize,
    staging: Vec<u8>,
    /// Tables already staged this step (`upload_table`), shared by later identical ones.
    tables: Vec<(Vec<u32>, u64)>,
    signature: Vec<u64>,
    /// Why this run cannot be replayed or captured (the step then runs eagerly).
    spoiled: Option<String>,
    /// The spoiling was a failure (out of KV blocks, say), not something a graph cannot
    /// hold: the eager run meets it again, and it does not count against graphs.
    faulted: bool,
}

/// What a recording thread's operation does.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// Not recording: do it now.
    Eager,
    /// Planning, or capture already spoiled: record it, do nothing.
    Skip,
    /// Capturing: record it and issue it (into the graph).
    Capture,
}

/// A captured step.
struct Captured {
    key: u64,
    signature: Vec<u64>,
    graph: KeptGraph,
    /// Captured at this key's last step and not replayed since: a mismatch now runs
    /// eagerly instead of capturing again, so a step whose signature never repeats does not
    /// pay for a capture every time.
    fresh: bool,
}

/// A graph kept in [`Graphs`].
struct KeptGraph(cudarc::driver::CudaGraph);

// SAFETY: CUDA graph objects may be used from any thread as long as no two use one at the
// same time; a kept graph is reached only through the `Graphs` mutex, and launched while
// the step lock is held.
#[allow(unsafe_code)]
unsafe impl Send for KeptGraph {}

/// The device's graphs and the memory they bake in.
#[derive(Default)]
pub(super) struct Graphs {
    arena: Option<CudaSlice<u8>>,
    staging: Option<CudaSlice<u8>>,
    /// Most recently used first.
    captured: Vec<Captured>,
    stats: GraphStats,
    failures_in_a_row: u32,
    last_failure: Option<String>,
    /// Keys that have run a step eagerly (most recent first).
    warmed: Vec<u64>,
    /// Timing events around the last replay (start, end), read when the next one starts.
    replay_events: Option<(CudaEvent, CudaEvent)>,
    replay_timed_pending: bool,
}

/// How decode steps ran: replayed from a graph, captured into one, or eagerly. After four
/// failed captures in a row a device stops trying (graphs off, as `ARL_CUDA_GRAPHS=0`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub replayed: u64,
    pub captured: u64,
    /// Steps that ran eagerly: a plan that could not be replayed and was not captured, or
    /// a failed capture.
    pub eager: u64,
    /// Captures that failed (see [`Cuda::graph_failure`]).
    pub failed: u64,
    /// Host time spent planning steps, and capturing and instantiating graphs (µs).
    pub plan_us: u64,
    pub capture_us: u64,
    /// GPU time of the replayed graphs whose end has been seen (µs; events around each
    /// launch, read at the next one: a replay still running then goes untimed), and how
    /// many that was.
    pub replay_gpu_us: u64,
    pub replays_timed: u64,
}

impl Graphs {
    /// Adds the last timed replay's GPU time. With `wait`, waits for its end if it has not
    /// come; without (before the next replay, on the step's hot path), a replay still
    /// running goes untimed rather than stall the host.
    fn settle_replay_time(&mut self, wait: bool) {
        if !std::mem::take(&mut self.replay_timed_pending) {
            return;
        }
        if let Some((start, end)) = &self.replay_events
            && (wait || end.try_is_complete().unwrap_or(false))
            && let Ok(ms) = start.elapsed_ms(end)
        {
            self.stats.replay_gpu_us += (f64::from(ms) * 1e3) as u64;
            self.stats.replays_timed += 1;
        }
    }
}

impl Recording {
    /// A run's empty recording; arena and staging as (address, bytes).
    fn new(capture: bool, arena: (u64, usize), staging: (u64, usize)) -> Self {
        Self {
            owner: std::thread::current().id(),
            capture,
            arena_base: arena.0,
            arena_capacity: arena.1,
            arena_used: 0,
            staging_base: staging.0,
            staging_capacity: staging.1,
            staging: Vec::new(),
            tables: Vec::new(),
            signature: Vec::new(),
            spoiled: None,
            faulted: false,
        }
    }

    /// `bytes` of the arena: the address (0 once it is past the arena: a plan then only
    /// learns the size it needs; a capture is spoiled).
    fn alloc(&mut self, bytes: usize) -> u64 {
        let at = self.arena_used.next_multiple_of(ALIGN);
        self.arena_used = at + bytes;
        if self.arena_used > self.arena_capacity {
            if self.capture {
                self.spoil("the arena is smaller than the plan said");
            }
            return 0;
        }
        self.arena_base + at as u64
    }

    /// Stages `bytes`; the device address they will have when the step is launched.
    fn stage(&mut self, bytes: &[u8]) -> u64 {
        let at = self.staging.len().next_multiple_of(ALIGN);
        let slot = bytes.len().max(MIN_SLOT).next_power_of_two();
        self.staging.resize(at, 0);
        self.staging.extend_from_slice(bytes);
        self.staging.resize(at + slot, 0);
        if self.staging.len() > self.staging_capacity {
            if self.capture {
                self.spoil("the staging area is smaller than the plan said");
            }
            return 0;
        }
        self.staging_base + at as u64
    }

    fn spoil(&mut self, why: impl Into<String>) {
        if self.spoiled.is_none() {
            self.spoiled = Some(why.into());
        }
    }

    fn capturing(&self) -> bool {
        self.capture
    }

    fn pass(&self) -> Pass {
        if self.capture && self.spoiled.is_none() {
            Pass::Capture
        } else {
            Pass::Skip
        }
    }
}

impl Cuda {
    /// Runs `step` (one decode step's work on this device, returning its output buffer) as
    /// a graph kept under `key` (see the module's comment). `step` must start each call
    /// from the same state: it may run up to three times. The output is the caller's own
    /// (a graph's is copied out of the arena).
    pub fn graphed(&self, key: u64, step: &mut dyn FnMut() -> GpuBuf) -> GpuBuf {
        if !self.device.graphs_enabled() || !self.ok() {
            return step();
        }
        let _step = self
            .device
            .step_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let planning = std::time::Instant::now();
        let (out, plan) = self.record(false, step);
        self.graphs().stats.plan_us += planning.elapsed().as_micros() as u64;
        if plan.spoiled.is_none() && self.replay(key, &plan) {
            return self.detach(&out);
        }
        drop(out);
        if let Some(why) = plan.spoiled {
            if plan.faulted {
                self.ran_eagerly();
            } else {
                self.capture_failed(why);
            }
            return step();
        }
        if !self.should_capture(key) {
            self.ran_eagerly();
            return step();
        }
        if self.make_room(plan.arena_used, plan.staging.len()).is_err() {
            // Too little memory for the arena: the step runs eagerly, its temporaries
            // freed as it goes.
            self.ran_eagerly();
            return step();
        }
        let capturing = std::time::Instant::now();
        if let Err(e) = self
            .device
            .capture_stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        {
            self.fail(device::driver("starting a graph capture")(e));
            return step();
        }
        let (out, capture) = self.record(true, step);
        let graph = self
            .device
            .capture_stream
            .end_capture(sys::CUgraphInstantiate_flags(0));
        self.graphs().stats.capture_us += capturing.elapsed().as_micros() as u64;
        let why = match (graph, capture.spoiled) {
            (Ok(Some(graph)), None) => {
                let graph = KeptGraph(graph);
                if self.stage(&capture.staging) {
                    self.launch_graph(&graph);
                }
                let mut graphs = self.graphs();
                graphs.stats.captured += 1;
                graphs.failures_in_a_row = 0;
                graphs.captured.retain(|g| g.key != key);
                graphs.captured.insert(
                    0,
                    Captured {
                        key,
                        signature: capture.signature,
                        graph,
                        fresh: true,
                    },
                );
                graphs.captured.truncate(KEPT);
                drop(graphs);
                return self.detach(&out);
            }
            (_, Some(why)) => why,
            (Err(e), None) => format!("ending the capture: {e}"),
            (Ok(None), None) => "the capture held nothing".into(),
        };
        // Nothing of the capture ran; the step runs as it always did.
        drop(out);
        if capture.faulted {
            self.ran_eagerly();
        } else {
            self.capture_failed(why);
        }
        step()
    }

    /// A copy of a graphed step's output (a view of the arena) in memory of its own, so
    /// that the next graphed step — another model's in the same engine step, say — cannot
    /// overwrite it while it is still read (a step's logits: a few MB, a copy of
    /// microseconds).
    fn detach(&self, out: &GpuBuf) -> GpuBuf {
        let mut owned = self.alloc_kept(out.len, "keeping a step's output");
        self.copy_within(&mut owned, 0, out, 0, out.len);
        owned
    }

    fn ran_eagerly(&self) {
        self.graphs().stats.eager += 1;
    }

    /// Whether this thread is capturing a step now.
    pub(super) fn capturing(&self) -> bool {
        self.with_recording(|r| r.capturing()).unwrap_or(false)
    }

    /// Counts a failed capture (or a plan that could not be replayed); after several in a
    /// row, graphs are turned off for this device (each failure costs a step an extra pass
    /// or two) and the reason kept.
    fn capture_failed(&self, why: String) {
        const GIVE_UP_AFTER: u32 = 4;
        let mut graphs = self.graphs();
        graphs.stats.eager += 1;
        graphs.stats.failed += 1;
        graphs.failures_in_a_row += 1;
        if graphs.failures_in_a_row >= GIVE_UP_AFTER {
            self.device.graphs_on.store(false, Ordering::Relaxed);
            graphs.captured.clear();
        }
        graphs.last_failure = Some(why);
    }

    /// Why the last capture failed, if one did.
    pub fn graph_failure(&self) -> Option<String> {
        self.graphs().last_failure.clone()
    }

    /// How this device's decode steps ran so far (waits for the last replay to end, to
    /// count its GPU time).
    pub fn graph_stats(&self) -> GraphStats {
        let mut graphs = self.graphs();
        graphs.settle_replay_time(true);
        graphs.stats
    }

    /// Turns graphs on or off for this device (on unless `ARL_CUDA_GRAPHS=0` or profiling).
    pub fn set_graphs(&self, on: bool) {
        self.device.graphs_on.store(on, Ordering::Relaxed);
        let mut graphs = self.graphs();
        graphs.failures_in_a_row = 0;
        if !on {
            graphs.captured.clear();
        }
    }

    fn graphs(&self) -> std::sync::MutexGuard<'_, Graphs> {
        self.device
            .graphs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One run of `step` recorded (planned or captured), and what it recorded.
    fn record(&self, capture: bool, step: &mut dyn FnMut() -> GpuBuf) -> (GpuBuf, Recording) {
        let fresh = || {
            let graphs = self.graphs();
            let place = |s: &Option<CudaSlice<u8>>| {
                s.as_ref()
                    .map_or((0, 0), |s| (s.device_ptr(&self.device.stream).0, s.len()))
            };
            Recording::new(capture, place(&graphs.arena), place(&graphs.staging))
        };
        // A twin (`gemm.rs`) never crosses into or out of a recorded run: a plan launches
        // nothing, so its twins describe memory not yet written.
        self.drop_twin();
        *self.recording_slot() = Some(fresh());
        self.device.recording.store(true, Ordering::Release);
        let out = step();
        self.device.recording.store(false, Ordering::Release);
        self.drop_twin();
        // The step lock keeps other recordings out, so the slot still holds this one.
        let recording = self.recording_slot().take().unwrap_or_else(|| {
            let mut lost = fresh();
            lost.spoil("the recording was lost");
            lost
        });
        (out, recording)
    }

    fn recording_slot(&self) -> std::sync::MutexGuard<'_, Option<Recording>> {
        self.device
            .recording_slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `f` on this thread's recording, if it is making one.
    pub(super) fn with_recording<R>(&self, f: impl FnOnce(&mut Recording) -> R) -> Option<R> {
        if !self.device.recording.load(Ordering::Acquire) {
            return None;
        }
        let mut slot = self.recording_slot();
        match slot.as_mut() {
            Some(r) if r.owner == std::thread::current().id() => Some(f(r)),
            _ => None,
        }
    }

    /// Records an operation's signature words; what to do with the operation.
    pub(super) fn note(&self, words: &[u64]) -> Pass {
        self.with_recording(|r| {
            r.signature.extend_from_slice(words);
            r.pass()
        })
        .unwrap_or(Pass::Eager)
    }

    /// Records a kernel launch.
    pub(super) fn note_launch(&self, name: &'static str, cfg: &LaunchConfig, args: &[Arg]) -> Pass {
        self.with_recording(|r| {
            let (g, b) = (cfg.grid_dim, cfg.block_dim);
            r.signature.extend_from_slice(&[
                1,
                name.as_ptr() as u64,
                g.0.into(),
                g.1.into(),
                g.2.into(),
                b.0.into(),
                b.1.into(),
                b.2.into(),
                cfg.shared_mem_bytes.into(),
                args.len() as u64,
            ]);
            r.signature.extend(args.iter().map(Arg::word));
            r.pass()
        })
        .unwrap_or(Pass::Eager)
    }

    /// `bytes` of the arena while recording (a zeroed f32 buffer when `zeroed`): Some(address,
    /// 0 when it does not fit), or None when not recording.
    pub(super) fn arena_alloc(&self, bytes: usize, zeroed: bool) -> Option<u64> {
        let (ptr, pass) = self.with_recording(|r| {
            let ptr = r.alloc(bytes);
            if zeroed {
                r.signature.extend_from_slice(&[2, ptr, bytes as u64]);
            }
            (ptr, r.pass())
        })?;
        if zeroed && ptr != 0 && pass == Pass::Capture {
            // SAFETY: [ptr, ptr + bytes) lies inside the arena (checked by `alloc`), which
            // lives as long as the graphs that write it; the memset goes into the capture.
            let zeroed = unsafe {
                cudarc::driver::result::memset_d8_async(
                    ptr,
                    0,
                    bytes,
                    self.device.capture_stream.cu_stream(),
                )
            };
            if let Err(e) = zeroed {
                self.spoil(format!("zeroing an arena buffer: {e}"));
            }
        }
        Some(ptr)
    }

    /// Stages a table while recording: Some(its device address at launch), or None when not
    /// recording. `shared` tables (`upload_table`) with the same words share a slot.
    pub(super) fn stage_table(&self, bytes: &[u8], shared: Option<&[u32]>) -> Option<u64> {
        self.with_recording(|r| {
            if let Some(words) = shared {
                if let Some((_, at)) = r.tables.iter().find(|(w, _)| w == words) {
                    return *at;
                }
                let at = r.stage(bytes);
                r.tables.push((words.to_vec(), at));
                return at;
            }
            r.stage(bytes)
        })
    }

    /// Marks this thread's recording as not replayable; false when not recording.
    pub(super) fn spoil(&self, why: impl Into<String>) -> bool {
        self.with_recording(|r| r.spoil(why)).is_some()
    }

    /// Marks this thread's recording as failed (see `Recording::faulted`); false when not
    /// recording.
    pub(super) fn spoil_by_fault(&self, why: String) -> bool {
        self.with_recording(|r| {
            r.spoil(why);
            r.faulted = true;
        })
        .is_some()
    }

    /// Launches the graph kept under `key` when its signature is the plan's.
    fn replay(&self, key: u64, plan: &Recording) -> bool {
        if plan.arena_used > plan.arena_capacity || plan.staging.len() > plan.staging_capacity {
            return false;
        }
        let mut graphs = self.graphs();
        let Some(at) = graphs.captured.iter().position(|g| g.key == key) else {
            return false;
        };
        if graphs.captured[at].signature != plan.signature {
            return false;
        }
        let mut kept = graphs.captured.remove(at);
        drop(graphs);
        let launched = self.stage(&plan.staging) && self.launch_timed(&kept.graph);
        kept.fresh = false;
        let mut graphs = self.graphs();
        graphs.captured.insert(0, kept);
        if launched {
            graphs.stats.replayed += 1;
            graphs.failures_in_a_row = 0;
        }
        // A failed launch is the device's fault now; the caller's check reports it.
        true
    }

    /// Whether a step whose plan matched no graph should be captured. A key's first step
    /// runs eagerly: the libraries' lazily loaded kernels (cuBLAS picks one per shape) load
    /// there, not inside a capture. Then see `Captured::fresh`.
    fn should_capture(&self, key: u64) -> bool {
        const WARMED_KEPT: usize = 256;
        let mut graphs = self.graphs();
        if !graphs.warmed.contains(&key) {
            graphs.warmed.insert(0, key);
            graphs.warmed.truncate(WARMED_KEPT);
            return false;
        }
        match graphs.captured.iter_mut().find(|g| g.key == key) {
            Some(g) if g.fresh => {
                g.fresh = false;
                false
            }
            _ => true,
        }
    }

    /// Grows the arena and the staging area to hold a step's needs (with room to spare);
    /// graphs made with the old ones are dropped.
    fn make_room(&self, arena_bytes: usize, staging_bytes: usize) -> Result<(), CudaError> {
        let mut graphs = self.graphs();
        let short =
            |s: &Option<CudaSlice<u8>>, need: usize| s.as_ref().is_none_or(|s| s.len() < need);
        if !short(&graphs.arena, arena_bytes) && !short(&graphs.staging, staging_bytes) {
            return Ok(());
        }
        graphs.captured.clear();
        let stream = &self.device.stream;
        let grow = |s: &mut Option<CudaSlice<u8>>, need: usize, min: usize, what| {
            if short(s, need) {
                *s = None;
                let bytes = (need + need / 4).max(min);
                // SAFETY: arena buffers are zeroed by their memsets and staging slots written
                // by the staging copy before any kernel reads them.
                *s = Some(unsafe { stream.alloc::<u8>(bytes) }.map_err(device::driver(what))?);
            }
            Ok::<(), CudaError>(())
        };
        grow(
            &mut graphs.arena,
            arena_bytes,
            1 << 20,
            "allocating the graph arena",
        )?;
        grow(
            &mut graphs.staging,
            staging_bytes,
            64 << 10,
            "allocating the staging area",
        )
    }

    /// `launch_graph` between two timing events, whose interval the next replay (or
    /// `graph_stats`) adds to `GraphStats::replay_gpu_us`. Timing is best effort: a step is
    /// never failed for it.
    fn launch_timed(&self, graph: &KeptGraph) -> bool {
        let stream = &self.device.stream;
        let events = {
            let mut graphs = self.graphs();
            graphs.settle_replay_time(false);
            if graphs.replay_events.is_none() {
                let event = || {
                    stream
                        .context()
                        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                        .ok()
                };
                graphs.replay_events = event().zip(event());
            }
            graphs
                .replay_events
                .as_ref()
                .is_some_and(|(start, _)| start.record(stream).is_ok())
        };
        let launched = self.launch_graph(graph);
        if events && launched {
            let mut graphs = self.graphs();
            let ended = graphs
                .replay_events
                .as_ref()
                .is_some_and(|(_, end)| end.record(stream).is_ok());
            graphs.replay_timed_pending = ended;
        }
        launched
    }

    /// Launches `graph` on the device's stream (it was captured on the capture stream).
    fn launch_graph(&self, graph: &KeptGraph) -> bool {
        let stream = &self.device.stream;
        // SAFETY: the graph is live (borrowed), instantiated in this context, and launched
        // on this context's stream; what it reads and writes (arena, staging area, weights,
        // KV pool) lives as long as it may run: see `make_room` and the signature check.
        let launched = stream.context().bind_to_thread().and_then(|()| unsafe {
            cudarc::driver::result::graph::launch(graph.0.cu_graph_exec(), stream.cu_stream())
        });
        if let Err(e) = launched {
            self.fail(device::driver("launching a graph")(e));
            return false;
        }
        true
    }

    /// Copies a step's staged tables to the staging area, ahead of its graph on the stream.
    fn stage(&self, bytes: &[u8]) -> bool {
        if bytes.is_empty() {
            return true;
        }
        let mut graphs = self.graphs();
        let Some(staging) = graphs.staging.as_mut() else {
            return false;
        };
        let mut dst = staging.slice_mut(0..bytes.len());
        match self.device.stream.memcpy_htod(bytes, &mut dst) {
            Ok(()) => true,
            Err(e) => {
                self.fail(device::driver("staging a step's tables")(e));
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recording(capture: bool, arena: usize, staging: usize) -> Recording {
        Recording::new(capture, (1 << 32, arena), (1 << 40, staging))
    }

    #[test]
    fn the_arena_hands_out_the_same_aligned_offsets_every_step() {
        let mut r = recording(true, 4096, 0);
        assert_eq!(r.alloc(10), 1 << 32);
        assert_eq!(r.alloc(300), (1 << 32) + 256);
        assert_eq!(r.alloc(1), (1 << 32) + 768);
        assert_eq!(r.arena_used, 769);
        assert!(r.spoiled.is_none());
        assert_eq!(r.alloc(4096), 0, "past the arena");
        assert!(r.spoiled.is_some(), "a capture past the arena is spoiled");
        let mut plan = recording(false, 0, 0);
        assert_eq!(plan.alloc(100), 0);
        assert_eq!(plan.arena_used, 100, "a plan learns the size it needs");
        assert!(plan.spoiled.is_none());
    }

    #[test]
    fn a_growing_table_keeps_its_slot_until_it_doubles() {
        let mut r = recording(false, 0, 1 << 20);
        let first = r.stage(&[1u8; 100]);
        let second = r.stage(&[2u8; 8]);
        assert_eq!(first, 1 << 40);
        assert_eq!(
            second,
            (1 << 40) + 256,
            "a 100-byte table takes a 128-byte slot"
        );
        assert_eq!(&r.staging[..100], &[1u8; 100]);
        assert_eq!(&r.staging[256..264], &[2u8; 8]);
        let mut grown = recording(false, 0, 1 << 20);
        grown.stage(&[1u8; 120]);
        assert_eq!(
            grown.stage(&[2u8; 8]),
            second,
            "120 bytes still fit the slot"
        );
    }
}
