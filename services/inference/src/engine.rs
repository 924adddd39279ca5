//! The batching engine: one thread owns every sequence and KV cache and runs the model.
//!
//! Each iteration it takes new requests and weight swaps from its inbox, admits waiting
//! requests while there are free slots, then runs one forward pass per policy version over
//! every active sequence: a decoding sequence feeds its last token, a new one feeds the
//! next chunk of its prompt (chunked prefill, so a long prompt never stalls the others).
//! Requests join and leave between steps. A request with `n` choices prefills once; the
//! other choices fork from its cache.
//!
//! Log-probabilities are the model's own (log-softmax of the raw logits, before
//! temperature or truncation), as vLLM returns them: they are what the trainer's
//! importance ratios compare against.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use arl_model::backend::BackendError;
use arl_model::cuda::{Pick, TOP_MAX};
use arl_model::generate::{Rng, Sampling, sample};
use arl_model::load::LoadedModel;
use rayon::prelude::*;
use tokio::sync::mpsc;

use crate::device::{Cache, Device, KvRoom, Logits, Runner};

/// A loaded policy version, ready on the engine's device.
#[derive(Debug)]
pub struct ServedModel {
    /// The run whose trained weights these are; None for the model the engine started
    /// with (version 0). A policy is (run, version): two runs' version 3 differ.
    pub run_id: Option<arl_schemas::RunId>,
    pub version: u64,
    /// The host copy: tokenizer, chat template, configuration (and the CPU's weights).
    pub loaded: LoadedModel,
    runner: Runner,
}

impl ServedModel {
    /// A version ready to serve on `device` (for a GPU, its weights uploaded).
    pub fn new(
        run_id: Option<arl_schemas::RunId>,
        version: u64,
        loaded: LoadedModel,
        device: &Device,
    ) -> Result<Self, BackendError> {
        Self::prepared(run_id, version, loaded, None, device)
    }

    /// A version the trainer of this process handed over in memory
    /// ([`arl_model::handoff`]): on a GPU, its weights copied device to device (the
    /// trainer's copy is freed once the engine's own is made).
    pub fn handed(
        run_id: Option<arl_schemas::RunId>,
        version: u64,
        handed: arl_model::handoff::HandedVersion,
        device: &Device,
    ) -> Result<Self, BackendError> {
        Self::prepared(
            run_id,
            version,
            handed.model,
            handed.device.as_ref(),
            device,
        )
    }

    fn prepared(
        run_id: Option<arl_schemas::RunId>,
        version: u64,
        loaded: LoadedModel,
        on_gpu: Option<&arl_model::handoff::DeviceWeights>,
        device: &Device,
    ) -> Result<Self, BackendError> {
        let runner = device.prepare(&loaded, on_gpu)?;
        Ok(Self {
            run_id,
            version,
            loaded,
            runner,
        })
    }

    fn new_cache(&self) -> Cache {
        self.runner.new_cache(&self.loaded.model)
    }

    /// The KV pool requests are admitted to (None on the CPU).
    pub fn kv_room(&self) -> Option<KvRoom> {
        self.runner.kv_room()
    }

    fn truncate(&self, cache: &mut Cache, len: usize) {
        self.runner.truncate(&self.loaded.model, cache, len);
    }

    /// Whether this is `run`'s version `version` or a newer version of the same run.
    pub fn is_at_least(&self, run: &arl_schemas::RunId, version: u64) -> bool {
        self.run_id.as_ref() == Some(run) && self.version >= version
    }

    /// The policy these weights are: (run, version).
    pub fn policy(&self) -> Policy {
        Policy {
            run_id: self.run_id.clone(),
            version: self.version,
        }
    }

    /// Whether these are the weights of `policy`. Never a bare version: after a swap from
    /// one run's version 1 to another's, both are in flight at once.
    fn is(&self, policy: &Policy) -> bool {
        self.version == policy.version && self.run_id == policy.run_id
    }
}

/// A policy's identity: the run whose trained weights it is (None for the model the
/// engine started with) and the version. Sequences, cached prefixes and sessions are
/// matched to weights by it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    pub run_id: Option<arl_schemas::RunId>,
    pub version: u64,
}

/// What to do with requests in flight when new weights arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SwapPolicy {
    /// Finish them on the version they started with (it stays loaded until then).
    Finish,
    /// Abort them with an error naming the new version; the client retries.
    Abort,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Sequences decoded together (a request with `n` choices takes `n`).
    pub max_batch: usize,
    /// Requests waiting for a slot before new ones get 429.
    pub queue_limit: usize,
    /// Prompt tokens fed per step across all prefilling sequences.
    pub prefill_chunk: usize,
    /// Upper bound on prompt + completion (the model's own limit applies too).
    pub max_model_len: usize,
    pub swap_policy: SwapPolicy,
    /// Sessions whose KV cache is kept for the next turn.
    pub session_cache: usize,
    /// Prompt tokens whose KV caches are kept for later requests that share a prefix with
    /// them (0 = off).
    pub prefix_cache_tokens: usize,
    /// What runs the model; every version served is prepared for it.
    pub device: Device,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch: 16,
            queue_limit: 64,
            prefill_chunk: 256,
            max_model_len: 8192,
            swap_policy: SwapPolicy::Finish,
            session_cache: 32,
            prefix_cache_tokens: 16_384,
            device: Device::Cpu,
        }
    }
}

