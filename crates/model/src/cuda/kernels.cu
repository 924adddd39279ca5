// The CUDA backend's kernels, compiled by NVRTC when the backend starts (no nvcc at build
// time). Each one mirrors a CPU kernel of `ops/` and keeps its shape conventions: row-major
// f32, N tokens, C channels, nh heads, nkv key/value heads, hd head size, V vocabulary.
// Reductions accumulate in f32 (sum of squares in f64); matrix products are cuBLAS (bf16
// inputs, f32 accumulation) and live in `gemm.rs`, not here.
//
// No headers: NVRTC needs none for this file, so nothing depends on CUDA's include folder.
// bf16 values are `unsigned short` bit patterns (what cuBLAS reads as CUDA_R_16BF).

typedef unsigned short bf16_bits;

#define BLOCK 256
// −∞ without math.h (NVRTC has no headers here).
#define NEG_INF __int_as_float(0xff800000)

// ---- reductions within one block (blockDim.x == BLOCK) ----

__device__ float block_sum(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += shared[w];
    return total;
}

__device__ float block_max(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float m = NEG_INF;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, shared[w]);
    return m;
}

// ---- elementwise and memory ----

// bf16(v), round to nearest even; NaN stays NaN.
__device__ bf16_bits round_bf16(float v) {
    unsigned int bits = __float_as_uint(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16_bits)((bits >> 16) | 0x40);
    return (bf16_bits)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// out (len) = bf16(x).
extern "C" __global__ void to_bf16(bf16_bits* out, const float* x, long long len) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < len) out[i] = round_bf16(x[i]);
}

// x ≈ hi + lo, both bf16 (16 significant bits together): gradients flowing back through
// the layers keep f32-like precision in products that otherwise take one bf16 operand.
extern "C" __global__ void to_bf16_split(bf16_bits* hi, bf16_bits* lo, const float* x, long long len) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= len) return;
    bf16_bits h = round_bf16(x[i]);
    hi[i] = h;
    lo[i] = round_bf16(x[i] - __uint_as_float(((unsigned int)h) << 16));
}

extern "C" __global__ void add_assign(float* x, const float* y, long long len) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < len) x[i] += y[i];
}

extern "C" __global__ void scale(float* x, float factor, long long len) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < len) x[i] *= factor;
}

// total += Σ x² (f64 accumulation, one atomic per block).
extern "C" __global__ void sum_squares(double* total, const float* x, long long len) {
    __shared__ double partial[BLOCK];
    double acc = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        double v = (double)x[i];
        acc += v * v;
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(total, partial[0]);
}

// out row r = x row rows[r]. out: (R, c)
extern "C" __global__ void gather_rows(float* out, const float* x, const int* rows, int nrows, int c) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)nrows * c) return;
    int r = (int)(i / c), col = (int)(i % c);
    out[i] = x[(long long)rows[r] * c + col];
}

// out (N, O) += bias (O) on every row.
extern "C" __global__ void add_bias(float* out, const float* bias, int n, int o) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < (long long)n * o) out[i] += bias[i % o];
}

// db (O) += Σ_rows dout (N, O). grid: (ceil(O/BLOCK), ceil(N/rows_per_block))
extern "C" __global__ void column_sums(float* db, const float* dout, int n, int o, int rows_per_block) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= o) return;
    int r0 = blockIdx.y * rows_per_block;
    int r1 = min(n, r0 + rows_per_block);
    float acc = 0.f;
    for (int r = r0; r < r1; r++) acc += dout[(long long)r * o + col];
    atomicAdd(&db[col], acc);
}

// ---- embedding ----

// out (N, C) = table rows of tokens. table: (V, C)
extern "C" __global__ void embedding_forward(float* out, const float* table, const unsigned int* tokens, int n, int c) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)n * c) return;
    int t = (int)(i / c), col = (int)(i % c);
    out[i] = table[(long long)tokens[t] * c + col];
}

// dtable rows of tokens += dout rows (repeated tokens add up: atomics).
extern "C" __global__ void embedding_backward(float* dtable, const float* dout, const unsigned int* tokens, int n, int c) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)n * c) return;
    int t = (int)(i / c), col = (int)(i % c);
    atomicAdd(&dtable[(long long)tokens[t] * c + col], dout[i]);
}

// ---- RMSNorm: one block per row ----

