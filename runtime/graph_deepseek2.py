"""The deepseek2 forward pass, written once against the backend interface (runtime.backend).

It follows llama.cpp's graph for this architecture with latent attention absorbed
(runtime.arch.MLA): per layer, each head's query (from x, or through the low-rank q_a),
the latent and the shared RoPE key from kv_a; RoPE, the latent's norm and the cache row;
the queries taken into the latent's space (k_b), attention of all heads over the one
latent key row, the outputs taken out of it (v_b), the output projection. The FFN is
glm4moe's (runtime.graph_glm4moe.ffn): dense layers as one expert, shared experts beside
the routed ones.
"""
from __future__ import annotations

from .graph_glm4moe import ffn


def forward(m, tokens, pos, pos0: int, n: int, last_only: bool = False):
    """As graph_qwen3moe.forward: appends the tokens' latent rows to the cache and returns
    float32 logits (n, n_vocab), or (1, n_vocab) for the last token only."""
    B, hp, W = m.backend, m.hp, m.weights
    eps = hp.rms_eps
    x = B.embed(W.tok_embd, tokens, "x")
    h = B.rms_norm(x, W.layers[0].attn_norm, eps, "h")
    for il, L in enumerate(W.layers):
        q = B.mla_query(L, h)
        B.mla_rope_store_(m.cache, il, q, B.matmul(L.mla.kv_a, h, "kv_a"), L, pos, pos0)
        a = B.attention(m.cache, il, B.mla_absorb(L, q, "q_latent"), pos, pos0, n, "attn")
        h = B.add_rms_norm_(x, B.matmul(L.wo, B.mla_expand(L, a, "attn_v"), "attn_out"), L.ffn_norm, eps, "h")
        h = ffn(m, il, L, x, h, n)

    if last_only and n > 1:
        h = h[n - 1:n]
    return B.matmul(W.output, h, "logits")
