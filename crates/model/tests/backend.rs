//! The compute boundary holds: the model and its training passes run unchanged on a second
//! backend whose buffers are opaque (not `Vec<f32>`), give bit-identical results to the
//! CPU backend, and move data across the boundary only where they return results.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use arl_model::backend::{AdamStep, Backend, KvRows, Span};
use arl_model::config::{Architecture, ModelConfig};
use arl_model::generate::{Sampling, generate};
use arl_model::load::LoadedModel;
use arl_model::model::{KvCache, Model, SeqInput};
use arl_model::ops::{ContiguousKv, Cpu, PackedMatrix};
use arl_model::train::AdamW;
use arl_model::weights::Weights;

/// A buffer the model cannot look into: only the backend can.
#[derive(Clone, Debug)]
struct DeviceBuf(Vec<f32>);

/// A handle to a block-format matrix held by the device.
#[derive(Clone, Copy, Debug)]
struct DevicePacked(usize);

/// A device stand-in: its own buffer type, host transfers counted, kernels from the CPU.
#[derive(Clone, Debug, Default)]
struct Device {
    uploads: Arc<AtomicUsize>,
    downloads: Arc<AtomicUsize>,
    packed: Arc<std::sync::Mutex<Vec<PackedMatrix>>>,
}

impl Device {
    fn transfers(&self) -> (usize, usize) {
        (
            self.uploads.load(Ordering::SeqCst),
            self.downloads.load(Ordering::SeqCst),
        )
    }
    fn packed(&self, p: &DevicePacked) -> PackedMatrix {
        self.packed.lock().unwrap()[p.0].clone()
    }
}

type B = DeviceBuf;

impl Backend for Device {
    type Buf = DeviceBuf;
    type Packed = DevicePacked;
    // The cache is the CPU's own (its keys and values are host slices either way).
    type Kv = ContiguousKv;
    type KvStep = ();

