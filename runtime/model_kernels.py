"""The small CUDA kernels of the model graph (everything that is not a quantized product):
embedding rows, RMSNorm, NEOX RoPE, KV-cache store, single-token attention, routing,
SwiGLU and the weighted expert sum.

They read positions from device memory, never from launch arguments, so one decode step
can be captured in a CUDA graph and replayed at every position. Plain fixed source (no
template, no system header): NVRTC compiles it with or without a GPU.
"""
from __future__ import annotations

SOURCE = r"""
typedef unsigned char u8;
typedef unsigned short u16;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float block_reduce(float v, bool is_max, float* sh) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : (is_max ? NEG_INF : 0.0f);
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    return v;
}

// Rows of a q4_0 / q8_0 QuantTensor in moeforge's split layout: quant bytes of row r,
// block b at qs + (r*nb + b)*QS; the block's f16 scale at meta + r*meta_stride + 2*b.
extern "C" __global__ void get_rows_q4_0(const u8* qs, const u8* meta, int nb, int meta_stride,
                                         const int* rows, float* out, int k) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= k) return;
    const long r = rows[t];
    const int b = i >> 5, j = i & 31;
    const u8 q = qs[(r * nb + b) * 16 + (j & 15)];
    const int v = (j < 16 ? (q & 15) : (q >> 4)) - 8;
    out[(long)t * k + i] = v * h2f(*(const u16*)(meta + r * meta_stride + 2 * b));
}

extern "C" __global__ void get_rows_q8_0(const u8* qs, const u8* meta, int nb, int meta_stride,
                                         const int* rows, float* out, int k) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= k) return;
    const long r = rows[t];
    const int b = i >> 5, j = i & 31;
    const signed char q = (signed char)qs[(r * nb + b) * 32 + j];
    out[(long)t * k + i] = q * h2f(*(const u16*)(meta + r * meta_stride + 2 * b));
}

// One block per row; in place is safe (each thread rereads its own elements).
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int d, float eps) {
    __shared__ float sh[32];
    const long row = blockIdx.x;
    const float* xr = x + row * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i] * xr[i];
    s = block_reduce(s, false, sh);
    const float scale = rsqrtf(s / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[row * d + i] = xr[i] * scale * w[i];
}

// NEOX: element i pairs with i + hd/2; angle pos * base^(-2i/hd).
extern "C" __global__ void rope_neox(float* x, const int* pos, int n, int n_heads, int hd, float log2_base) {
    const int half = hd >> 1;
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n * n_heads * half) return;
    const int i = idx % half;
    const long th = idx / half;            // token * n_heads + head
    const int t = th / n_heads;
    const float theta = pos[t] * exp2f(-2.0f * i / hd * log2_base);
    float s, c;
    sincosf(theta, &s, &c);
    float* p = x + th * hd;
    const float x0 = p[i], x1 = p[i + half];
    p[i] = x0 * c - x1 * s;
    p[i + half] = x0 * s + x1 * c;
}

// One block per row: x += y in place, then out = rms_norm(x) * w (the residual sum and
// the next norm in one launch).
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ y,
                                        const float* __restrict__ w, float* __restrict__ out, int d, float eps) {
    __shared__ float sh[32];
    const long row = blockIdx.x;
    float* xr = x + row * d;
    const float* yr = y + row * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = xr[i] + yr[i];
        xr[i] = v;
        s += v * v;
    }
    s = block_reduce(s, false, sh);
    const float scale = rsqrtf(s / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[row * d + i] = xr[i] * scale * w[i];
}

// One block per token: x += sum_j wts[j] * y[j] (the experts' weighted outputs), then
// out = rms_norm(x) * w, the next layer's input. Launched with 1024 threads: at decode
// this is the only block, and each thread's top_k loads are issued together.
extern "C" __global__ void moe_combine_rms_norm(float* __restrict__ x, const float* __restrict__ y,
                                                const float* __restrict__ wts, const float* __restrict__ w,
                                                float* __restrict__ out, int top_k, int d, float eps) {
    __shared__ float sh[32];
    const long t = blockIdx.x;
    float* xr = x + t * d;
    const float* yt = y + t * top_k * d;
    const float* wt = wts + t * top_k;
    float s2 = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float s = 0.0f;
#pragma unroll 8
        for (int j = 0; j < top_k; ++j) s += wt[j] * yt[(long)j * d + i];
        const float v = xr[i] + s;
        xr[i] = v;
        s2 += v * v;
    }
    s2 = block_reduce(s2, false, sh);
    const float scale = rsqrtf(s2 / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[t * d + i] = xr[i] * scale * w[i];
}

// After the q, k, v projections of a token: per-head RMSNorm of q and k, NEOX RoPE, and
// k and v stored in the cache at the token's position, in one launch (five before).
// Block (head, token) over the n_heads query heads then the n_kv_heads key heads;
// thread i < hd/2 holds the rotation pair (i, i + hd/2).
extern "C" __global__ void qk_norm_rope_store(float* q, float* k, const float* v, const float* qn,
                                              const float* kn, float* kc, float* vc, const int* pos,
                                              int n_heads, int n_kv_heads, int hd, float eps, float log2_base) {
    __shared__ float sh[32];
    const int head = blockIdx.x, i = threadIdx.x, half = hd >> 1;
    const long t = blockIdx.y;
    const bool is_q = head < n_heads;
    const int kvh = head - n_heads, kv_dim = n_kv_heads * hd;
    float* p = is_q ? q + (t * n_heads + head) * hd : k + t * kv_dim + kvh * hd;
    const float* w = is_q ? qn : kn;
    float x0 = 0.0f, x1 = 0.0f;
    if (i < half) { x0 = p[i]; x1 = p[i + half]; }
    const float s = block_reduce(x0 * x0 + x1 * x1, false, sh);
    const float scale = rsqrtf(s / hd + eps);
    if (i >= half) return;
    x0 = x0 * scale * w[i];
    x1 = x1 * scale * w[i + half];
    const float theta = pos[t] * exp2f(-2.0f * i / hd * log2_base);
    float sn, c;
    sincosf(theta, &sn, &c);
    const float r0 = x0 * c - x1 * sn, r1 = x0 * sn + x1 * c;
    p[i] = r0;
    p[i + half] = r1;
    if (!is_q) {
        const long dst = (long)pos[t] * kv_dim + kvh * hd;
        const float* vr = v + t * kv_dim + kvh * hd;
        kc[dst + i] = r0;
        kc[dst + i + half] = r1;
        vc[dst + i] = vr[i];
        vc[dst + i + half] = vr[i + half];
    }
}

// Prompt attention's softmax, in place over the scores s (rows of L cached positions;
// row r holds query token r % n at position pos0 + r % n): scaled, causally masked,
// normalised, in one pass per step over a row that stays in L1 (the elementwise CuPy
// chain it replaces made a full pass over all scores in memory for each step).
extern "C" __global__ void softmax_causal(float* s, int L, int n, int pos0, float scale) {
    __shared__ float sh[32];
    const long r = blockIdx.x;
    float* row = s + r * L;
    const int last = pos0 + (int)(r % n);       // the last visible position
    float mx = NEG_INF;
    for (int c = threadIdx.x; c <= last && c < L; c += blockDim.x) mx = fmaxf(mx, row[c] * scale);
    mx = block_reduce(mx, true, sh);
    float sum = 0.0f;
    for (int c = threadIdx.x; c < L; c += blockDim.x) {
        const float e = c <= last ? __expf(row[c] * scale - mx) : 0.0f;
        row[c] = e;
        sum += e;
    }
    sum = block_reduce(sum, false, sh);
    const float inv = 1.0f / sum;
    for (int c = threadIdx.x; c < L; c += blockDim.x) row[c] *= inv;
}

extern "C" __global__ void kv_store(const float* k, const float* v, float* kc, float* vc, const int* pos,
                                    int n, int kv_dim) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n * kv_dim) return;
    const int t = idx / kv_dim, j = idx % kv_dim;
    const long dst = (long)pos[t] * kv_dim + j;
    kc[dst] = k[idx];
    vc[dst] = v[idx];
}

// One token: one block per query head over the n_kv = pos[0] + 1 cached positions.
// scores: scratch of n_heads * ctx floats.
#define ATTN_THREADS 1024
#define ATTN_UNROLL 4
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode(
        const float* q, const float* kc, const float* vc, const int* pos, float* out, float* scores,
        int ctx, int n_heads, int n_kv_heads, int hd, float scale) {
    // One block per query head. Scores: each warp takes ATTN_UNROLL cached positions at a
    // time, its lanes sweeping the key rows coalesced, all loads issued before the
    // reductions (a thread walking a whole row on its own, as before, made every step
    // wait on the last load: ~80 us a layer at 128 positions). Output: the threads split
    // into ATTN_THREADS/hd groups of positions, one dimension each, so value rows are read
    // coalesced with ATTN_UNROLL loads in flight; the groups meet in shared memory.
    __shared__ float sh[32];
    __shared__ float qs[256];
    __shared__ float part[ATTN_THREADS];
    const int h = blockIdx.x, kvh = h / (n_heads / n_kv_heads);
    const int n_kv = pos[0] + 1, kv_dim = n_kv_heads * hd;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float* sc = scores + (long)h * ctx;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = q[h * hd + i];
    __syncthreads();
    float mx = NEG_INF;
    for (int t0 = warp; t0 < n_kv; t0 += ATTN_UNROLL * nwarps) {
        float s[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int t = t0 + u * nwarps;
            s[u] = 0.0f;
            if (t < n_kv) {
                const float* kr = kc + (long)t * kv_dim + kvh * hd;
                for (int i = lane; i < hd; i += 32) s[u] += qs[i] * kr[i];
            }
        }
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            for (int o = 16; o > 0; o >>= 1) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
            const int t = t0 + u * nwarps;
            if (t < n_kv) {
                if (lane == 0) sc[t] = s[u] * scale;
                mx = fmaxf(mx, s[u] * scale);
            }
        }
    }
    mx = block_reduce(mx, true, sh);      // its barriers also publish sc[] to the block
    float sum = 0.0f;
    for (int t = threadIdx.x; t < n_kv; t += blockDim.x) {
        const float e = __expf(sc[t] - mx);
        sc[t] = e;
        sum += e;
    }
    sum = block_reduce(sum, false, sh);
    const int groups = max(1, (int)blockDim.x / hd), g = threadIdx.x / hd, i = threadIdx.x % hd;
    float acc = 0.0f;
    if (g < groups) {
        const float* vr = vc + kvh * hd + i;
        int t = g;
        for (; t + (ATTN_UNROLL - 1) * groups < n_kv; t += ATTN_UNROLL * groups) {
            float v[ATTN_UNROLL];
#pragma unroll
            for (int u = 0; u < ATTN_UNROLL; ++u) v[u] = vr[(long)(t + u * groups) * kv_dim];
#pragma unroll
            for (int u = 0; u < ATTN_UNROLL; ++u) acc += sc[t + u * groups] * v[u];
        }
        for (; t < n_kv; t += groups) acc += sc[t] * vr[(long)t * kv_dim];
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x < hd) {
        float v = 0.0f;
        for (int gg = 0; gg < groups; ++gg) v += part[gg * hd + threadIdx.x];
        out[h * hd + threadIdx.x] = v / sum;
    }
}

// Softmax over the experts, top-k by repeated arg-max (ties: lowest index, as a stable
// descending sort), the chosen probabilities renormalised (sum clamped at 2^-14) and
// scaled when scale is neither 0 nor 1. One warp per token, lane l holding experts
// l, l+32, ... in registers: a thread per token walked 128 logits top_k times in a row,
// and at decode that serial walk was a whole kernel's latency per layer.
#define ROUTE_SLOTS (512 / 32)
__device__ void route_one(const float* l, int n_exp, int top_k, float scale, int* ids, float* wts) {
    const int lane = threadIdx.x & 31;
    float v[ROUTE_SLOTS];
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < ROUTE_SLOTS; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < n_exp ? __ldcg(l + e) : NEG_INF;   // L2: router_route's last block reads others' logits
        mx = fmaxf(mx, v[i]);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < ROUTE_SLOTS; ++i)
        if (lane + 32 * i < n_exp) sum += __expf(v[i] - mx);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    unsigned taken = 0;
    float wsum = 0.0f, mine = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        int be = -1;
        float bv = NEG_INF;
#pragma unroll
        for (int i = 0; i < ROUTE_SLOTS; ++i) {
            const int e = lane + 32 * i;
            if (e < n_exp && !((taken >> i) & 1u) && (be < 0 || v[i] > bv)) { be = e; bv = v[i]; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) { be = oe; bv = ov; }
        }
        if ((be & 31) == lane) taken |= 1u << (be >> 5);
        const float p = __expf(bv - mx) / sum;
        if (lane == j) mine = p;
        wsum += p;
        if (lane == 0) ids[j] = be;
    }
    wsum = fmaxf(wsum, 6.103515625e-5f);
    const float mul = (scale != 0.0f && scale != 1.0f) ? scale : 1.0f;
    if (lane < top_k) wts[lane] = mine / wsum * mul;
}

extern "C" __global__ void route_topk(const float* logits, int n, int n_exp, int top_k, float scale,
                                      int* ids, float* wts) {
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= n) return;
    route_one(logits + (long)t * n_exp, n_exp, top_k, scale, ids + t * top_k, wts + t * top_k);
}


// gu: rows of [gate (ff) | up (ff)]; out: rows of silu(gate) * up.
extern "C" __global__ void swiglu(const float* gu, float* out, long rows, int ff) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * ff) return;
    const long r = idx / ff;
    const int j = idx % ff;
    const float g = gu[r * 2 * ff + j], u = gu[r * 2 * ff + ff + j];
    out[idx] = g / (1.0f + __expf(-g)) * u;
}

extern "C" __global__ void swiglu_split(const float* g, const float* u, float* out, long total) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    const float a = g[idx];
    out[idx] = a / (1.0f + __expf(-a)) * u[idx];
}

// out[t, r] = W[r] . x[t] for float32 weights and a few tokens (the router, float test
// models): one warp per row, so the decode step needs no cuBLAS call inside the graph.
// One output of a float32 product: warp per row, lanes over k (16-byte loads when aligned).
__device__ __forceinline__ void dense_row(const float* w, const float* x, float* out, int m, int k, int r, int t) {
    const int lane = threadIdx.x & 31;
    const float* wr = w + (long)r * k;
    const float* xt = x + (long)t * k;
    float s = 0.0f;
    if ((k & 3) == 0 && ((((unsigned long long)wr) | ((unsigned long long)xt)) & 15) == 0) {
        // 16-byte loads: a quarter of the dependent load rounds (the router at decode)
        const float4* w4 = (const float4*)wr;
        const float4* x4 = (const float4*)xt;
        for (int i = lane; i < (k >> 2); i += 32) {
            const float4 a = w4[i], b = x4[i];
            s += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
        }
    } else {
        for (int i = lane; i < k; i += 32) s += wr[i] * xt[i];
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) out[(long)t * m + r] = s;
}

extern "C" __global__ void dense_f32(const float* w, const float* x, float* out, int m, int k) {
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), t = blockIdx.y;
    if (r < m) dense_row(w, x, out, m, k, r, t);
}

// Decode: the float32 router product and the routing in one launch. Blocks compute 8
// logits each exactly as dense_f32 does; the last block to finish (a global counter,
// which it resets for the next launch) routes every token from the logits in L2. A
// single block doing the product as well was slower: 1 MB of router weights is too much
// for one SM.
extern "C" __global__ void router_route(const float* w, const float* x, float* logits, int m, int k, int n,
                                        int top_k, float scale, int* ids, float* wts, unsigned* counter) {
    __shared__ bool last;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), t = blockIdx.y;
    if (r < m) dense_row(w, x, logits, m, k, r, t);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();                                   // this block's logits, before the count
        last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int tt = threadIdx.x >> 5; tt < n; tt += blockDim.x >> 5)
        route_one(logits + (long)tt * m, m, top_k, scale, ids + tt * top_k, wts + tt * top_k);
    if (threadIdx.x == 0) *counter = 0u;
}

// Float32 experts (test models): out[entry, r] = W[ids[entry]][r] . x[entry / x_div];
// x_div = top_k when every slot of a token shares its row, 1 when each slot has its own.
extern "C" __global__ void dense_f32_id(const float* w, const float* x, const int* ids, float* out,
                                        int m, int k, int x_div) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), entry = blockIdx.y;
    if (r >= m) return;
    const float* wr = w + ((long)ids[entry] * m + r) * k;
    const float* xt = x + (long)(entry / x_div) * k;
    float s = 0.0f;
    for (int i = lane; i < k; i += 32) s += wr[i] * xt[i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) out[(long)entry * m + r] = s;
}

// x[t] += sum_j w[t, j] * y[t, j]: the experts' weighted sum and the residual in one pass.
extern "C" __global__ void moe_combine(float* x, const float* y, const float* w, int n, int top_k, int d) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)n * d) return;
    const int t = idx / d, i = idx % d;
    float s = 0.0f;
    for (int j = 0; j < top_k; ++j) s += w[t * top_k + j] * y[((long)t * top_k + j) * d + i];
    x[idx] += s;
}
"""

KERNELS = ("get_rows_q4_0", "get_rows_q8_0", "rms_norm", "rope_neox", "kv_store", "attn_decode",
           "add_rms_norm", "moe_combine_rms_norm", "qk_norm_rope_store", "softmax_causal", "router_route",
           "route_topk", "swiglu", "swiglu_split", "dense_f32", "dense_f32_id",
           "moe_combine")
MAX_EXPERTS = 512
MAX_HEAD_DIM = 256


def compile_check(arch: str = "sm_90") -> str:
    """Compile with NVRTC (no GPU needed); returns the program log. For the CPU tests."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(SOURCE, "model_kernels.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", "-std=c++14"])
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"model kernels failed to compile for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
