"""Candidates run in a separate process, so that what a bad kernel does (an illegal memory
access poisons the whole CUDA context; a hang never returns) ends one trial, not the study.

The worker process is started with multiprocessing's spawn (a fork would inherit the
parent's CUDA state) and kept between trials, because starting CUDA and building a case
costs seconds; it is killed on a timeout and exits by itself after any failure (a context
that saw a failed launch or a wrong result is not trusted with the next candidate), and a
fresh one is spawned on the next request. It also exits when its parent dies (the pipe
closes), so a killed study leaves no orphan holding the GPU.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import traceback


class TrialFailed(Exception):
    """A failed trial: compile or launch error, wrong result, crash or timeout."""


def _resolve(target: str):
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _watch_parent(ppid: int) -> None:
    """A killed parent never closes our pipe while we are busy in a kernel or a sleep;
    leave as soon as we are orphaned instead of holding the GPU."""
    import time
    while os.getppid() == ppid:
        time.sleep(0.5)
    os._exit(0)


def _child_main(conn, target: str, env: dict) -> None:
    import threading
    os.environ.update(env)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    handler = _resolve(target)()
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return   # the parent is gone
        if req is None:
            return
        try:
            conn.send(("ok", handler(req)))
        except BaseException as e:  # noqa: BLE001 - every failure is a result here
            reason = f"{type(e).__name__}: {e}".strip()
            tb = traceback.format_exc(limit=4)
            try:
                conn.send(("fail", reason[:2000], tb[-4000:]))
            finally:
                return   # never reuse a process that saw a failure


def _describe_exit(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class IsolatedRunner:
    """Sends requests to a worker process built by `target` ("module:factory"), one at a
    time. `call` returns the handler's result or raises TrialFailed with the reason."""

    def __init__(self, target: str, env: dict | None = None):
        self.target, self.env = target, dict(env or {})
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None
        self.spawned = 0
        self.state = None     # whatever the caller wants to remember about the live process

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_child_main, args=(child, self.target, self.env), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self.spawned += 1
        self.state = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def call(self, request: dict, timeout: float) -> dict:
        if not self.alive:
            self._reap()
            self._start()
        try:
            self._conn.send(request)
            ready = self._conn.poll(timeout)
        except (BrokenPipeError, EOFError, OSError):
            ready = True    # recv below reports how the process ended
        if not ready:
            self.kill()
            raise TrialFailed(f"timed out after {timeout:g} s (worker process killed)")
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            why = _describe_exit(self._proc.exitcode)
            self._reap()
            raise TrialFailed(f"worker process died ({why})") from None
        if msg[0] == "ok":
            return msg[1]
        self._proc.join(10)
        self._reap()
        raise TrialFailed(msg[1])

    def kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._reap()

    def _reap(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn, self.state = None, None, None

    def close(self) -> None:
        if self.alive:
            try:
                self._conn.send(None)
                self._proc.join(10)
            except (BrokenPipeError, OSError):
                pass
        self.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