#[derive(Clone, Debug)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub seed: Option<u64>,
    pub max_tokens: usize,
    /// Token ids that end a choice (the model's end-of-turn tokens, plus any asked for).
    pub stop_ids: Vec<u32>,
    /// Alternatives reported with each token (0 = none).
    pub top_logprobs: usize,
}

impl SamplingParams {
    /// Greedy with no stop token, so a choice decodes exactly `max_tokens` (benchmarks,
    /// and comparisons of one engine with another), reporting `top_logprobs` alternatives.
    pub fn greedy(max_tokens: usize, top_logprobs: usize) -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: Some(1),
            max_tokens,
            stop_ids: Vec::new(),
            top_logprobs,
        }
    }
}

/// A completion request in token space.
pub struct Request {
    pub prompt: Vec<u32>,
    pub n: usize,
    pub params: SamplingParams,
    /// Turns of one session share their KV cache across requests.
    pub session: Option<String>,
    pub events: mpsc::UnboundedSender<Event>,
    /// One flag per choice: set it to stop that choice (a stop string matched).
    pub cancel: Vec<Arc<AtomicBool>>,
}

/// One sampled token with the model's log-probabilities.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub id: u32,
    pub logprob: f32,
    /// The most likely tokens at this position, best first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Started {
        /// The policy the request was admitted on (it never changes mid-way).
        policy: Policy,
        cached_tokens: usize,
    },
    Token {
        choice: usize,
        token: Sampled,
    },
    Finished {
        choice: usize,
        reason: FinishReason,
    },
    Aborted {
        reason: AbortReason,
        message: String,
    },
}

/// Why the engine gave a request up before it finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortReason {
    /// New weights arrived mid-request under `--swap-policy abort`.
    WeightsChanged,
    /// The device failed the forward pass (out of GPU memory, a driver error).
    DeviceFailed,
}

impl AbortReason {
    /// The error code clients see (with a 503: retrying later may succeed).
    pub fn code(self) -> &'static str {
        match self {
            AbortReason::WeightsChanged => "weights_changed",
            AbortReason::DeviceFailed => "device_failed",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    #[error("no weights are loaded yet; retry when a policy version is published")]
    NoWeights,
    #[error("the request queue is full ({0} waiting); retry later")]
    QueueFull(usize),
    #[error(
        "this model's maximum context length is {max} tokens, but the prompt has {prompt} tokens"
    )]
    ContextLength { max: usize, prompt: usize },
    #[error(
        "this request needs {need} KV-cache positions (n × (prompt + max_tokens)) but the GPU's KV cache holds {capacity}; lower max_tokens or n, or give the cache more memory (--kv-cache-memory, --gpu-memory-utilization)"
    )]
    KvCapacity { need: usize, capacity: usize },
    #[error("the engine has stopped")]
    Stopped,
}

enum Inbox {
    Submit(Request),
    Swap(Arc<ServedModel>),
}

/// Shared between the handle and the engine thread.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub waiting: AtomicUsize,
    pub active: AtomicUsize,
    /// Tokens held in the KV caches of the running sequences.
    pub kv_tokens: AtomicUsize,
    pub steps: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Wall time of the steps so far (µs), in three parts: the forward passes as the host
    /// sees them (on a GPU: planning and launching, not waiting), the draws (on a GPU: the
    /// wait for the pass, then sampling), and the rest (tokens to their requests, finished
    /// sequences out of the batch).
    pub forward_us: AtomicU64,
    pub draw_us: AtomicU64,
    pub emit_us: AtomicU64,
}

/// The API side of the engine.
#[derive(Clone)]
pub struct EngineHandle {
    inbox: std_mpsc::Sender<Inbox>,
    current: Arc<Mutex<Option<Arc<ServedModel>>>>,
    config: EngineConfig,
    pub stats: Arc<EngineStats>,
}

impl EngineHandle {
    /// Starts the engine thread, serving `model` if given (else 503 until a swap).
    pub fn start(config: EngineConfig, model: Option<ServedModel>) -> std::io::Result<Self> {
        let (tx, rx) = std_mpsc::channel();
        let current = Arc::new(Mutex::new(model.map(Arc::new)));
        let stats = Arc::new(EngineStats::default());
        let mut engine = Engine {
            config: config.clone(),
            inbox: rx,
            current: current.clone(),
            waiting: VecDeque::new(),
            active: Vec::new(),
            sessions: SessionCache::new(config.session_cache),
            prefixes: PrefixCache::new(config.prefix_cache_tokens),
            stats: stats.clone(),
            seed_counter: 0,
        };
        std::thread::Builder::new()
            .name("arl-engine".into())
            .spawn(move || engine.run())?;
        Ok(Self {
            inbox: tx,
            current,
            config,
            stats,
        })
    }