// out = x · rstd · w; rstd (N) = 1/rms. x, out: (N, C)
extern "C" __global__ void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int c, float eps) {
    __shared__ float shared[32];
    const float* xr = x + (long long)blockIdx.x * c;
    float* outr = out + (long long)blockIdx.x * c;
    float acc = 0.f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) acc += xr[j] * xr[j];
    float ms = block_sum(acc, shared) / (float)c;
    float s = 1.0f / sqrtf(ms + eps);
    for (int j = threadIdx.x; j < c; j += blockDim.x) outr[j] = xr[j] * s * w[j];
    if (threadIdx.x == 0) rstd[blockIdx.x] = s;
}

// dx += s·w·dout − x·s³·(Σ dout·w·x)/C, per row. One block per row.
extern "C" __global__ void rmsnorm_backward_dx(float* dx, const float* dout, const float* x, const float* w, const float* rstd, int c) {
    __shared__ float shared[32];
    long long base = (long long)blockIdx.x * c;
    float s = rstd[blockIdx.x];
    float acc = 0.f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) acc += dout[base + j] * w[j] * x[base + j];
    float dot = block_sum(acc, shared);
    float k = s * s * s * dot / (float)c;
    for (int j = threadIdx.x; j < c; j += blockDim.x)
        dx[base + j] += s * w[j] * dout[base + j] - k * x[base + j];
}

// dw (C) += Σ_rows dout · x · rstd. grid: (ceil(C/BLOCK), ceil(N/rows_per_block))
extern "C" __global__ void rmsnorm_backward_dw(float* dw, const float* dout, const float* x, const float* rstd, int n, int c, int rows_per_block) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= c) return;
    int r0 = blockIdx.y * rows_per_block;
    int r1 = min(n, r0 + rows_per_block);
    float acc = 0.f;
    for (int r = r0; r < r1; r++) acc += dout[(long long)r * c + col] * x[(long long)r * c + col] * rstd[r];
    atomicAdd(&dw[col], acc);
}

// ---- RoPE (rotate_half layout), in place. x: (N, heads, hd); one thread per (row, head, i < hd/2)

extern "C" __global__ void rope_apply(float* x, const int* positions, const float* inv_freq, int n, int heads, int half, float sign) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)n * heads * half) return;
    int f = (int)(i % half);
    long long rh = i / half;  // row * heads + head
    int row = (int)(rh / heads);
    float a = (float)positions[row] * inv_freq[f];
    float cs = cosf(a), sn = sign * sinf(a);
    float* head = x + rh * (2LL * half);
    float x1 = head[f], x2 = head[f + half];
    head[f] = x1 * cs - x2 * sn;
    head[f + half] = x2 * cs + x1 * sn;
}

// ---- SwiGLU ----

extern "C" __global__ void swiglu_forward(float* out, const float* gate, const float* up, long long len) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= len) return;
    float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
}

extern "C" __global__ void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, long long len) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= len) return;
    float g = gate[i], d = dout[i];
    float sig = 1.0f / (1.0f + expf(-g));
    dup[i] += d * g * sig;
    dgate[i] += d * up[i] * (sig * (1.0f + g * (1.0f - sig)));
}

// ---- causal grouped-query attention over packed spans ----
// Per row r of the batch: span[r] = (first row of its sequence, length T, offset of the
// sequence's (nh, T, T) probabilities in att). att keeps every probability for the backward
// (the flash-style kernels of the next GPU issue drop it).

// One block per (row, head). out: (N, nh, hd); att row (span, h, i) gets P_i·.
extern "C" __global__ void attention_forward(float* out, float* att, const float* q, const float* k, const float* v,
                                             const long long* span, int heads, int kv_heads, int hd) {
    __shared__ float shared[32];
    int row = blockIdx.x, h = blockIdx.y;
    long long start = span[3 * row], t = span[3 * row + 1], off = span[3 * row + 2];
    int i = (int)(row - start);
    int kvh = h / (heads / kv_heads);
    float scale = 1.0f / sqrtf((float)hd);
    const float* qi = q + ((long long)row * heads + h) * hd;
    float* p = att + off + ((long long)h * t + i) * t;
    float local_max = NEG_INF;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) {
        const float* kj = k + ((start + j) * kv_heads + kvh) * hd;
        float s = 0.f;
        for (int d = 0; d < hd; d++) s += qi[d] * kj[d];
        s *= scale;
        p[j] = s;
        local_max = fmaxf(local_max, s);
    }
    float m = block_max(local_max, shared);
    float local_sum = 0.f;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) {
        float e = expf(p[j] - m);
        p[j] = e;
        local_sum += e;
    }
    float sum = block_sum(local_sum, shared);
    for (int j = threadIdx.x; j < t; j += blockDim.x) p[j] = j <= i ? p[j] / sum : 0.f;
    __syncthreads();
    float* oi = out + ((long long)row * heads + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j <= i; j++) acc += p[j] * v[((start + j) * kv_heads + kvh) * hd + d];
        oi[d] = acc;
    }
}

