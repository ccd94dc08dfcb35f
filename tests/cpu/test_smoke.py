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
