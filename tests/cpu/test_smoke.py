import pytest


def test_import_needs_no_gpu():
    import moeforge
    assert moeforge.QuantTensor and moeforge.mul_mat_id and moeforge.mul_mat


def test_gpu_machine_scripts_parse_and_llama_compare_asks_for_its_source():
    """The scripts run only on the GPU machine, in few, costly calls: a syntax error or a
    missing argument must show here, not there."""
    import pathlib
    import subprocess
    scripts = pathlib.Path(__file__).resolve().parents[2] / "scripts"
    for name in ("gpu-check", "llama-compare"):
        subprocess.run(["bash", "-n", str(scripts / name)], check=True)
    r = subprocess.run(["bash", str(scripts / "llama-compare")], capture_output=True, text=True)
    assert r.returncode != 0 and "usage: scripts/llama-compare LLAMA_SRC" in r.stderr


def test_gpu_check_modes_call_what_they_say_and_pack_their_logs(tmp_path):
    """scripts/gpu-check's rule and regions modes, with python3, ncu, nvidia-smi and moeforge
    stubbed (each call logged): the A/B alternates the setting with the rules as they are
    and ends with the model's A/B; regions runs ncu on each product; the logs come back as
    one archive; rule without a setting refuses by name."""
    import pathlib
    import subprocess
    import tarfile
    repo = pathlib.Path(__file__).resolve().parents[2]
    stubs, log = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir()
    for name in ("python3", "ncu", "nvidia-smi", "moeforge"):
        (stubs / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {log}\n'
                                  '[[ "$*" == *"tree_ab.py run"* ]] && echo "{}"\nexit 0\n')
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(tmp_path / "out"),
           "AB_SET": "MMF_WGMMA_Y256_MIN_WAVES=2", "REGIONS": "q4_0 128 8 2048 768 2048 down; q4_0 8 2 4096 14336 512 down"}
    r = subprocess.run(["bash", str(repo / "scripts" / "gpu-check"), "rule"], cwd=repo, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    runs = [c for c in calls if "tree_ab.py run" in c]
    assert len(runs) == 4 and ["--set" in c for c in runs] == [False, True, False, True]
    assert any("dispatch_ab.py" in c and "MMF_WGMMA_Y256_MIN_WAVES=2" in c for c in calls)
    with tarfile.open(tmp_path / "out" / "gpu-check.tgz") as tar:
        assert "gpu-check/rule.jsonl" in tar.getnames()
    assert not (tmp_path / "out" / "gpu-check").exists()
    log.unlink()
    r = subprocess.run(["bash", str(repo / "scripts" / "gpu-check"), "regions"], cwd=repo, env=env,
                       capture_output=True, text=True)
    profiled = [c for c in log.read_text().splitlines() if c.startswith("ncu --kernel-name")]
    assert r.returncode == 0 and len(profiled) == 2 and profiled[1].endswith("tile_regions.py run q4_0 8 2 4096 14336 512 down")
    r = subprocess.run(["bash", str(repo / "scripts" / "gpu-check"), "rule"], cwd=repo,
                       env={**env, "AB_SET": ""}, capture_output=True, text=True)
    assert r.returncode == 2 and "AB_SET=NAME=VALUE" in r.stdout


def test_step_kernels_table_sums_an_ncu_export_and_flags_kernels_outside_the_chain():
    """scripts/step_kernels.py table: an ncu raw CSV export (its own lines and the program's
    around it, a units row, thousands separators) summed by kernel name, slowest first; a
    CuPy kernel (no PDL: it ends the decode step's chain) flagged."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "step_kernels.py"
    spec = importlib.util.spec_from_file_location("step_kernels", path)
    sk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sk)
    head = '"ID","Kernel Name","Grid Size","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum"'
    lines = ["==PROF== Connected to process 1", "done 133", head, '"","","","ns","byte","byte"',
             '"0","mmvq_id_q4_0_t1w8r4(int, float*)","(512, 1, 1)","10,180","10,260,000","0"',
             '"1","cupy_add__float32_float32_float32","(16, 1, 1)","2,270","20,000","4,000"',
             '"2","mmvq_id_q4_0_t1w8r4(int, float*)","(512, 1, 1)","9,820","10,240,000","0"',
             "==PROF== Disconnected from process 1"]
    rows = sk.table(lines)
    assert [r["kernel"] for r in rows] == ["mmvq_id_q4_0_t1w8r4", "cupy_add__float32_float32_float32"]
    first, add = rows
    assert first["calls"] == 2 and abs(first["us"] - 20.0) < 1e-9 and abs(first["mb"] - 20.5) < 1e-9
    assert abs(first["gb_s"] - 1025.0) < 1e-6 and not first["outside_chain"]
    assert add["outside_chain"] and abs(add["mb"] - 0.024) < 1e-12
    text = sk.format_table(rows)
    assert "outside the PDL chain" in text.splitlines()[2] and text.splitlines()[-1].split()[1] == "3"
    with pytest.raises(ValueError, match="Kernel Name"):
        sk.table(["no header here"])


def test_glu_probe_names_its_models_and_stops_without_a_gpu():
    """scripts/glu_probe.py (run on the GPU machine): an unknown model is refused by name;
    without a CUDA device it says so and exits 2 before building anything."""
    import pathlib
    import subprocess
    import sys
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "glu_probe.py"
    r = subprocess.run([sys.executable, str(path), "--models", "gpt-oss-20b,nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown model nope" in r.stderr
    import os
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}     # as on CI's machine, on any machine
    r = subprocess.run([sys.executable, str(path), "--n", "2048"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "no CUDA device found" in r.stderr


def test_tile_regions_splits_a_sass_export_at_the_main_loop():
    """scripts/tile_regions.py table: ncu's SASS source page (its kernel line, then a header
    row) split at the first backward branch after the last MMA: prologue, main loop and
    epilogue with their shares of the stall samples and top reasons; an export without MMA
    or without a loop is refused by name."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "tile_regions.py"
    spec = importlib.util.spec_from_file_location("tile_regions", path)
    tr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tr)
    head = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
            '"stall_wait","stall_long_sb","stall_long_sb (Not Issued)"')

    def export(sass):
        rows = [f'"0x{0x100 + 16 * i:x}","{src}","{s:,}","{e}","{w}","{lsb}","999"'
                for i, (src, s, e, w, lsb) in enumerate(sass)]
        return ['"Kernel Name","mmf_id_q4_0_x128y256w8k4s3_wg",', head, *rows]
    sass = [("S2R R0, SR_TID.X", 10, 8, 10, 0),                   # prologue
            ("LDG.E R2, desc[UR4][R4.64]", 30, 8, 0, 30),
            ("LDS R3, [R0]", 100, 80, 100, 0),                     # the loop from 0x120
            ("HGMMA.64x128x16.F32 R24, R168, gdesc[UR8], R24", 1000, 80, 900, 0),
            ("@P0 BRA 0x120", 40, 80, 40, 0),
            ("LDG.E R5, desc[UR4][R6.64]", 1800, 8, 0, 1800),      # epilogue
            ("STG.E desc[UR4][R8.64], R24", 20, 8, 20, 0)]
    pro, loop, epi = tr.regions(export(sass))
    assert [r["instructions"] for r in (pro, loop, epi)] == [2, 3, 2]
    assert abs(pro["share"] - 40 / 3000) < 1e-12 and abs(loop["share"] - 1140 / 3000) < 1e-12
    assert abs(epi["share"] - 1820 / 3000) < 1e-12 and epi["executed"] == 16
    assert epi["stalls"][0] == ("long_sb", 1800 / 1820) and loop["stalls"][0] == ("wait", 1040 / 1140)
    assert loop["hot"][0] == ("0x130", sass[3][0], 1000 / 3000, "wait")     # the MMA's wait first
    assert [h[0] for h in loop["hot"]] == ["0x130", "0x120", "0x140"] and epi["hot"][0][3] == "long_sb"
    text = tr.format_table([pro, loop, epi])
    lines = text.splitlines()
    assert next(x for x in lines if x.startswith("epilogue")) and "long_sb 99%" in text
    assert lines[lines.index(next(x for x in lines if x.startswith("main loop"))) + 1].split()[:3] == \
        ["0x130", "33.3%", "wait"]
    with pytest.raises(ValueError, match="no MMA"):
        tr.regions(export([s for s in sass if "HGMMA" not in s[0]]))
    with pytest.raises(ValueError, match="no backward branch"):
        tr.regions(export([s for s in sass if "BRA" not in s[0]]))
    with pytest.raises(ValueError, match="no SASS rows"):
        tr.regions(["nothing here"])