// D (N, nh) = Σ_j P_ij (dout_i · v_j), the softmax backward's row dot. One block per (row, head).
extern "C" __global__ void attention_backward_rowdot(float* dot, const float* dout, const float* att, const float* v,
                                                     const long long* span, int heads, int kv_heads, int hd) {
    __shared__ float shared[32];
    int row = blockIdx.x, h = blockIdx.y;
    long long start = span[3 * row], t = span[3 * row + 1], off = span[3 * row + 2];
    int i = (int)(row - start);
    int kvh = h / (heads / kv_heads);
    const float* doi = dout + ((long long)row * heads + h) * hd;
    const float* p = att + off + ((long long)h * t + i) * t;
    float acc = 0.f;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) {
        const float* vj = v + ((start + j) * kv_heads + kvh) * hd;
        float dp = 0.f;
        for (int d = 0; d < hd; d++) dp += doi[d] * vj[d];
        acc += p[j] * dp;
    }
    float total = block_sum(acc, shared);
    if (threadIdx.x == 0) dot[(long long)row * heads + h] = total;
}

// Rows of the softmax backward held in shared memory at once (tiles of a sequence).
#define TILE 1024

// dq_i += scale · Σ_j P_ij (dout_i·v_j − D_i) k_j. One block per (row, head); j in tiles.
extern "C" __global__ void attention_backward_dq(float* dq, const float* dout, const float* att, const float* k,
                                                 const float* v, const float* dot,
                                                 const long long* span, int heads, int kv_heads, int hd) {
    __shared__ float ds[TILE];  // this row's dS over one tile of keys
    int row = blockIdx.x, h = blockIdx.y;
    long long start = span[3 * row], t = span[3 * row + 1], off = span[3 * row + 2];
    int i = (int)(row - start);
    int kvh = h / (heads / kv_heads);
    float scale = 1.0f / sqrtf((float)hd);
    const float* doi = dout + ((long long)row * heads + h) * hd;
    const float* p = att + off + ((long long)h * t + i) * t;
    float di = dot[(long long)row * heads + h];
    float* dqi = dq + ((long long)row * heads + h) * hd;
    for (int j0 = 0; j0 <= i; j0 += TILE) {
        int j1 = min(i + 1, j0 + TILE);
        __syncthreads();
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
            const float* vj = v + ((start + j) * kv_heads + kvh) * hd;
            float dp = 0.f;
            for (int d = 0; d < hd; d++) dp += doi[d] * vj[d];
            ds[j - j0] = p[j] * (dp - di) * scale;
        }
        __syncthreads();
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float acc = 0.f;
            for (int j = j0; j < j1; j++) acc += ds[j - j0] * k[((start + j) * kv_heads + kvh) * hd + d];
            dqi[d] += acc;
        }
    }
}

// For key row j and kv head g, over the heads h of its group and the rows i ≥ j (in tiles):
// dv_j += Σ P_ij dout_i; dk_j += scale · Σ P_ij (dout_i·v_j − D_i) q_i. One block per (row, kv head).
extern "C" __global__ void attention_backward_dkv(float* dk, float* dv, const float* dout, const float* att, const float* q,
                                                  const float* v, const float* dot,
                                                  const long long* span, int heads, int kv_heads, int hd) {
    __shared__ float pc[TILE];   // P_ij over one tile of query rows
    __shared__ float dsc[TILE];  // dS_ij over the same tile
    int row = blockIdx.x, g = blockIdx.y;
    long long start = span[3 * row], t = span[3 * row + 1], off = span[3 * row + 2];
    int j = (int)(row - start);
    int group = heads / kv_heads;
    float scale = 1.0f / sqrtf((float)hd);
    const float* vj = v + ((long long)row * kv_heads + g) * hd;
    float* dkj = dk + ((long long)row * kv_heads + g) * hd;
    float* dvj = dv + ((long long)row * kv_heads + g) * hd;
    for (int hh = 0; hh < group; hh++) {
        int h = g * group + hh;
        for (int i0 = j; i0 < t; i0 += TILE) {
            int i1 = (int)min((long long)(i0 + TILE), t);
            __syncthreads();
            for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
                long long qrow = start + i;
                const float* doi = dout + (qrow * heads + h) * hd;
                float pij = att[off + ((long long)h * t + i) * t + j];
                float dp = 0.f;
                for (int d = 0; d < hd; d++) dp += doi[d] * vj[d];
                pc[i - i0] = pij;
                dsc[i - i0] = pij * (dp - dot[qrow * heads + h]) * scale;
            }
            __syncthreads();
            for (int d = threadIdx.x; d < hd; d += blockDim.x) {
                float acc_v = 0.f, acc_k = 0.f;
                for (int i = i0; i < i1; i++) {
                    long long qrow = start + i;
                    acc_v += pc[i - i0] * dout[(qrow * heads + h) * hd + d];
                    acc_k += dsc[i - i0] * q[(qrow * heads + h) * hd + d];
                }
                dvj[d] += acc_v;
                dkj[d] += acc_k;
            }
        }
    }
}

