//! The paged KV cache: every sequence's keys and values live in fixed-size blocks of one
//! pool per model shape, so hundreds of sequences share GPU memory without each growing
//! (and copying) a buffer of its own, and a fork (a GRPO group's choices, a cached prompt
//! prefix) shares its parent's blocks instead of copying them.
//!
//! A block holds [`BLOCK_TOKENS`] positions of every layer: `[layer][keys, values][position]
//! [kv_dim]`, so copying one (copy-on-write) is one device copy. Blocks are counted: a
//! sequence writing into a block another one still holds gets its own copy first
//! ([`Cuda::kv_prepare_paged`]), and a block goes back to the pool when its last holder
//! drops it. Each forward pass uploads one table — every new row's slot, every row's block
//! list and visible length — that every layer's write and attention launches read.

use std::sync::{Arc, Mutex, PoisonError, Weak};

use cudarc::driver::LaunchConfig;

use super::{Arg, BLOCK, Cuda, CudaError, GpuBuf, Table, args, device};
use crate::backend::{Backend, KvRows, Span};

/// Positions a block holds (a power of two: the attention kernel shifts by its log).
pub const BLOCK_TOKENS: usize = 16;
const BLOCK_SHIFT: i32 = BLOCK_TOKENS.trailing_zeros() as i32;
/// Bytes a pool allocates at once when it grows on demand.
const CHUNK_BYTES: usize = 64 << 20;

/// The blocks of every KV cache of one model shape on one GPU.
#[derive(Debug)]
pub struct KvPool {
    cuda: Cuda,
    layers: usize,
    kv_dim: usize,
    state: Mutex<PoolState>,
}

#[derive(Debug, Default)]
struct PoolState {
    /// The pool's allocations; blocks are slices of them.
    chunks: Vec<GpuBuf>,
    /// Each block's device address.
    addr: Vec<u64>,
    /// Each block's holders (0: free).
    refs: Vec<u32>,
    free: Vec<u32>,
    /// The most blocks the pool may hold; None grows until the GPU runs out of memory.
    limit: Option<usize>,
}

impl KvPool {
    /// Floats one block holds.
    fn block_floats(&self) -> usize {
        self.layers * 2 * BLOCK_TOKENS * self.kv_dim
    }

    /// Bytes one block holds: KV memory per position is this / [`BLOCK_TOKENS`].
    pub fn block_bytes(&self) -> usize {
        self.block_floats() * size_of::<f32>()
    }

    /// Positions a block holds.
    pub fn block_tokens(&self) -> usize {
        BLOCK_TOKENS
    }

    /// Allocates the pool's blocks now, `blocks` in all, and caps it there: a serving engine
    /// sizes its KV memory once and admits requests to what it holds. The error is the
    /// allocation's (too little free memory).
    pub fn reserve(&self, blocks: usize) -> Result<(), CudaError> {
        let mut state = self.lock();
        state.limit = Some(blocks.max(state.addr.len()));
        while state.addr.len() < blocks {
            if !self.grow(&mut state) {
                // Too little memory: the pool keeps what it got, the caller hears why.
                state.limit = Some(state.addr.len());
                break;
            }
        }
        drop(state);
        self.cuda.synchronize()
    }

    /// Whether caches of models of this shape can take blocks from it.
    pub fn fits(&self, layers: usize, kv_dim: usize) -> bool {
        self.layers == layers && self.kv_dim == kv_dim
    }

    /// Blocks not held by any cache (including those the pool may still allocate).
    pub fn free_blocks(&self) -> usize {
        let state = self.lock();
        state.free.len()
            + state
                .limit
                .map_or(0, |l| l.saturating_sub(state.addr.len()))
    }

