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


def test_swiglu_oai_is_one_definition_and_the_f16_form_stores_as_the_converter():
    """glu_oai_id and glu_oai_id_f16 compute SwiGLU-OAI with one device function (what makes
    the fused form bit-identical, which the GPU tests check), and glu_oai_id_f16 stores its
    four values in the places mmf_x_to_f16 stores them, for both tile forms."""
    from moeforge.codegen.spec import MmfSpec
    model = render(ModelSpec())
    assert model.count("expf(-1.702f * g)") == 1
    for kernel in ("void glu_oai_id(", "void glu_oai_id_f16("):
        body = model.split(kernel)[1].split("\n}")[0]
        assert "swiglu_oai(" in body and "1.702" not in body, kernel
    fused = model.split("void glu_oai_id_f16(")[1].split("\n}")[0]
    for wgmma in (True, False):
        conv = render(MmfSpec("q8_0", x=128, y=128, warps=8, kblocks=4, stages=4, wgmma=wgmma) if wgmma
                      else MmfSpec("q8_0", x=64, y=128, warps=8))
        body = conv.split("void __launch_bounds__(256) mmf_x_to_f16(")[1].split("\n}")[0]
        stores = [ln.strip().replace("pack_h2", "f16x2_of").replace("u32*", "unsigned*")
                  for ln in body.splitlines() if ln.strip().startswith(("xw", "xh[", "u32* xw"))]
        assert stores and all(s in fused for s in stores), stores


class _Dev:
    def __init__(self, addr):
        self.data = type("P", (), {"ptr": addr})()


def _glu_form(act, *, gate_b=None, up_b=None, k=64, path="mmf_id", fuse=True, monkeypatch):
    from types import SimpleNamespace

    from moeforge.runtime import dispatch
    from moeforge.runtime.moe_cuda import CudaMoeOps
    choice = dispatch.Choice(path, None)
    monkeypatch.setattr(dispatch, "choose_mul_mat_id", lambda *a, **kw: choice)
    down = SimpleNamespace(q=SimpleNamespace(f16_fits=True), shape=(8, 128, k), qtype="q8_0")
    L = SimpleNamespace(down=down, gate_b=gate_b, up_b=up_b)
    me = SimpleNamespace(hp=SimpleNamespace(expert_act=act), fuse_glu_quant=fuse)
    return CudaMoeOps._glu_form(me, L, 512, 4)


def test_which_down_products_take_the_gate_up_products(monkeypatch):
    """SiLU (no biases) on every path that prepares x in its own launch; SwiGLU-OAI only on
    the f16 tiles, with both biases or neither, 16-byte aligned, k a multiple of 4."""
    form = lambda act, **kw: _glu_form(act, monkeypatch=monkeypatch, **kw)   # noqa: E731
    for path in ops.GLU_PATHS:
        assert form("silu", path=path) is not None
    assert form("silu", path="mmvq") is None
    assert form("silu", gate_b=_Dev(256), up_b=_Dev(512)) is None
    assert form("silu", fuse=False) is None
    assert form("swiglu_oai") is not None
    assert form("swiglu_oai", gate_b=_Dev(256), up_b=_Dev(4096)) is not None
    assert form("swiglu_oai", path="mmq_id") is None
    assert form("swiglu_oai", gate_b=_Dev(256), up_b=_Dev(4100)) is None    # not 16-byte aligned
    assert form("swiglu_oai", gate_b=_Dev(256)) is None                    # one bias without the other
    assert form("swiglu_oai", k=66) is None
    assert form("gelu") is None