// Query rows (t of them, at positions start..) over a cache of start + t keys. One block per
// (new row, head); scores go to a scratch row of length start + t. q, out: (t, nh, hd) at
// the given row offset; k, v: (len, nkv, hd).
extern "C" __global__ void attention_cached(float* out, float* scores, const float* q, const float* k, const float* v,
                                            int start, int t, int heads, int kv_heads, int hd) {
    __shared__ float shared[32];
    int r = blockIdx.x, h = blockIdx.y;
    int kvh = h / (heads / kv_heads);
    int visible = start + r + 1;
    int width = start + t;
    float scale = 1.0f / sqrtf((float)hd);
    const float* qi = q + ((long long)r * heads + h) * hd;
    float* p = scores + ((long long)r * heads + h) * width;
    float local_max = NEG_INF;
    for (int j = threadIdx.x; j < visible; j += blockDim.x) {
        const float* kj = k + ((long long)j * kv_heads + kvh) * hd;
        float s = 0.f;
        for (int d = 0; d < hd; d++) s += qi[d] * kj[d];
        s *= scale;
        p[j] = s;
        local_max = fmaxf(local_max, s);
    }
    float m = block_max(local_max, shared);
    float local_sum = 0.f;
    for (int j = threadIdx.x; j < visible; j += blockDim.x) {
        float e = expf(p[j] - m);
        p[j] = e;
        local_sum += e;
    }
    float sum = block_sum(local_sum, shared);
    __syncthreads();
    float* oi = out + ((long long)r * heads + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < visible; j++) acc += p[j] * v[((long long)j * kv_heads + kvh) * hd + d];
        oi[d] = acc / sum;
    }
}

// ---- the vocabulary head, on a chunk of R rows of logits (R, V) ----

// lse, entropy, logprob (rows r0..r0+R) from logits. One block per row. target −1 = none.
extern "C" __global__ void head_stats(float* lse, float* entropy, float* logprob, const float* logits,
                                      const int* targets, int r0, int vocab) {
    __shared__ float shared[32];
    const float* z = logits + (long long)blockIdx.x * vocab;
    int r = r0 + blockIdx.x;
    float local_max = NEG_INF;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) local_max = fmaxf(local_max, z[j]);
    float m = block_max(local_max, shared);
    float local_sum = 0.f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) local_sum += expf(z[j] - m);
    float l = m + logf(block_sum(local_sum, shared));
    // H = lse − Σ p z
    float local_pz = 0.f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) local_pz += expf(z[j] - l) * z[j];
    float pz = block_sum(local_pz, shared);
    if (threadIdx.x == 0) {
        lse[r] = l;
        entropy[r] = l - pz;
        int target = targets[r];
        logprob[r] = target >= 0 ? z[target] - l : 0.f;
    }
}

// logits (R, V) → ∂L/∂z in place: −d_lp·p − d_H·p·(log p + H), plus d_lp at the target.
extern "C" __global__ void head_dlogits(float* z, const float* lse, const float* entropy, const float* d_logprob,
                                        const float* d_entropy, const int* targets, int r0, int vocab) {
    int r = r0 + blockIdx.x;
    float* zr = z + (long long)blockIdx.x * vocab;
    float l = lse[r], h = entropy[r], d_lp = d_logprob[r], d_h = d_entropy[r];
    int target = targets[r];
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float logp = zr[j] - l;
        float p = expf(logp);
        float g = -d_lp * p - d_h * p * (logp + h);
        if (j == target) g += d_lp;
        zr[j] = g;
    }
}

// ---- AdamW (decoupled weight decay), elementwise ----

extern "C" __global__ void adamw(float* param, const float* grad, float* m, float* v, long long len, float lr, float beta1,
                                 float beta2, float eps, float weight_decay, float correction1, float correction2) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= len) return;
    float g = grad[i];
    float mi = beta1 * m[i] + (1.0f - beta1) * g;
    float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float update = (mi / correction1) / (sqrtf(vi / correction2) + eps);
    param[i] -= lr * (update + weight_decay * param[i]);
}
