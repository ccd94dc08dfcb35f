"""Which heads the prompt attention kernel takes (runtime.backend_cuda.prefill_supported)
and its shared memory: no GPU needed."""
from moeforge.runtime.arch_qwen3moe import HParams
from moeforge.runtime.backend_cuda import prefill_smem, prefill_supported


def _hp(n_head, n_head_kv, head_dim):
    return HParams(n_vocab=32, n_embd=64, n_layer=2, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                   n_ff_exp=64, n_expert=8, n_expert_used=2, rms_eps=1e-6, rope_base=1e6, n_ctx_train=4096)


def test_qwen3_heads_are_taken():
    assert prefill_supported(_hp(32, 4, 128))       # Qwen3-30B-A3B
    assert prefill_supported(_hp(64, 4, 128))       # Qwen3-235B-A22B: 16 heads a group
    assert prefill_supported(_hp(6, 3, 36))


def test_other_heads_go_through_cublas():
    assert not prefill_supported(_hp(8, 8, 256))    # wider than 32 lanes x 4
    assert not prefill_supported(_hp(34, 1, 64))    # more than 16 query heads a group
    assert not prefill_supported(_hp(4, 2, 30))     # not a multiple of 4
    assert not prefill_supported(_hp(6, 4, 64))     # groups of unequal size


def test_shared_memory_fits_an_h100_block():
    assert prefill_smem(_hp(32, 4, 128)) == 4 * (8 * 8 * 128 + 2 * 32 * 129 + 2 * 32 * 128 + 8 * 8 * 32)
    for hp in (_hp(32, 4, 128), _hp(64, 4, 128), _hp(16, 16, 128)):
        assert prefill_smem(hp) <= 227 * 1024