    fn name(&self) -> &'static str {
        "test-device"
    }
    fn zeros(&self, len: usize) -> B {
        DeviceBuf(vec![0.0; len])
    }
    fn upload(&self, host: &[f32]) -> B {
        self.uploads.fetch_add(1, Ordering::SeqCst);
        DeviceBuf(host.to_vec())
    }
    fn download(&self, buf: &B) -> Vec<f32> {
        self.downloads.fetch_add(1, Ordering::SeqCst);
        buf.0.clone()
    }
    fn len(&self, buf: &B) -> usize {
        buf.0.len()
    }
    fn pack(&self, host: &PackedMatrix) -> Option<DevicePacked> {
        let mut all = self.packed.lock().unwrap();
        all.push(host.clone());
        Some(DevicePacked(all.len() - 1))
    }
    fn kv_new(&self, layers: usize, kv_dim: usize) -> ContiguousKv {
        Cpu.kv_new(layers, kv_dim)
    }
    fn kv_truncate(&self, kv: &mut ContiguousKv, len: usize) {
        Cpu.kv_truncate(kv, len);
    }
    fn kv_prepare(&self, seqs: &mut [KvRows<'_, ContiguousKv>]) {
        Cpu.kv_prepare(seqs);
    }
    fn kv_write(&self, l: usize, _: &(), seqs: &mut [KvRows<'_, ContiguousKv>], k: &B, v: &B) {
        Cpu.kv_write(l, &(), seqs, &k.0, &v.0);
    }
    fn gather_rows(&self, out: &mut B, x: &B, rows: &[usize], c: usize) {
        Cpu.gather_rows(&mut out.0, &x.0, rows, c);
    }
    fn add_assign(&self, x: &mut B, y: &B) {
        Cpu.add_assign(&mut x.0, &y.0);
    }
    fn scale(&self, x: &mut B, factor: f32) {
        Cpu.scale(&mut x.0, factor);
    }
    fn sum_squares(&self, xs: &[&B]) -> f64 {
        Cpu.sum_squares(&xs.iter().map(|x| &x.0).collect::<Vec<_>>())
    }
    fn embedding_forward(&self, out: &mut B, table: &B, tokens: &[u32]) {
        Cpu.embedding_forward(&mut out.0, &table.0, tokens);
    }
    fn embedding_backward(&self, dtable: &mut B, dout: &B, tokens: &[u32]) {
        Cpu.embedding_backward(&mut dtable.0, &dout.0, tokens);
    }
    fn rmsnorm_forward(&self, out: &mut B, rstd: &mut B, x: &B, w: &B, eps: f32) {
        Cpu.rmsnorm_forward(&mut out.0, &mut rstd.0, &x.0, &w.0, eps);
    }
    fn rmsnorm_backward(&self, dx: &mut B, dw: &mut B, dout: &B, x: &B, w: &B, rstd: &B) {
        Cpu.rmsnorm_backward(&mut dx.0, &mut dw.0, &dout.0, &x.0, &w.0, &rstd.0);
    }
    fn matmul_forward(
        &self,
        out: &mut B,
        x: &B,
        w: &B,
        bias: Option<&B>,
        n: usize,
        i: usize,
        o: usize,
    ) {
        Cpu.matmul_forward(&mut out.0, &x.0, &w.0, bias.map(|b| &b.0), n, i, o);
    }
    fn matmul_packed(&self, out: &mut B, x: &B, w: &DevicePacked, bias: Option<&B>, n: usize) {
        let w = self.packed(w);
        Cpu.matmul_packed(&mut out.0, &x.0, &w, bias.map(|b| &b.0), n);
    }
    fn matmul_backward(
        &self,
        dx: &mut B,
        dw: &mut B,
        db: Option<&mut B>,
        dout: &B,
        x: &B,
        w: &B,
        n: usize,
        i: usize,
        o: usize,
    ) {
        let db = db.map(|b| &mut b.0);
        Cpu.matmul_backward(&mut dx.0, &mut dw.0, db, &dout.0, &x.0, &w.0, n, i, o);
    }
    fn rope_apply(&self, x: &mut B, heads: usize, positions: &[usize], inv: &[f32], sign: f32) {
        Cpu.rope_apply(&mut x.0, heads, positions, inv, sign);
    }
    fn swiglu_forward(&self, out: &mut B, gate: &B, up: &B) {
        Cpu.swiglu_forward(&mut out.0, &gate.0, &up.0);
    }
    fn swiglu_backward(&self, dgate: &mut B, dup: &mut B, dout: &B, gate: &B, up: &B) {
        Cpu.swiglu_backward(&mut dgate.0, &mut dup.0, &dout.0, &gate.0, &up.0);
    }
    fn attention_forward(
        &self,
        out: &mut B,
        lse: &mut B,
        q: &B,
        k: &B,
        v: &B,
        spans: &[Span],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) {
        Cpu.attention_forward(
            &mut out.0, &mut lse.0, &q.0, &k.0, &v.0, spans, heads, kv_heads, hd,
        );
    }
    fn attention_backward(
        &self,
        dq: &mut B,
        dk: &mut B,
        dv: &mut B,
        dout: &B,
        out: &B,
        lse: &B,
        q: &B,
        k: &B,
        v: &B,
        spans: &[Span],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) {
        Cpu.attention_backward(
            &mut dq.0, &mut dk.0, &mut dv.0, &dout.0, &out.0, &lse.0, &q.0, &k.0, &v.0, spans,
            heads, kv_heads, hd,
        );
    }
    fn kv_attention(
        &self,
        layer: usize,
        _: &(),
        out: &mut B,
        q: &B,
        k: &B,
        v: &B,
        seqs: &[KvRows<'_, ContiguousKv>],
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) {
        Cpu.kv_attention(
            layer,
            &(),
            &mut out.0,
            &q.0,
            &k.0,
            &v.0,
            seqs,
            heads,
            kv_heads,
            hd,
        );
    }
    fn head_forward(
        &self,
        lse: &mut B,
        entropy: &mut B,
        logprob: &mut B,
        h: &B,
        w: &B,
        targets: &[Option<u32>],
        c: usize,
        vocab: usize,
    ) {
        Cpu.head_forward(
            &mut lse.0,
            &mut entropy.0,
            &mut logprob.0,
            &h.0,
            &w.0,
            targets,
            c,
            vocab,
        );
    }
    fn head_backward(
        &self,
        dh: &mut B,
        dw: &mut B,
        h: &B,
        w: &B,
        lse: &B,
        entropy: &B,
        targets: &[Option<u32>],
        d_logprob: &[f32],
        d_entropy: &[f32],
        c: usize,
        vocab: usize,
    ) {
        Cpu.head_backward(
            &mut dh.0, &mut dw.0, &h.0, &w.0, &lse.0, &entropy.0, targets, d_logprob, d_entropy, c,
            vocab,
        );
    }
    fn adamw(&self, param: &mut B, grad: &B, m: &mut B, v: &mut B, step: AdamStep) {
        Cpu.adamw(&mut param.0, &grad.0, &mut m.0, &mut v.0, step);
    }
}

fn tiny(architecture: Architecture) -> ModelConfig {
    ModelConfig {
        architecture,
        vocab_size: 50,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: architecture == Architecture::Llama,
    }
}

/// Prefill two sequences together, then decode both for a few steps.
fn decode<Bk: Backend>(model: &Model<Bk>) -> Vec<Vec<f32>> {
    let mut a = KvCache::new(model);
    let mut b = KvCache::new(model);
    let mut all = model.forward(&mut [
        SeqInput {
            tokens: &[1, 7, 3, 9],
            cache: &mut a,
        },
        SeqInput {
            tokens: &[4, 2],
            cache: &mut b,
        },
    ]);
    for token in [5u32, 11, 13] {
        all.extend(model.forward(&mut [
            SeqInput {
                tokens: &[token],
                cache: &mut a,
            },
            SeqInput {
                tokens: &[token + 1],
                cache: &mut b,
            },
        ]));
    }
    all
}

/// Two training updates; returns the log-probabilities before and the weights after.
fn train<Bk: Backend>(model: &mut Model<Bk>) -> (Vec<Vec<f32>>, Weights) {
    let sequences: [&[u32]; 2] = [&[1, 5, 9, 2, 33, 7], &[3, 11, 18, 49, 0]];
    let mut optimizer = AdamW::new(model, 0.01);
    let mut first = Vec::new();
    for _ in 0..2 {
        let (pass, logprobs) = model.forward_train(&sequences);
        let d: Vec<Vec<f32>> = logprobs.iter().map(|r| vec![1.0; r.len()]).collect();
        let d_entropy: Vec<Vec<f32>> = logprobs.iter().map(|r| vec![0.1; r.len()]).collect();
        let mut grads = model.zeros_like_weights();
        model.backward(&pass, &d, &d_entropy, &mut grads);
        let norm = model.grad_norm(&grads);
        model.scale_grads(&mut grads, 1.0 / norm.max(1.0));
        optimizer.update(model, &grads, 0.01);
        if first.is_empty() {
            first = logprobs;
        }
    }
    (first, model.host_weights())
}

#[test]
fn the_model_runs_unchanged_on_another_backend_with_identical_results() {
    for architecture in [Architecture::Llama, Architecture::Qwen2] {
        let config = tiny(architecture);
        let mut cpu = Model::new(config.clone(), Weights::random(&config, 3, 0.3));
        let device = Device::default();
        let mut on_device = cpu.to_backend(device.clone());
        let uploaded = device.transfers().0;
        assert_eq!(
            uploaded,
            cpu.weights().named().len(),
            "one upload per tensor"
        );

        let expected = decode(&cpu);
        let (_, downloads_before) = device.transfers();
        assert_eq!(decode(&on_device), expected, "{architecture:?} logits");
        let (uploads, downloads) = device.transfers();
        // 4 forward calls: only their logits cross back; nothing is uploaded.
        assert_eq!((uploads, downloads - downloads_before), (uploaded, 4));

        let (lp_cpu, w_cpu) = train(&mut cpu);
        let (lp_dev, w_dev) = train(&mut on_device);
        assert_eq!(
            lp_dev, lp_cpu,
            "{architecture:?} training log-probabilities"
        );
        for ((name, a), (_, b)) in w_cpu.named().iter().zip(w_dev.named()) {
            assert_eq!(a.data, b.data, "{architecture:?} {name} after two updates");
        }
        assert_ne!(
            w_cpu.embed.data,
            Weights::random(&config, 3, 0.3).embed.data
        );
    }
}

#[test]
fn a_real_quantized_model_decodes_identically_through_the_boundary() {
    let loaded = LoadedModel::open(&common::smollm2()).unwrap();
    assert!(loaded.model.has_packed_weights());
    let device = Device::default();
    let on_device = loaded.model.to_backend(device.clone());
    assert!(on_device.has_packed_weights());
    assert!(!device.packed.lock().unwrap().is_empty());
    let prompt = loaded.tokenizer.encode("The capital of France is").unwrap();
    let sampling = Sampling::default();
    let cpu = generate(&loaded.model, &prompt, 8, &[], &sampling);
    let dev = generate(&on_device, &prompt, 8, &[], &sampling);
    assert_eq!(dev, cpu);
}
