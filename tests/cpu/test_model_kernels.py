"""The model graph's small CUDA kernels compile with NVRTC (no GPU needed)."""
import re

import pytest

from moeforge.runtime.model_kernels import KERNELS, SOURCE, compile_check


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_model_kernels_compile(arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    compile_check(arch)


def test_every_kernel_is_listed():
    for k in KERNELS:
        assert re.search(rf'extern "C" __global__ void (__launch_bounds__\(\w+\)\s+)?{k}\(', SOURCE), k
    assert SOURCE.count('extern "C" __global__') == len(KERNELS)
