"""Faster CPU replacements for two of mlx-lm's kernels: attention and SwiGLU.

On Linux CPU, MLX's `exp` and `sigmoid` run at ~14-19 ns per element on one
thread, so attention's softmax (heads x queries x keys exponentials) and the
MLP's SiLU cost more than the matmuls around them in a prefill: on the demo
model a 512-token prefill spent 1.25 s of 2.4 s in attention. `power(2, x)` is
~2.5x cheaper than `exp(x)`, so both kernels here work in base 2:

- attention folds log2(e) into the query scale, takes softmax as
  2^(s - max) with scores floored at 2^-64 (a fully masked, left-padded row
  must stay finite, and far-below-max scores are zero for fp32 anyway), and
  divides by the row sum after the PV matmul (on heads x queries x dim rather
  than x keys). GQA query heads sharing a KV head become rows of one matmul.
  Long causal prefills are cut into query blocks that skip the masked keys;
  a large decode batch runs half its rows on a second CPU stream.
- SwiGLU is gate * x / (1 + 2^(-gate * log2 e)).
- Linear layers keep their weight transposed, (in, out) row-major: OpenBLAS
  multiplies `x @ W` 7-12 % faster than `x @ W.T` at decode batch sizes
  (a batch-16 decode step of the demo model: 102 -> 96 ms).

When `make install` could build csrc/cpu_ops.cpp (`_cpu_ops`, see
scripts/build_cpu_ops.py), these run as vectorised C++ MLX primitives
instead of MLX's scalar CPU loops: SwiGLU, the softmax of a prefill's scores,
a decode's whole attention (one pass over each row's keys and values instead
of ~100 tiny GEMMs per layer), and the linear layers (`PackedLinear`: weights
packed once at load, where OpenBLAS re-packs them on every call). Without it
(no compiler, another MLX version) the MLX versions below run, with a log
line.

Only used on the CPU device with float32 activations; Metal keeps mlx's fused
`mx.fast.scaled_dot_product_attention`. Results agree with mlx-lm's to fp32
rounding (tests/unit/test_cpu_kernels.py); greedy tokens equal mlx-lm's
(tests/integration/test_parity.py compares against stock mlx-lm).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
MASKED = -1e30  # finite: a row with every key masked (left padding) must not become NaN
FLOOR = -64.0  # 2^-64 of the row's largest weight: zero for fp32 sums, and pow is fast there
QUERY_BLOCK = 128  # causal prefills longer than this skip the masked keys block by block
SPLIT_DECODE_ROWS = 8  # decode batches this large run half their attention on a second CPU stream


def _causal(q_len: int, k_len: int) -> mx.array:
    """(q_len, k_len) bool: the queries are the last q_len positions of the k_len keys; each sees itself
    and what precedes it."""
    return mx.arange(k_len)[None] <= (mx.arange(q_len)[:, None] + (k_len - q_len))


def _attend(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None, native=None) -> mx.array:
    """q: (B, Hk, r, L, D), already scaled by scale*log2(e); mask broadcastable to (B, Hk, r, L, S).
    Returns (B, Hk, r, L, D)."""
    B, Hk, r, L, D = q.shape
    S = keys.shape[2]
    if native is not None and L == 1 and (decode_mask := _decode_mask(mask, B, S)) is not False:
        return native.decode_attention(q.reshape(B, Hk, r, D), keys, values, decode_mask).reshape(B, Hk, r, 1, D)
    scores = (q.reshape(B, Hk, r * L, D) @ keys.swapaxes(-1, -2)).reshape(B, Hk, r, L, S)
    if mask is not None:
        scores = mx.where(mask, scores, MASKED) if mask.dtype == mx.bool_ else scores + mask * LOG2E
    if native is not None:
        return (native.softmax2(scores).reshape(B, Hk, r * L, S) @ values).reshape(B, Hk, r, L, D)
    weights = mx.power(2.0, mx.maximum(scores - scores.max(axis=-1, keepdims=True), FLOOR))
    out = weights.reshape(B, Hk, r * L, S) @ values
    return (out / weights.sum(axis=-1).reshape(B, Hk, r * L, 1)).reshape(B, Hk, r, L, D)


def _decode_mask(mask: mx.array | None, B: int, S: int) -> mx.array | None | bool:
    """A one-query mask as the (B or 1, S) bool rows the native decode kernel takes; None for no mask;
    False when it cannot (an additive mask, or one that differs per head)."""
    if mask is None:
        return None
    if mask.dtype != mx.bool_ or mask.shape[-1] != S or mask.size not in (S, B * S):
        return False
    if mask.size == B * S and B > 1 and (mask.ndim < 2 or mask.shape[0] != B):
        return False
    return mask.reshape(-1, S)


def _group_mask(mask: mx.array, Hk: int, r: int) -> mx.array:
    """A (B|1, 1|H, L, S) mask as (B|1, 1|Hk, 1|r, L, S), matching the grouped scores."""
    if mask.ndim < 4:
        return mask
    b, h, L, S = mask.shape
    return mask.reshape(b, 1, 1, L, S) if h == 1 else mask.reshape(b, Hk, r, L, S)


def attention(queries, keys, values, cache, scale: float, mask, sinks=None, *, _fallback=None,
              split_decode: bool = False, native=None):
    """Drop-in for `mlx_lm.models.base.scaled_dot_product_attention` on CPU; `split_decode` when this
    process has a core to spare for a second stream; `native`: the `_cpu_ops` module, if used."""
    if sinks is not None or hasattr(cache, "bits") or queries.dtype != mx.float32:
        return _fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    r = H // Hk
    q = (queries * (scale * LOG2E)).reshape(B, Hk, r, L, D)
    if isinstance(mask, str):  # "causal"
        if L <= QUERY_BLOCK:
            out = _attend(q, keys, values, _causal(L, S), native)
        else:
            # Query block i only needs the keys up to its last position.
            parts = []
            for start in range(0, L, QUERY_BLOCK):
                n = min(QUERY_BLOCK, L - start)
                visible = S - L + start + n
                parts.append(_attend(q[:, :, :, start : start + n], keys[:, :, :visible], values[:, :, :visible],
                                     _causal(n, visible), native))
            out = mx.concatenate(parts, axis=3)
    else:
        grouped = None if mask is None else _group_mask(mask, Hk, r)
        split = split_decode and L == 1 and B >= SPLIT_DECODE_ROWS
        out = (_attend_split if split else _attend)(q, keys, values, grouped, native)
    return out.reshape(B, H, L, D)


_second_stream: mx.Stream | None = None


def _attend_split(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None, native=None) -> mx.array:
    """A batched decode's attention with half its rows on a second CPU stream.

    MLX runs each stream's ops on its own thread, one op at a time, and a
    decode's attention is dozens of small ops between the layer matmuls (which
    OpenBLAS already spreads over the cores): two streams keep both cores busy
    there. Measured: batch-16 decode step 121-126 ms -> 110-113 ms (demo model).
    Prefill attention gained nothing this way (its ops are large enough)."""
    global _second_stream
    if _second_stream is None:
        _second_stream = mx.new_stream(mx.cpu)
    h = q.shape[0] // 2
    per_row = mask is not None and mask.shape[0] > 1  # else it broadcasts over both halves
    first = _attend(q[:h], keys[:h], values[:h], mask[:h] if per_row else mask, native)
    with mx.stream(_second_stream):
        second = _attend(q[h:], keys[h:], values[h:], mask[h:] if per_row else mask, native)
    return mx.concatenate([first, second], axis=0)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """Drop-in for `mlx_lm.models.activations.swiglu`: silu(gate) * x, via power instead of sigmoid."""
    return gate * x / (1.0 + mx.power(2.0, gate * -LOG2E))


def native_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """`swiglu` in one vectorised pass (`_cpu_ops`), for float32 operands of one shape."""
    if gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape:
        return _native.swiglu(gate, x)
    return swiglu(gate, x)


_native: Any = None  # the loaded `_cpu_ops` module (see native_ops)
_native_status: str | None = None


def native_ops() -> tuple[Any, str]:
    """The compiled `_cpu_ops` module, or None, and a phrase saying which for the log."""
    global _native, _native_status
    if _native_status is None:
        try:
            from meshlm.model import _cpu_ops
        except ImportError as e:
            _native_status = f"not built ({e}); run `make install` with a C++20 compiler"
        else:
            if _cpu_ops.mlx_version != mx.__version__:
                _native_status = f"built for MLX {_cpu_ops.mlx_version}, not {mx.__version__}; run `make install`"
            else:
                try:  # nanobind must share MLX's type domain for mx.array to pass in
                    mx.eval(_cpu_ops.swiglu(mx.zeros((1,)), mx.zeros((1,))))
                    _native, _native_status = _cpu_ops, "vectorised C++ kernels (_cpu_ops)"
                except TypeError as e:
                    _native_status = f"unusable with this MLX ({e})"
    return _native, _native_status


class TransposedLinear(nn.Module):
    """`nn.Linear` with its weight stored as (in, out): same outputs, a faster GEMM on CPU."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        if "bias" in linear:
            self.bias = linear.bias

    @property
    def weight(self) -> mx.array:
        """The (out, in) view, for code that reads a layer's shape (a view, not a copy)."""
        return self["weight_t"].T

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, self["weight_t"])
        return x @ self["weight_t"]


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight packed as (out/16, in, 16) column panels for `_cpu_ops.packed_linear`:
    decode-sized batches stream each panel once (OpenBLAS re-packs the whole weight on every call)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        out_dims, in_dims = linear.weight.shape
        panel = _native.panel
        self.weight_p = mx.contiguous(linear.weight.T.reshape(in_dims, out_dims // panel, panel).transpose(1, 0, 2))
        if "bias" in linear:
            self.bias = linear.bias

    @property
    def weight(self) -> mx.array:
        """The (out, in) weight, for code that reads a layer's shape (lazy: copied only if evaluated)."""
        w = self["weight_p"]
        return w.transpose(1, 0, 2).reshape(w.shape[1], -1).T

    def __call__(self, x: mx.array) -> mx.array:
        return _native.packed_linear(x, self["weight_p"], self["bias"] if "bias" in self else None)


def transpose_linears(model: nn.Module, packed: bool = False) -> int:
    """Swap every plain float32 `nn.Linear` (not quantized or sharded ones, whose classes differ) for a
    TransposedLinear, or with `packed` (the native kernels loaded) a PackedLinear where its output size is
    a multiple of the panel width; module by module so at most one module's linear weights exist twice
    at once; returns how many. A tied LM head is the embedding table and stays as it is."""
    swapped = 0

    def visit(container) -> None:  # a Module is a dict of its parameters and children
        nonlocal swapped
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, child in list(items):
            if type(child) is nn.Linear and child.weight.dtype == mx.float32:
                pack = packed and child.weight.shape[0] % _native.panel == 0
                replacement = PackedLinear(child) if pack else TransposedLinear(child)
                mx.eval(replacement.parameters())
                container[key] = replacement
                swapped += 1
            elif isinstance(child, (dict, list)):
                visit(child)

    visit(model)
    return swapped


def install(model: Any, cores: int = 1, native: bool = True) -> bool:
    """Use these kernels for `model`'s architecture (its mlx-lm module's globals) when running on CPU;
    `cores` is how many this process may use (a second decode stream needs two); `native`: use the
    compiled `_cpu_ops` where it loads. A module already patched is left as it is: one process, one
    core share."""
    if mx.default_device() != mx.cpu:
        return False
    module = sys.modules.get(type(model).__module__)
    original = getattr(module, "scaled_dot_product_attention", None)
    if module is None or original is None or not hasattr(module, "swiglu"):
        return False
    if getattr(original, "__name__", "") != "_cpu_attention":
        split = cores >= 2
        ops, status = native_ops() if native else (None, "off (--no-native-kernels)")

        def _cpu_attention(queries, keys, values, cache, scale, mask, sinks=None):
            return attention(queries, keys, values, cache, scale, mask, sinks, _fallback=original,
                             split_decode=split, native=ops)

        module.scaled_dot_product_attention = _cpu_attention
        module.swiglu = native_swiglu if ops is not None else swiglu
        log.info("CPU kernels: base-2 attention and SwiGLU for %s; native: %s", module.__name__, status)
    packed = native and native_ops()[0] is not None and _native.packed_gemm
    if packed:
        _native.set_gemm_threads(cores)
    swapped = transpose_linears(model, packed)
    if swapped:
        log.info("CPU kernels: %d linear layers hold their weights %s", swapped,
                 "in 16-column panels" if packed else "transposed")
    return True
