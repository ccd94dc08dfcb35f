"""Reading a GGUF file for the model runtime: metadata and tensors as host views.

The file is memory-mapped by gguf's reader, so a tensor's bytes are read from disk only
when something touches them (the upload), and pass through host memory once. Nothing
here knows an architecture: arch modules say what they expect, `check_tensors` compares.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..codegen.quant import QUANT_TYPES, type_name
from .convert import FOREIGN, block_size, row_bytes

# Types a weight matrix may have: moeforge's quantized formats, plain floats, and the GGUF
# types converted to q8_0 as they load (runtime/convert.py).
FLOAT_TYPES = ("f32", "f16", "bf16")
MATRIX_TYPES = FLOAT_TYPES + tuple(QUANT_TYPES) + FOREIGN


class GGUFError(ValueError):
    """A GGUF file moeforge cannot run: the message names the file and the key or tensor."""


@dataclass
class TensorRef:
    """One tensor of the file, not yet read: numpy-order shape, GGUF type name, and a
    loader for its bytes (quantized: uint8 (rows, row_bytes); float: typed array):
    load() gives a host array, load(cupy) a device one (merges and the like then happen
    on the device)."""
    name: str
    qtype: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray] = field(repr=False)

    @property
    def quantized(self) -> bool:
        return self.qtype in QUANT_TYPES

    @property
    def nbytes(self) -> int:
        if self.quantized or self.qtype in FOREIGN:
            rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
            return rows * row_bytes(self.qtype, self.shape[-1])
        return int(np.prod(self.shape)) * {"f32": 4, "f16": 2, "bf16": 2}.get(self.qtype, 4)


def check_header(path: str | os.PathLike) -> None:
    """A missing file or one that does not start as GGUF, reported before anything else is
    checked (a GPU, say): the first 4 bytes only, the full validation is GGUFFile's."""
    path = str(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file ({os.path.getsize(path)} bytes; it starts with {magic!r}, "
                        f"not b'GGUF')")


class GGUFFile:
    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader
        self.path = str(path)
        check_header(self.path)
        try:
            self.reader = GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises whatever numpy raises on short data
            size = os.path.getsize(self.path)
            raise GGUFError(f"{self.path}: not a readable GGUF file ({size} bytes; corrupt or truncated?): "
                            f"{type(e).__name__}: {e}") from None
        self.metadata = {name: self._value(f) for name, f in self.reader.fields.items()
                         if not name.startswith("GGUF.")}
        self.tensors: dict[str, TensorRef] = {}
        size = self.reader.data.size
        for t in self.reader.tensors:
            qtype = type_name(t.tensor_type)
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))
            ref = TensorRef(t.name, qtype, shape, (lambda xp=np, t=t: xp.asarray(t.data)))
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise GGUFError(f"{self.path}: tensor {t.name!r} ends at byte {end} but the file has {size} "
                                f"bytes (truncated?)")
            self.tensors[t.name] = ref

    @staticmethod
    def _value(f):
        from gguf import GGUFValueType
        if not f.types:
            return None
        if f.types[0] == GGUFValueType.ARRAY:
            if len(f.types) > 1 and f.types[1] == GGUFValueType.STRING:
                return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
            return [f.parts[i].tolist()[0] for i in f.data]
        if f.types[0] == GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
        return f.parts[f.data[0]].tolist()[0]

    def get(self, key: str, default=None, *, required: bool = False, kind=None):
        if key not in self.metadata:
            if required:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        v = self.metadata[key]
        if kind is int:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise GGUFError(f"{self.path}: metadata key {key!r} must be a non-negative integer, got {v!r}")
        elif kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
                raise GGUFError(f"{self.path}: metadata key {key!r} must be a number, got {v!r}")
            v = float(v)
        return v

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", required=True))


@dataclass(frozen=True)
class Expect:
    """What an architecture expects of one tensor."""
    shape: tuple[int, ...]
    types: tuple[str, ...] = MATRIX_TYPES
    required: bool = True


def check_tensors(f: GGUFFile, expected: dict[str, Expect]) -> None:
    """Every expected tensor present with its shape and an allowed type, and nothing else;
    all problems in one error, so a broken converter is fixed in one go."""
    problems = []
    for name, ex in expected.items():
        t = f.tensors.get(name)
        if t is None:
            if ex.required:
                problems.append(f"tensor {name!r} is missing")
            continue
        if t.shape != ex.shape:
            problems.append(f"tensor {name!r} has shape {t.shape}, expected {ex.shape}")
        if t.qtype not in ex.types:
            problems.append(f"tensor {name!r} is {t.qtype}, expected one of {', '.join(ex.types)}")
        elif (t.quantized or t.qtype in FOREIGN) and t.shape[-1] % block_size(t.qtype)[0]:
            problems.append(f"tensor {name!r}: row length {t.shape[-1]} is not a multiple of the "
                            f"{t.qtype} block size")
    extra = sorted(set(f.tensors) - set(expected))
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        problems.append(f"unexpected tensors for {f.architecture}: {', '.join(extra[:5])}{more}")
    if problems:
        raise GGUFError(f"{f.path}: " + "; ".join(problems))