    /// What runs the model: versions to swap in are prepared for it.
    pub fn device(&self) -> &Device {
        &self.config.device
    }

    /// The version new requests start on.
    pub fn current(&self) -> Option<Arc<ServedModel>> {
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The longest prompt + completion the current model accepts.
    pub fn max_len(&self) -> usize {
        self.current().map_or(self.config.max_model_len, |m| {
            max_len(&m, self.config.max_model_len)
        })
    }

    /// The KV-cache tokens the engine admits to: on a GPU, what its block pool holds; on
    /// the CPU (which allocates per sequence), max_batch sequences of the longest context.
    pub fn kv_capacity_tokens(&self) -> usize {
        match self.current().and_then(|m| m.kv_room()) {
            Some(room) => room.blocks * room.block_tokens,
            None => self.config.max_batch * self.max_len(),
        }
    }

    pub fn submit(&self, request: Request) -> Result<(), SubmitError> {
        if self.current().is_none() {
            return Err(SubmitError::NoWeights);
        }
        let max = self.max_len();
        if request.prompt.len() >= max {
            return Err(SubmitError::ContextLength {
                max,
                prompt: request.prompt.len(),
            });
        }
        if let Some(model) = self.current()
            && let Some(room) = model.kv_room()
        {
            let need = KvReservation::of(room, &request, max).total();
            if need > room.blocks {
                return Err(SubmitError::KvCapacity {
                    need: need * room.block_tokens,
                    capacity: room.blocks * room.block_tokens,
                });
            }
        }
        let waiting = self.stats.waiting.load(Ordering::SeqCst);
        if waiting >= self.config.queue_limit {
            return Err(SubmitError::QueueFull(waiting));
        }
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        self.inbox.send(Inbox::Submit(request)).map_err(|_| {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            SubmitError::Stopped
        })
    }

    /// Makes `model` the version new requests start on, between two decode steps.
    pub fn swap(&self, model: ServedModel) -> Result<(), SubmitError> {
        let model = Arc::new(model);
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(model.clone());
        self.inbox
            .send(Inbox::Swap(model))
            .map_err(|_| SubmitError::Stopped)
    }
}

struct Sequence {
    request: Arc<RequestShared>,
    choice: usize,
    model: Arc<ServedModel>,
    cache: Cache,
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    /// Tokens already in the cache.
    fed: usize,
    /// Prompt length (tokens after it were generated).
    prompt_len: usize,
    generated: usize,
    rng: Rng,
    /// Choices still to fork from this one once its prompt is in the cache.
    forks: usize,
    /// A forward pass failed on it: its cache is not to be kept.
    failed: bool,
    /// KV blocks set aside for it (and for the choices still to fork from it): it never
    /// runs out mid-way, however long it decodes. 0 on the CPU.
    kv_own: usize,
    /// The prompt's full blocks its request's choices share (set aside once for them all,
    /// for as long as one of them runs).
    kv_shared: Option<Arc<SharedBlocks>>,
}

/// A count of KV blocks held in common by a request's choices.
#[derive(Debug)]
struct SharedBlocks(usize);

struct RequestShared {
    params: SamplingParams,
    session: Option<String>,
    events: mpsc::UnboundedSender<Event>,
    cancel: Vec<Arc<AtomicBool>>,
    base_seed: u64,
}

struct Engine {
    config: EngineConfig,
    inbox: std_mpsc::Receiver<Inbox>,
    current: Arc<Mutex<Option<Arc<ServedModel>>>>,
    waiting: VecDeque<Request>,
    active: Vec<Sequence>,
    sessions: SessionCache,
    prefixes: PrefixCache,
    stats: Arc<EngineStats>,
    seed_counter: u64,
}

impl Engine {
    fn run(&mut self) {
        loop {
            let message = if self.active.is_empty() && self.waiting.is_empty() {
                match self.inbox.recv() {
                    Ok(message) => Some(message),
                    Err(_) => return, // every handle is gone
                }
            } else {
                self.inbox.try_recv().ok()
            };
            if let Some(message) = message {
                self.receive(message);
                while let Ok(message) = self.inbox.try_recv() {
                    self.receive(message);
                }
            }
            self.admit();
            if !self.active.is_empty() {
                self.step();
            }
            self.publish_stats();
        }
    }

    /// The live gauges (`vllm:num_requests_running`, KV usage) from the batch as it is now.
    fn publish_stats(&self) {
        self.stats.active.store(self.active.len(), Ordering::SeqCst);
        let cached: usize = self.active.iter().map(|seq| seq.fed).sum();
        self.stats.kv_tokens.store(cached, Ordering::SeqCst);
    }

    fn receive(&mut self, message: Inbox) {
        match message {
            Inbox::Submit(request) => self.waiting.push_back(request),
            Inbox::Swap(model) => {
                tracing::info!(policy_version = model.version, "weights swapped in");
                // Cached prefixes were computed by other weights.
                self.sessions.clear();
                self.prefixes.clear();
                if self.config.swap_policy == SwapPolicy::Abort {
                    let message = format!(
                        "aborted: the weights changed to policy version {} during generation; retry the request",
                        model.version
                    );
                    for seq in self.active.drain(..) {
                        let _ = seq.request.events.send(Event::Aborted {
                            reason: AbortReason::WeightsChanged,
                            message: message.clone(),
                        });
                    }
                }
            }
        }
    }