    /// Blocks the pool holds or may allocate (None: no cap).
    pub fn capacity_blocks(&self) -> Option<usize> {
        self.lock().limit
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One more allocation of blocks (up to the limit); false when none can be made.
    fn grow(&self, state: &mut PoolState) -> bool {
        let per_chunk = (CHUNK_BYTES / self.block_bytes()).max(1);
        let room = state
            .limit
            .map_or(per_chunk, |l| l.saturating_sub(state.addr.len()));
        let blocks = per_chunk.min(room);
        if blocks == 0 {
            return false;
        }
        let chunk = self
            .cuda
            .alloc_kept(blocks * self.block_floats(), "KV cache blocks");
        if chunk.slice.is_none() {
            return false;
        }
        for b in 0..blocks {
            let id = state.addr.len() as u32;
            state.addr.push(chunk.ptr(b * self.block_floats()));
            state.refs.push(0);
            state.free.push(id);
        }
        // Lowest ids first, so a fresh pool hands out its blocks in address order.
        state.free.sort_unstable_by(|a, b| b.cmp(a));
        state.chunks.push(chunk);
        true
    }

    /// A free block, held once; None when the pool is full (or the GPU is out of memory).
    fn take(&self, state: &mut PoolState) -> Option<u32> {
        if state.free.is_empty() && !self.grow(state) {
            return None;
        }
        let id = state.free.pop()?;
        state.refs[id as usize] = 1;
        Some(id)
    }

    fn release(&self, state: &mut PoolState, id: u32) {
        let refs = &mut state.refs[id as usize];
        *refs -= 1;
        if *refs == 0 {
            state.free.push(id);
        }
    }
}

/// One sequence's KV cache: its blocks, in position order (block i holds positions
/// i·BLOCK_TOKENS..). The length lives with the caller ([`crate::model::KvCache`]).
#[derive(Debug)]
pub struct PagedKv {
    pool: Arc<KvPool>,
    blocks: Vec<u32>,
}

impl PagedKv {
    /// The pool its blocks come from.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Blocks writing positions start..start + count would take from the pool: new ones,
    /// and a copy of a shared block it would write into.
    pub fn blocks_to_write(&self, start: usize, count: usize) -> usize {
        if count == 0 {
            return 0;
        }
        let fresh = (start + count).div_ceil(BLOCK_TOKENS)
            - self.blocks.len().min(start.div_ceil(BLOCK_TOKENS));
        let copied = self.shared_block_at(&self.pool.lock(), start).is_some();
        fresh + usize::from(copied)
    }

    /// The index (in `blocks`) of the block that position `start` falls in, when it is
    /// partly filled and another cache holds it too: writing there needs a copy first.
    fn shared_block_at(&self, state: &PoolState, start: usize) -> Option<usize> {
        let i = start / BLOCK_TOKENS;
        let shared = !start.is_multiple_of(BLOCK_TOKENS)
            && self
                .blocks
                .get(i)
                .is_some_and(|&b| state.refs[b as usize] > 1);
        shared.then_some(i)
    }
}

impl Clone for PagedKv {
    /// A fork: the same blocks, held once more.
    fn clone(&self) -> Self {
        let mut state = self.pool.lock();
        for &b in &self.blocks {
            state.refs[b as usize] += 1;
        }
        Self {
            pool: self.pool.clone(),
            blocks: self.blocks.clone(),
        }
    }
}

impl Drop for PagedKv {
    fn drop(&mut self) {
        let mut state = self.pool.lock();
        for &b in &self.blocks {
            self.pool.release(&mut state, b);
        }
    }
}

/// A forward pass's table on the device (see the module doc): new row e's slot at e, its
/// entry (row of the step's q, k, v and out; where its sequence's block addresses start;
/// positions it sees) at `entries + 3e`, block addresses from `blocks`, and from `attended`
/// the entries of the rows that attend over the paged cache.
///
/// A fresh prompt (a sequence whose cache starts empty this pass, with more than one new
/// row) attends over its own new keys instead, with the dense causal kernels training uses
/// (`fresh`, spans of the step's rows): tensor cores tile its keys across the block, where
/// the paged kernel walks them one row of queries at a time.
#[derive(Debug)]
pub struct PagedStep {
    table: Option<Table<i64>>,
    rows: usize,
    entries: usize,
    blocks: usize,
    attended: usize,
    attended_rows: usize,
    /// Splits launched for the attended rows: the most any row takes, rounded up to a power
    /// of two so that a graphed step's launch shape changes rarely as caches grow.
    decode_splits: usize,
    fresh: Vec<Span>,
}

impl PagedStep {
    fn at(&self, offset: usize) -> u64 {
        self.table
            .as_ref()
            .map_or(0, |t| t.ptr() + (offset * size_of::<i64>()) as u64)
    }
}

impl Cuda {
    /// A pool of its own for caches of `layers` layers and `kv_dim` (nkv·hd) keys a
    /// position (an engine's, sized with [`KvPool::reserve`]); give it to a model's backend
    /// with [`Self::with_kv_pool`].
    pub fn new_kv_pool(&self, layers: usize, kv_dim: usize) -> Arc<KvPool> {
        Arc::new(KvPool {
            cuda: Cuda {
                device: self.device.clone(),
                kv: None,
            },
            layers,
            kv_dim,
            state: Mutex::new(PoolState::default()),
        })
    }

