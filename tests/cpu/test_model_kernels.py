"""The model graph's small CUDA kernels: rendered by codegen like every other family and
compiled with NVRTC (no GPU needed), every kernel the backend launches present."""
import re

import pytest

from moeforge.codegen.compile import compile_spec
from moeforge.codegen.render import render
from moeforge.codegen.spec import ModelSpec


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_model_kernels_compile(arch, tmp_path):
    compiled = compile_spec(ModelSpec(), arch, tmp_path)
    assert compiled.cubin.stat().st_size > 0
    assert set(ModelSpec.KERNELS) <= set(compiled.info), sorted(set(ModelSpec.KERNELS) - set(compiled.info))


def test_every_kernel_is_listed():
    src = render(ModelSpec())
    for k in ModelSpec.KERNELS:
        assert re.search(rf'extern "C" __global__ void (__launch_bounds__\([\w, ]+\)\s+)?{k}\(', src), k
    assert src.count('extern "C" __global__') == len(ModelSpec.KERNELS)


def test_the_limits_size_the_kernels():
    src = render(ModelSpec(max_experts=256, max_head_dim=128))
    assert "#define ROUTE_SLOTS (256 / 32)" in src and "__shared__ float qs[128];" in src
    with pytest.raises(ValueError, match="multiple of 32"):
        ModelSpec(max_experts=100).check()