    /// Moves waiting requests into the batch while there are slots. A request whose prompt
    /// shares a prefix with a prompt still being prefilled waits for it (a few steps at
    /// most), then starts from its cache instead of computing the same prefix again: the
    /// n trials of a GRPO group arrive together with the same prompt.
    fn admit(&mut self) {
        let Some(model) = self
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        else {
            return;
        };
        let mut deferred = VecDeque::new();
        let room = model.kv_room();
        let max = max_len(&model, self.config.max_model_len);
        let mut reserved = self.kv_reserved();
        while let Some(request) = self.waiting.front() {
            let slots = request.n.max(1);
            if !self.active.is_empty() && self.active.len() + slots > self.config.max_batch {
                break;
            }
            // On a GPU, a request starts once the KV pool can hold all of it.
            let need = room.map(|room| KvReservation::of(room, request, max));
            let blocks = need.map_or(0, KvReservation::total);
            if let Some(room) = room
                && reserved + blocks > room.blocks
            {
                break;
            }
            reserved += blocks;
            let Some(request) = self.waiting.pop_front() else {
                break;
            };
            if self.prefixes.enabled() && self.shares_a_prefill(&model, &request.prompt) {
                deferred.push_back(request);
                continue;
            }
            self.start(&model, request, need);
        }
        // Deferred requests keep their place at the front of the queue.
        while let Some(request) = deferred.pop_back() {
            self.waiting.push_front(request);
        }
    }

    /// Whether an active sequence on `model` is still prefilling a prompt that shares a
    /// useful prefix with `prompt` beyond what the prefix cache already holds.
    fn shares_a_prefill(&self, model: &Arc<ServedModel>, prompt: &[u32]) -> bool {
        let policy = model.policy();
        let cached = self.prefixes.longest(&policy, prompt);
        self.active.iter().any(|seq| {
            seq.model.is(&policy)
                && seq.fed < seq.prompt_len
                && shared_prefix(&seq.tokens[..seq.prompt_len], prompt) >= cached + MIN_SHARED
        })
    }

    /// Starts a request: its cache from its session or a shared prefix, one sequence (whose
    /// other choices fork once its prompt is in).
    fn start(&mut self, model: &Arc<ServedModel>, request: Request, kv: Option<KvReservation>) {
        let slots = request.n.max(1);
        self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
        self.seed_counter += 1;
        let base_seed = request
            .params
            .seed
            .unwrap_or_else(|| random_seed(self.seed_counter));
        let from_session = request
            .session
            .as_deref()
            .and_then(|session| self.sessions.take(session, model, &request.prompt));
        let (cache, cached) = from_session
            .or_else(|| self.prefixes.take(model, &request.prompt))
            .unwrap_or_else(|| (model.new_cache(), 0));
        let shared = Arc::new(RequestShared {
            params: request.params,
            session: request.session,
            events: request.events,
            cancel: request.cancel,
            base_seed,
        });
        let started = shared.events.send(Event::Started {
            policy: model.policy(),
            cached_tokens: cached,
        });
        if started.is_err() {
            return; // the client is gone
        }
        self.active.push(Sequence {
            request: shared,
            choice: 0,
            model: model.clone(),
            cache,
            prompt_len: request.prompt.len(),
            tokens: request.prompt,
            fed: cached,
            generated: 0,
            rng: Rng::new(base_seed),
            forks: slots - 1,
            failed: false,
            kv_own: kv.map_or(0, |kv| kv.per_choice * slots),
            kv_shared: kv
                .filter(|kv| kv.shared > 0)
                .map(|kv| Arc::new(SharedBlocks(kv.shared))),
        });
    }

    /// KV blocks set aside for the running sequences: each one's own, and once each the
    /// prompt blocks a request's choices share.
    fn kv_reserved(&self) -> usize {
        let mut shared: Vec<&Arc<SharedBlocks>> = Vec::new();
        let mut total = 0;
        for seq in &self.active {
            total += seq.kv_own;
            if let Some(blocks) = &seq.kv_shared
                && !shared.iter().any(|s| Arc::ptr_eq(s, blocks))
            {
                total += blocks.0;
                shared.push(blocks);
            }
        }
        total
    }

