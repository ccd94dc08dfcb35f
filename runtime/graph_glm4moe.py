"""The glm4moe forward pass, written once against the backend interface (runtime.backend).

It follows llama.cpp's graph for this architecture (runtime.arch_glm4moe says how it
differs from qwen3moe): biased q, k and v, q/k RMSNorm where the file has it, NEOX RoPE
on part of each head; dense FFNs in the first layers and sigmoid routing with a selection
bias and a shared expert after them. Dense layers and shared experts ride the expert
products: a dense layer's FFN is one expert every token takes, the shared expert one more
slot of every token's routing (Gating.shared), both with weight 1.
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
        if L.q_norm is None:
            # the biases go with the RoPE launch (one launch less)
            q, k, v = B.qkv(L, h, bias=False)
            B.rope_store_(m.cache, il, q, k, v, pos, pos0, L)
        else:   # GLM-4.5: the norms come after the biases, before the RoPE of part of each head
            q, k, v = B.qkv(L, h)
            B.head_norm_(q, L.q_norm, hp.n_head, eps)
            B.head_norm_(k, L.k_norm, hp.n_head_kv, eps)
            B.rope_store_(m.cache, il, q, k, v, pos, pos0)
        a = B.attention(m.cache, il, q, pos, pos0, n, "attn")
        h = B.add_rms_norm_(x, B.matmul(L.wo, a, "attn_out"), L.ffn_norm, eps, "h")
        h = ffn(m, il, L, x, h, n)

    if last_only and n > 1:
        h = h[n - 1:n]
    return B.matmul(W.output, h, "logits")


def ffn(m, il: int, L, x, h, n: int):
    """Layer il's FFN on its normed input h, added to the residual x (glm4moe's and
    deepseek2's): a dense layer as its one expert, else the routed experts (a selection
    bias where the layer has one) and a shared expert apart where it does not ride with
    them; returns the next layer's input (its norm, or the output norm, of x)."""
    B, hp, W = m.backend, m.hp, m.weights
    if L.router is None:
        ids, wts = B.dense_route(n)
    else:
        ids, wts = B.route_tokens(L.router, h, hp.gating, sel_bias=L.exp_probs_b)
        if L.shared is not None:
            B.shared_expert_(L.shared, x, h)
    act = B.expert_gate_up(L, h, ids, "act")
    nxt = W.layers[il + 1].attn_norm if il + 1 < len(W.layers) else W.output_norm
    return B.moe_down_combine_rms_norm_(L, x, act, ids, wts, nxt, hp.rms_eps, "h")
