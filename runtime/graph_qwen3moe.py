"""The qwen3moe forward pass, written once against the backend interface (runtime.backend).

It follows llama.cpp's graph for this architecture: pre-norm attention with per-head
RMSNorm on q and k, NEOX RoPE over the whole head, grouped-query heads; a MoE FFN with
softmax routing, top-k, the chosen probabilities renormalised to sum to one (qwen3moe's
norm_topk_prob; the sum clamped below at 2^-14 like llama.cpp) and optionally scaled,
SwiGLU experts, and a weighted sum of the experts' outputs.

Every intermediate is named: the CUDA backend keeps one preallocated buffer per name and
shape, so a decode step allocates nothing and can be replayed as a CUDA graph.
"""
from __future__ import annotations


def forward(m, tokens, pos, pos0: int, n: int, last_only: bool = False):
    """tokens, pos: backend int32 arrays (n,); pos0: the first position (host int, used
    only where the backend cannot read positions on the device). Appends the tokens' keys
    and values to the cache and returns the backend's float32 logits (n, n_vocab), or
    (1, n_vocab) for the last token only (what prompt processing needs)."""
    B, hp, W = m.backend, m.hp, m.weights
    eps = hp.rms_eps
    x = B.embed(W.tok_embd, tokens, "x")
    for il, L in enumerate(W.layers):
        h = B.rms_norm(x, L.attn_norm, eps, "h")
        q = B.matmul(L.wq, h, "q")
        k = B.matmul(L.wk, h, "k")
        v = B.matmul(L.wv, h, "v")
        B.head_norm_(q, L.q_norm, hp.n_head, eps)
        B.head_norm_(k, L.k_norm, hp.n_head_kv, eps)
        B.rope_(q, pos, hp.n_head, hp.rope_base)
        B.rope_(k, pos, hp.n_head_kv, hp.rope_base)
        a = B.attention(m.cache, il, q, k, v, pos, pos0, n, "attn")
        B.add_(x, B.matmul(L.wo, a, "attn_out"))

        h = B.rms_norm(x, L.ffn_norm, eps, "h")
        ids, wts = B.route(B.matmul(L.router, h, "router"), hp.n_expert_used, hp.expert_weights_scale)
        if L.gate_up is not None:
            act = B.swiglu(B.mul_mat_id(L.gate_up, h, ids, "gate_up"), "act")
        else:
            act = B.swiglu_split(B.mul_mat_id(L.gate, h, ids, "gate"), B.mul_mat_id(L.up, h, ids, "up"), "act")
        B.moe_combine_(x, B.mul_mat_id(L.down, act, ids, "down"), wts)

    if last_only and n > 1:
        x = x[n - 1:n]
    h = B.rms_norm(x, W.output_norm, eps, "h")
    return B.matmul(W.output, h, "logits")
