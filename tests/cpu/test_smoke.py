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