    /// This handle, with caches of `pool`'s shape taking their blocks from `pool`.
    pub fn with_kv_pool(&self, pool: Arc<KvPool>) -> Cuda {
        Cuda {
            device: self.device.clone(),
            kv: Some(pool),
        }
    }

    /// The pool caches of this shape take blocks from: this handle's own (see
    /// [`Self::with_kv_pool`]), else the GPU's shared pool for the shape, made on first use.
    pub fn kv_pool(&self, layers: usize, kv_dim: usize) -> Arc<KvPool> {
        if let Some(pool) = &self.kv
            && pool.layers == layers
            && pool.kv_dim == kv_dim
        {
            return pool.clone();
        }
        let mut pools = self
            .device
            .kv_pools
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        pools.retain(|p| p.strong_count() > 0);
        if let Some(pool) = pools
            .iter()
            .filter_map(Weak::upgrade)
            .find(|p| p.layers == layers && p.kv_dim == kv_dim)
        {
            return pool;
        }
        let pool = self.new_kv_pool(layers, kv_dim);
        pools.push(Arc::downgrade(&pool));
        pool
    }

    pub(super) fn kv_new_paged(&self, layers: usize, kv_dim: usize) -> PagedKv {
        PagedKv {
            pool: self.kv_pool(layers, kv_dim),
            blocks: Vec::new(),
        }
    }

    pub(super) fn kv_truncate_paged(&self, kv: &mut PagedKv, len: usize) {
        let keep = len.div_ceil(BLOCK_TOKENS);
        if kv.blocks.len() > keep {
            let mut state = kv.pool.lock();
            for b in kv.blocks.drain(keep..) {
                kv.pool.release(&mut state, b);
            }
        }
    }

