import os

import numpy as np
import pytest


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly, with the reason, where no CUDA device is present."""
    from moeforge.runtime.device import has_gpu
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """Fresh random inputs every run; the seed is printed so a failure can be replayed
    (MOEFORGE_SEED=... pytest ...)."""
    seed = int(os.environ.get("MOEFORGE_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"\n[seed {seed}] {request.node.name}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def generated(tmp_path_factory):
    """Every instance compiled for every architecture, once per test session."""
    import io
    from moeforge.codegen.compile import ARCHS
    from moeforge.codegen.generate import generate
    from moeforge.codegen.quant import parse_types
    build_dir = tmp_path_factory.mktemp("build")
    buf = io.StringIO()
    summary = generate(parse_types("all"), ARCHS, build_dir, progress=False, out=buf)
    return build_dir, summary, buf.getvalue()
