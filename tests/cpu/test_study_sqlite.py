"""The Optuna driver on the default SQLite storage, with the CPU stand-in objective:
resume after a kill, failed trials never win, the default is measured first."""
import signal
import time

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from moeforge.cli import main
from moeforge.tuning import paths
from moeforge.tuning.space import TuneKey, default_choice, params_of

import tune_helpers as th


def test_killed_run_resumes_and_loses_nothing(tmp_path):
    cache, prof = tmp_path / "cache", tmp_path / "prof"
    argv = th.tune_argv(prof, "--trials", "14")
    p = th.start(argv, th.env(cache, sleep=0.4), tmp_path / "run1.log")
    try:
        url = f"sqlite:///{cache / 'tuning.db'}"
        study = th.the_study(url)
        th.wait_for(lambda: sum(th.measured(t) for t in study.get_trials()) >= 4, 90, "four trials")
        killed = th.wait_for(lambda: th.running_of(study, p.pid), 30, "a trial in flight")
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    before = {t.number: (t.state, t.value) for t in study.get_trials()}
    assert before[killed.number][0] == TrialState.RUNNING, "the killed worker's trial is left RUNNING"
    done_before = {n: v for n, (s, v) in before.items() if s == TrialState.COMPLETE}
    assert len(done_before) >= 3

    t0 = time.time()
    p2 = th.start(argv, th.env(cache, sleep=0.0), tmp_path / "run2.log")
    assert p2.wait(120) == 0, (tmp_path / "run2.log").read_text()[-3000:]
    # well inside the 30 s heartbeat grace: the dead local worker's trial was reclaimed at once
    assert time.time() - t0 < 25

    trials = study.get_trials()
    by_num = {t.number: t for t in trials}
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    for n, v in done_before.items():     # nothing done before the kill was lost or redone
        assert by_num[n].state == TrialState.COMPLETE and by_num[n].value == v
    k = by_num[killed.number]
    assert k.state == TrialState.FAIL and "fail_reason" not in k.user_attrs
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
    assert retries[0].params == k.params
    assert sum(th.measured(t) for t in trials) == 14
    assert list(prof.glob("*.yaml")), "the profile was written"

    # the same command again resumes a finished study: nothing to do, nothing re-measured
    p3 = th.start(argv, th.env(cache), tmp_path / "run3.log")
    assert p3.wait(60) == 0
    assert len(study.get_trials()) == len(trials)


