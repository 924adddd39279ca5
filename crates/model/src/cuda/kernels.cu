// The CUDA backend's kernels, compiled by NVRTC when the backend starts (no nvcc at build
// time). Each one mirrors a CPU kernel of `ops/` and keeps its shape conventions: row-major
// f32, N tokens, C channels, nh heads, nkv key/value heads, hd head size, V vocabulary.
// Reductions accumulate in f32 (sum of squares in f64); matrix products are cuBLAS (bf16
// inputs, f32 accumulation, in `gemm.rs`) but for products of a few rows (`gemv_bf16`).
//
// No headers: NVRTC needs none for this file, so nothing depends on CUDA's include folder.
// bf16 values are `unsigned short` bit patterns (what cuBLAS reads as CUDA_R_16BF).

typedef unsigned short bf16_bits;

#define BLOCK 256
// −∞ without math.h (NVRTC has no headers here).
#define NEG_INF __int_as_float(0xff800000)

// ---- reductions within one block (blockDim.x == BLOCK) ----

// The block's sum, in T (float, or double where the host sums in f64); every thread gets it.
template <typename T>
__device__ T block_sum(T v, T* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += shared[w];
    return total;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
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

// Two floats as bf16x2 (round to nearest even): lo in the low half (the lower address or
// column), hi in the high half.
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
    unsigned int d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// The two floats a bf16x2 word holds.
__device__ __forceinline__ float low_half(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float high_half(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

// Elementwise kernels take 4 elements per thread: one 16-byte load per operand where the
// quad is whole and aligned (the memory-bound common case), one element at a time otherwise.
__device__ __forceinline__ bool aligned16(const void* p) { return (((unsigned long long)p) & 15) == 0; }

// out (len) = bf16(x). Threads: ceil(len / 4).
extern "C" __global__ void to_bf16(bf16_bits* out, const float* x, long long len) {
    long long i = 4 * (blockIdx.x * (long long)blockDim.x + threadIdx.x);
    if (i >= len) return;
    if (i + 4 <= len && aligned16(x + i) && (((unsigned long long)(out + i)) & 7) == 0) {
        float4 v = *(const float4*)(x + i);
        uint2 w;
        w.x = pack2(v.x, v.y);
        w.y = pack2(v.z, v.w);
        *(uint2*)(out + i) = w;
        return;
    }
    for (long long j = i; j < len && j < i + 4; j++) out[j] = round_bf16(x[j]);
}

// out (len) = x rounded to bf16 and widened back: the values a bf16 file of x holds.
// Threads: len.
extern "C" __global__ void round_to_bf16(float* out, const float* x, long long len) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < len) out[i] = __uint_as_float(((unsigned int)round_bf16(x[i])) << 16);
}

// x ≈ hi + lo, both bf16 (16 significant bits together): gradients flowing back through
// the layers keep f32-like precision in products that otherwise take one bf16 operand.
// Threads: ceil(len / 4).
extern "C" __global__ void to_bf16_split(bf16_bits* hi, bf16_bits* lo, const float* x, long long len) {
    long long i = 4 * (blockIdx.x * (long long)blockDim.x + threadIdx.x);
    if (i >= len) return;
    if (i + 4 <= len && aligned16(x + i) && (((unsigned long long)(hi + i)) & 7) == 0 &&
        (((unsigned long long)(lo + i)) & 7) == 0) {
        float4 v = *(const float4*)(x + i);
        uint2 h, l;
        h.x = pack2(v.x, v.y);
        h.y = pack2(v.z, v.w);
        l.x = pack2(v.x - low_half(h.x), v.y - high_half(h.x));
        l.y = pack2(v.z - low_half(h.y), v.w - high_half(h.y));
        *(uint2*)(hi + i) = h;
        *(uint2*)(lo + i) = l;
        return;
    }
    for (long long j = i; j < len && j < i + 4; j++) {
        bf16_bits top = round_bf16(x[j]);
        hi[j] = top;
        lo[j] = round_bf16(x[j] - __uint_as_float(((unsigned int)top) << 16));
    }
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

// out = x · rstd · w; rstd (N) = 1/rms. x, out: (N, C). With out_bf, out's bf16 rounding
// too (what to_bf16 would make of it, for the products that read it).
extern "C" __global__ void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int c, float eps,
                                           bf16_bits* out_bf) {
    __shared__ float shared[32];
    const float* xr = x + (long long)blockIdx.x * c;
    float* outr = out + (long long)blockIdx.x * c;
    float acc = 0.f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) acc += xr[j] * xr[j];
    float ms = block_sum(acc, shared) / (float)c;
    float s = 1.0f / sqrtf(ms + eps);
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float v = xr[j] * s * w[j];
        outr[j] = v;
        if (out_bf) out_bf[(long long)blockIdx.x * c + j] = round_bf16(v);
    }
    if (threadIdx.x == 0) rstd[blockIdx.x] = s;
}

// x += y, then out = x · s · w with s = 1/rms(x) (a residual add and the next norm in one
// pass; the sums as rmsnorm_forward's). One block per row.
extern "C" __global__ void add_rmsnorm_forward(float* x, const float* y, float* out, float* rstd, const float* w,
                                               int c, float eps, bf16_bits* out_bf) {
    __shared__ float shared[32];
    float* xr = x + (long long)blockIdx.x * c;
    const float* yr = y + (long long)blockIdx.x * c;
    float* outr = out + (long long)blockIdx.x * c;
    float acc = 0.f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float v = xr[j] + yr[j];
        xr[j] = v;
        acc += v * v;
    }
    float ms = block_sum(acc, shared) / (float)c;
    float s = 1.0f / sqrtf(ms + eps);
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float v = xr[j] * s * w[j];
        outr[j] = v;
        if (out_bf) out_bf[(long long)blockIdx.x * c + j] = round_bf16(v);
    }
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

// q (N, heads·hd), k and v (N, kv_heads·hd) from qkv (N, (heads + 2·kv_heads)·hd), the product
// of stacked q, k and v weights: each bias added (a null bias adds nothing), q and k rotated
// as rope_apply rotates them and then scaled by `factor` (as `scale` would). With `slots`
// (kv_write's: row r's position in layer 0's keys), k and v also go into the paged cache as
// kv_write puts them. One thread per (row, head of q, k or v, i < hd/2).
extern "C" __global__ void qkv_split_rope(float* q, float* k, float* v, const float* qkv, const float* bq,
                                          const float* bk, const float* bv, const int* positions,
                                          const float* inv_freq, int n, int heads, int kv_heads, int half,
                                          float factor, const long long* slots, long long layer_offset,
                                          long long v_offset) {
    int all = heads + 2 * kv_heads, hd = 2 * half;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)n * all * half) return;
    int f = (int)(i % half);
    long long rh = i / half;  // row * all + head
    int row = (int)(rh / all), h = (int)(rh % all);
    float* dst = q;
    const float* bias = bq;
    int head = h, width = heads;
    if (h >= heads + kv_heads) {
        dst = v, bias = bv, head = h - heads - kv_heads, width = kv_heads;
    } else if (h >= heads) {
        dst = k, bias = bk, head = h - heads, width = kv_heads;
    }
    const float* src = qkv + rh * hd;
    float x1 = src[f], x2 = src[f + half];
    if (bias) {
        x1 += bias[head * hd + f];
        x2 += bias[head * hd + f + half];
    }
    float* out = dst + ((long long)row * width + head) * hd;
    // This head's place in the row's cache slot (k; v is v_offset further on).
    float* cached = slots && h >= heads ? (float*)slots[row] + layer_offset + (long long)head * hd : 0;
    if (h >= heads + kv_heads) {
        out[f] = x1;
        out[f + half] = x2;
        if (cached) {
            cached[v_offset + f] = x1;
            cached[v_offset + f + half] = x2;
        }
        return;
    }
    float a = (float)positions[row] * inv_freq[f];
    float cs = cosf(a), sn = sinf(a);
    float r1 = x1 * cs - x2 * sn, r2 = x2 * cs + x1 * sn;
    out[f] = r1 * factor;
    out[f + half] = r2 * factor;
    if (cached) {
        cached[f] = r1 * factor;
        cached[f + half] = r2 * factor;
    }
}

// ---- SwiGLU ----

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// out = silu(gate) · up. Threads: ceil(len / 4).
extern "C" __global__ void swiglu_forward(float* out, const float* gate, const float* up, long long len) {
    long long i = 4 * (blockIdx.x * (long long)blockDim.x + threadIdx.x);
    if (i >= len) return;
    if (i + 4 <= len && aligned16(out + i) && aligned16(gate + i) && aligned16(up + i)) {
        float4 g = *(const float4*)(gate + i), u = *(const float4*)(up + i), o;
        o.x = silu_times(g.x, u.x);
        o.y = silu_times(g.y, u.y);
        o.z = silu_times(g.z, u.z);
        o.w = silu_times(g.w, u.w);
        *(float4*)(out + i) = o;
        return;
    }
    for (long long j = i; j < len && j < i + 4; j++) out[j] = silu_times(gate[j], up[j]);
}