    /// Frees KV blocks cached prefixes and sessions hold when the pool has too few left for
    /// this step's writes: the least recently used first (prefixes, then sessions), only
    /// until the step fits. Running sequences' writes fit in what admission set aside for
    /// them, so after this they always do.
    fn make_kv_room(&mut self, model: &ServedModel, indices: &[usize], feed_to: &[Option<usize>]) {
        let Some(free) = model.runner.kv_free_blocks() else {
            return;
        };
        let wanted: usize = indices
            .iter()
            .map(|&i| {
                let seq = &self.active[i];
                let count = feed_to[i].map_or(0, |end| end - seq.fed);
                Runner::blocks_to_feed(&seq.cache, count)
            })
            .sum();
        if wanted <= free {
            return;
        }
        let (mut prefixes, mut sessions) = (0, 0);
        // An entry may share its blocks with a running sequence: dropping it then frees
        // nothing, so the pool is asked again after each one.
        while model
            .runner
            .kv_free_blocks()
            .is_some_and(|free| free < wanted)
        {
            if self.prefixes.evict_oldest() {
                prefixes += 1;
            } else if self.sessions.evict_oldest() {
                sessions += 1;
            } else {
                break;
            }
        }
        tracing::debug!(
            wanted,
            free,
            prefixes,
            sessions,
            "KV pool short: dropped cached prefixes and sessions"
        );
    }

    /// One forward pass per policy version over every sequence with tokens to feed.
    fn step(&mut self) {
        let started = Instant::now();
        let mut budget = self.config.prefill_chunk.max(1);
        // Per sequence: the end of the tokens fed this step.
        let mut feed_to: Vec<Option<usize>> = Vec::with_capacity(self.active.len());
        for seq in &self.active {
            let pending = seq.tokens.len() - seq.fed;
            if pending <= 1 {
                feed_to.push(Some(seq.tokens.len()));
            } else if budget > 0 {
                let take = pending.min(budget);
                budget -= take;
                feed_to.push(Some(seq.fed + take));
            } else {
                feed_to.push(None);
            }
        }
        // Per sequence: the forward pass (an index into `outputs`) and the row of its logits
        // that its next token is drawn from.
        let mut draw_from: Vec<Option<(usize, usize)>> = vec![None; self.active.len()];
        let mut outputs: Vec<Logits> = Vec::new();
        // One forward per policy: two runs' version 1 are different weights.
        let mut policies: Vec<Policy> = Vec::new();
        for seq in &self.active {
            if !policies.iter().any(|p| seq.model.is(p)) {
                policies.push(seq.model.policy());
            }
        }
        for policy in policies {
            let indices: Vec<usize> = (0..self.active.len())
                .filter(|&i| self.active[i].model.is(&policy) && feed_to[i].is_some())
                .collect();
            let Some(&first) = indices.first() else {
                continue;
            };
            let model = self.active[first].model.clone();
            self.make_kv_room(&model, &indices, &feed_to);
            let mut batch = Vec::with_capacity(indices.len());
            for (i, seq) in self.active.iter_mut().enumerate() {
                if let (Some(end), true) = (feed_to[i], seq.model.is(&policy)) {
                    let Sequence {
                        tokens, cache, fed, ..
                    } = seq;
                    batch.push((&tokens[*fed..end], cache));
                }
            }
            let logits = match model.runner.forward(&model.loaded.model, batch) {
                Ok(logits) => logits,
                Err(error) => {
                    self.abort_failed(&indices, &error);
                    continue;
                }
            };
            for (row, i) in indices.into_iter().enumerate() {
                let end = feed_to[i].unwrap_or(0);
                let seq = &mut self.active[i];
                let prefilled =
                    seq.generated == 0 && seq.fed < seq.prompt_len && end == seq.prompt_len;
                seq.fed = end;
                if prefilled {
                    self.prefixes.put(
                        seq.model.policy(),
                        &seq.tokens[..seq.prompt_len],
                        &seq.cache,
                    );
                }
                if end == seq.tokens.len() {
                    draw_from[i] = Some((outputs.len(), row));
                }
            }
            outputs.push(logits);
        }
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        let forwarded = Instant::now();
        self.stats
            .forward_us
            .fetch_add(micros(forwarded - started), Ordering::Relaxed);

        // Fork the other choices of requests whose prompt just finished.
        let mut forked = Vec::new();
        for (i, seq) in self.active.iter_mut().enumerate() {
            if seq.forks > 0
                && let Some(from) = draw_from[i]
            {
                let per_choice = seq.kv_own / (seq.forks + 1);
                for choice in 1..=seq.forks {
                    seq.kv_own -= per_choice;
                    forked.push((
                        Sequence {
                            request: seq.request.clone(),
                            choice,
                            model: seq.model.clone(),
                            cache: seq.cache.clone(),
                            tokens: seq.tokens.clone(),
                            fed: seq.fed,
                            prompt_len: seq.prompt_len,
                            generated: 0,
                            rng: Rng::new(seq.request.base_seed.wrapping_add(choice as u64)),
                            forks: 0,
                            failed: false,
                            kv_own: per_choice,
                            kv_shared: seq.kv_shared.clone(),
                        },
                        from,
                    ));
                }
                seq.forks = 0;
            }
        }
        for (seq, from) in forked {
            self.active.push(seq);
            draw_from.push(Some(from));
        }

        let mut sampled = self.draw(&outputs, &draw_from);
        drop(outputs);
        let drawn = Instant::now();
        self.stats
            .draw_us
            .fetch_add(micros(drawn - forwarded), Ordering::Relaxed);

        let mut done = vec![false; self.active.len()];
        // Finish events go out after the batch shrinks, so a client that saw its request end
        // never scrapes it as still running.
        let mut finished = Vec::new();
        for (i, seq) in self.active.iter_mut().enumerate() {
            if seq.request.cancel[seq.choice].load(Ordering::SeqCst) {
                done[i] = true;
                continue;
            }
            let Some(token) = sampled[i].take() else {
                continue;
            };
            seq.tokens.push(token.id);
            seq.generated += 1;
            self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
            let params = &seq.request.params;
            let finish = if params.stop_ids.contains(&token.id) {
                Some(FinishReason::Stop)
            } else if seq.generated >= params.max_tokens
                || seq.tokens.len() >= max_len(&seq.model, self.config.max_model_len)
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            let choice = seq.choice;
            let sent = seq.request.events.send(Event::Token { choice, token });
            if let (Some(reason), Ok(())) = (finish, &sent) {
                finished.push((
                    seq.request.events.clone(),
                    Event::Finished { choice, reason },
                ));
                done[i] = true;
            }
            if sent.is_err() {
                // The client went away: drop every choice of the request.
                done[i] = true;
                seq.request
                    .cancel
                    .iter()
                    .for_each(|c| c.store(true, Ordering::SeqCst));
            }
        }
        let mut index = 0;
        let sessions = &mut self.sessions;
        self.active.retain_mut(|seq| {
            let keep = !done[index] && !seq.request.cancel[seq.choice].load(Ordering::SeqCst);
            index += 1;
            if !keep
                && seq.choice == 0
                && seq.forks == 0
                && !seq.failed
                && let Some(session) = &seq.request.session
            {
                let cache = std::mem::replace(&mut seq.cache, seq.model.new_cache());
                sessions.put(
                    session,
                    seq.model.policy(),
                    seq.tokens[..seq.fed].to_vec(),
                    cache,
                );
            }
            keep
        });
        self.publish_stats();
        for (events, event) in finished {
            // A client gone by now loses nothing: its sequence has already left the batch.
            let _ = events.send(event);
        }
        self.stats
            .emit_us
            .fetch_add(micros(drawn.elapsed()), Ordering::Relaxed);
        tracing::trace!(
            batch = self.active.len(),
            ms = started.elapsed().as_millis() as u64,
            "step"
        );
    }
}

impl Engine {
    /// The batch's next tokens. Each sequence draws from its own row of logits with its own
    /// generator, so the result does not depend on the batch. Rows left on a GPU are drawn
    /// there and only the picks come back (a draw asking for more alternatives than the
    /// device reports reads its row back and draws on the host, as every CPU row does). A
    /// device failure aborts the sequences of that pass.
    fn draw(
        &mut self,
        outputs: &[Logits],
        draw_from: &[Option<(usize, usize)>],
    ) -> Vec<Option<Sampled>> {
        let n = self.active.len();
        let mut drawn: Vec<Option<Drawn<'_>>> = (0..n).map(|_| None).collect();
        for (output, logits) in outputs.iter().enumerate() {
            let members: Vec<usize> = (0..n)
                .filter(|&i| {
                    let seq = &self.active[i];
                    draw_from[i].is_some_and(|(o, _)| o == output)
                        && !seq.request.cancel[seq.choice].load(Ordering::SeqCst)
                })
                .collect();
            if let Err(error) = self.draw_pass(logits, &members, draw_from, &mut drawn) {
                self.abort_failed(&members, &error);
                members.iter().for_each(|&i| drawn[i] = None);
            }
        }
        self.active
            .par_iter_mut()
            .zip(drawn.into_par_iter())
            .with_min_len(2)
            .map(|(seq, drawn)| match drawn? {
                Drawn::Picked(sampled) => Some(sampled),
                Drawn::OnHost(row) => Some(sample_token(&row, &seq.request.params, &mut seq.rng)),
            })
            .collect()
    }

