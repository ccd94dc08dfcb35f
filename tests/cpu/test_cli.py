import subprocess
import sys


def _moeforge(*args):
    return subprocess.run([sys.executable, "-m", "moeforge.cli", *args], capture_output=True, text=True)


def test_bench_without_gpu_says_so():
    r = _moeforge("bench", "--n", "1")
    assert r.returncode == 2
    assert "no CUDA device" in r.stderr


def test_bench_names_a_bad_shape_before_it_looks_for_a_gpu():
    r = _moeforge("bench", "--shape", "qwen9-moe", "--n", "1")
    assert r.returncode == 2 and "qwen9-moe" in r.stderr and "E,top_k,m,k" in r.stderr
    r = _moeforge("bench", "--shape", "qwen3-30b-a3b", "--shape", "32,4,2880,2880", "--n", "1")
    assert r.returncode == 2 and "no CUDA device" in r.stderr      # the names parse


def test_model_commands_name_a_bad_file_before_they_look_for_a_gpu(tmp_path):
    """This machine has no GPU: a missing or foreign file must still be what the user hears."""
    junk = tmp_path / "notes.gguf"
    junk.write_bytes(b"# not a model\n" * 8)
    for cmd in (["bench"], ["bench-model"], ["run", "-p", "hi"], ["perplexity", "-f", __file__]):
        r = _moeforge(cmd[0], str(tmp_path / "absent.gguf"), *cmd[1:])
        assert r.returncode != 0 and "absent.gguf: no such file" in r.stderr, (cmd, r.stderr)
        r = _moeforge(cmd[0], str(junk), *cmd[1:])
        assert r.returncode != 0 and "not a GGUF file" in r.stderr and "b'# no'" in r.stderr, (cmd, r.stderr)
        assert "GPU" not in r.stderr


def test_generate_rejects_unknown_arch_and_type():
    r = _moeforge("generate", "--arch", "sm_99")
    assert r.returncode == 2 and "sm_99" in r.stderr
    r = _moeforge("generate", "--types", "q3_x")
    assert r.returncode != 0 and "q3_x" in r.stderr
    r = _moeforge("generate", "--families", "mmvq,mmx")
    assert r.returncode == 2 and "mmx" in r.stderr and "mmvq" in r.stderr


def test_generate_command_reuses_the_cache(generated):
    """The command over a build directory that already holds every instance it asks for
    (q8_0's f16 tiles on sm_90, conftest.compile_plan): all cache hits (the compilation
    itself is checked by the codegen test that filled it), and only that family."""
    build_dir, _, _ = generated
    r = _moeforge("generate", "--types", "q8_0", "--arch", "sm_90", "--families", "mmf",
                  "--out", str(build_dir), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("sm_90")]
    assert rows and {(row[1], row[2]) for row in rows} == {("mmf", "q8_0")}
    total = [line for line in r.stdout.splitlines() if line.endswith(str(build_dir))][0]
    n, cached = total.split()[0], total.split("(")[1].split()[0]
    assert n == cached and int(n) > 10


def test_products_without_gpu_raise_a_clear_error():
    import numpy as np
    import pytest
    import moeforge
    from moeforge.runtime.device import NoGPUError
    with pytest.raises(NoGPUError, match="CUDA device"):
        moeforge.mul_mat_id(None, np.zeros((1, 32), np.float32), np.zeros((1, 1), np.int32))