def test_failed_trials_are_recorded_and_never_win(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    # the stand-in's best tile is x=16: make every x=16 candidate compute a wrong result
    monkeypatch.setenv("MOEFORGE_STANDIN_WRONG", "-x16y")
    rc = main(["tune", "--objective", "standin", "--shape", th.SHAPE, "--types", "q4_0", "--n", "512",
               "--trials", "30", "--profile-dir", str(tmp_path / "prof"), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    study = th.the_study(paths.default_storage_url())
    trials = study.get_trials()
    first = min(trials, key=lambda t: t.number)
    key = TuneKey("mul_mat_id", "q4_0", (8, 2, 64, 256), 512)
    assert first.params == params_of(default_choice(key)) and first.user_attrs["seed"] == "default"
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert failed, "the sampler should have tried the stand-in's optimum"
    assert all("-x16y" in t.user_attrs["spec"] and "NMSE" in t.user_attrs["fail_reason"] for t in failed)
    (pfile,) = (tmp_path / "prof").glob("*.yaml")
    entry = yaml.safe_load(pfile.read_text())["entries"][0]
    assert entry["spec"]["x"] != 16
    assert entry["us"] <= entry["default_us"]
    assert "failed trials" in out and "NMSE" in out


def test_budget_counts_measured_trials_and_stops_when_exhausted(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    # n=16 with E=128: a tiny space (x=8 only): the study ends when every candidate is measured
    rc = main(["tune", "--objective", "standin", "--shape", "128,8,768,2048", "--types", "q8_0", "--n", "16",
               "--trials", "500", "--profile-dir", str(tmp_path / "prof"), "--quiet"])
    assert rc == 0
    from moeforge.tuning.space import build
    size = len(build(TuneKey("mul_mat_id", "q8_0", (128, 8, 768, 2048), 16)))
    study = th.the_study(paths.default_storage_url())
    measured = [t for t in study.get_trials() if th.measured(t)]
    assert len(measured) == size
    assert len({tuple(sorted(t.params.items())) for t in measured}) == size, "no candidate measured twice"


def test_time_budget_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MOEFORGE_STANDIN_SLEEP", "0.2")
    t0 = time.time()
    rc = main(["tune", "--objective", "standin", "--shape", th.SHAPE, "--types", "q4_0", "--n", "64,512",
               "--time-budget", "8", "--profile-dir", str(tmp_path / "prof"), "--quiet"])
    assert rc == 0
    assert time.time() - t0 < 8 + 8
    storage = optuna.storages.RDBStorage(paths.default_storage_url())
    names = optuna.study.get_all_study_names(storage)
    assert len(names) == 2
    for name in names:   # the time was shared: both buckets measured their default and more
        trials = optuna.load_study(study_name=name, storage=storage).get_trials()
        assert sum(th.measured(t) for t in trials) >= 2


@pytest.mark.parametrize("args,msg", [
    (["--shape", "1,2,3"], "E,top_k,m,k"),
    (["--shape", "llama-7b"], "qwen3-30b-a3b"),
    (["--n", "48"], "powers of two"),
    (["--types", "q4_1"], "unknown quant type"),
])
def test_bad_arguments_are_usage_errors(args, msg, capsys, tmp_path):
    rc = main(["tune", "--objective", "standin", "--profile-dir", str(tmp_path), *args])
    assert rc == 2
    assert msg in capsys.readouterr().err


def test_one_worker_process_per_gpu_share_the_studies(tmp_path, monkeypatch):
    """--gpus starts one worker process per GPU; with the stand-in they share each study."""
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MOEFORGE_STANDIN_SLEEP", "0.1")
    rc = main(["tune", "--objective", "standin", "--shape", th.SHAPE, "--types", "q4_0", "--n", "512",
               "--trials", "16", "--gpus", "0,1", "--profile-dir", str(tmp_path / "prof"), "--quiet"])
    assert rc == 0
    study = th.the_study(paths.default_storage_url())
    measured = [t for t in study.get_trials() if th.measured(t)]
    assert 16 <= len(measured) <= 17
    assert len({t.user_attrs["worker"] for t in measured}) == 2
    assert list((tmp_path / "prof").glob("*.yaml"))


def _take_waiting(url: str, conn) -> None:
    from moeforge.tuning.storage import make_storage
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.load_study(study_name="race", storage=make_storage(url))
    taken = []
    while (tid := study._pop_waiting_trial_id()) is not None:
        taken.append(tid)
    conn.send(taken)


def test_concurrent_workers_never_take_the_same_waiting_trial(tmp_path):
    """Workers racing for enqueued trials on one SQLite file each get distinct ones (the
    pysqlite driver's deferred BEGIN once let two of them take the same trial; the second
    to finish it then died on "Cannot tell a COMPLETE trial")."""
    import multiprocessing as mp

    from moeforge.tuning.storage import make_storage
    url = f"sqlite:///{tmp_path / 'race.db'}"
    study = optuna.create_study(study_name="race", storage=make_storage(url))
    for k in range(150):
        study.enqueue_trial({"x": k})
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for _ in range(5):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_take_waiting, args=(url, send))
        p.start()
        pipes.append(recv)
        procs.append(p)
    taken = [tid for r in pipes for tid in r.recv()]
    for p in procs:
        p.join(60)
    assert len(taken) == 150, f"{len(taken) - len(set(taken))} trials were taken twice"
    assert len(set(taken)) == 150