    /// Room for every sequence's new positions (a copy of a shared block it writes into,
    /// new blocks past its end), then the pass's table, uploaded once.
    pub(super) fn kv_prepare_paged(&self, seqs: &mut [KvRows<'_, PagedKv>]) -> PagedStep {
        let rows: usize = seqs.iter().map(|s| s.rows.len()).sum();
        let mut slots = Vec::with_capacity(rows);
        let mut entries = Vec::with_capacity(3 * rows);
        let mut blocks: Vec<i64> = Vec::new();
        let mut attended = Vec::with_capacity(3 * rows);
        let mut fresh = Vec::new();
        let mut most_splits = 1;
        for s in seqs.iter_mut() {
            if s.rows.is_empty() {
                continue;
            }
            if !self.kv_make_room(s.kv, s.start, s.rows.len()) {
                self.fail(CudaError::OutOfMemory {
                    what: "KV cache blocks",
                    bytes: s.kv.pool.block_bytes(),
                });
                break;
            }
            let kv = &*s.kv;
            let state = kv.pool.lock();
            let first_block = blocks.len() as i64;
            blocks.extend(kv.blocks.iter().map(|&b| state.addr[b as usize] as i64));
            let is_fresh = s.start == 0 && s.rows.len() > 1;
            if is_fresh {
                fresh.push((s.rows.start, s.rows.len()));
            }
            for (i, row) in s.rows.clone().enumerate() {
                let p = s.start + i;
                let base = state.addr[kv.blocks[p / BLOCK_TOKENS] as usize];
                let within = (p % BLOCK_TOKENS) * kv.pool.kv_dim * size_of::<f32>();
                slots.push((base + within as u64) as i64);
                let entry = [row as i64, first_block, (p + 1) as i64];
                entries.extend(entry);
                if !is_fresh {
                    attended.extend(entry);
                    most_splits = most_splits.max(decode_splits(p + 1));
                }
            }
        }
        let n = slots.len();
        let attended_rows = attended.len() / 3;
        // The block list last: every other part's offset depends only on the rows, so a
        // graphed decode step's kernel arguments hold still as caches grow.
        let mut table = slots;
        table.extend(entries);
        let attended_at = table.len();
        table.extend(attended);
        let blocks_at = table.len();
        table.extend(blocks);
        PagedStep {
            table: self.upload_any(&table),
            rows: n,
            entries: n,
            blocks: blocks_at,
            attended: attended_at,
            attended_rows,
            decode_splits: most_splits.next_power_of_two(),
            fresh,
        }
    }

    /// Gives `kv` its own copy of a shared block that positions start.. would write into,
    /// and blocks up to position start + count; false when the pool has none left.
    fn kv_make_room(&self, kv: &mut PagedKv, start: usize, count: usize) -> bool {
        // A cache holds exactly its first `start` positions (truncated before reuse).
        self.kv_truncate_paged(kv, start);
        let pool = kv.pool.clone();
        let mut state = pool.lock();
        if let Some(i) = kv.shared_block_at(&state, start) {
            let shared = kv.blocks[i];
            let Some(own) = pool.take(&mut state) else {
                return false;
            };
            let (from, to) = (state.addr[shared as usize], state.addr[own as usize]);
            self.copy_raw(to, from, pool.block_bytes(), "copying a shared KV block");
            pool.release(&mut state, shared);
            kv.blocks[i] = own;
        }
        while kv.blocks.len() < (start + count).div_ceil(BLOCK_TOKENS) {
            let Some(b) = pool.take(&mut state) else {
                return false;
            };
            kv.blocks.push(b);
        }
        true
    }

    pub(super) fn kv_write_paged(
        &self,
        layer: usize,
        step: &PagedStep,
        pool: &KvPool,
        k: &GpuBuf,
        v: &GpuBuf,
    ) {
        let (layer_offset, v_offset) = offsets(pool, layer);
        let (kp, vp, slots, entries, kv_dim) = (
            k.ptr(0),
            v.ptr(0),
            step.at(0),
            step.at(step.entries),
            pool.kv_dim as i32,
        );
        let cfg = LaunchConfig {
            grid_dim: (step.rows as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            "kv_write",
            cfg,
            args![kp, vp, slots, entries, layer_offset, v_offset, kv_dim],
        );
    }

    /// The step's slot table (row r's position in layer 0's keys; the step's entries are
    /// its rows in order) and the floats from a slot to layer `layer`'s key and from a key to
    /// its value: what a kernel writing the rows' keys and values needs.
    pub(super) fn kv_slots(
        &self,
        layer: usize,
        step: &PagedStep,
        pool: &KvPool,
    ) -> (u64, i64, i64) {
        let (layer_offset, v_offset) = offsets(pool, layer);
        (step.at(0), layer_offset, v_offset)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn kv_attention_paged(
        &self,
        layer: usize,
        step: &PagedStep,
        pool: &KvPool,
        out: &mut GpuBuf,
        (q, k, v): (&GpuBuf, &GpuBuf, &GpuBuf),
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) {
        if !step.fresh.is_empty() {
            // (N, nh) row statistics the dense kernels write; decoding needs none.
            let mut lse = self.alloc(q.len / hd.max(1), "attention statistics");
            self.attention_forward(out, &mut lse, q, k, v, &step.fresh, heads, kv_heads, hd);
        }
        if step.attended_rows == 0 {
            return;
        }
        let (layer_offset, v_offset) = offsets(pool, layer);
        let (o, qp, entries, blocks) = (
            out.ptr(0),
            q.ptr(0),
            step.at(step.attended),
            step.at(step.blocks),
        );
        let (h, kvh, hd32, shift) = (heads as i32, kv_heads as i32, hd as i32, BLOCK_SHIFT);
        let Some(kernel) = decode_kernel(hd) else {
            // A head size the split kernels do not take: one block per (row, head).
            self.launch(
                "attention_paged",
                super::per_row_head(step.attended_rows, heads),
                args![
                    o,
                    qp,
                    entries,
                    blocks,
                    layer_offset,
                    v_offset,
                    h,
                    kvh,
                    hd32,
                    shift
                ],
            );
            return;
        };
        let splits = step.decode_splits;
        // Each split's (max, sum, Σ p·v) where a row takes more than one.
        let part = self.scratch(
            if splits > 1 {
                step.attended_rows * heads * splits * (hd + 2)
            } else {
                0
            },
            "attention splits",
        );
        // Without fresh rows (a decode step) these kernels write every row of out: they
        // can give the o product its bf16 twin.
        let twin = if step.fresh.is_empty() {
            self.bf16_alloc(out.len)
        } else {
            super::gemm::Bf16::none()
        };
        let tp = twin.ptr(self);
        let (pp, per_split, most) = (part.ptr(0), DECODE_BLOCKS_PER_SPLIT, DECODE_MAX_SPLITS);
        let grid = |z: usize| LaunchConfig {
            grid_dim: (step.attended_rows as u32, heads as u32, z as u32),
            block_dim: (32 * DECODE_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            kernel,
            grid(splits),
            args![
                o,
                tp,
                pp,
                qp,
                entries,
                blocks,
                layer_offset,
                v_offset,
                h,
                kvh,
                shift,
                per_split,
                most
            ],
        );
        if splits > 1 {
            let launched = splits as i32;
            self.launch(
                "attention_decode_merge",
                LaunchConfig {
                    block_dim: (hd as u32, 1, 1),
                    ..grid(1)
                },
                args![
                    o, tp, pp, entries, h, hd32, launched, shift, per_split, most
                ],
            );
        }
        self.keep_twin(out, twin);
    }

    /// A device copy between raw addresses (blocks of a pool), ordered on the stream.
    fn copy_raw(&self, to: u64, from: u64, bytes: usize, what: &'static str) {
        self.drop_twin();
        // A step's plan copies for real (nothing is capturing the stream, and the copy is
        // the step's own, before its launch); a capture cannot hold it.
        let capturing = self.capturing();
        if !self.ok() || (capturing && self.spoil(format!("{what} while capturing a step"))) {
            return;
        }
        // SAFETY: both addresses are the starts of blocks of `bytes` bytes inside live
        // pool allocations (the pool outlives every block it hands out), and the copy is
        // ordered on the stream every read and write of those blocks is ordered on.
        let copied = unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                to,
                from,
                bytes,
                self.device.stream.cu_stream(),
            )
        };
        if let Err(e) = copied {
            self.fail(device::driver(what)(e));
        }
    }
}

/// Cached attention of decode rows splits a row's cache into up to this many parts, each
/// of at least `DECODE_BLOCKS_PER_SPLIT` blocks, run by blocks of `DECODE_WARPS` warps (the
/// kernel's `decode_splits` counts a row's splits from its own length only).
const DECODE_MAX_SPLITS: i32 = 16;
const DECODE_BLOCKS_PER_SPLIT: i32 = 4;
const DECODE_WARPS: u32 = 4;

/// The split decode kernel for head size `hd` (32 lanes × 1, 2, 4 or 8 dimensions).
fn decode_kernel(hd: usize) -> Option<&'static str> {
    Some(match hd {
        32 => "attention_decode_1",
        64 => "attention_decode_2",
        128 => "attention_decode_4",
        256 => "attention_decode_8",
        _ => return None,
    })
}

/// How many splits a row seeing `visible` positions takes (the kernel's `decode_splits`).
fn decode_splits(visible: usize) -> usize {
    let blocks = visible.div_ceil(BLOCK_TOKENS);
    blocks
        .div_ceil(DECODE_BLOCKS_PER_SPLIT as usize)
        .clamp(1, DECODE_MAX_SPLITS as usize)
}

/// Floats from a block's start to layer `layer`'s keys, and from a key to its value.
fn offsets(pool: &KvPool, layer: usize) -> (i64, i64) {
    let per_layer = 2 * BLOCK_TOKENS * pool.kv_dim;
    (
        (layer * per_layer) as i64,
        (BLOCK_TOKENS * pool.kv_dim) as i64,
    )
}
