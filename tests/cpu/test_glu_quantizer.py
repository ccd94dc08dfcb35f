"""SwiGLU in the down product's quantizer, on the CPU: the quantizing kernels compute it with
the swiglu kernel's own expression (what makes the fused path bit-identical, which the GPU
tests check), and bad widths are refused before any launch."""
import re

import numpy as np
import pytest

from moeforge.codegen.render import render
from moeforge.codegen.spec import ModelSpec, UtilSpec
from moeforge.runtime import ops


def test_every_swiglu_is_the_one_definition():
    """The model's swiglu kernels, the quantizers' SwiGLU input and the f16 converter's all
    call silu_times from act.cuh.j2, defined once in each compile unit."""
    from moeforge.codegen.spec import MmfSpec
    util, model = render(UtilSpec()), render(ModelSpec())
    mmf = render(MmfSpec("q4_0", x=64, y=128, warps=8))
    for src in (util, model, mmf):
        assert src.count("DEV float silu_times(float g, float u) { return g / (1.0f + __expf(-g)) * u; }") == 1
        assert src.count("/ (1.0f + __expf(-") == 1      # no second SiLU written out
    for kernel in ("void swiglu(", "void swiglu_split("):
        body = model.split(kernel)[1].split("\n}")[0]
        assert re.search(r"out\[idx\] = silu_times\(", body), kernel
    assert "silu_times(g.x, u.x)" in util and "silu_times(g.x, u.x)" in mmf


def test_both_quantizing_launches_take_the_glu_switch():
    util = render(UtilSpec())
    for kernel in ("quantize_q8_1", "prepare_moe"):
        head = util.split(f"void __launch_bounds__(512) {kernel}(")[1].split("{")[0]
        assert head.rstrip().endswith("int glu)"), kernel
    assert util.count("quantize_block8(") == 3     # the definition and both launches, each passing glu
    assert len(re.findall(r"quantize_block8\([^;]*glu\);", util)) == 2


def test_gate_up_products_must_have_an_even_width():
    assert ops._act_width(np.zeros((3, 64), np.float32), glu=True) == 32
    assert ops._act_width(np.zeros((3, 64), np.float32), glu=False) == 64
    with pytest.raises(ValueError, match="even width"):
        ops._act_width(np.zeros((3, 63), np.float32), glu=True)


def test_glu_products_stand_for_the_activation_shape():
    from moeforge.runtime.moe_cuda import GluProducts
    gu = np.zeros((5, 8, 2 * 96), np.float32)
    assert GluProducts(gu, choice=None).shape == (5, 8, 96)
