import json

import pytest

from moeforge.codegen.compile import ARCHS, compile_spec, parse_ptxas
from moeforge.codegen.enumerate import all_specs
from moeforge.codegen.quant import parse_types
from moeforge.codegen.render import render, templates_hash
from moeforge.codegen.spec import KernelSpec, MmqSpec, MmvqSpec, ModelSpec, UtilSpec

SPECS = all_specs(parse_types("all"))


def test_names_are_unique_and_deterministic():
    names = [s.name for s in SPECS]
    assert len(names) == len(set(names))
    assert MmqSpec("q4_0", x=64, y=128, warps=8).name == "mmq_id-q4_0-x64y128w8k8s2-sk"
    assert MmvqSpec("q8_0", tokens=2, act="swiglu_oai", bias=True).name == "mmvq_id-q8_0-t2w4r1-swiglu_oai-bias"
    assert all(s.symbol.isidentifier() for s in SPECS)


def test_specs_round_trip_through_dicts():
    for s in SPECS[:: max(1, len(SPECS) // 60)]:
        assert KernelSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s


@pytest.mark.parametrize("bad", [
    dict(family="mmq", qtype="q4_0", x=12, y=128, warps=4),
    dict(family="mmq", qtype="q4_0", x=16, y=96, warps=4),
    dict(family="mmq", qtype="q4_0", x=16, y=64, warps=4, stages=5),
    dict(family="mmvq", qtype="q8_0", tokens=9),
    dict(family="mmvq", qtype="q8_0", bias=True),
    dict(family="mmvq", qtype="q9_0"),
    dict(family="nope"),
    dict(family="mmq", qtype="q4_0", x=16, y=64, warps=4, tile=3),
])
def test_invalid_specs_are_refused(bad):
    with pytest.raises(ValueError):
        KernelSpec.from_dict(bad)


def test_every_instance_renders_with_its_symbol():
    for s in SPECS:
        src = render(s)
        if isinstance(s, (UtilSpec, ModelSpec)):
            assert all(f" {k}(" in src for k in s.kernels)
        else:
            assert f" {s.symbol}(" in src


def test_mmq_layout_is_aligned():
    for s in SPECS:
        if isinstance(s, MmqSpec):
            lay = s.layout()
            assert all(v % 16 == 0 for v in lay.values()), s.name
            assert s.smem_bytes() == lay["stage"] * s.stages


def test_ptxas_log_parsing():
    log = ("ptxas info    : Compiling entry function 'k1' for 'sm_90'\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 96 registers, used 1 barriers, 260 bytes smem\n")
    assert parse_ptxas(log) == {"k1": {"registers": 96, "spill_stores": 4, "spill_loads": 12,
                                       "stack": 8, "smem": 260}}
    serial = ("ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized "
              "due to program dependence on compiler-inserted WG.AR in divergent path in the function 'k1'\n")
    assert parse_ptxas(serial + log)["k1"]["wgmma_serialized"] is True
    assert "wgmma_serialized" not in parse_ptxas(log)["k1"]


def test_compile_cache_is_keyed_by_source(tmp_path):
    a = MmvqSpec("q4_0", tokens=1)
    first = compile_spec(a, "sm_90", tmp_path)
    assert not first.cached and first.cubin.stat().st_size > 0
    assert first.info[a.symbol]["registers"] > 0
    again = compile_spec(a, "sm_90", tmp_path)
    assert again.cached and again.cubin == first.cubin
    other = compile_spec(MmvqSpec("q4_0", tokens=2), "sm_90", tmp_path)
    assert other.cubin != first.cubin
    # a damaged entry is rebuilt, never trusted
    meta = first.cubin.parent / first.cubin.name.replace(".cubin", ".json")
    meta.write_text("{not json")
    rebuilt = compile_spec(a, "sm_90", tmp_path)
    assert not rebuilt.cached
    assert len(templates_hash()) == 16


def test_generate_compiles_every_instance(generated):
    """For sm_90 and sm_80 every branch signature of the templates and every instance the
    dispatch defaults name; on sm_90 also every instance a shipped profile names, every f16
    tile and model module, and samples of the int8 tiles and mat-vecs that still compile
    every size of every tile axis; fixed samples otherwise (conftest.compile_plan), NVRTC
    only (no GPU, no toolkit)."""
    from conftest import FULL_ARCHS, _named_specs, _profile_specs, branch_signature, compile_plan, form_signature
    build_dir, summary, table = generated
    assert summary["failures"] == [], summary["failures"][:3]
    plan = compile_plan()
    assert summary["total"] == sum(len(v) for v in plan.values())
    sm90 = set(plan["sm_90"])
    assert len(plan["sm_90"]) == len(sm90)
    assert {s for s in SPECS if not isinstance(s, (MmqSpec, MmvqSpec))} | _profile_specs() <= sm90
    for family in (MmqSpec, MmvqSpec):
        for axis in ("x", "y", "warps", "kblocks", "stages", "tokens", "rows"):
            every = {getattr(s, axis) for s in SPECS if isinstance(s, family) and hasattr(s, axis)}
            assert every == {getattr(s, axis) for s in sm90 if isinstance(s, family) and hasattr(s, axis)}, \
                (family.__name__, axis)
    assert {branch_signature(s) for s in SPECS} == {branch_signature(s) for s in sm90}
    assert {form_signature(s) for s in SPECS if s.supports("sm_80")} == {form_signature(s) for s in plan["sm_80"]}
    for arch in FULL_ARCHS:
        assert _named_specs() <= set(plan[arch]), arch
    for arch in ARCHS:
        assert len(list((build_dir / arch).glob("*.cubin"))) == len(set(plan[arch])), arch
    # no instance lost its asynchronous wgmma to ptxas (it would still be right, only slow)
    metas = [json.loads(p.read_text()) for p in (build_dir / "sm_90").glob("*.json")]
    serialized = [(m["spec"], k) for m in metas for k, v in m["kernels"].items() if v.get("wgmma_serialized")]
    assert serialized == [], serialized[:3]
    assert set(FULL_ARCHS) <= set(ARCHS) and "instances" in table and "sm_90" in table


def test_templates_have_only_the_code_paths_the_compile_test_covers():
    """The templates branch on __CUDA_ARCH__ >= 800 and >= 900 only, so every other
    architecture compiles sm_80's path and a sample of it suffices (conftest.generated):
    a new threshold must come with its architecture in FULL_ARCHS."""
    import re
    from pathlib import Path

    from conftest import FULL_ARCHS
    tdir = Path(__file__).resolve().parents[2] / "templates"
    found = set()
    for f in tdir.glob("*.j2"):
        found |= {int(v) for v in re.findall(r"__CUDA_ARCH__\s*>=\s*(\d+)", f.read_text())}
        assert not re.search(r"__CUDA_ARCH__\s*(==|<|>(?!=)|<=)", f.read_text()), f.name
    assert found == {800, 900}
    assert {f"sm_{v // 10}" for v in found} == set(FULL_ARCHS)
    # the formats' traits: no architecture branch; the int8 tiles' and mat-vecs' branches hold
    # PDL's instructions only: so sm_80 compiles each form in one format (conftest.form_signature)
    from moeforge.codegen.quant import QUANT_TYPES
    for q in QUANT_TYPES.values():
        assert "__CUDA_ARCH__" not in (tdir / q.template).read_text(), q.template
    from conftest import form_signature
    forms = {form_signature(s): s for s in SPECS if isinstance(s, (MmqSpec, MmvqSpec))}.values()
    for spec in forms:
        src = render(spec)
        blocks = re.findall(r"#if __CUDA_ARCH__ >= 900\n(.*?)#endif", src, re.S)
        assert src.count("__CUDA_ARCH__") == len(blocks), spec.name
        for line in "\n".join(blocks).splitlines():
            line = line.strip()
            assert not line or line.startswith("//") or line.startswith('asm volatile("griddepcontrol.'), \
                (spec.name, line)


def test_every_default_decode_spec_is_generated():
    """What dispatch runs without a profile must be among the instances generate builds
    (q5_K and q6_K have no profile entries at all: everything they run is a default):
    conftest._named_specs lists the defaults, of the plain and fused mat-vecs (1 to 8
    tokens, each activation, with and without biases, the model's expert gate/up after the
    router) and of the int8 tiles, and the shipped profiles' entries."""
    from conftest import _named_specs
    missing = _named_specs() - set(SPECS)
    assert not missing, sorted(s.name for s in missing)[:5]


def test_fused_sweep_holds_the_default_and_each_decode_form_once():
    from moeforge.bench_fused import _fused_specs
    from moeforge.runtime import dispatch
    specs = _fused_specs("q4_0", 1, "silu", False, sweep=True, k=2048)
    assert specs[0] == dispatch.default_fused("q4_0", 1, "silu", False, ids=True, k=2048)
    assert len(specs) == len(set(specs))
    assert {s.rows for s in specs if s.prequant} == {1, 2, 4}
    assert {s.units for s in specs if s.guess} == {1, 2}
    eight = _fused_specs("q4_0", 8, "silu", False, sweep=True, k=2048)
    assert any(s.per_pair and s.prequant for s in eight) and any(s.tokens == 8 for s in eight)
    assert _fused_specs("q8_0", 2, "gelu", True, sweep=False, k=2880) == [
        dispatch.default_fused("q8_0", 2, "gelu", True, ids=True, k=2880)]


def test_k_quants_leave_the_32_weight_instances_untouched():
    """q4_K's scale reads are a template branch; q4_0/q8_0 must render without any trace of
    it (their shipped profile entries record each kernel's source hash), and q4_K's stages
    must hold whole super-blocks."""
    for spec in (MmqSpec("q4_0", 64, 128, 4), MmvqSpec("q8_0", act="silu"), MmvqSpec.decode("q4_0", rows=2, act="silu")):
        src = render(spec)
        assert "qt_wscale_at" not in src and "qt_wscale(" in src
    for spec in (MmqSpec("q4_K", 64, 128, 4), MmvqSpec("q4_K", act="silu")):
        src = render(spec)
        assert "qt_wscale_at(" in src and "qt_wscale(" not in src
    with pytest.raises(ValueError, match="whole q4_K super-blocks"):
        MmqSpec("q4_K", 64, 128, 4, kblocks=4).check()
