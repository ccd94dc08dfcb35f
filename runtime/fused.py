"""The fused expert FFN front half for decoding: out = act(W_gate x + b_gate) * (W_up x + b_up),
computed in one mat-vec launch from one quantization of x, for the merged gate_up layout
(gate rows first, then up) or for separate gate and up tensors.

Every tensor of a fused call must live in the same GPU memory as x and agree in type and
shape; anything else is refused before launch (a fused kernel that trusted a host or
foreign pointer is how ik_llama.cpp's first version of this fusion crashed).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..codegen.spec import MmvqSpec
from . import dispatch
from .device import require_gpu
from .ops import _check_out, _device_array, _mmvq, mul_mat, mul_mat_id
from .tensor import QuantTensor

ACTS = MmvqSpec.ACTS


def _on_device(t: QuantTensor, name: str, device_id: int) -> None:
    cp = require_gpu()
    if not isinstance(t, QuantTensor):
        raise ValueError(f"{name} must be a moeforge.QuantTensor, got {type(t).__name__}")
    buf = t.buffer
    if not isinstance(buf, cp.ndarray):
        raise ValueError(f"{name} lives in host memory ({type(buf).__name__}); a fused call needs every "
                         f"tensor on the GPU of x (device {device_id})")
    if buf.device.id != device_id:
        raise ValueError(f"{name} is on device {buf.device.id}, x on device {device_id}")


class _Operands:
    """Validated operands of one fused call: gate and up weights, n_ff, biases."""

    def __init__(self, x, gate_up, gate, up, gate_bias, up_bias, experts: bool):
        cp = require_gpu("fused gate/up")
        ndim = 3 if experts else 2
        if (gate_up is None) == (gate is None and up is None) or (gate is None) != (up is None):
            raise ValueError("pass either gate_up (merged: gate rows, then up rows) or both gate and up")
        first = gate_up if gate_up is not None else gate
        if not isinstance(first, QuantTensor):
            raise ValueError(f"{'gate_up' if gate_up is not None else 'gate'} must be a moeforge.QuantTensor")
        dev = first.buffer.device.id if isinstance(first.buffer, cp.ndarray) else cp.cuda.Device().id
        self.x = _device_array(x, "x", np.float32, (2,), dev)
        for name, t in (("gate_up", gate_up), ("gate", gate), ("up", up)):
            if t is not None:
                _on_device(t, name, dev)
                if len(t.shape) != ndim:
                    raise ValueError(f"{name} must have {ndim} dimensions, got shape {t.shape}")
        if gate_up is not None:
            if gate_up.m % 2:
                raise ValueError(f"gate_up has {gate_up.m} rows per expert; merged gate/up needs an even count")
            self.gate, self.up, self.n_ff, self.up_off = gate_up, gate_up, gate_up.m // 2, gate_up.m // 2
        else:
            if gate.shape != up.shape or gate.qtype != up.qtype:
                raise ValueError(f"gate {gate.qtype} {gate.shape} and up {up.qtype} {up.shape} must agree")
            self.gate, self.up, self.n_ff, self.up_off = gate, up, gate.m, 0
        if self.x.shape[1] != self.gate.k:
            raise ValueError(f"x has k={self.x.shape[1]}, the weights have k={self.gate.k}")
        self.rows_e = self.gate.m
        lead = (self.gate.n_experts,) if experts else ()
        self.bias_g = self._bias(gate_bias, "gate_bias", lead, dev)
        self.bias_u = self._bias(up_bias, "up_bias", lead, dev)
        if (self.bias_g is None) != (self.bias_u is None):
            raise ValueError("pass both gate_bias and up_bias, or neither")
        self.device = dev

    def _bias(self, b, name, lead, dev):
        if b is None:
            return None
        b = _device_array(b, name, np.float32, (len(lead) + 1,), dev)
        if b.shape != (*lead, self.n_ff):
            raise ValueError(f"{name} must have shape {(*lead, self.n_ff)}, got {b.shape}")
        return b


def _activate(g, u, act: str):
    cp = require_gpu()
    if act == "silu":
        return g / (1 + cp.exp(-g)) * u
    if act == "gelu":
        return 0.5 * g * (1 + cp.tanh(np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g ** 3))) * u
    g = cp.minimum(g, 7)
    u = cp.clip(u, -7, 7)
    return g / (1 + cp.exp(np.float32(-1.702) * g)) * (u + 1)


def moe_gate_up(x, ids, *, gate_up: QuantTensor | None = None, gate: QuantTensor | None = None,
                up: QuantTensor | None = None, act: str = "silu", gate_bias=None, up_bias=None,
                out=None, spec: MmvqSpec | None = None):
    """Per-expert act(gate) * up. x float32 (n, k), ids int32 (n, top_k) -> (n, top_k, n_ff)."""
    cp = require_gpu("moe_gate_up")
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    ops_ = _Operands(x, gate_up, gate, up, gate_bias, up_bias, experts=True)
    ids = _device_array(ids, "ids", np.int32, (2,), ops_.device)
    n, top_k = ids.shape
    E = ops_.gate.n_experts
    if ops_.x.shape[0] != n:
        raise ValueError(f"x has {ops_.x.shape[0]} tokens but ids has {n}")
    lo, hi = (int(v) for v in cp.stack([ids.min(), ids.max()]).get()) if n and top_k else (0, 0)
    if lo < 0 or hi >= E:
        raise ValueError(f"ids holds values in [{lo}, {hi}], outside [0, {E})")
    shape = (n, top_k, ops_.n_ff)
    out = _check_out(out, shape, ops_.device) if out is not None else cp.empty(shape, dtype=cp.float32)
    if n == 0 or top_k == 0:
        return out
    run_moe_gate_up(ops_, ids, out, act, spec)
    return out


def run_moe_gate_up(o: "_Operands", ids, out, act: str, spec: MmvqSpec | None = None, x_q8=None) -> None:
    """The launches of moe_gate_up, on validated operands (graph-capturable for n <= 8).
    x_q8 (xq, xds, nbp): x quantized by an earlier kernel (the model's norm); the ids may
    come from the kernel just before, so the one-token form then waits before it reads them."""
    n, top_k = ids.shape
    if n <= dispatch.MMVQ_MAX_TOKENS:
        # with x_q8 the router wrote the ids just before: the form that waits first
        if spec is None:
            spec = dispatch.default_fused(o.gate.qtype, n, act, o.bias_g is not None, ids=True, k=o.gate.k,
                                          wait_first=x_q8 is not None)
        elif x_q8 is not None and spec.prequant and spec.pdl:
            spec = dataclasses.replace(spec, wait_first=True, guess=False)
        _mmvq(spec, o.gate, o.x, ids, top_k, out, o.n_ff, up=o.up, up_off=o.up_off,
              rows_e=o.rows_e, bias_g=o.bias_g, bias_u=o.bias_u, bias_e=o.n_ff, x_q8=x_q8)
        return
    # Larger batches: grouped GEMMs and the activation on their outputs.
    g, u = _split_products(o, ids, experts=True)
    if o.bias_g is not None:
        g = g + o.bias_g[ids]
        u = u + o.bias_u[ids]
    out[...] = _activate(g, u, act)


def gate_up(x, *, gate_up: QuantTensor | None = None, gate: QuantTensor | None = None,
            up: QuantTensor | None = None, act: str = "silu", gate_bias=None, up_bias=None,
            out=None, spec: MmvqSpec | None = None):
    """Dense act(gate) * up. x float32 (n, k) -> (n, n_ff)."""
    cp = require_gpu("gate_up")
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    ops_ = _Operands(x, gate_up, gate, up, gate_bias, up_bias, experts=False)
    n = ops_.x.shape[0]
    shape = (n, ops_.n_ff)
    out = _check_out(out, shape, ops_.device) if out is not None else cp.empty(shape, dtype=cp.float32)
    if n == 0:
        return out
    if n <= dispatch.MMVQ_MAX_TOKENS:
        spec = spec or dispatch.default_fused(ops_.gate.qtype, n, act, ops_.bias_g is not None, ids=False,
                                              k=ops_.gate.k)
        _mmvq(spec, ops_.gate, ops_.x, None, 1, out, ops_.n_ff, up=ops_.up, up_off=ops_.up_off,
              rows_e=ops_.rows_e, bias_g=ops_.bias_g, bias_u=ops_.bias_u, bias_e=ops_.n_ff)
        return out
    g, u = _split_products(ops_, None, experts=False)
    if ops_.bias_g is not None:
        g = g + ops_.bias_g
        u = u + ops_.bias_u
    out[...] = _activate(g, u, act)
    return out


def _split_products(o: _Operands, ids, experts: bool):
    """gate and up products as ordinary launches (batches past the mat-vec range). The
    merged tensor is one product whose output holds gate then up."""
    def prod(w):
        return mul_mat_id(w, o.x, ids) if experts else mul_mat(w, o.x)
    if o.gate is o.up:
        both = prod(o.gate)
        return both[..., :o.n_ff], both[..., o.n_ff:]
    return prod(o.gate), prod(o.up)


Operands = _Operands
__all__ = ["moe_gate_up", "gate_up", "run_moe_gate_up", "Operands", "ACTS"]