    /// One forward pass's draws: `members` (indices into the batch) from `logits`.
    fn draw_pass<'a>(
        &mut self,
        logits: &'a Logits,
        members: &[usize],
        draw_from: &[Option<(usize, usize)>],
        drawn: &mut [Option<Drawn<'a>>],
    ) -> Result<(), BackendError> {
        let mut picks = Vec::new();
        let mut picked_by = Vec::new();
        for &i in members {
            let Some((_, row)) = draw_from[i] else {
                continue;
            };
            let seq = &mut self.active[i];
            let params = &seq.request.params;
            if logits.on_device() && drawn_on_device(params) {
                let uniform = if params.temperature > 0.0 {
                    seq.rng.next_f32()
                } else {
                    0.0
                };
                picks.push(Pick {
                    row,
                    temperature: params.temperature,
                    uniform,
                    top_n: params.top_logprobs,
                    top_k: params.top_k,
                    top_p: params.top_p,
                });
                picked_by.push(i);
            } else {
                drawn[i] = Some(Drawn::OnHost(logits.row(row)?));
            }
        }
        if !picks.is_empty() {
            for (i, picked) in picked_by.into_iter().zip(logits.draw(&picks)?) {
                drawn[i] = Some(Drawn::Picked(Sampled {
                    id: picked.id,
                    logprob: picked.logprob,
                    top: picked.top,
                }));
            }
        }
        Ok(())
    }

