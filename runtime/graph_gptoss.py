"""The gpt-oss forward pass, written once against the backend interface (runtime.backend).

It follows llama.cpp's graph for this architecture (runtime.arch_gptoss says how it
differs from qwen3moe): biased q, k, v and output products, YaRN NEOX RoPE, attention
with a sink logit per head and, on every other layer, a sliding window; a MoE FFN whose
router has a bias, SwiGLU-OAI experts with biased gate, up and down products.
"""
from __future__ import annotations


def forward(m, tokens, pos, pos0: int, n: int, last_only: bool = False):
    """As graph_qwen3moe.forward: appends the tokens' keys and values to the cache and
    returns float32 logits (n, n_vocab), or (1, n_vocab) for the last token only."""
    B, hp, W = m.backend, m.hp, m.weights
    eps = hp.rms_eps
    x = B.embed(W.tok_embd, tokens, "x")
    h = B.rms_norm(x, W.layers[0].attn_norm, eps, "h")
    for il, L in enumerate(W.layers):
        # the biases of q, k, v and the output projection go with the next op (one launch less each)
        q, k, v = B.qkv(L, h, bias=False)
        B.rope_store_(m.cache, il, q, k, v, pos, pos0, L)
        a = B.attention(m.cache, il, q, pos, pos0, n, "attn", sinks=L.sinks, window=hp.window(il))
        h = B.add_rms_norm_(x, B.matmul(L.wo, a, "attn_out"), L.ffn_norm, eps, "h", bias=L.bo)

        ids, wts = B.route_tokens(L.router, h, hp.gating, bias=L.router_b)
        act = B.expert_gate_up(L, h, ids, "act")
        nxt = W.layers[il + 1].attn_norm if il + 1 < len(W.layers) else W.output_norm
        h = B.moe_down_combine_rms_norm_(L, x, act, ids, wts, nxt, eps, "h")

    if last_only and n > 1:
        h = h[n - 1:n]
    return B.matmul(W.output, h, "logits")
