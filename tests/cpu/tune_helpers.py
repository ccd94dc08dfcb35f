"""Running `moeforge tune` with the CPU stand-in objective, and reading its studies back."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import optuna
from optuna.trial import TrialState

SHAPE = "8,2,64,256"


def tune_argv(profile_dir, *extra, shape=SHAPE) -> list[str]:
    return [sys.executable, "-m", "moeforge.cli", "tune", "--objective", "standin", "--shape", shape,
            "--types", "q4_0", "--n", "512", "--profile-dir", str(profile_dir), "--quiet", *extra]


def env(cache_dir, sleep: float = 0.0, log=None, **more) -> dict:
    e = {**os.environ, "MOEFORGE_CACHE_DIR": str(cache_dir), "MOEFORGE_STANDIN_SLEEP": str(sleep),
         "PYTHONUNBUFFERED": "1"}
    if log:
        e["MOEFORGE_STANDIN_LOG"] = str(log)
    e.update({k: str(v) for k, v in more.items()})
    return e


def start(argv, env_, log_path):
    out = open(log_path, "ab")
    return subprocess.Popen(argv, env=env_, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def the_study(url: str, timeout: float = 60.0) -> optuna.Study:
    """The one study the commands above create (waits until a worker has made it)."""
    end = time.time() + timeout
    while True:
        try:
            names = optuna.study.get_all_study_names(storage=url)
        except Exception:
            names = []
        if names:
            assert len(names) == 1, names
            return optuna.load_study(study_name=names[0], storage=url)
        if time.time() > end:
            raise AssertionError(f"no study appeared in {url}")
        time.sleep(0.2)


def wait_for(pred, timeout: float, what: str, step: float = 0.1):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def running_of(study: optuna.Study, pid: int):
    """The trial `pid` is evaluating (its parameters drawn and its candidate sent off)."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if f":{pid}:" in t.user_attrs.get("worker", "") and "spec" in t.user_attrs:
            return t
    return None


def measured(t) -> bool:
    from moeforge.tuning.study import measured as m
    return m(t)