    /// A forward pass failed on the device (out of memory, a driver error): the requests
    /// it ran are told why (an error the client sees, never a silent drop) and cancelled,
    /// so their sequences leave the batch at the end of this step; their caches, which the
    /// pass may have left half-written, are kept nowhere. The engine goes on with the rest.
    fn abort_failed(&mut self, indices: &[usize], error: &BackendError) {
        tracing::error!(%error, sequences = indices.len(), "forward pass failed");
        let message = format!("the inference device failed: {error}; retry the request");
        for &i in indices {
            let seq = &mut self.active[i];
            seq.failed = true;
            let _ = seq.request.events.send(Event::Aborted {
                reason: AbortReason::DeviceFailed,
                message: message.clone(),
            });
            seq.request
                .cancel
                .iter()
                .for_each(|c| c.store(true, Ordering::SeqCst));
        }
    }
}

/// Prompt + completion limit of a model under the configured cap.
fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn max_len(model: &ServedModel, cap: usize) -> usize {
    model.loaded.model.config.max_position_embeddings.min(cap)
}

/// A sequence's next token: drawn on the device, or its row of logits to draw from here.
enum Drawn<'a> {
    Picked(Sampled),
    OnHost(Cow<'a, [f32]>),
}

/// Whether the GPU makes this draw itself: any but one asking for more alternatives than
/// it reports.
fn drawn_on_device(params: &SamplingParams) -> bool {
    params.top_logprobs <= TOP_MAX
}

/// The KV blocks a request can fill: its prompt and every token each choice may generate.
/// Its choices fork from one cache after the prompt, so the prompt's full blocks are
/// shared (never written again); the block the prompt ends in and those after it are each
/// choice's own (a write into a shared block copies it first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KvReservation {
    shared: usize,
    per_choice: usize,
    choices: usize,
}

impl KvReservation {
    fn of(room: KvRoom, request: &Request, max_len: usize) -> Self {
        let choices = request.n.max(1);
        let whole =
            room.blocks_for((request.prompt.len() + request.params.max_tokens).min(max_len));
        let shared = if choices > 1 {
            (request.prompt.len() / room.block_tokens).min(whole)
        } else {
            0
        };
        Self {
            shared,
            per_choice: whole - shared,
            choices,
        }
    }

    fn total(self) -> usize {
        self.shared + self.per_choice * self.choices
    }
}

/// Samples with the request's settings; reports the model's raw log-probabilities.
fn sample_token(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> Sampled {
    let sampling = Sampling {
        temperature: params.temperature,
        top_p: params.top_p,
        top_k: params.top_k,
        seed: 0,
    };
    let lse = log_sum_exp(logits);
    let id = if params.temperature <= 0.0 {
        // Greedy needs no sampling pass over the vocabulary.
        argmax(logits)
    } else {
        sample(logits, &sampling, rng).0
    };
    let top = if params.top_logprobs == 0 {
        Vec::new()
    } else {
        let mut indexed: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &z)| (i as u32, z - lse))
            .collect();
        let k = params.top_logprobs.min(indexed.len());
        indexed.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
        indexed.truncate(k);
        indexed.sort_by(|a, b| b.1.total_cmp(&a.1));
        indexed
    };
    Sampled {
        id,
        logprob: logits[id as usize] - lse,
        top,
    }
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &z) in logits.iter().enumerate() {
        if z > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&z| f64::from((z - max).exp())).sum();
    max + sum.ln() as f32
}

