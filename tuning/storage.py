"""Study storage: SQLite in the user cache by default, any SQLAlchemy URL (PostgreSQL) to
share studies between workers on many hosts.

A trial whose worker dies stays RUNNING in the database. Two mechanisms turn it back into
work: Optuna's heartbeat (every worker beats per running trial; a trial whose beat is older
than the grace period is failed and re-enqueued by any live worker, on any host), and, for
an immediate resume on the same host, `reclaim_dead` (the trial records its worker's host,
pid and process start time; if that process is gone, the trial is failed and re-enqueued at
once instead of after the grace period).
"""
from __future__ import annotations

import os
import socket
import sqlite3
import time
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

HEARTBEAT_S = 5
GRACE_S = 30
MAX_RETRY = 3


class Retry:
    """Re-enqueue a trial whose worker died, with the same parameters, at most MAX_RETRY
    times. (Optuna's own retry callback copies the user attributes too, which would carry
    the dead worker's id into the new trial and invite a live worker to reclaim it.)"""

    def __init__(self, max_retry: int = MAX_RETRY):
        self.max_retry = max_retry

    def __call__(self, study: optuna.Study, trial) -> None:
        history = list(trial.system_attrs.get("retry_history", [])) + [trial.number]
        if len(history) > self.max_retry:
            return
        study.add_trial(optuna.trial.create_trial(
            state=TrialState.WAITING, params=trial.params, distributions=trial.distributions,
            system_attrs={"failed_trial": history[0], "retry_history": history},
            user_attrs={k: v for k, v in trial.user_attrs.items() if k in ("seed",)}))


def make_storage(url: str, heartbeat: int = HEARTBEAT_S, grace: int = GRACE_S) -> optuna.storages.RDBStorage:
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        # Several local workers (--gpus) write one file: wait for its lock, never fail on it.
        engine = {"connect_args": {"timeout": 120}}
    else:
        engine = {"pool_pre_ping": True}
    cb = Retry()
    kw = dict(heartbeat_interval=heartbeat, grace_period=grace)
    for attempt in range(5):
        # Workers started together race to create the tables of a new database; the loser
        # of that race sees an integrity error and simply tries again.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # heartbeat options are flagged experimental
                try:
                    storage = optuna.storages.RDBStorage(url, engine_kwargs=engine,
                                                         heartbeat_stale_trial_callback=cb, **kw)
                except TypeError:   # Optuna < 4.9 names the callback differently
                    storage = optuna.storages.RDBStorage(url, engine_kwargs=engine, failed_trial_callback=cb, **kw)
            break
        except Exception as e:  # noqa: BLE001 - sqlalchemy's errors vary by driver
            text = type(e).__name__ + repr(e)
            if attempt == 4 or not ("IntegrityError" in text or "already exists" in text):
                raise
            time.sleep(0.5 + attempt)
    if url.startswith("sqlite:///"):
        _sqlite_fast(storage)
    return storage


def _sqlite_fast(storage) -> None:
    """A trial makes ~20 small commits; with SQLite's default rollback journal each one
    waits for an fsync (~10 ms here), which costs more than a fast kernel's whole trial. WAL
    with synchronous=NORMAL is still crash-safe for the database (a power cut can lose the
    last commits, never corrupt the file) and lets local readers run beside the writer.

    Every transaction also starts with BEGIN IMMEDIATE. Python's sqlite3 driver otherwise
    opens a transaction only at the first write, so Optuna's read-check-write of a waiting
    trial (SELECT ... FOR UPDATE, which SQLite ignores) is not atomic, and two workers could
    both take the same enqueued trial: both measure it, and the second to finish is refused
    ("Cannot tell a COMPLETE trial") and kills its worker. Taking the write lock up front
    serializes those updates; readers outside a transaction still run beside them (WAL)."""
    import sqlalchemy

    def on_connect(conn, _record):
        conn.isolation_level = None    # the driver stops issuing its own deferred BEGIN
        cur = conn.cursor()
        cur.execute("PRAGMA busy_timeout=60000")   # wait for another worker's commit
        # WAL is a property of the file, set by the first connection. Asking for it takes a
        # lock that SQLite does not wait for: a worker connecting while another commits got
        # "database is locked" here, so it only asks when needed, and retries.
        for attempt in range(100):
            try:
                if cur.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    cur.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or attempt == 99:
                    raise
                time.sleep(0.05 + 0.01 * attempt)
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    def on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    sqlalchemy.event.listen(storage.engine, "connect", on_connect)
    sqlalchemy.event.listen(storage.engine, "begin", on_begin)
    storage.engine.dispose()   # connections opened while creating the tables lack the pragmas


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), so a recycled pid is not
    mistaken for the worker that died."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def worker_id(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid) or '?'}"


def _is_dead_here(worker: str) -> bool:
    try:
        host, pid, start = worker.rsplit(":", 2)
        pid = int(pid)
    except ValueError:
        return False
    if host != socket.gethostname():
        return False   # another host: only its heartbeat can tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return start != "?" and _start_time(pid) != start


def reclaim_dead(study: optuna.Study) -> list[int]:
    """Fail and re-enqueue the RUNNING trials of workers on this host that no longer exist."""
    storage = study._storage
    reclaimed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        w = t.user_attrs.get("worker")
        if not w or not _is_dead_here(w):
            continue
        try:
            if not storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                continue
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError):
            continue    # another worker got there first
        reclaimed.append(t.number)
        Retry()(study, storage.get_trial(t._trial_id))
    return reclaimed