// out (N, I) = silu(gate) · up from gate_up (N, 2I), the product of stacked gate and up
// weights; with out_bf, its bf16 rounding too (as rmsnorm_forward). One thread per element.
extern "C" __global__ void swiglu_stacked(float* out, const float* gate_up, int n, int inner, bf16_bits* out_bf) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)n * inner) return;
    long long row = i / inner;
    int j = (int)(i % inner);
    const float* r = gate_up + row * 2LL * inner;
    float v = silu_times(r[j], r[inner + j]);
    out[i] = v;
    if (out_bf) out_bf[i] = round_bf16(v);
}

// dgate += d·up·σ(g)(1 + g(1 − σ(g))), dup += d·silu(g).
__device__ __forceinline__ void swiglu_grad(float& dg, float& du, float d, float g, float u) {
    float sig = 1.0f / (1.0f + expf(-g));
    du += d * g * sig;
    dg += d * u * (sig * (1.0f + g * (1.0f - sig)));
}

// Threads: ceil(len / 4).
extern "C" __global__ void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                                           long long len) {
    long long i = 4 * (blockIdx.x * (long long)blockDim.x + threadIdx.x);
    if (i >= len) return;
    if (i + 4 <= len && aligned16(dgate + i) && aligned16(dup + i) && aligned16(dout + i) && aligned16(gate + i) &&
        aligned16(up + i)) {
        float4 dg = *(float4*)(dgate + i), du = *(float4*)(dup + i);
        float4 d = *(const float4*)(dout + i), g = *(const float4*)(gate + i), u = *(const float4*)(up + i);
        swiglu_grad(dg.x, du.x, d.x, g.x, u.x);
        swiglu_grad(dg.y, du.y, d.y, g.y, u.y);
        swiglu_grad(dg.z, du.z, d.z, g.z, u.z);
        swiglu_grad(dg.w, du.w, d.w, g.w, u.w);
        *(float4*)(dgate + i) = dg;
        *(float4*)(dup + i) = du;
        return;
    }
    for (long long j = i; j < len && j < i + 4; j++) swiglu_grad(dgate[j], dup[j], dout[j], gate[j], up[j]);
}

// ---- products of a few rows: out (n, o) = x (n, k) · Wᵀ, x and W bf16, f32 sums ----
//
// cuBLAS reaches about 40% of the memory bandwidth on the decode step's thin products and
// costs a bias launch after each; these kernels stream W once for n ≤ GEMV_ROWS rows on the
// tensor cores (mma m16n8k16: 16 columns of out — rows of W — by the 8 rows of x, padded
// with zeros) and fuse what follows the product (bias; SwiGLU).
//
// A warp takes a tile of 16 columns; `split` warps of one 256-thread block share a tile's
// K range, block by block of 64 (warp g of the tile takes the K-blocks ≡ g mod split, in
// increasing order), and their partial sums are added in order g = 0, 1, … Within a K-block
// lane (q, t) (q = lane / 4, t = lane % 4) holds K elements [16t, 16t + 16) of W's rows q and
// q + 8 and of x's row q, fed to the four mma steps in one fixed order (the same
// permutation of K for W and x, so the product is unchanged). A column of x never mixes
// with another in an mma, so a row's products do not depend on n or on the other rows.
// Needs k % 8 == 0 and 16-byte aligned x and W (the caller checks).

#define GEMV_ROWS 8
#define GEMV_KBLOCK 64
// K-blocks a warp has in flight (more: more registers, fewer warps resident).
#define GEMV_UNROLL 2

__device__ __forceinline__ void mma_bf16(float* c, unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The two 16-byte chunks of a row at K-block `kb`, lane part t (zeros past the row's end or
// for a missing row).
__device__ __forceinline__ void gemv_load(uint4* dst, const bf16_bits* row, bool live, int kb, int t, int chunks) {
    int c = kb * (GEMV_KBLOCK / 8) + 2 * t;
    const uint4* v = (const uint4*)row;
    dst[0] = live && c < chunks ? __ldg(v + c) : make_uint4(0, 0, 0, 0);
    dst[1] = live && c + 1 < chunks ? __ldg(v + c + 1) : make_uint4(0, 0, 0, 0);
}

// The four mma steps of one K-block: acc (this lane's 4 sums of the 16 × 8 tile) += W rows
// (lo: row q, hi: row q + 8) · x row q, as 2 + 2 chunks each.
__device__ __forceinline__ void gemv_kblock(float* acc, const uint4* lo, const uint4* hi, const uint4* xq) {
    const unsigned int* wl = (const unsigned int*)lo;
    const unsigned int* wh = (const unsigned int*)hi;
    const unsigned int* xv = (const unsigned int*)xq;
#pragma unroll
    for (int s = 0; s < 4; s++) mma_bf16(acc, wl[2 * s], wh[2 * s], wl[2 * s + 1], wh[2 * s + 1], xv[2 * s], xv[2 * s + 1]);
}

// acc[j] (j < R: tiles of 16 columns, rows w[j] + 16·k … ) += this warp's K-blocks.
template <int R>
__device__ __forceinline__ void gemv_tiles(float (*acc)[4], const bf16_bits* const* w, const int* rows_left,
                                           const bf16_bits* x, int n, int k, int g, int split) {
    const int lane = threadIdx.x & 31, q = lane >> 2, t = lane & 3;
    const int chunks = k >> 3, kblocks = (k + GEMV_KBLOCK - 1) / GEMV_KBLOCK;
    const bf16_bits* xrow = x + (long long)q * k;
    // GEMV_UNROLL K-blocks' loads in flight before any is used: the loads are the latency.
    for (int kb = g; kb < kblocks; kb += GEMV_UNROLL * split) {
        uint4 lo[GEMV_UNROLL][R][2], hi[GEMV_UNROLL][R][2], xq[GEMV_UNROLL][2];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            int b = kb + u * split;  // past the last K-block: zeros, not used
#pragma unroll
            for (int j = 0; j < R; j++) {
                gemv_load(lo[u][j], w[j] + (long long)q * k, q < rows_left[j], b, t, chunks);
                gemv_load(hi[u][j], w[j] + (long long)(q + 8) * k, q + 8 < rows_left[j], b, t, chunks);
            }
            gemv_load(xq[u], xrow, q < n, b, t, chunks);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            if (kb + u * split >= kblocks) break;
#pragma unroll
            for (int j = 0; j < R; j++) gemv_kblock(acc[j], lo[u][j], hi[u][j], xq[u]);
        }
    }
}

// The tile's sums complete in the tile's first warp (g == 0): the split warps' partial sums
// added in order through `partial`.
__device__ __forceinline__ void gemv_tile_sums(float* acc, float (*partial)[32][4], int split) {
    if (split == 1) return;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; i++) partial[warp][lane][i] = acc[i];
    __syncthreads();
    if (warp % split == 0) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float s = partial[warp][lane][i];
            for (int g = 1; g < split; g++) s += partial[warp + g][lane][i];
            acc[i] = s;
        }
    }
}

// out (n, o) = x (n, k) · Wᵀ (+ bias (o)); n ≤ GEMV_ROWS. Blocks: ceil(ceil(o / 16) · split / 8) × 256.
extern "C" __global__ void gemv_bf16(float* out, const bf16_bits* x, const bf16_bits* w, const float* bias, int n,
                                     int k, int o, int split) {
    __shared__ float partial[8][32][4];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * (8 / split) + warp / split, g = warp % split;
    const int col = 16 * tile;
    float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    const bf16_bits* rows[1] = {w + (long long)col * k};
    const int left[1] = {o - col};
    if (col < o) gemv_tiles<1>(acc, rows, left, x, n, k, g, split);
    gemv_tile_sums(acc[0], partial, split);
    if (col >= o || g != 0) return;
    // acc: (column q, rows 2t, 2t + 1), then (column q + 8, the same rows).
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int c = col + q + (i >> 1) * 8, r = 2 * t + (i & 1);
        if (c < o && r < n) out[(long long)r * o + c] = bias ? acc[0][i] + bias[c] : acc[0][i];
    }
}

// out (n, inner) = silu(x · W_gateᵀ) · (x · W_upᵀ) from the stacked W (2·inner, k) (gate rows
// first), and its bf16 rounding into out_bf: `gemv_bf16` then `swiglu_stacked` in one pass.
// Blocks: ceil(ceil(inner / 16) · split / 8) × 256.
extern "C" __global__ void gemv_bf16_swiglu(float* out, bf16_bits* out_bf, const bf16_bits* x, const bf16_bits* w,
                                            int n, int k, int inner, int split) {
    __shared__ float partial[8][32][4];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * (8 / split) + warp / split, g = warp % split;
    const int col = 16 * tile;
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    const bf16_bits* rows[2] = {w + (long long)col * k, w + (long long)(inner + col) * k};
    const int left[2] = {inner - col, inner - col};
    if (col < inner) gemv_tiles<2>(acc, rows, left, x, n, k, g, split);
    gemv_tile_sums(acc[0], partial, split);
    gemv_tile_sums(acc[1], partial, split);
    if (col >= inner || g != 0) return;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int c = col + q + (i >> 1) * 8, r = 2 * t + (i & 1);
        if (c >= inner || r >= n) continue;
        float v = silu_times(acc[0][i], acc[1][i]);
        out[(long long)r * inner + c] = v;
        if (out_bf) out_bf[(long long)r * inner + c] = round_bf16(v);
    }
}

