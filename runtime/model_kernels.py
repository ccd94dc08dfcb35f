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
extern "C" __global__ void attn_decode(const float* q, const float* kc, const float* vc, const int* pos,
                                       float* out, float* scores, int ctx, int n_heads, int n_kv_heads,
                                       int hd, float scale) {
    __shared__ float sh[32];
    __shared__ float qs[256];
    const int h = blockIdx.x, kvh = h / (n_heads / n_kv_heads);
    const int n_kv = pos[0] + 1, kv_dim = n_kv_heads * hd;
    float* sc = scores + (long)h * ctx;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = q[h * hd + i];
    __syncthreads();
    float mx = NEG_INF;
    for (int t = threadIdx.x; t < n_kv; t += blockDim.x) {
        const float* kr = kc + (long)t * kv_dim + kvh * hd;
        float s = 0.0f;
        for (int i = 0; i < hd; ++i) s += qs[i] * kr[i];
        s *= scale;
        sc[t] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_reduce(mx, true, sh);
    float sum = 0.0f;
    for (int t = threadIdx.x; t < n_kv; t += blockDim.x) {
        const float e = __expf(sc[t] - mx);
        sc[t] = e;
        sum += e;
    }
    sum = block_reduce(sum, false, sh);   // its barriers also publish sc[] to the block
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float acc = 0.0f;
        for (int t = 0; t < n_kv; ++t) acc += sc[t] * vc[(long)t * kv_dim + kvh * hd + i];
        out[h * hd + i] = acc / sum;
    }
}

// Softmax over the experts, top-k by repeated arg-max (ties: lowest index, as a stable
// descending sort), the chosen probabilities renormalised (sum clamped at 2^-14) and
// scaled when scale is neither 0 nor 1. One thread per token.
extern "C" __global__ void route_topk(const float* logits, int n, int n_exp, int top_k, float scale,
                                      int* ids, float* wts) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* l = logits + (long)t * n_exp;
    float mx = NEG_INF;
    for (int e = 0; e < n_exp; ++e) mx = fmaxf(mx, l[e]);
    float sum = 0.0f;
    for (int e = 0; e < n_exp; ++e) sum += __expf(l[e] - mx);
    unsigned taken[16] = {0};   // up to 512 experts
    float wsum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        int best = -1;
        float bv = NEG_INF;
        for (int e = 0; e < n_exp; ++e) {
            if ((taken[e >> 5] >> (e & 31)) & 1u) continue;
            if (best < 0 || l[e] > bv) { best = e; bv = l[e]; }
        }
        taken[best >> 5] |= 1u << (best & 31);
        const float p = __expf(bv - mx) / sum;
        ids[t * top_k + j] = best;
        wts[t * top_k + j] = p;
        wsum += p;
    }
    wsum = fmaxf(wsum, 6.103515625e-5f);
    const float mul = (scale != 0.0f && scale != 1.0f) ? scale : 1.0f;
    for (int j = 0; j < top_k; ++j) wts[t * top_k + j] = wts[t * top_k + j] / wsum * mul;
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
extern "C" __global__ void dense_f32(const float* w, const float* x, float* out, int m, int k) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), t = blockIdx.y;
    if (r >= m) return;
    const float* wr = w + (long)r * k;
    const float* xt = x + (long)t * k;
    float s = 0.0f;
    for (int i = lane; i < k; i += 32) s += wr[i] * xt[i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) out[(long)t * m + r] = s;
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
