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
    h = B.rms_norm(x, W.layers[0].attn_norm, eps, "h")
    for il, L in enumerate(W.layers):
        q, k, v = B.qkv(L, h)
        B.qk_norm_rope_store_(m.cache, il, q, k, v, L, pos, pos0)
        a = B.attention(m.cache, il, q, pos, pos0, n, "attn")
        h = B.add_rms_norm_(x, B.matmul(L.wo, a, "attn_out"), L.ffn_norm, eps, "h")

        ids, wts = B.route_tokens(L.router, h, hp.gating)
        act = B.expert_gate_up(L, h, ids, "act")
        # the residual sum and the next norm (the next layer's, or the output norm) together
        nxt = W.layers[il + 1].attn_norm if il + 1 < len(W.layers) else W.output_norm
        h = B.moe_down_combine_rms_norm_(L, x, act, ids, wts, nxt, eps, "h")

    if last_only and n > 1:
        h = h[n - 1:n]      # RMSNorm is per row: normalising every row and keeping the last is the same
    return B.matmul(W.output, h, "logits")
