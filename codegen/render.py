"""Spec -> CUDA source, through the Jinja2 templates shipped in moeforge.templates."""
from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import resources

import jinja2

from .quant import QUANT_TYPES
from .spec import KernelSpec, MmfSpec, MmqSpec


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    root = resources.files("moeforge.templates")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    # a format's traits (its codebook, say) where a kernel that is not of one format needs them
    env.globals["quant_types"] = QUANT_TYPES
    return env


def render(spec: KernelSpec) -> str:
    spec.check()
    extra = {"L": spec.layout()} if isinstance(spec, (MmqSpec, MmfSpec)) else {}
    if hasattr(spec, "quant"):
        # K-quant scales are found from the super-block and the block's index in it
        # (quant_q4_K.cuh.j2, qt_wscale_at); a 32-weight block's from its own address
        extra["super_blocks"] = spec.quant.super_meta
    return _env().get_template(spec.template).render(spec=spec, **extra)


@lru_cache(maxsize=None)
def source_hash(spec: KernelSpec) -> str:
    """Hash of one instance's rendered source: what a profile entry records, so that it is
    trusted exactly as long as the kernel it timed is the kernel that would run."""
    return hashlib.sha256(render(spec).encode()).hexdigest()[:16]


@lru_cache(maxsize=1)
def templates_hash() -> str:
    """Hash of every template file: recorded in a profile's fingerprint and part of each
    study's name (a study never mixes timings of different kernels)."""
    root = resources.files("moeforge.templates")
    h = hashlib.sha256()
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".j2"):
            h.update(entry.name.encode())
            h.update(entry.read_bytes())
    return h.hexdigest()[:16]