/// A seed for requests that do not fix one.
fn random_seed(counter: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ counter.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Shared prefixes shorter than this are computed again rather than copied.
const MIN_SHARED: usize = 16;

fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// KV caches of recent prompts (automatic prefix caching, as vLLM's): a request that
/// shares at least MIN_SHARED leading tokens with one starts from a copy of its cache.
/// Bounded by prompt tokens held; least recently used evicted; emptied when weights change.
struct PrefixCache {
    token_budget: usize,
    tokens_held: usize,
    entries: Vec<PrefixEntry>,
    clock: u64,
}

struct PrefixEntry {
    policy: Policy,
    tokens: Vec<u32>,
    cache: Cache,
    used: u64,
}

impl PrefixCache {
    fn new(token_budget: usize) -> Self {
        Self {
            token_budget,
            tokens_held: 0,
            entries: Vec::new(),
            clock: 0,
        }
    }

    fn enabled(&self) -> bool {
        self.token_budget > 0
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.tokens_held = 0;
    }

    /// Drops the least recently used entry; false when there is none.
    fn evict_oldest(&mut self) -> bool {
        let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
            return false;
        };
        self.tokens_held -= self.entries.swap_remove(oldest).tokens.len();
        true
    }

    /// The longest prefix of `prompt` an entry of `policy` holds (0 below MIN_SHARED).
    fn longest(&self, policy: &Policy, prompt: &[u32]) -> usize {
        self.best(policy, prompt).map_or(0, |(_, shared)| shared)
    }

    fn best(&self, policy: &Policy, prompt: &[u32]) -> Option<(usize, usize)> {
        // At least one prompt token is left to feed: its logits start the completion.
        let limit = prompt.len().saturating_sub(1);
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| &e.policy == policy)
            .map(|(i, e)| (i, shared_prefix(&e.tokens, prompt).min(limit)))
            .filter(|&(_, shared)| shared >= MIN_SHARED)
            .max_by_key(|&(_, shared)| shared)
    }

    /// A copy of the best entry's cache cut to the shared prefix, and its length.
    fn take(&mut self, model: &ServedModel, prompt: &[u32]) -> Option<(Cache, usize)> {
        let (i, shared) = self.best(&model.policy(), prompt)?;
        self.clock += 1;
        let entry = &mut self.entries[i];
        entry.used = self.clock;
        let mut cache = entry.cache.clone();
        model.truncate(&mut cache, shared);
        Some((cache, shared))
    }

    /// Keeps a copy of a prompt's cache (or marks an equal entry as used).
    fn put(&mut self, policy: Policy, tokens: &[u32], cache: &Cache) {
        if tokens.len() < MIN_SHARED || tokens.len() > self.token_budget {
            return;
        }
        self.clock += 1;
        if let Some(entry) = self
            .entries
            .iter_mut()
            .find(|e| e.policy == policy && e.tokens == tokens)
        {
            entry.used = self.clock;
            return;
        }
        while self.tokens_held + tokens.len() > self.token_budget && self.evict_oldest() {}
        self.tokens_held += tokens.len();
        self.entries.push(PrefixEntry {
            policy,
            tokens: tokens.to_vec(),
            cache: cache.clone(),
            used: self.clock,
        });
    }
}

/// KV caches of recent sessions, keyed by session id, least recently used evicted.
struct SessionCache {
    capacity: usize,
    entries: HashMap<String, SessionEntry>,
    clock: u64,
}

struct SessionEntry {
    policy: Policy,
    tokens: Vec<u32>,
    cache: Cache,
    used: u64,
}

impl SessionCache {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: HashMap::new(),
            clock: 0,
        }
    }

    fn clear(&mut self) {
        self.entries.clear();
    }

    /// Drops the least recently used session's cache; false when there is none.
    fn evict_oldest(&mut self) -> bool {
        let oldest = self
            .entries
            .iter()
            .min_by_key(|(_, e)| e.used)
            .map(|(k, _)| k.clone());
        oldest.is_some_and(|k| self.entries.remove(&k).is_some())
    }

    /// The session's cache cut to the prefix it shares with `prompt` (keeping at least one
    /// prompt token to feed), and that prefix's length; None when nothing is shared.
    fn take(
        &mut self,
        session: &str,
        model: &ServedModel,
        prompt: &[u32],
    ) -> Option<(Cache, usize)> {
        let entry = self.entries.remove(session)?;
        if !model.is(&entry.policy) {
            return None;
        }
        let shared = entry
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len().saturating_sub(1));
        if shared == 0 {
            return None;
        }
        let mut cache = entry.cache;
        model.truncate(&mut cache, shared);
        Some((cache, shared))
    }

    fn put(&mut self, session: &str, policy: Policy, tokens: Vec<u32>, cache: Cache) {
        if self.capacity == 0 || tokens.is_empty() {
            return;
        }
        self.clock += 1;
        if self.entries.len() >= self.capacity && !self.entries.contains_key(session) {
            self.evict_oldest();
        }
        self.entries.insert(
            session.to_owned(),
            SessionEntry {
                policy,
                tokens,
                cache,
                used: self.clock,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(prompt: usize, n: usize, max_tokens: usize) -> Request {
        Request {
            prompt: vec![1; prompt],
            n,
            params: SamplingParams::greedy(max_tokens, 0),
            session: None,
            events: mpsc::unbounded_channel().0,
            cancel: Vec::new(),
        }
    }

    #[test]
    fn choices_set_aside_their_shared_prompt_blocks_once() {
        let room = KvRoom {
            block_tokens: 16,
            blocks: 1000,
        };
        let of =
            |prompt, n, max_tokens| KvReservation::of(room, &request(prompt, n, max_tokens), 4096);
        // One choice: all of prompt + completion, as before.
        assert_eq!(of(40, 1, 24).total(), 4);
        // 8 choices of a 1,000-token prompt (62 full blocks, the 63rd partly filled) and 200
        // new tokens (75 blocks in all): 62 once, then 13 each, not 8 × 75.
        let group = of(1000, 8, 200);
        assert_eq!((group.shared, group.per_choice), (62, 13));
        assert_eq!(group.total(), 62 + 8 * 13);
        // A prompt ending on a block boundary leaves nothing partly filled to copy.
        assert_eq!(of(32, 4, 16).total(), 2 + 4);
        // The model's length caps what a choice can fill.
        assert_eq!(of(4000, 2, 500).total(), 250 + 2 * 6);
    }
}