def test_the_f16_tiles_refuse_before_anything_is_launched():
    """check_f16 (what run_mmf and the SwiGLU-OAI path ask first): wrong routing or weights
    whose scales f16 cannot hold are named before any kernel, so no GPU is needed here."""
    from types import SimpleNamespace

    from moeforge.codegen.spec import MmfSpec
    from moeforge.runtime.mmf import check_f16, run_mmf
    fits = SimpleNamespace(f16_fits=True, qtype="q4_0")
    wide = SimpleNamespace(f16_fits=False, qtype="q4_0",
                           quant=SimpleNamespace(f16_scale_bytes=(0, 1)))
    spec = MmfSpec("q4_0", x=64, y=128, warps=8)
    check_f16(spec, fits, object())
    with pytest.raises(ValueError, match="needs expert ids"):
        run_mmf(spec, fits, None, None, 1, None)
    with pytest.raises(ValueError, match="past what f16 holds"):
        run_mmf(spec, wide, None, object(), 1, None)


def test_the_glu_tiles_are_taken_only_where_both_products_run_on_wgmma(monkeypatch):
    """_glu_tile: the gate|up product's glu tile (its chosen wgmma tile with the model's
    activation) only with the switch on, the gate|up and the down both on expert wgmma
    tiles and the glu tile's compile free of spills; the down's weights are refused by name
    before the gate|up tiles would write x."""
    import dataclasses
    from types import SimpleNamespace

    from moeforge.codegen.spec import MmfSpec
    from moeforge.runtime import dispatch, moe_cuda
    from moeforge.runtime.moe_cuda import CudaMoeOps
    wg = dispatch.Choice("mmf_id", MmfSpec("q4_0", 128, 256, 8, 4, 3, ids=True, wgmma=True))
    sync = dispatch.Choice("mmf_id", MmfSpec("q4_0", 64, 128, 8))
    ids = np.zeros((300, 2), dtype=np.int32)

    def tile(*, on=True, gu=wg, down=wg, act="silu", m=256, fits=True, spilled=False):
        monkeypatch.setattr(dispatch, "choose_mul_mat_id", lambda *a, **kw: gu)
        monkeypatch.setattr(moe_cuda, "load", lambda spec: SimpleNamespace(spilled=spilled))
        down_w = SimpleNamespace(f16_fits=fits, qtype="q4_0", quant=SimpleNamespace(f16_scale_bytes=(0, 1)))
        gate_up = SimpleNamespace(shape=(8, m, 128), qtype="q4_0", q=SimpleNamespace(f16_fits=True))
        L = SimpleNamespace(gate_up=gate_up, down=SimpleNamespace(q=down_w))
        me = SimpleNamespace(hp=SimpleNamespace(expert_act=act), fuse_glu_tiles=on)
        return CudaMoeOps._glu_tile(me, L, ids, down)

    assert tile() == dataclasses.replace(wg.spec, glu="silu")
    assert tile(act="swiglu_oai").glu == "swiglu_oai"
    assert tile(on=False) is None
    assert tile(down=sync) is None and tile(gu=sync) is None
    assert tile(gu=dispatch.Choice("mmq_id", None)) is None
    assert tile(m=96) is None                   # not two halves of whole blocks
    assert tile(spilled=True) is None           # its compile spilled registers
    with pytest.raises(ValueError, match="past what f16 holds"):
        tile(fits=False)


def test_the_glu_tiles_switch(monkeypatch):
    """The glu tiles are on by default (they measured faster: dispatch.GLU_TILES) and
    MOEFORGE_GLU_TILES turns them off and on again, as the backend reads it."""
    from moeforge.runtime import dispatch
    monkeypatch.delenv("MOEFORGE_GLU_TILES", raising=False)
    assert dispatch.glu_tiles_enabled()
    monkeypatch.setenv("MOEFORGE_GLU_TILES", "0")
    assert not dispatch.glu_tiles_enabled()
    monkeypatch.setattr(dispatch, "GLU_TILES", False)
    monkeypatch.setenv("MOEFORGE_GLU_TILES", "1")
    assert dispatch.glu_tiles_enabled()
    monkeypatch.delenv("MOEFORGE_GLU_TILES")
    assert not dispatch.glu_tiles_enabled()
