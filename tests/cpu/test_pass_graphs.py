"""runtime.graphs.PassGraphs without a GPU: a stand-in stream records what is captured and
launched, a stand-in CuPy holds the allocator."""
import warnings

import pytest

from moeforge.runtime.graphs import PassGraphs


class FakeCuda:
    def __init__(self):
        self.allocator = self.pool

    @staticmethod
    def pool(nbytes):
        return nbytes

    def get_allocator(self):
        return self.allocator

    def set_allocator(self, fn):
        self.allocator = fn


class FakeCp:
    def __init__(self):
        self.cuda = FakeCuda()


class FakeGraph:
    def __init__(self, stream, work):
        self.stream, self.work = stream, work

    def launch(self, stream):
        stream.launched.append(self.work)


class FakeStream:
    def __init__(self):
        self.capturing = False
        self.launched = []

    def begin_capture(self):
        self.capturing = True
        self.recorded = []

    def end_capture(self):
        self.capturing = False
        return FakeGraph(self, tuple(self.recorded))


class Pass:
    """A forward pass: records its work on the stream (in capture) or runs it (eager)."""

    def __init__(self, cp, stream, name, allocate=False):
        self.cp, self.stream, self.name, self.allocate, self.eager = cp, stream, name, allocate, 0

    def __call__(self):
        if self.allocate:
            self.cp.cuda.get_allocator()(256)
        if self.stream.capturing:
            self.stream.recorded.append(self.name)
        else:
            self.eager += 1
        return f"out-{self.name}"


def _setup():
    cp, stream = FakeCp(), FakeStream()
    return cp, stream, PassGraphs(cp, stream, max_entries=2)


def test_eager_then_captured_then_replayed():
    cp, stream, g = _setup()
    layout = [("cache", 0)]
    fwd = Pass(cp, stream, "p512")
    assert g.run("k", lambda: layout[0], fwd) == "out-p512" and fwd.eager == 1 and not g.captured("k")
    assert g.run("k", lambda: layout[0], fwd) == "out-p512" and g.captured("k")
    assert fwd.eager == 1 and stream.launched == [("p512",)]       # captured, then launched
    g.run("k", lambda: layout[0], fwd)
    assert fwd.eager == 1 and len(stream.launched) == 2             # replayed, not re-run
    assert cp.cuda.allocator == cp.cuda.pool                              # restored after capture


def test_a_moved_buffer_means_eager_then_a_new_capture():
    cp, stream, g = _setup()
    layout = [("cache", 0)]
    fwd = Pass(cp, stream, "p")
    for _ in range(3):
        g.run("k", lambda: layout[0], fwd)
    layout[0] = ("cache", 1)
    g.run("k", lambda: layout[0], fwd)
    assert fwd.eager == 2 and len(stream.launched) == 2            # stale graph not launched
    g.run("k", lambda: layout[0], fwd)
    assert fwd.eager == 2 and len(stream.launched) == 3


def test_an_allocation_while_captured_is_refused_and_the_pass_runs_eagerly():
    cp, stream, g = _setup()
    fwd = Pass(cp, stream, "p", allocate=True)
    g.run("k", lambda: 0, fwd)
    with pytest.warns(UserWarning, match="not captured"):
        assert g.run("k", lambda: 0, fwd) == "out-p"
    assert not g.captured("k") and fwd.eager == 2 and cp.cuda.allocator == cp.cuda.pool
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # refused once: no second attempt, no second warning
        g.run("k", lambda: 0, fwd)
    assert fwd.eager == 3 and stream.launched == []


def test_disabled_runs_eagerly_and_entries_are_bounded():
    cp, stream, g = _setup()
    passes = {k: Pass(cp, stream, k) for k in ("a", "b", "c")}
    for k in ("a", "b", "c"):
        for _ in range(2):
            g.run(k, lambda: 0, passes[k])
    assert not g.captured("a") and g.captured("b") and g.captured("c")
    g.enabled = False
    before = passes["b"].eager
    g.run("b", lambda: 0, passes["b"])           # off: even a captured pass runs eagerly
    g.run("a", lambda: 0, passes["a"])
    g.run("a", lambda: 0, passes["a"])
    assert passes["b"].eager == before + 1 and not g.captured("a")


def test_passes_run_once_each_leave_a_bounded_trace():
    # a prompt of every length from 1 to 100 tokens: each key runs once, eagerly; only the
    # most recent ones are remembered for a capture on their second run
    cp, stream, g = _setup()
    for n in range(1, 101):
        g.run(("prompt", n), lambda: 0, Pass(cp, stream, f"p{n}"))
    assert len(g._warm) <= 4 * g.max_entries
    again = Pass(cp, stream, "p100")
    g.run(("prompt", 100), lambda: 0, again)       # recent: captured on this second run
    assert g.captured(("prompt", 100)) and again.eager == 0 and ("prompt", 100) not in g._warm
    early = Pass(cp, stream, "p1")
    g.run(("prompt", 1), lambda: 0, early)         # forgotten: eager again, captured next time
    assert not g.captured(("prompt", 1)) and early.eager == 1
    g.run(("prompt", 1), lambda: 0, early)
    assert g.captured(("prompt", 1)) and early.eager == 1
