"""Forward passes replayed as CUDA graphs.

A pass that allocates nothing and never waits for the host (every buffer named and
grow-only, token ids and positions read from device memory) can be captured once and
replayed: the host then spends one launch on it instead of hundreds, which is what a
prompt ubatch of ~700 launches is otherwise bound by. Entries are keyed by what shapes the
captured work (the decode step; a prompt ubatch's token count and whether only its last
row gets logits) and remember the layout they were captured against (buffer generations,
the cache): a pass whose buffers moved is run eagerly once more and captured again.

A pass is captured on its second run with a layout: the first, eager, compiles kernels and
sizes buffers. During capture CuPy may not allocate (a temporary's address would be baked
into the graph and later handed to another array): the allocator refuses, and a pass that
tries is run eagerly from then on, with a warning.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Entry:
    graph: object
    layout: tuple
    out: object


class PassGraphs:
    def __init__(self, cp, stream, max_entries: int = 8):
        self.cp, self.stream, self.max_entries = cp, stream, max_entries
        self.enabled = True
        self._entries: OrderedDict = OrderedDict()
        self._warm: OrderedDict = OrderedDict()   # key -> layout after its last eager run (recent ones)
        self._refused: set = set()

    def captured(self, key) -> bool:
        return key in self._entries

    def run(self, key, layout, forward):
        """forward() runs the pass on the backend's stream and returns its output buffer;
        layout() describes every address the pass uses."""
        if not self.enabled:
            return forward()
        now = layout()
        e = self._entries.get(key)
        if e is not None and e.layout == now:
            self._entries.move_to_end(key)
            e.graph.launch(self.stream)
            return e.out
        if key in self._refused or self._warm.get(key) != now:
            out = forward()
            self._warm[key] = layout()
            self._warm.move_to_end(key)
            while len(self._warm) > 4 * self.max_entries:   # prompt sizes seen once each
                self._warm.popitem(last=False)
            return out
        try:
            graph, out = self._capture(forward)
            if layout() != now:
                raise RuntimeError("a buffer was allocated while the pass was captured")
        except Exception as err:  # capture is an optimisation: this pass runs eagerly from now on
            warnings.warn(f"moeforge: {key} not captured as a CUDA graph ({err}); running eagerly")
            self._refused.add(key)
            self._entries.pop(key, None)
            return forward()
        self._warm.pop(key, None)
        self._entries[key] = _Entry(graph, now, out)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        graph.launch(self.stream)
        return out

    def _capture(self, forward):
        cp = self.cp
        previous = cp.cuda.get_allocator()

        def refuse(nbytes):
            raise RuntimeError(f"CuPy allocated {nbytes} bytes inside the captured pass")
        cp.cuda.set_allocator(refuse)
        try:
            self.stream.begin_capture()
            try:
                out = forward()
            finally:
                graph = self.stream.end_capture()
        finally:
            cp.cuda.set_allocator(previous)
        return graph, out