// ---- causal grouped-query attention over packed spans, flash-style ----
// Nothing of size T² is kept: the forward writes each (row, head)'s log-sum-exp of scaled
// scores (lse: (N, nh)) and the backward rebuilds probabilities from q, k and lse. Head
// sizes 64 and 128 run on tensor cores (mma.sync, bf16 operands, f32 accumulation); any
// other head size runs the generic kernels below them (f32 throughout).

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// ---- the generic path: block b's row = span[3b+2], the first row of its sequence span[3b], its
// length span[3b+1] (the spans need not cover every row: a step's fresh prompts) ----

// q_i · k_j · scale
__device__ float score(const float* qi, const float* kj, int hd, float scale) {
    float s = 0.f;
    for (int d = 0; d < hd; d++) s += qi[d] * kj[d];
    return s * scale;
}

// Keys a block stages in shared memory at once.
#define TILE 1024

// Where one (sequence, kv head)'s keys and values lie. Dense (training): row j at
// k + j·stride. Paged (the decode cache): position j in block blocks[j >> shift] at row
// j & (2^shift − 1); a block holds every layer's keys, then values, for 2^shift positions.
// Both say how far rows stay evenly spaced from j (`run_end`, below `end`) and how far apart
// (`step`), so the P·V loop walks a run of values with a pointer, not a lookup per row.
struct DenseKv {
    const float* k;
    const float* v;
    int stride;
    __device__ const float* key(int j) const { return k + (long long)j * stride; }
    __device__ const float* value(int j) const { return v + (long long)j * stride; }
    __device__ int run_end(int j, int end) const { return end; }
    __device__ int step() const { return stride; }
};

struct PagedKv {
    const long long* blocks;
    long long offset;    // this layer's keys and this kv head in a block
    long long v_offset;  // from a key to its value
    int shift;
    int kv_dim;
    __device__ const float* key(int j) const {
        return (const float*)blocks[j >> shift] + offset + (long long)(j & ((1 << shift) - 1)) * kv_dim;
    }
    __device__ const float* value(int j) const { return key(j) + v_offset; }
    __device__ int run_end(int j, int end) const { return min(end, ((j >> shift) + 1) << shift); }
    __device__ int step() const { return kv_dim; }
};

// One (row, head): out_i = Σ_j p_j v_j over the first `visible` keys and values, p_j =
// exp(s_j − lse) from an online max and sum, computed a tile of keys at a time; returns lse.
// Called by a whole block (`shared`, `pc` its own).
template <class Kv>
__device__ float attend_row(float* oi, const float* qi, const Kv& kv, int visible, int hd, float* shared,
                            float* pc) {
    float scale = 1.0f / sqrtf((float)hd);
    float m = NEG_INF, l = 0.f;
    for (int j = threadIdx.x; j < visible; j += blockDim.x) {
        float s = score(qi, kv.key(j), hd, scale);
        float m_new = fmaxf(m, s);
        l = l * expf(m - m_new) + expf(s - m_new);
        m = m_new;
    }
    float row_max = block_max(m, shared);
    float total = block_sum(m == NEG_INF ? 0.f : l * expf(m - row_max), shared);
    float row_lse = row_max + logf(total);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) oi[d] = 0.f;
    for (int j0 = 0; j0 < visible; j0 += TILE) {
        int j1 = min(visible, j0 + TILE);
        __syncthreads();
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
            pc[j - j0] = expf(score(qi, kv.key(j), hd, scale) - row_lse);
        }
        __syncthreads();
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float acc = 0.f;
            for (int j = j0; j < j1;) {
                const float* vj = kv.value(j) + d;
                for (int end = kv.run_end(j, j1); j < end; j++, vj += kv.step()) acc += pc[j - j0] * *vj;
            }
            oi[d] += acc;
        }
    }
    return row_lse;
}

// One block per (row, head) of the packed batch: the row attends over its sequence's keys
// up to itself.
extern "C" __global__ void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                                             const int* span, int heads, int kv_heads, int hd) {
    __shared__ float shared[32];
    __shared__ float pc[TILE];
    int row = span[3 * blockIdx.x + 2], h = blockIdx.y;
    long long start = span[3 * blockIdx.x];
    int kvh = h / (heads / kv_heads);
    long long pair = (long long)row * heads + h;
    long long first = (start * kv_heads + kvh) * hd;
    DenseKv kv = {k + first, v + first, kv_heads * hd};
    float row_lse = attend_row(out + pair * hd, q + pair * hd, kv, (int)(row - start) + 1, hd, shared, pc);
    if (threadIdx.x == 0) lse[pair] = row_lse;
}

// D (N·nh) = Σ_d dout·out per (row, head), the softmax backward's row dot (Σ_j P_ij dP_ij).
// One warp per (row, head).
extern "C" __global__ void attention_rowdot(float* dot, const float* dout, const float* out, long long pairs, int hd) {
    long long pair = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (pair >= pairs) return;
    const float* a = dout + pair * hd;
    const float* b = out + pair * hd;
    float acc = 0.f;
    for (int d = lane; d < hd; d += 32) acc += a[d] * b[d];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
    if (lane == 0) dot[pair] = acc;
}

