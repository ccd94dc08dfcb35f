"""SwiGLU in the down product's quantizer, on the CPU: the quantizing kernels compute it with
the swiglu kernel's own expression (what makes the fused path bit-identical, which the GPU
tests check), and bad widths are refused before any launch."""
import re

import numpy as np
import pytest

from moeforge.codegen.render import render
from moeforge.codegen.spec import ModelSpec, UtilSpec
from moeforge.runtime import ops


def _silu_expression(src: str, lhs: str) -> str:
    m = re.search(lhs + r"\s*(?:=|return)\s*([^;]+);", src)
    assert m, lhs
    return m.group(1).strip()


def test_quantizer_swiglu_is_the_swiglu_kernels_expression():
    util, model = render(UtilSpec()), render(ModelSpec())
    ours = _silu_expression(util, r"DEV float silu_times\(float g, float u\) \{")
    theirs = _silu_expression(model.split("void swiglu(")[1], r"out\[idx\]")
    assert ours == theirs == "g / (1.0f + __expf(-g)) * u"


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
