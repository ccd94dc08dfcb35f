"""Several workers on one study in a real PostgreSQL server (as on several GPU hosts), with
the CPU stand-in objective: no trial lost or done twice, and a worker killed mid-trial
leaves a trial that another worker picks up (heartbeat, then retry).

The server must start: if it cannot, the test fails (it never skips itself into green).
"""
import signal
from collections import Counter

import pytest
from optuna.trial import TrialState

import pg
import tune_helpers as th

BUDGET = 40


@pytest.fixture(scope="module")
def postgres():
    server = pg.Server()     # raises (fails the test) when no server can be started
    yield server
    server.stop()


def test_server_is_real(postgres):
    import sqlalchemy
    with sqlalchemy.create_engine(postgres.url).connect() as c:
        assert "PostgreSQL" in c.execute(sqlalchemy.text("select version()")).scalar()


def test_workers_share_a_study_and_recover_a_killed_worker(postgres, tmp_path):
    log = tmp_path / "evaluations.log"
    # m=256 leaves ~100 candidates at n=512, more than the budget: the budget ends the study
    argv = th.tune_argv(tmp_path / "prof", "--trials", str(BUDGET), "--storage", postgres.url,
                        "--heartbeat", "1", "--grace", "3", shape="8,2,256,256")
    # The victim's trials take a minute, so it is surely mid-trial when it is killed.
    victim = th.start(argv, th.env(tmp_path / "c0", sleep=60, log=log), tmp_path / "w0.log")
    workers = [th.start(argv, th.env(tmp_path / f"c{i}", sleep=0.15, log=log), tmp_path / f"w{i}.log")
               for i in (1, 2)]
    try:
        study = th.the_study(postgres.url)
        killed = th.wait_for(lambda: th.running_of(study, victim.pid), 90, "the victim's trial in flight")
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        for i, w in enumerate(workers, 1):
            assert w.wait(240) == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
    finally:
        for p in (victim, *workers):
            if p.poll() is None:
                p.kill()

    trials = study.get_trials()
    by_num = {t.number: t for t in trials}
    # nothing lost: no trial is left running or waiting
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]

    # the killed worker's trial went stale, failed, and came back as a retry that a live
    # worker measured, with the same parameters
    k = by_num[killed.number]
    assert k.state == TrialState.FAIL and "fail_reason" not in k.user_attrs
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert len(retries) == 1, [t.number for t in retries]
    r = retries[0]
    assert r.state == TrialState.COMPLETE and r.params == k.params
    assert f":{victim.pid}:" not in r.user_attrs["worker"]

    # nothing done twice: every trial number was evaluated by at most one process, and every
    # measured trial exactly once
    lines = [ln.split() for ln in log.read_text().splitlines()]
    starts = Counter(int(t) for ev, _, t, _ in lines if ev == "start")
    ends = Counter(int(t) for ev, _, t, _ in lines if ev == "end")
    assert max(starts.values()) == 1, [n for n, c in starts.items() if c > 1]
    measured = [t for t in trials if th.measured(t)]
    for t in measured:
        assert starts[t.number] == 1 and ends[t.number] == 1, t.number
    assert ends[killed.number] == 0, "the victim never finished its trial"

    # the budget holds across workers (each may overshoot by the one trial it had started)
    assert BUDGET <= len(measured) <= BUDGET + 2
    workers_seen = {t.user_attrs["worker"] for t in measured}
    assert len(workers_seen) >= 2, "both live workers took part"