// dq_i += scale · Σ_j P_ij (dout_i·v_j − D_i) k_j, P_ij = exp(s_ij − lse_i). One block per
// (row, head); j in tiles.
extern "C" __global__ void attention_backward_dq(float* dq, const float* dout, const float* lse, const float* q,
                                                 const float* k, const float* v, const float* dot,
                                                 const int* span, int heads, int kv_heads, int hd) {
    __shared__ float ds[TILE];  // this row's dS over one tile of keys
    int row = span[3 * blockIdx.x + 2], h = blockIdx.y;
    long long start = span[3 * blockIdx.x];
    int i = (int)(row - start);
    int kvh = h / (heads / kv_heads);
    float scale = 1.0f / sqrtf((float)hd);
    long long pair = (long long)row * heads + h;
    const float* qi = q + pair * hd;
    const float* doi = dout + pair * hd;
    float li = lse[pair], di = dot[pair];
    float* dqi = dq + pair * hd;
    for (int j0 = 0; j0 <= i; j0 += TILE) {
        int j1 = min(i + 1, j0 + TILE);
        __syncthreads();
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
            const float* kj = k + ((start + j) * kv_heads + kvh) * hd;
            const float* vj = v + ((start + j) * kv_heads + kvh) * hd;
            float p = expf(score(qi, kj, hd, scale) - li);
            float dp = 0.f;
            for (int d = 0; d < hd; d++) dp += doi[d] * vj[d];
            ds[j - j0] = p * (dp - di) * scale;
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
extern "C" __global__ void attention_backward_dkv(float* dk, float* dv, const float* dout, const float* lse,
                                                  const float* q, const float* k, const float* v, const float* dot,
                                                  const int* span, int heads, int kv_heads, int hd) {
    __shared__ float pc[TILE];   // P_ij over one tile of query rows
    __shared__ float dsc[TILE];  // dS_ij over the same tile
    int row = span[3 * blockIdx.x + 2], g = blockIdx.y;
    long long start = span[3 * blockIdx.x], t = span[3 * blockIdx.x + 1];
    int j = (int)(row - start);
    int group = heads / kv_heads;
    float scale = 1.0f / sqrtf((float)hd);
    const float* kj = k + ((long long)row * kv_heads + g) * hd;
    const float* vj = v + ((long long)row * kv_heads + g) * hd;
    float* dkj = dk + ((long long)row * kv_heads + g) * hd;
    float* dvj = dv + ((long long)row * kv_heads + g) * hd;
    for (int hh = 0; hh < group; hh++) {
        int h = g * group + hh;
        for (int i0 = j; i0 < t; i0 += TILE) {
            int i1 = (int)min((long long)(i0 + TILE), t);
            __syncthreads();
            for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
                long long pair = (start + i) * heads + h;
                const float* doi = dout + pair * hd;
                float pij = expf(score(q + pair * hd, kj, hd, scale) - lse[pair]);
                float dp = 0.f;
                for (int d = 0; d < hd; d++) dp += doi[d] * vj[d];
                pc[i - i0] = pij;
                dsc[i - i0] = pij * (dp - dot[pair]) * scale;
            }
            __syncthreads();
            for (int d = threadIdx.x; d < hd; d += blockDim.x) {
                float acc_v = 0.f, acc_k = 0.f;
                for (int i = i0; i < i1; i++) {
                    long long pair = (start + i) * heads + h;
                    acc_v += pc[i - i0] * dout[pair * hd + d];
                    acc_k += dsc[i - i0] * q[pair * hd + d];
                }
                dvj[d] += acc_v;
                dkj[d] += acc_k;
            }
        }
    }
}

// ---- the tensor-core path (head size 64 or 128) ----
// mma.sync.m16n8k16 fragments (lane = 4·g + c, g = lane/4, c = lane%4):
//   A (16×16, row-major): a[0] = (g, 2c..2c+1), a[1] = (g+8, 2c..), a[2] = (g, 2c+8..), a[3] = (g+8, 2c+8..)
//   B (16×8, by column):  b[0] = (k 2c..2c+1, n g), b[1] = (k 2c+8..2c+9, n g)
//   C (16×8, f32):        c[0..1] = (g, 2c..2c+1), c[2..3] = (g+8, 2c..2c+1)
// Two adjacent C tiles of a row block are, packed to bf16, the A fragment of a 16-wide k
// step: P or dS never leave registers between their two products.
// q, k, v and dout arrive as bf16 (converted once per call, not once per block); tiles are
// staged in shared memory with rows padded by 8 (bank spread).
// A tile table row per block: (first row of the sequence, its length, first row of the tile).

__device__ __forceinline__ void mma16816(float* c, const unsigned int* a, const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned int ld32(const bf16_bits* p) { return *(const unsigned int*)p; }

// A fragment of rows r0.., columns k0.. of a row-major shared tile.
__device__ __forceinline__ void frag_a(unsigned int* a, const bf16_bits* s, int stride, int r0, int k0, int lane) {
    const bf16_bits* p = s + (r0 + (lane >> 2)) * stride + k0 + 2 * (lane & 3);
    a[0] = ld32(p);
    a[1] = ld32(p + 8 * stride);
    a[2] = ld32(p + 8);
    a[3] = ld32(p + 8 * stride + 8);
}

// B fragment with B[k][n] = s[n0 + n][k0 + k] (the tile's rows are B's columns: Kᵀ in Q·Kᵀ).
__device__ __forceinline__ void frag_b_t(unsigned int* b, const bf16_bits* s, int stride, int n0, int k0, int lane) {
    const bf16_bits* p = s + (n0 + (lane >> 2)) * stride + k0 + 2 * (lane & 3);
    b[0] = ld32(p);
    b[1] = ld32(p + 8);
}

// B fragment with B[k][n] = s[k0 + k][n0 + n] (the tile's rows are B's rows: V in P·V).
__device__ __forceinline__ void frag_b(unsigned int* b, const bf16_bits* s, int stride, int k0, int n0, int lane) {
    const bf16_bits* p = s + (k0 + 2 * (lane & 3)) * stride + n0 + (lane >> 2);
    b[0] = (unsigned int)p[0] | ((unsigned int)p[stride] << 16);
    b[1] = (unsigned int)p[8 * stride] | ((unsigned int)p[9 * stride] << 16);
}

// The A fragment of k step kk from C tiles c[2kk], c[2kk+1] (16 rows × 16 columns).
__device__ __forceinline__ void c_to_a(unsigned int* a, const float* c0, const float* c1) {
    a[0] = pack2(c0[0], c0[1]);
    a[1] = pack2(c0[2], c0[3]);
    a[2] = pack2(c1[0], c1[1]);
    a[3] = pack2(c1[2], c1[3]);
}

// rows × HD bf16 values (row r at src + r·src_stride; rows ≥ valid are zero) → a shared
// tile, 8 values (16 bytes) per load.
template <int HD>
__device__ __forceinline__ void stage(bf16_bits* s, const bf16_bits* src, long long src_stride, int rows, int valid) {
    const int stride = HD + 8;
    for (int idx = threadIdx.x; idx < rows * (HD / 8); idx += blockDim.x) {
        int r = idx / (HD / 8), c8 = (idx % (HD / 8)) * 8;
        uint4 x;
        x.x = x.y = x.z = x.w = 0u;
        if (r < valid) x = *(const uint4*)(src + r * src_stride + c8);
        unsigned int* d = (unsigned int*)(s + r * stride + c8);
        d[0] = x.x;
        d[1] = x.y;
        d[2] = x.z;
        d[3] = x.w;
    }
}

// The forward. Block: 4 warps × 16 query rows of one head; keys in blocks of 64.
// Per row: running max m and sum l of 2^(s·scale·log2e − m); out = Σ p v / l.
template <int HD>
__device__ void flash_forward(float* out, float* lse, const bf16_bits* q, const bf16_bits* k, const bf16_bits* v,
                              const int* tiles, int heads, int kv_heads) {
    const int BN = 64, S = HD + 8;
    __shared__ bf16_bits ks[BN * S];  // also stages the query tile (BN = 64 rows)
    __shared__ bf16_bits vs[BN * S];
    const int start = tiles[3 * blockIdx.x], len = tiles[3 * blockIdx.x + 1], q0 = tiles[3 * blockIdx.x + 2];
    const int h = blockIdx.y, kvh = h / (heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r0 = q0 + 16 * warp;
    const float scale = LOG2E / sqrtf((float)HD);
    const long long q_stride = (long long)heads * HD, kv_stride = (long long)kv_heads * HD;
    stage<HD>(ks, q + ((long long)(start + q0) * heads + h) * HD, q_stride, 64, len - q0);
    __syncthreads();
    unsigned int qa[HD / 16][4];
    for (int kk = 0; kk < HD / 16; kk++) frag_a(qa[kk], ks, S, 16 * warp, 16 * kk, lane);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[HD / 8][4];
    for (int nt = 0; nt < HD / 8; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    const int kend = min(len, q0 + 64);
    for (int kb = 0; kb < kend; kb += BN) {
        __syncthreads();
        stage<HD>(ks, k + ((long long)(start + kb) * kv_heads + kvh) * HD, kv_stride, BN, len - kb);
        stage<HD>(vs, v + ((long long)(start + kb) * kv_heads + kvh) * HD, kv_stride, BN, len - kb);
        __syncthreads();
        if (kb > r0 + 15) continue;  // every key of this block follows every row of this warp
        float s[BN / 8][4];
        for (int nt = 0; nt < BN / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            for (int kk = 0; kk < HD / 16; kk++) {
                unsigned int b[2];
                frag_b_t(b, ks, S, 8 * nt, 16 * kk, lane);
                mma16816(s[nt], qa[kk], b);
            }
        }
        for (int half = 0; half < 2; half++) {
            const int row = r0 + g + 8 * half;
            float mx = NEG_INF;
            for (int nt = 0; nt < BN / 8; nt++)
                for (int e = 0; e < 2; e++) {
                    int col = kb + 8 * nt + 2 * c + e;
                    float x = (col > row || col >= len) ? NEG_INF : s[nt][2 * half + e] * scale;
                    s[nt][2 * half + e] = x;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            float m_new = fmaxf(m[half], mx);
            float base = m_new == NEG_INF ? 0.f : m_new;
            float corr = exp2f(m[half] - base);
            m[half] = m_new;
            float sum = 0.f;
            for (int nt = 0; nt < BN / 8; nt++)
                for (int e = 0; e < 2; e++) {
                    float p = exp2f(s[nt][2 * half + e] - base);
                    s[nt][2 * half + e] = p;
                    sum += p;
                }
            l[half] = l[half] * corr + sum;
            for (int nt = 0; nt < HD / 8; nt++) {
                o[nt][2 * half] *= corr;
                o[nt][2 * half + 1] *= corr;
            }
        }
        for (int kk = 0; kk < BN / 16; kk++) {
            unsigned int pa[4];
            c_to_a(pa, s[2 * kk], s[2 * kk + 1]);
            for (int nt = 0; nt < HD / 8; nt++) {
                unsigned int b[2];
                frag_b(b, vs, S, 16 * kk, 8 * nt, lane);
                mma16816(o[nt], pa, b);
            }
        }
    }
    for (int half = 0; half < 2; half++) {
        float total = l[half];
        total += __shfl_xor_sync(0xffffffff, total, 1);
        total += __shfl_xor_sync(0xffffffff, total, 2);
        const int row = r0 + g + 8 * half;
        if (row >= len) continue;
        const long long pair = (long long)(start + row) * heads + h;
        const float inv = 1.0f / total;
        for (int nt = 0; nt < HD / 8; nt++) {
            float2 w;
            w.x = o[nt][2 * half] * inv;
            w.y = o[nt][2 * half + 1] * inv;
            *(float2*)(out + pair * HD + 8 * nt + 2 * c) = w;
        }
        if (c == 0) lse[pair] = (m[half] + log2f(total)) * LN2;
    }
}

// dq += Σ_j dS_ij k_j · (1/√hd), dS = P ∘ (dO·Vᵀ − D). Blocks as the forward's.
template <int HD>
__device__ void flash_backward_dq(float* dq, const bf16_bits* dout, const float* lse, const bf16_bits* q, const bf16_bits* k,
                                  const bf16_bits* v, const float* dot, const int* tiles, int heads, int kv_heads) {
    const int BN = HD == 128 ? 32 : 64, S = HD + 8;
    __shared__ bf16_bits ks[BN * S];
    __shared__ bf16_bits vs[BN * S];
    __shared__ bf16_bits qs[64 * S];
    const int start = tiles[3 * blockIdx.x], len = tiles[3 * blockIdx.x + 1], q0 = tiles[3 * blockIdx.x + 2];
    const int h = blockIdx.y, kvh = h / (heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r0 = q0 + 16 * warp;
    const float scale = LOG2E / sqrtf((float)HD);
    const long long q_stride = (long long)heads * HD, kv_stride = (long long)kv_heads * HD;
    unsigned int qa[HD / 16][4], da[HD / 16][4];
    stage<HD>(qs, q + ((long long)(start + q0) * heads + h) * HD, q_stride, 64, len - q0);
    __syncthreads();
    for (int kk = 0; kk < HD / 16; kk++) frag_a(qa[kk], qs, S, 16 * warp, 16 * kk, lane);
    __syncthreads();
    stage<HD>(qs, dout + ((long long)(start + q0) * heads + h) * HD, q_stride, 64, len - q0);
    __syncthreads();
    for (int kk = 0; kk < HD / 16; kk++) frag_a(da[kk], qs, S, 16 * warp, 16 * kk, lane);
    float lse2[2], d[2];
    for (int half = 0; half < 2; half++) {
        const int row = r0 + g + 8 * half;
        const long long pair = (long long)(start + min(row, len - 1)) * heads + h;
        lse2[half] = lse[pair] * LOG2E;
        d[half] = dot[pair];
    }
    float acc[HD / 8][4];
    for (int nt = 0; nt < HD / 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    const int kend = min(len, q0 + 64);
    for (int kb = 0; kb < kend; kb += BN) {
        __syncthreads();
        stage<HD>(ks, k + ((long long)(start + kb) * kv_heads + kvh) * HD, kv_stride, BN, len - kb);
        stage<HD>(vs, v + ((long long)(start + kb) * kv_heads + kvh) * HD, kv_stride, BN, len - kb);
        __syncthreads();
        if (kb > r0 + 15) continue;
        float s[BN / 8][4], dp[BN / 8][4];
        for (int nt = 0; nt < BN / 8; nt++) {
            for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.f;
            for (int kk = 0; kk < HD / 16; kk++) {
                unsigned int b[2];
                frag_b_t(b, ks, S, 8 * nt, 16 * kk, lane);
                mma16816(s[nt], qa[kk], b);
                frag_b_t(b, vs, S, 8 * nt, 16 * kk, lane);
                mma16816(dp[nt], da[kk], b);
            }
        }
        for (int nt = 0; nt < BN / 8; nt++)
            for (int e = 0; e < 4; e++) {
                const int half = e >> 1, row = r0 + g + 8 * half, col = kb + 8 * nt + 2 * c + (e & 1);
                float p = (col > row || col >= len || row >= len) ? 0.f : exp2f(s[nt][e] * scale - lse2[half]);
                s[nt][e] = p * (dp[nt][e] - d[half]);
            }
        for (int kk = 0; kk < BN / 16; kk++) {
            unsigned int a[4];
            c_to_a(a, s[2 * kk], s[2 * kk + 1]);
            for (int nt = 0; nt < HD / 8; nt++) {
                unsigned int b[2];
                frag_b(b, ks, S, 16 * kk, 8 * nt, lane);
                mma16816(acc[nt], a, b);
            }
        }
    }
    const float out_scale = 1.0f / sqrtf((float)HD);
    for (int half = 0; half < 2; half++) {
        const int row = r0 + g + 8 * half;
        if (row >= len) continue;
        float* dst = dq + ((long long)(start + row) * heads + h) * HD + 2 * c;
        for (int nt = 0; nt < HD / 8; nt++) {
            dst[8 * nt] += acc[nt][2 * half] * out_scale;
            dst[8 * nt + 1] += acc[nt][2 * half + 1] * out_scale;
        }
    }
}

// dk, dv of a tile of keys (WARPS × 16 of them) for one kv head, over the heads of its
// group and every query row at or after the tile's first key, BQ query rows at a time:
// Pᵀ = 2^(K·Qᵀ·scale − lse), dV += Pᵀ·dO, dSᵀ = Pᵀ ∘ (V·dOᵀ − D), dK += dSᵀ·Q.
template <int HD, int WARPS, int BQ>
__device__ void flash_backward_dkv(float* dk, float* dv, const bf16_bits* dout, const float* lse, const bf16_bits* q,
                                   const bf16_bits* k, const bf16_bits* v, const float* dot, const int* tiles, int heads,
                                   int kv_heads) {
    const int BK = 16 * WARPS, S = HD + 8;
    __shared__ bf16_bits ks[BK * S];
    __shared__ bf16_bits vs[BK * S];
    __shared__ bf16_bits qs[BQ * S];
    __shared__ bf16_bits dos[BQ * S];
    __shared__ float lse_s[BQ], dot_s[BQ];
    const int start = tiles[3 * blockIdx.x], len = tiles[3 * blockIdx.x + 1], k0 = tiles[3 * blockIdx.x + 2];
    const int kvh = blockIdx.y, group = heads / kv_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int j0 = k0 + 16 * warp;  // this warp's first key
    const float scale = LOG2E / sqrtf((float)HD);
    const long long q_stride = (long long)heads * HD, kv_stride = (long long)kv_heads * HD;
    stage<HD>(ks, k + ((long long)(start + k0) * kv_heads + kvh) * HD, kv_stride, BK, len - k0);
    stage<HD>(vs, v + ((long long)(start + k0) * kv_heads + kvh) * HD, kv_stride, BK, len - k0);
    float dk_acc[HD / 8][4], dv_acc[HD / 8][4];
    for (int nt = 0; nt < HD / 8; nt++)
        for (int e = 0; e < 4; e++) dk_acc[nt][e] = dv_acc[nt][e] = 0.f;
    for (int hh = 0; hh < group; hh++) {
        const int h = kvh * group + hh;
        for (int qb = k0; qb < len; qb += BQ) {
            __syncthreads();
            stage<HD>(qs, q + ((long long)(start + qb) * heads + h) * HD, q_stride, BQ, len - qb);
            stage<HD>(dos, dout + ((long long)(start + qb) * heads + h) * HD, q_stride, BQ, len - qb);
            for (int r = threadIdx.x; r < BQ; r += blockDim.x) {
                const bool in = qb + r < len;
                const long long pair = (long long)(start + qb + r) * heads + h;
                lse_s[r] = in ? lse[pair] * LOG2E : 0.f;
                dot_s[r] = in ? dot[pair] : 0.f;
            }
            __syncthreads();
            if (qb + BQ - 1 < j0 || j0 >= len) continue;  // no query row here sees this warp's keys
            float s[BQ / 8][4], dp[BQ / 8][4];
            for (int nt = 0; nt < BQ / 8; nt++) {
                for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.f;
                for (int kk = 0; kk < HD / 16; kk++) {
                    unsigned int a[4], b[2];
                    frag_b_t(b, qs, S, 8 * nt, 16 * kk, lane);
                    frag_a(a, ks, S, 16 * warp, 16 * kk, lane);
                    mma16816(s[nt], a, b);
                    frag_b_t(b, dos, S, 8 * nt, 16 * kk, lane);
                    frag_a(a, vs, S, 16 * warp, 16 * kk, lane);
                    mma16816(dp[nt], a, b);
                }
            }
            // s becomes Pᵀ, dp becomes dSᵀ (rows: keys j, columns: query rows i).
            for (int nt = 0; nt < BQ / 8; nt++)
                for (int e = 0; e < 4; e++) {
                    const int key = j0 + g + 8 * (e >> 1), ci = 8 * nt + 2 * c + (e & 1), row = qb + ci;
                    float p = (row < key || row >= len || key >= len) ? 0.f : exp2f(s[nt][e] * scale - lse_s[ci]);
                    s[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] - dot_s[ci]);
                }
            for (int kk = 0; kk < BQ / 16; kk++) {
                unsigned int pa[4], da[4];
                c_to_a(pa, s[2 * kk], s[2 * kk + 1]);
                c_to_a(da, dp[2 * kk], dp[2 * kk + 1]);
                for (int nt = 0; nt < HD / 8; nt++) {
                    unsigned int b[2];
                    frag_b(b, dos, S, 16 * kk, 8 * nt, lane);
                    mma16816(dv_acc[nt], pa, b);
                    frag_b(b, qs, S, 16 * kk, 8 * nt, lane);
                    mma16816(dk_acc[nt], da, b);
                }
            }
        }
    }
    const float out_scale = 1.0f / sqrtf((float)HD);
    for (int half = 0; half < 2; half++) {
        const int key = j0 + g + 8 * half;
        if (key >= len) continue;
        const long long at = ((long long)(start + key) * kv_heads + kvh) * HD + 2 * c;
        for (int nt = 0; nt < HD / 8; nt++) {
            dk[at + 8 * nt] += dk_acc[nt][2 * half] * out_scale;
            dk[at + 8 * nt + 1] += dk_acc[nt][2 * half + 1] * out_scale;
            dv[at + 8 * nt] += dv_acc[nt][2 * half];
            dv[at + 8 * nt + 1] += dv_acc[nt][2 * half + 1];
        }
    }
}

// Entry points: head size 64 with 4 warps of keys and 64 query rows per dk/dv step; 128 with 2
// and 32 (register and shared-memory room for its wider accumulators).

extern "C" __global__ void __launch_bounds__(128) flash_forward_64(float* out, float* lse, const bf16_bits* q, const bf16_bits* k,
                                                                   const bf16_bits* v, const int* tiles, int heads, int kv_heads) {
    flash_forward<64>(out, lse, q, k, v, tiles, heads, kv_heads);
}

extern "C" __global__ void __launch_bounds__(128) flash_backward_dq_64(float* dq, const bf16_bits* dout, const float* lse, const bf16_bits* q,
                                                                       const bf16_bits* k, const bf16_bits* v, const float* dot,
                                                                       const int* tiles, int heads, int kv_heads) {
    flash_backward_dq<64>(dq, dout, lse, q, k, v, dot, tiles, heads, kv_heads);
}

extern "C" __global__ void __launch_bounds__(128) flash_backward_dkv_64(float* dk, float* dv, const bf16_bits* dout, const float* lse,
                                                                       const bf16_bits* q, const bf16_bits* k, const bf16_bits* v,
                                                                       const float* dot, const int* tiles, int heads, int kv_heads) {
    flash_backward_dkv<64, 4, 64>(dk, dv, dout, lse, q, k, v, dot, tiles, heads, kv_heads);
}

extern "C" __global__ void __launch_bounds__(128) flash_forward_128(float* out, float* lse, const bf16_bits* q, const bf16_bits* k,
                                                                   const bf16_bits* v, const int* tiles, int heads, int kv_heads) {
    flash_forward<128>(out, lse, q, k, v, tiles, heads, kv_heads);
}

extern "C" __global__ void __launch_bounds__(128) flash_backward_dq_128(float* dq, const bf16_bits* dout, const float* lse, const bf16_bits* q,
                                                                       const bf16_bits* k, const bf16_bits* v, const float* dot,
                                                                       const int* tiles, int heads, int kv_heads) {
    flash_backward_dq<128>(dq, dout, lse, q, k, v, dot, tiles, heads, kv_heads);
}

extern "C" __global__ void __launch_bounds__(64) flash_backward_dkv_128(float* dk, float* dv, const bf16_bits* dout, const float* lse,
                                                                       const bf16_bits* q, const bf16_bits* k, const bf16_bits* v,
                                                                       const float* dot, const int* tiles, int heads, int kv_heads) {
    flash_backward_dkv<128, 2, 32>(dk, dv, dout, lse, q, k, v, dot, tiles, heads, kv_heads);
}

// Cached attention over the paged KV cache: one block per (new row, head). entries[3e] is
// the row (in q and out), entries[3e+1] where its sequence's block addresses start in
// `blocks`, entries[3e+2] how many positions it sees (its own included).
extern "C" __global__ void attention_paged(float* out, const float* q, const long long* entries,
                                           const long long* blocks, long long layer_offset, long long v_offset,
                                           int heads, int kv_heads, int hd, int shift) {
    __shared__ float shared[32];
    __shared__ float pc[TILE];
    const long long* entry = entries + 3 * blockIdx.x;
    int h = blockIdx.y;
    int kvh = h / (heads / kv_heads);
    long long pair = entry[0] * heads + h;
    PagedKv kv = {blocks + entry[1], layer_offset + (long long)kvh * hd, v_offset, shift, kv_heads * hd};
    attend_row(out + pair * hd, q + pair * hd, kv, (int)entry[2], hd, shared, pc);
}

// ---- cached attention split over the cache (split-K), for decode rows ----
// With out_bf, each output's bf16 rounding goes there too (a twin, `gemm.rs`).
// Block (e, h, s) of a launch of gridDim.z = Z splits: entry e's row, head h, over KV blocks
// s, s + S, s + 2S, … of its sequence (S = decode_splits(visible) ≤ Z: blocks with s ≥ S
// exit), its 4 warps taking positions warp, warp + 4, … of each KV block, lanes splitting the
// head's hd = 32·P dimensions. Each warp keeps a running max, sum and Σ p·v (online
// softmax); the block merges its warps. With S = 1 the block writes the row's output; else
// its (max, sum, Σ p·v[hd]) go to part[(e·heads + h)·Z + s] and attention_decode_merge
// combines them. S depends on the row's own length only, so a row's output does not depend
// on the batch it is in.
#define DECODE_WARPS 4

__device__ __forceinline__ int decode_splits(int visible, int shift, int blocks_per_split, int max_splits) {
    int kv_blocks = (visible + (1 << shift) - 1) >> shift;
    return max(1, min(max_splits, (kv_blocks + blocks_per_split - 1) / blocks_per_split));
}

template <int P>
__device__ void attention_decode(float* out, bf16_bits* out_bf, float* part, const float* q,
                                 const long long* entries, const long long* blocks, long long layer_offset,
                                 long long v_offset, int heads, int kv_heads, int shift, int blocks_per_split,
                                 int max_splits) {
    const int hd = 32 * P, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long* entry = entries + 3 * blockIdx.x;
    const int h = blockIdx.y, s = blockIdx.z, visible = (int)entry[2];
    const int splits = decode_splits(visible, shift, blocks_per_split, max_splits);
    if (s >= splits) return;
    const int kvh = h / (heads / kv_heads), kv_dim = kv_heads * hd, tokens = 1 << shift;
    const long long pair = entry[0] * heads + h;
    const long long* seq_blocks = blocks + entry[1];
    const float scale = 1.0f / sqrtf((float)hd);
    float qv[P], acc[P];
#pragma unroll
    for (int p = 0; p < P; p++) {
        qv[p] = q[pair * hd + lane + 32 * p];
        acc[p] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const int kv_blocks = (visible + tokens - 1) >> shift;
    for (int b = s; b < kv_blocks; b += splits) {
        const float* base = (const float*)seq_blocks[b] + layer_offset + (long long)kvh * hd;
        for (int r0 = warp; r0 < tokens; r0 += 4 * DECODE_WARPS) {
            // Four positions at once: their loads in flight together.
            float sc[4], vv[4][P];
            bool seen[4];
#pragma unroll
            for (int t = 0; t < 4; t++) {
                int r = r0 + DECODE_WARPS * t;
                seen[t] = r < tokens && (b << shift) + r < visible;  // the same on every lane
                const float* kj = base + (long long)r * kv_dim;
                float d = 0.f;
#pragma unroll
                for (int p = 0; p < P; p++) {
                    d += seen[t] ? qv[p] * kj[lane + 32 * p] : 0.f;
                    vv[t][p] = seen[t] ? kj[v_offset + lane + 32 * p] : 0.f;
                }
                sc[t] = d;
            }
#pragma unroll
            for (int t = 0; t < 4; t++) {
                if (!seen[t]) continue;
                float score = warp_sum(sc[t]) * scale;
                float m_new = fmaxf(m, score);
                float corr = expf(m - m_new), pj = expf(score - m_new);
                l = l * corr + pj;
#pragma unroll
                for (int p = 0; p < P; p++) acc[p] = acc[p] * corr + pj * vv[t][p];
                m = m_new;
            }
        }
    }
    // The block's warps merged: max, sum and Σ p·v over every position it saw.
    __shared__ float w_m[DECODE_WARPS], w_l[DECODE_WARPS], w_acc[DECODE_WARPS][32 * P];
    if (lane == 0) {
        w_m[warp] = m;
        w_l[warp] = l;
    }
#pragma unroll
    for (int p = 0; p < P; p++) w_acc[warp][lane + 32 * p] = acc[p];
    __syncthreads();
    float block_m = NEG_INF;
    for (int w = 0; w < DECODE_WARPS; w++) block_m = fmaxf(block_m, w_m[w]);
    float block_l = 0.f;
    for (int w = 0; w < DECODE_WARPS; w++) block_l += w_m[w] == NEG_INF ? 0.f : w_l[w] * expf(w_m[w] - block_m);
    float* dst = splits == 1 ? out + pair * hd : part + ((pair * gridDim.z + s) * (hd + 2));
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < DECODE_WARPS; w++)
            if (w_m[w] != NEG_INF) o += w_acc[w][d] * expf(w_m[w] - block_m);
        if (splits == 1) {
            dst[d] = o / block_l;
            if (out_bf) out_bf[pair * hd + d] = round_bf16(o / block_l);
        } else {
            dst[d + 2] = o;
        }
    }
    if (splits > 1 && threadIdx.x == 0) {
        dst[0] = block_m;
        dst[1] = block_l;
    }
}

// The split kernel for head sizes 32, 64, 128 and 256 (P = hd / 32).
extern "C" __global__ void __launch_bounds__(32 * DECODE_WARPS) attention_decode_1(
    float* out, bf16_bits* out_bf, float* part, const float* q, const long long* entries, const long long* blocks,
    long long layer_offset, long long v_offset, int heads, int kv_heads, int shift, int blocks_per_split,
    int max_splits) {
    attention_decode<1>(out, out_bf, part, q, entries, blocks, layer_offset, v_offset, heads, kv_heads, shift,
                         blocks_per_split, max_splits);
}
extern "C" __global__ void __launch_bounds__(32 * DECODE_WARPS) attention_decode_2(
    float* out, bf16_bits* out_bf, float* part, const float* q, const long long* entries, const long long* blocks,
    long long layer_offset, long long v_offset, int heads, int kv_heads, int shift, int blocks_per_split,
    int max_splits) {
    attention_decode<2>(out, out_bf, part, q, entries, blocks, layer_offset, v_offset, heads, kv_heads, shift,
                         blocks_per_split, max_splits);
}
extern "C" __global__ void __launch_bounds__(32 * DECODE_WARPS) attention_decode_4(
    float* out, bf16_bits* out_bf, float* part, const float* q, const long long* entries, const long long* blocks,
    long long layer_offset, long long v_offset, int heads, int kv_heads, int shift, int blocks_per_split,
    int max_splits) {
    attention_decode<4>(out, out_bf, part, q, entries, blocks, layer_offset, v_offset, heads, kv_heads, shift,
                         blocks_per_split, max_splits);
}
extern "C" __global__ void __launch_bounds__(32 * DECODE_WARPS) attention_decode_8(
    float* out, bf16_bits* out_bf, float* part, const float* q, const long long* entries, const long long* blocks,
    long long layer_offset, long long v_offset, int heads, int kv_heads, int shift, int blocks_per_split,
    int max_splits) {
    attention_decode<8>(out, out_bf, part, q, entries, blocks, layer_offset, v_offset, heads, kv_heads, shift,
                         blocks_per_split, max_splits);
}

// The splits of attention_decode's rows with S > 1 combined: one block per (entry, head),
// a thread per dimension.
extern "C" __global__ void attention_decode_merge(float* out, bf16_bits* out_bf, const float* part,
                                                  const long long* entries, int heads, int hd, int splits_launched,
                                                  int shift, int blocks_per_split, int max_splits) {
    const long long* entry = entries + 3 * blockIdx.x;
    int splits = decode_splits((int)entry[2], shift, blocks_per_split, max_splits);
    if (splits == 1) return;
    long long pair = entry[0] * heads + blockIdx.y;
    const float* parts = part + pair * splits_launched * (hd + 2);
    float m = NEG_INF;
    for (int s = 0; s < splits; s++) m = fmaxf(m, parts[s * (hd + 2)]);
    float l = 0.f;
    for (int s = 0; s < splits; s++) l += parts[s * (hd + 2) + 1] * expf(parts[s * (hd + 2)] - m);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < splits; s++) o += parts[s * (hd + 2) + 2 + d] * expf(parts[s * (hd + 2)] - m);
        out[pair * hd + d] = o / l;
        if (out_bf) out_bf[pair * hd + d] = round_bf16(o / l);
    }
}

// A pass's new keys and values into the paged cache, one layer: the row entries[3e] of k
// and v (kv_dim floats each) goes to slots[e] (its position's row in layer 0's keys) +
// layer_offset, its value v_offset further on. One block per entry.
extern "C" __global__ void kv_write(const float* k, const float* v, const long long* slots,
                                    const long long* entries, long long layer_offset, long long v_offset,
                                    int kv_dim) {
    long long e = blockIdx.x;
    long long r = entries[3 * e];
    float* dst = (float*)slots[e] + layer_offset;
    for (int d = threadIdx.x; d < kv_dim; d += blockDim.x) {
        dst[d] = k[r * kv_dim + d];
        dst[v_offset + d] = v[r * kv_dim + d];
    }
}

// ---- the vocabulary head, on a chunk of R rows of logits (R, V) ----

// One logit into a thread's running (max m, Σ e^(z−m), Σ e^(z−m)·z).
__device__ __forceinline__ void softmax_stats_add(float& m, float& sum, float& weighted, float x) {
    if (x > m) {
        float corr = expf(m - x);
        sum *= corr;
        weighted *= corr;
        m = x;
    }
    float e = expf(x - m);
    sum += e;
    weighted += e * x;
}

// lse, entropy, logprob (rows r0..r0+R) from logits, in one read of each row: every thread
// keeps a running max m, Σ e^(z−m) and Σ e^(z−m)·z, rescaled when m grows; the block then
// combines them (H = lse − Σ p z). One block per row. target −1 = none.
extern "C" __global__ void head_stats(float* lse, float* entropy, float* logprob, const float* logits,
                                      const int* targets, int r0, int vocab) {
    __shared__ float shared[32];
    const float* z = logits + (long long)blockIdx.x * vocab;
    int r = r0 + blockIdx.x;
    float m = NEG_INF, sum = 0.f, weighted = 0.f;
    if ((vocab & 3) == 0 && aligned16(z)) {
        // Four logits per load; the running max moves at most once per quad.
        for (int j = 4 * threadIdx.x; j < vocab; j += 4 * blockDim.x) {
            float4 v = *(const float4*)(z + j);
            float top = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
            if (top > m) {
                float corr = expf(m - top);
                sum *= corr;
                weighted *= corr;
                m = top;
            }
            float e0 = expf(v.x - m), e1 = expf(v.y - m), e2 = expf(v.z - m), e3 = expf(v.w - m);
            sum += (e0 + e1) + (e2 + e3);
            weighted += (e0 * v.x + e1 * v.y) + (e2 * v.z + e3 * v.w);
        }
    } else {
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) softmax_stats_add(m, sum, weighted, z[j]);
    }
    float row_max = block_max(m, shared);
    float corr = m == NEG_INF ? 0.f : expf(m - row_max);
    float total = block_sum(sum * corr, shared);
    float pz = block_sum(weighted * corr, shared) / total;
    if (threadIdx.x == 0) {
        float l = row_max + logf(total);
        lse[r] = l;
        entropy[r] = l - pz;
        int target = targets[r];
        logprob[r] = target >= 0 ? z[target] - l : 0.f;
    }
}

// logits (R, V) → ∂L/∂z = −d_lp·p − d_H·p·(log p + H), plus d_lp at the target, written as
// bf16 hi + lo (16 significant bits: it flows back to every layer) for the products after it.
extern "C" __global__ void head_dlogits(bf16_bits* hi, bf16_bits* lo, const float* z, const float* lse,
                                        const float* entropy, const float* d_logprob, const float* d_entropy,
                                        const int* targets, int r0, int vocab) {
    int r = r0 + blockIdx.x;
    long long base = (long long)blockIdx.x * vocab;
    float l = lse[r], h = entropy[r], d_lp = d_logprob[r], d_h = d_entropy[r];
    int target = targets[r];
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float logp = z[base + j] - l;
        float p = expf(logp);
        float g = -d_lp * p - d_h * p * (logp + h);
        if (j == target) g += d_lp;
        bf16_bits top = round_bf16(g);
        hi[base + j] = top;
        lo[base + j] = round_bf16(g - __uint_as_float(((unsigned int)top) << 16));
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

// ---- the engine's next tokens, drawn from rows of logits on the device ----

#define SAMPLE_THREADS 512
// Alternatives reported per pick at most (the API's top_logprobs cap).
#define TOP_MAX 20

// (value, index) with the larger value, the smaller index on a tie: the host's argmax keeps
// the first of equal logits.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

// The block's best (value, index) of every thread's candidate; every thread gets it.
__device__ void block_best(float& v, int& i, float* shared_v, int* shared_i) {
    for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffff, v, o), __shfl_xor_sync(0xffffffff, i, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { shared_v[warp] = v; shared_i[warp] = i; }
    __syncthreads();
    v = NEG_INF;
    i = 0x7fffffff;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) better(v, i, shared_v[w], shared_i[w]);
}

// A float's bits as an unsigned key in the same order (larger float, larger key).
__device__ __forceinline__ unsigned order_key(float z) {
    unsigned b = __float_as_uint(z);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Radix select over a row's keys ≥ floor, a byte at a time from the top: the largest key τ
// whose keys ≥ τ weigh at least `target` — counting each key as 1 (`counting`: the k-th
// largest logit, target k) or as e^((z − max)/T) with target a fraction of the kept keys'
// whole weight (the nucleus: the logit where the running mass of the best tokens first
// reaches top_p). Four histogram passes of 256 bins, a histogram per warp (logits crowd a
// few top bytes: one shared histogram would serialize the whole block on them); every
// thread gets τ. At most SAMPLE_THREADS / 32 warps.
__device__ unsigned radix_threshold(const float* z, int vocab, unsigned floor, bool counting, float target,
                                    float row_max, float temperature) {
    __shared__ float hist[SAMPLE_THREADS / 32 * 256];
    __shared__ unsigned prefix_s;
    __shared__ float above_s, target_s;
    unsigned prefix = 0, mask = 0;
    float above = 0.f;
    int warps = blockDim.x >> 5;
    float* mine = hist + (threadIdx.x >> 5) * 256;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < warps * 256; b += blockDim.x) hist[b] = 0.f;
        __syncthreads();
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            unsigned key = order_key(z[j]);
            if (key < floor || (key & mask) != prefix) continue;
            atomicAdd(&mine[(key >> shift) & 255], counting ? 1.f : expf((z[j] - row_max) / temperature));
        }
        __syncthreads();
        for (int b = threadIdx.x; b < 256; b += blockDim.x)
            for (int w = 1; w < warps; w++) hist[b] += hist[w * 256 + b];
        __syncthreads();
        if (threadIdx.x == 0) {
            float goal = target;
            if (shift == 24 && !counting) {
                float whole = 0.f;
                for (int b = 0; b < 256; b++) whole += hist[b];
                goal = target * whole;
                target_s = goal;
            } else if (!counting) {
                goal = target_s;
            }
            int b = 255;
            float cum = above;
            for (; b > 0 && cum + hist[b] < goal; b--) cum += hist[b];
            prefix_s = prefix | ((unsigned)b << shift);
            above_s = cum;
        }
        __syncthreads();
        prefix = prefix_s;
        above = above_s;
        mask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

// One block (SAMPLE_THREADS) per pick. A pick is 6 floats: the logits row it reads, its
// temperature (≤ 0: greedy), the uniform in [0, 1) the host drew from the sequence's
// generator, how many alternatives to report, top-k (0: off) and top-p (1: off). As the
// host's sampling does:
//   - log-sum-exp over the raw logits, summed in f64, for the raw log-probabilities;
//   - greedy: the first index of the largest logit;
//   - top-k, then top-p, keep the logits at or above a threshold (radix_threshold: the
//     k-th largest; then the one where the best tokens' tempered mass first reaches p), so
//     ties at the threshold all stay;
//   - otherwise the inverse CDF of softmax(z / T) over what is kept, at u·Σ, in
//     vocabulary order (the host walks its sorted candidates: the same distribution, but a
//     uniform may name another token of it): each warp sums a contiguous
//     slice of the vocabulary, the slice holding the target is walked 32 logits at a time
//     (a prefix sum across the warp), and the first index whose running sum passes the
//     target is the token (the last index if rounding leaves none, as on the host);
//   - the top n by value, best first, ties to the smaller index.
// out per pick: [token id bits, logprob, TOP_MAX ids bits, TOP_MAX logprobs].
extern "C" __global__ void sample_rows(float* out, const float* logits, const float* picks, int vocab) {
    __shared__ float shared_v[32];
    __shared__ int shared_i[32];
    __shared__ double shared_d[32];
    __shared__ double slice_sum[32];
    __shared__ int chosen;
    const float* pick = picks + 6 * blockIdx.x;
    const float* z = logits + (long long)(int)pick[0] * vocab;
    float temperature = pick[1], uniform = pick[2];
    int top_n = min((int)pick[3], TOP_MAX);
    float* o = out + (long long)blockIdx.x * (2 + 2 * TOP_MAX);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // The row's largest logit and Σ e^(z − max): 16-byte loads where the row is aligned
    // (one block reads the whole row: loads in flight, not their count, set its pace).
    int quads = aligned16(z) ? vocab / 4 : 0;
    const float4* z4 = (const float4*)z;
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    for (int q = threadIdx.x; q < quads; q += blockDim.x) {
        float4 v = z4[q];
        better(best, best_i, v.x, 4 * q);
        better(best, best_i, v.y, 4 * q + 1);
        better(best, best_i, v.z, 4 * q + 2);
        better(best, best_i, v.w, 4 * q + 3);
    }
    for (int j = 4 * quads + threadIdx.x; j < vocab; j += blockDim.x) better(best, best_i, z[j], j);
    block_best(best, best_i, shared_v, shared_i);
    float row_max = best;
    double sum = 0.0, sum2 = 0.0;
    for (int q = threadIdx.x; q < quads; q += blockDim.x) {
        float4 v = z4[q];
        sum += (double)expf(v.x - row_max) + (double)expf(v.y - row_max);
        sum2 += (double)expf(v.z - row_max) + (double)expf(v.w - row_max);
    }
    for (int j = 4 * quads + threadIdx.x; j < vocab; j += blockDim.x) sum += (double)expf(z[j] - row_max);
    float lse = row_max + (float)log(block_sum(sum + sum2, shared_d));

    if (threadIdx.x == 0) chosen = best_i;
    if (temperature > 0.f) {
        int top_k = (int)pick[4];
        float top_p = pick[5];
        unsigned floor = 0;
        if (top_k > 0 && top_k < vocab) floor = radix_threshold(z, vocab, 0, true, (float)top_k, row_max, temperature);
        if (top_p < 1.f) floor = radix_threshold(z, vocab, floor, false, top_p, row_max, temperature);
        int warps = blockDim.x >> 5, slice = (vocab + warps - 1) / warps;
        int from = warp * slice, to = min(vocab, from + slice);
        double part = 0.0;
        for (int j = from + lane; j < to; j += 32)
            if (order_key(z[j]) >= floor) part += (double)expf((z[j] - row_max) / temperature);
        for (int s = 16; s > 0; s >>= 1) part += __shfl_xor_sync(0xffffffff, part, s);
        if (lane == 0) slice_sum[warp] = part;
        __syncthreads();
        // Every thread finds the slice holding the target (the same answer in each).
        double total = 0.0;
        for (int w = 0; w < warps; w++) total += slice_sum[w];
        double target = (double)uniform * total, before = 0.0;
        int holder = -1;
        for (int w = 0; w < warps; w++) {
            if (target < before + slice_sum[w]) { holder = w; break; }
            before += slice_sum[w];
        }
        __syncthreads();
        if (warp == holder) {
            double running = before;
            int last = -1;
            bool found = false;
            for (int base = from; base < to && !found; base += 32) {
                int j = base + lane;
                double e = j < to && order_key(z[j]) >= floor ? (double)expf((z[j] - row_max) / temperature) : 0.0;
                double scan = e;
                for (int s = 1; s < 32; s <<= 1) {
                    double up = __shfl_up_sync(0xffffffff, scan, s);
                    if (lane >= s) scan += up;
                }
                unsigned passed = __ballot_sync(0xffffffff, j < to && target < running + scan);
                unsigned weighty = __ballot_sync(0xffffffff, e > 0.0);
                if (passed) {
                    if (lane == 0) chosen = base + __ffs(passed) - 1;
                    found = true;
                } else if (weighty) {
                    last = base + 31 - __clz(weighty);
                }
                running += __shfl_sync(0xffffffff, scan, 31);
            }
            // The slice's own sum ran a little below the block's: its last token with any
            // weight is the one the target fell behind.
            if (!found && lane == 0 && last >= 0) chosen = last;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        o[0] = __int_as_float(chosen);
        o[1] = z[chosen] - lse;
    }

    // The top n in one read of the row: each thread keeps the best n of its own logits
    // (best first, ties to the smaller index, NaN never), then n rounds each take the best
    // of the threads' heads (`better`'s order), the winner's thread moving to its next.
    if (top_n == 0) return;
    float kept_v[TOP_MAX];
    int kept_i[TOP_MAX], kept = 0;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float v = z[j];
        if (v != v || (kept == top_n && !(v > kept_v[kept - 1]))) continue;
        int at = kept == top_n ? kept - 1 : kept++;
        for (; at > 0 && kept_v[at - 1] < v; at--) {
            kept_v[at] = kept_v[at - 1];
            kept_i[at] = kept_i[at - 1];
        }
        kept_v[at] = v;
        kept_i[at] = j;
    }
    int head = 0;
    for (int t = 0; t < top_n; t++) {
        float v = head < kept ? kept_v[head] : NEG_INF;
        int vi = head < kept ? kept_i[head] : 0x7fffffff;
        int mine = vi;
        block_best(v, vi, shared_v, shared_i);
        if (head < kept && vi == mine) head++;
        if (threadIdx.x == 0) {
            o[2 + t] = __int_as_float(vi);
            o[2 + TOP_MAX + t] = v - lse;
        }
    }
}
