"""The correctness gate: no candidate is timed, let alone chosen, before its output agrees
with both numpy references.

The emulating reference (q8_1 activations, integer block dots; for the f16 tensor-core
path, weights and activations rounded to float16) agrees with a correct kernel to float32
accumulation error, so it catches subtle bugs (a lost stream-k partial, a wrong scale); the
float64 reference catches gross ones with ggml's own bar. To keep the gate cheap
at large n, the references cover a subset: every output row that a y-tile edge or a random
draw picks (bugs in the m direction hit whole tiles), and all tokens up to MAX_TOKENS, else
a random subset plus the first and last tokens (routing bugs are per token). The subset is
fresh for every case, so a candidate cannot pass by luck twice.

Routing: random (each token picks top_k distinct experts uniformly, as the anchor tables
do) and skewed (a few hot experts take most tokens, as real models route), which fills some
experts' tiles and leaves others empty.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import reference as ref
from ..codegen.quant import quant_type
from ..codegen.spec import MmfSpec

NMSE_EMULATED = ref.NMSE_EMULATED     # f16 tiles past 4096 of k: ref.nmse_emulated_bar
NMSE_FLOAT = 5e-4
MAX_TOKENS = 512
RANDOM_ROWS = 96


class GateFailure(Exception):
    """A wrong result: the reason says which reference and by how much."""


def routing(kind: str, n: int, E: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    if top_k > E:
        raise ValueError(f"top_k={top_k} > E={E}")
    if kind == "random":
        return np.argsort(rng.random((n, E)), axis=1)[:, :top_k].astype(np.int32)
    if kind == "skewed":
        # Gumbel top-k over weights that give a few experts ~E/hot times the mass of the rest:
        # distinct experts per token, most tokens visiting every hot expert.
        hot = max(1, min(4, E // 8))
        logw = np.zeros(E)
        logw[rng.choice(E, size=hot, replace=False)] = np.log(4.0 * E / hot)
        keys = logw[None, :] + rng.gumbel(size=(n, E))
        return np.argsort(-keys, axis=1)[:, :top_k].astype(np.int32)
    raise ValueError(f"unknown routing {kind!r}")


def check_rows(m: int, rng: np.random.Generator, tile_edges=(64, 128)) -> np.ndarray:
    rows = set(rng.choice(m, size=min(m, RANDOM_ROWS), replace=False).tolist())
    rows |= {0, m - 1}
    for t in tile_edges:
        for edge in range(t, m, t):
            rows |= {edge - 1, edge}
    return np.array(sorted(r for r in rows if 0 <= r < m), dtype=np.int64)


def check_tokens(n: int, rng: np.random.Generator) -> np.ndarray:
    if n <= MAX_TOKENS:
        return np.arange(n, dtype=np.int64)
    inner = rng.choice(np.arange(1, n - 1), size=MAX_TOKENS - 2, replace=False)
    return np.array(sorted([0, n - 1, *inner.tolist()]), dtype=np.int64)


@dataclass
class Reference:
    """Both references for one input set, on the checked tokens x rows only."""
    tokens: np.ndarray
    rows: np.ndarray
    emulated: np.ndarray     # (len(tokens), top_k, len(rows)) float64
    exact: np.ndarray
    emulated_f16: np.ndarray | None  # the f16 path's own rounding; None: the type has no f16 tiles
    k: int                           # the products' length: the f16 emulation's bar grows with it

    def pick(self, out: np.ndarray) -> np.ndarray:
        """The checked part of a full (n, top_k, m) output."""
        return out[self.tokens][:, :, self.rows]


def reference(raw: np.ndarray, qtype: str, shape, x: np.ndarray, ids: np.ndarray,
              tokens: np.ndarray, rows: np.ndarray) -> Reference:
    """raw: GGUF blocks of the (E, m, k) weights; x: (n, k) or (n, top_k, k); ids (n, top_k)."""
    q = quant_type(qtype)
    E, m, k = shape
    sub = np.ascontiguousarray(np.asarray(raw).reshape(E, m, q.row_bytes(k))[:, rows])
    sub_shape = (E, len(rows), k)
    xs, idss = x[tokens], ids[tokens]
    emu = ref.mul_mat_id_emulated(sub, qtype, sub_shape, xs, idss)
    exact = ref.mul_mat_id_float(ref.dequantize(sub, qtype, sub_shape), xs, idss)
    emu16 = ref.mul_mat_id_emulated_f16(sub, qtype, sub_shape, xs, idss) if q.name in MmfSpec.QTYPES else None
    return Reference(tokens, rows, emu, exact, emu16, k)


def compare(got: np.ndarray, r: Reference, numerics: str = "q8_1") -> dict:
    """Raise GateFailure unless `got` (the checked part) passes both references; numerics
    "f16" holds it to the f16 path's emulation instead of q8_1's."""
    got = np.asarray(got)
    bad = int(np.size(got) - np.count_nonzero(np.isfinite(got)))
    if bad:
        raise GateFailure(f"{bad} of {got.size} checked outputs are NaN/inf (left unwritten or overflowed)")
    if numerics not in ("q8_1", "f16"):
        raise ValueError(f"unknown numerics {numerics!r}")
    e_emu, e_flt = ref.nmse(got, r.emulated_f16 if numerics == "f16" else r.emulated), ref.nmse(got, r.exact)
    bar = ref.nmse_emulated_bar(r.k, numerics == "f16")
    if not e_emu <= bar:
        raise GateFailure(f"NMSE vs the emulating reference {e_emu:.3e} > {bar:g}")
    if not e_flt <= NMSE_FLOAT:
        raise GateFailure(f"NMSE vs the float64 reference {e_flt:.3e} > {NMSE_FLOAT:g}")
    return {"nmse_emulated": e_emu, "nmse_float": e_flt}