def test_tree_ab_compares_the_fastest_runs_and_flags_any_changed_bit():
    """scripts/tree_ab.py: the products it times (a format only where its blocks divide k)
    and its table (first tag the baseline, each side's fastest run, `same` only when every
    run's output hash agreed); runs of other than two tags are refused by name."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "tree_ab.py"
    spec = importlib.util.spec_from_file_location("tree_ab", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    got = ab.products(["gpt-oss-20b", "qwen3-30b-a3b"], ["q4_K", "q4_0"], dense=False)
    assert ("qwen3-30b-a3b down", "q4_K", (128, 8, 2048, 768)) in got
    assert ("gpt-oss-20b down", "q4_0", (32, 4, 2880, 2880)) in got
    assert not any(q == "q4_K" and name.startswith("gpt-oss") for name, q, _ in got)    # 2880 % 256
    assert all(shape[0] > 1 for _, _, shape in got)
    assert any(shape[0] == 1 for _, _, shape in ab.products(["qwen3-30b-a3b"], ["q4_0"], dense=True))

    def row(tag, n, us, h):
        return dict(tag=tag, product="qwen3 down", qtype="q4_0", n=n, spec="mmf_id-q4_0-x128y128w8k4s5-wg",
                    us=us, hash=h)
    rows = [row("old", 1024, 200.0, "a"), row("new", 1024, 190.0, "a"), row("old", 1024, 210.0, "a"),
            row("new", 1024, 180.0, "a"), row("old", 2048, 300.0, "b"), row("new", 2048, 290.0, "c")]
    lines = ab.table(rows).splitlines()
    assert "new/old" in lines[0]
    assert lines[1].split()[-2:] == ["0.900", "yes"] and "200.0/210.0" in lines[1]
    assert lines[2].split()[-2:] == [f"{290 / 300:.3f}", "NO"]
    other = dict(row("new", 4096, 150.0, "e"), spec="mmf_id-q4_0-x128y256w8k4s3-wg")
    assert "x128y128w8k4s5-wg -> mmf_id-q4_0-x128y256" in \
        ab.table(rows + [row("old", 4096, 160.0, "e"), other]).splitlines()[-1]
    # --set: a dispatch constant for the run, the value before given back; a name that is
    # not one is refused by name
    from moeforge.runtime import dispatch
    before = ab.apply_settings(["MMF_WGMMA_Y256_MIN_WAVES=2"])
    try:
        assert dispatch.MMF_WGMMA_Y256_MIN_WAVES == 2 and before["MMF_WGMMA_Y256_MIN_WAVES"] != 2
    finally:
        dispatch.MMF_WGMMA_Y256_MIN_WAVES = before["MMF_WGMMA_Y256_MIN_WAVES"]
    for bad in ("MMF_WGMMA_Y256_MIN_WAVE=2", "MMF_WGMMA_Y256_MIN_WAVES", "mmf_rule_spec=1"):
        with pytest.raises(SystemExit, match="--set"):
            ab.apply_settings([bad])
    assert "only old ran" in ab.table(rows + [row("old", 4096, 1.0, "d")]).splitlines()[-1]
    with pytest.raises(ValueError, match="two tags"):
        ab.table(rows + [row("newer", 1024, 1.0, "a")])


def test_tree_ab_prepares_a_revision_importable_without_an_install(tmp_path):
    """scripts/tree_ab.py prepare: the tree at a revision, its package laid out by its own
    pyproject (links, no pip), imported from that folder ahead of the installed one, and
    rendering from its own templates."""
    import importlib.util
    import pathlib
    import subprocess
    import sys
    repo = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("tree_ab", repo / "scripts" / "tree_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    pkg = ab.prepare("HEAD", str(tmp_path / "old"), repo=str(repo))
    assert ab.prepare("HEAD", str(tmp_path / "old"), repo=str(repo)) == pkg    # again: nothing to redo
    code = ("import moeforge.codegen.render as r, moeforge.codegen.spec as s, moeforge.runtime.dispatch as d;"
            "print(r.__file__); print(d.__file__); print(len(r.render(s.UtilSpec())))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(pkg), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert all(pathlib.Path(p).resolve().is_relative_to((tmp_path / "old" / "tree").resolve()) for p in out[:2])
    assert int(out[2]) > 1000
    # a folder holding a tree (the device's copy has no git history): laid out from there
    again = ab.prepare(str(tmp_path / "old" / "tree"), str(tmp_path / "there"))
    assert (again / "moeforge" / "codegen").resolve() == (tmp_path / "old" / "tree" / "codegen").resolve()
    assert not (tmp_path / "there" / "tree").exists()
    # the same DIR laid out again from another tree: its links follow (a warm device's /tmp
    # kept the first tree's links, and that tree ran as the second)
    import shutil
    shutil.copytree(tmp_path / "old" / "tree", tmp_path / "other", symlinks=True)
    again = ab.prepare(str(tmp_path / "other"), str(tmp_path / "there"))
    assert (again / "moeforge").resolve() == (tmp_path / "other" / "moeforge").resolve()
    assert (again / "moeforge" / "runtime").resolve() == (tmp_path / "other" / "runtime").resolve()
    # the links are relative: the tree and its layout moved together still import
    moved = tmp_path / "moved"
    (tmp_path / "old").rename(moved)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(moved / "pkg"), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert pathlib.Path(out[0]).resolve().is_relative_to((moved / "tree").resolve())
