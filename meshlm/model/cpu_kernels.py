"""Faster CPU replacements for two of mlx-lm's kernels: attention and SwiGLU.

On Linux CPU, MLX's `exp` and `sigmoid` run at ~14-19 ns per element on one
thread, so attention's softmax (heads x queries x keys exponentials) and the
MLP's SiLU cost more than the matmuls around them in a prefill: on the demo
model a 512-token prefill spent 1.25 s of 2.4 s in attention. `power(2, x)` is
~2.5x cheaper than `exp(x)`, so both kernels here work in base 2:

- attention folds log2(e) into the query scale, takes softmax as
  2^(s - max) with scores floored at 2^-64 (a fully masked row must stay
  finite, and far-below-max scores are zero for fp32 anyway), and divides by
  the row sum after the PV matmul (on heads x queries x dim rather than x
  keys). GQA query heads sharing a KV head become rows of one matmul. Long
  causal prefills are cut into query blocks that skip the masked keys.
- SwiGLU is gate * x / (1 + 2^(-gate * log2 e)).
- Linear layers keep their weight transposed, (in, out) row-major: OpenBLAS
  multiplies `x @ W` 7-12 % faster than `x @ W.T` at decode batch sizes
  (a batch-16 decode step of the demo model: 102 -> 96 ms).

When `make install` could build csrc/cpu_ops.cpp (`_cpu_ops`, see
scripts/build_native.py), these run as vectorised C++ MLX primitives
instead of MLX's scalar CPU loops: SwiGLU, the softmax of a prefill's scores,
a decode's whole attention straight from the KV pool's blocks (one pass over
each row's keys and values instead of ~100 tiny GEMMs per layer), and the
linear layers (`PackedLinear`: weights packed once at load, where OpenBLAS
re-packs them on every call; tensor-parallel shards keep their all-reduce
around it, `ShardedLinear`), and a tied LM head (`PackedEmbedding`: the
embedding table packed once, its lookups gathered from the panels). Without it (no compiler, another MLX version)
the MLX versions below run, with a log line.

These are plain functions and modules: model/attention.py (the attention
seam's CPU backend) and model/adapt.py (which swaps an engine's own model's
MLPs and linear layers) decide where they run. Only used on the CPU device
with float32 activations; Metal keeps mlx's fused kernels. Results agree with
mlx's to fp32 rounding (tests/unit/test_cpu_kernels.py); greedy tokens equal
mlx-lm's (tests/integration/test_parity.py compares against stock mlx-lm).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from meshlm.platform import interrupt_deferred
from meshlm.model.vocab_parallel import TiedVocabSplit
from meshlm.transport.collectives import all_sum

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
MASKED = -1e30  # finite: a row with every key masked (left padding) must not become NaN
FLOOR = -64.0  # 2^-64 of the row's largest weight: zero for fp32 sums, and pow is fast there
QUERY_BLOCK = 128  # causal prefills longer than this skip the masked keys block by block


def _causal(q_len: int, k_len: int) -> mx.array:
    """(q_len, k_len) bool: the queries are the last q_len positions of the k_len keys; each sees itself
    and what precedes it."""
    return mx.arange(k_len)[None] <= (mx.arange(q_len)[:, None] + (k_len - q_len))


def attend(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None, native=None) -> mx.array:
    """q: (B, Hk, r, L, D), already scaled by scale*log2(e); keys/values (B, Hk, S, D); mask (bool or
    additive) broadcastable to (B, Hk, r, L, S). Returns (B, Hk, r, L, D)."""
    B, Hk, r, L, D = q.shape
    S = keys.shape[2]
    scores = (q.reshape(B, Hk, r * L, D) @ keys.swapaxes(-1, -2)).reshape(B, Hk, r, L, S)
    if mask is not None:
        scores = mx.where(mask, scores, MASKED) if mask.dtype == mx.bool_ else scores + mask * LOG2E
    if native is not None:
        return (native.softmax2(scores).reshape(B, Hk, r * L, S) @ values).reshape(B, Hk, r, L, D)
    weights = mx.power(2.0, mx.maximum(scores - scores.max(axis=-1, keepdims=True), FLOOR))
    out = weights.reshape(B, Hk, r * L, S) @ values
    return (out / weights.sum(axis=-1).reshape(B, Hk, r * L, 1)).reshape(B, Hk, r, L, D)


def _group_mask(mask: mx.array, Hk: int, r: int) -> mx.array:
    """A (B|1, 1|H, L, S) mask as (B|1, 1|Hk, 1|r, L, S), matching the grouped scores."""
    if mask.ndim < 4:
        return mask
    b, h, L, S = mask.shape
    return mask.reshape(b, 1, 1, L, S) if h == 1 else mask.reshape(b, Hk, r, L, S)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, native=None,
              mask: mx.array | str | None = "causal") -> mx.array:
    """mx.fast.scaled_dot_product_attention's semantics in base 2, for float32 on the CPU: queries
    (B, H, L, D), keys/values (B, Hk, S, D); mask "causal" (the queries are the last L of the S
    positions), None, or a bool/additive mask broadcastable to (B, H, L, S). `native`: `_cpu_ops`."""
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    r = H // Hk
    q = (queries * (scale * LOG2E)).reshape(B, Hk, r, L, D)
    if not isinstance(mask, str):
        out = attend(q, keys, values, None if mask is None else _group_mask(mask, Hk, r), native)
    elif L <= QUERY_BLOCK:
        out = attend(q, keys, values, _causal(L, S), native)
    else:
        # Query block i only needs the keys up to its last position.
        parts = []
        for start in range(0, L, QUERY_BLOCK):
            n = min(QUERY_BLOCK, L - start)
            visible = S - L + start + n
            parts.append(attend(q[:, :, :, start : start + n], keys[:, :, :visible], values[:, :, :visible],
                                _causal(n, visible), native))
        out = mx.concatenate(parts, axis=3)
    return out.reshape(B, H, L, D)


def partial_attention(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None, scale: float,
                      native) -> tuple[mx.array, mx.array]:
    """Attention with each query's log-sum-exp, for merging partials: q (n, H, D), keys/values (Hk, S, D),
    mask (n, S) bool or None; `native` is `_cpu_ops`, whose softmax also returns each row's log2-sum-exp."""
    n, H, D = q.shape
    Hk, S = keys.shape[0], keys.shape[1]
    r = H // Hk
    qs = (q * (scale * LOG2E)).reshape(n, Hk, r, D).transpose(1, 2, 0, 3).reshape(Hk, r * n, D)
    scores = (qs @ keys.swapaxes(-1, -2)).reshape(Hk, r, n, S)
    if mask is not None:
        scores = mx.where(mask, scores, MASKED)
    weights, lse2 = native.softmax2_lse(scores)
    out = weights.reshape(Hk, r * n, S) @ values  # (Hk, r * n, D)
    out = out.reshape(Hk, r, n, D).transpose(2, 0, 1, 3).reshape(n, H, D)
    return out, (lse2 / LOG2E).transpose(2, 0, 1).reshape(n, H)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """Drop-in for `mlx_lm.models.activations.swiglu`: silu(gate) * x, via power instead of sigmoid."""
    return gate * x / (1.0 + mx.power(2.0, gate * -LOG2E))


def swiglu_for(native=None):
    """The SwiGLU to run: `_cpu_ops`' single vectorised pass where it applies, else `swiglu`."""
    if native is None:
        return swiglu

    def native_swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape:
            return native.swiglu(gate, x)
        return swiglu(gate, x)

    return native_swiglu


# Every `_cpu_ops` function the Python side calls: a module built from an older csrc/cpu_ops.cpp for the same
# MLX lacks some, and is then not used at all (one check here, not one per caller).
NATIVE_API = ("swiglu", "softmax2", "softmax2_lse", "packed_linear", "packed_linear_split", "packed_swiglu",
              "set_software_prefetch", "set_gemm_threads", "untouched_zeros", "rms_norm", "rope", "kv_write",
              "paged_decode_attention", "paged_decode_partial", "decode_layer", "huge_pages", "causal_attention",
              "causal_partial", "causal_attention_paged", "causal_partial_paged")


@functools.cache
def native_ops() -> tuple[Any, str]:
    """The compiled `_cpu_ops` module, or None, and a phrase saying which for the log (loaded once:
    a compiled module cannot be unloaded anyway)."""
    try:
        with interrupt_deferred():  # a nanobind module's init
            from meshlm.model import _cpu_ops
    except ImportError as e:
        return None, f"not built ({e}); run `make install` with a C++20 compiler"
    if _cpu_ops.mlx_version != mx.__version__:
        return None, f"built for MLX {_cpu_ops.mlx_version}, not {mx.__version__}; run `make install`"
    missing = [name for name in NATIVE_API if not hasattr(_cpu_ops, name)]
    if missing:
        return None, f"built from an older csrc/cpu_ops.cpp (no {', '.join(missing)}); run `make install`"
    try:  # nanobind must share MLX's type domain for mx.array to pass in
        mx.eval(_cpu_ops.swiglu(mx.zeros((1,)), mx.zeros((1,))))
    except TypeError as e:
        return None, f"unusable with this MLX ({e})"
    return _cpu_ops, "vectorised C++ kernels (_cpu_ops)"


def in_huge_pages(model: nn.Module, native) -> int:
    """Evaluate `model`'s weights (their packing included) and move them into 2 MiB pages where Linux can
    (csrc's huge_pages); returns the bytes moved. Only speed changes: 0 where the kernel cannot."""
    weights = [a for _, a in tree_flatten(model.parameters())]
    mx.eval(weights)
    moved = native.huge_pages(weights)
    total = sum(a.nbytes for a in weights)
    log.info("CPU kernels: %.0f MiB holding the weights (%.0f MiB) moved into 2 MiB pages%s", moved / 2**20,
             total / 2**20, "" if moved else " (this kernel cannot: MADV_COLLAPSE needs Linux 6.1 and THP not 'never')")
    return moved


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
    decode-sized batches stream each panel once (OpenBLAS re-packs the whole weight on every call).
    `dtype`: what the panels hold; bfloat16 or float16 (half the bytes) only for a weight whose every value
    is one (`compact_dtype`), which the kernel widens back to the same float32 values."""

    def __init__(self, linear: nn.Linear, native, dtype: mx.Dtype = mx.float32) -> None:
        super().__init__()
        self._native = native
        out_dims, in_dims = linear.weight.shape
        panel = native.panel
        packed = linear.weight.T.reshape(in_dims, out_dims // panel, panel).transpose(1, 0, 2)
        self.weight_p = mx.contiguous(packed.astype(dtype))
        if "bias" in linear:
            self.bias = linear.bias

    @property
    def weight(self) -> mx.array:
        """The (out, in) weight, for code that reads a layer's shape (lazy: copied only if evaluated)."""
        w = self["weight_p"]
        return w.transpose(1, 0, 2).reshape(w.shape[1], -1).T

    def __call__(self, x: mx.array) -> mx.array:
        return self._native.packed_linear(x, self["weight_p"], self["bias"] if "bias" in self else None)


_SWAPPABLE = (nn.Linear, nn.AllToShardedLinear, nn.ShardedToAllLinear)


HALF_DTYPES = (mx.bfloat16, mx.float16)  # the 16-bit types packed panels may hold, in order of preference


EXACT_PROBE = 4096  # values checked before the whole weight: most float32 layers fail within them


def exact_in(w: mx.array, dtype: mx.Dtype) -> bool:
    """Every value of `w` is a `dtype` (as when a checkpoint stored in it was widened to float32 at load),
    so holding it as one loses nothing (a value out of float16's range rounds to inf: not exact). The
    first values decide most float32 layers, which then cost no pass over the whole weight at load."""
    def same(a: mx.array) -> bool:
        return bool(mx.array_equal(a.astype(dtype).astype(a.dtype), a).item())

    return same(w.reshape(-1)[:EXACT_PROBE]) and same(w)


def compact_dtype(w: mx.array) -> mx.Dtype:
    """The 16-bit type that holds every value of float32 `w` exactly (bfloat16 first: its widening is a
    shift), or float32."""
    return next((d for d in HALF_DTYPES if exact_in(w, d)), mx.float32)


def _local_linear(layer: nn.Module, native, packed: bool, half: bool) -> nn.Module:
    """A PackedLinear or TransposedLinear computing what `layer` (an nn.Linear or a tensor-parallel shard
    of one) computes on this rank, before any collective; packed in 16 bits if `half` and exact."""
    if packed and layer.weight.shape[0] % native.panel == 0:
        return PackedLinear(layer, native, compact_dtype(layer.weight) if half else mx.float32)
    return TransposedLinear(layer)


def half_layers(model: nn.Module) -> dict[str, int]:
    """How many of `model`'s packed linear layers hold 16-bit panels, by type name ("bfloat16": 3)."""
    held = [m["weight_p"].dtype for _, m in model.named_modules() if type(m) is PackedLinear]
    return {_name(d): n for d in HALF_DTYPES if (n := held.count(d))}


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _table_slot(model: nn.Module) -> tuple[nn.Module | None, str]:
    """Where `model`'s embedding table sits (the module holding it, its key): in the model, or inside a
    tensor-parallel TiedVocabSplit."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module):
        return None, "embed_tokens"
    outer = inner.get("embed_tokens")
    return (outer, "table") if isinstance(outer, TiedVocabSplit) else (inner, "embed_tokens")


def half_table(model: nn.Module) -> str | None:
    """The 16-bit type `model`'s packed tied embedding table is held in (inside a TiedVocabSplit or not),
    or None."""
    holder, key = _table_slot(model)
    table = holder.get(key) if holder is not None else None
    dtype = table["weight_p"].dtype if type(table) is PackedEmbedding else None
    return _name(dtype) if dtype in HALF_DTYPES else None


def transpose_linears(model: nn.Module, native=None, sum_group=None, half: bool = True) -> int:
    """Swap every float32 `nn.Linear` for a TransposedLinear, or with `native` (`_cpu_ops` with its packed
    GEMM) a PackedLinear where its output size is a multiple of the panel width; quantized layers stay.
    Tensor-parallel shards are swapped too (`ShardedLinear`), keeping their collective: without that, a
    rank's matmuls ran MLX's slower `x @ W.T` and TP=2 lost a third of its speed-up to the 1-rank model
    (docs/BENCHMARKS.md, issue 17). Module by module, so at most one module's weights exist twice at once;
    returns how many. A tied LM head is the embedding table, left to `pack_tied_embedding`. `sum_group`:
    what the shards sum over instead of their own MLX group (a SharedMemoryGroup). `half`: a layer whose
    every weight is exactly a bfloat16 (or float16) is packed as one (half the bytes a decode step streams)."""
    packed = native is not None and native.packed_gemm

    def replace(child) -> nn.Module | None:
        kind = type(child)
        if kind not in _SWAPPABLE or child.weight.dtype != mx.float32:
            return None
        local = _local_linear(child, native, packed, half)
        if kind is nn.Linear:
            return local
        return ShardedLinear(local, sum_group or child.group, kind is nn.ShardedToAllLinear)

    return swap_modules(model, replace)


def swap_modules(model: nn.Module, replace: Callable[[Any], nn.Module | None]) -> int:
    """Walk `model`'s modules and lists, putting `replace(child)` wherever it is not None (its
    parameters evaluated at once, so at most one module's weights exist twice); returns how many."""
    swapped = 0

    def visit(container) -> None:  # a Module is a dict of its parameters and children
        nonlocal swapped
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, child in list(items):
            replacement = replace(child)
            if replacement is not None:
                mx.eval(replacement.parameters())
                container[key] = replacement
                swapped += 1
            elif isinstance(child, (dict, list)):
                visit(child)

    visit(model)
    return swapped


class ShardedLinear(nn.Module):
    """A tensor-parallel linear layer with a CPU-kernel local matmul. `reduce`: the input is sharded and
    the ranks' partial outputs are summed (mlx's ShardedToAllLinear, whose bias is added once, after the
    sum); otherwise each rank computes its slice of the output (AllToShardedLinear, forward only)."""

    def __init__(self, local: nn.Module, group, reduce: bool) -> None:
        super().__init__()
        self._group, self._reduce = group, reduce
        if reduce and "bias" in local:
            self.bias = local.bias
            del local["bias"]
        self.local = local

    @property
    def weight(self) -> mx.array:
        return self.local.weight

    def __call__(self, x: mx.array) -> mx.array:
        y = self.local(x)
        if not self._reduce:
            return y
        y = all_sum(y, self._group)
        return y + self["bias"] if "bias" in self else y


class PackedEmbedding(nn.Module):
    """A tied embedding table held once, packed like PackedLinear's weight: the LM head (`as_linear`) runs
    the packed GEMM, which streams the table on every core (the demo model's 113 MB table at one row:
    3.0 ms against 8.3 ms for MLX's `x @ W.T`, a seventh of a decode step), and lookups gather their rows
    out of the panels, so the table is not held twice. `dtype`: what the panels hold, as PackedLinear's."""

    def __init__(self, embedding: nn.Embedding, native, dtype: mx.Dtype = mx.float32) -> None:
        super().__init__()
        self._native = native
        vocab, dims = embedding.weight.shape
        self._panel = panel = native.panel
        packed = embedding.weight.reshape(vocab // panel, panel, dims).transpose(0, 2, 1)
        self.weight_p = mx.contiguous(packed.astype(dtype))
        object.__setattr__(self, "_rows", {})  # rows_linear's views of weight_p (a dict attribute would be a child)

    @property
    def weight(self) -> mx.array:
        """The (vocab, dims) table, for code that reads its shape (lazy: copied only if evaluated)."""
        w = self["weight_p"]
        return w.transpose(0, 2, 1).reshape(-1, w.shape[1])

    def __call__(self, ids: mx.array) -> mx.array:
        w = self["weight_p"]
        panel, dims = self._panel, w.shape[1]
        # Element (p, i, j) is row p * panel + j, column i: a row is `dims` values `panel` apart.
        start = (ids // panel) * (dims * panel) + ids % panel
        rows = mx.take(w.reshape(-1), start[..., None] + mx.arange(dims) * panel)
        return rows.astype(mx.float32) if rows.dtype in HALF_DTYPES else rows

    def as_linear(self, x: mx.array) -> mx.array:
        return self._native.packed_linear(x, self["weight_p"], None)

    def rows_linear(self, x: mx.array, first: int, end: int) -> mx.array:
        """`as_linear`'s logits for vocabulary rows [first, end) alone (multiples of the panel width), read
        from those rows' panels in place (a tensor-parallel rank's share of a tied head)."""
        cached = self._rows.get((first, end))
        if cached is None:  # an evaluated slice is a view of the panels; a lazy one would copy every call
            cached = self["weight_p"][first // self._panel : end // self._panel]
            mx.eval(cached)
            self._rows[(first, end)] = cached
        return self._native.packed_linear(x, cached, None)


def pack_tied_embedding(model: nn.Module, native, half: bool = True) -> bool:
    """Swap a tied float32 embedding table (or the table inside a tensor-parallel TiedVocabSplit) for a
    PackedEmbedding where `native` has the packed GEMM and the vocabulary fills whole panels (in 16 bits
    if `half` and every value is one); True if it did."""
    holder, key = _table_slot(model)
    embed = holder.get(key) if holder is not None else None
    tied = getattr(model.args, "tie_word_embeddings", False) or "lm_head" not in model
    if (native is None or not native.packed_gemm or not tied or type(embed) is not nn.Embedding
            or embed.weight.dtype != mx.float32 or embed.weight.shape[0] % native.panel):
        return False
    packed = PackedEmbedding(embed, native, compact_dtype(embed.weight) if half else mx.float32)
    mx.eval(packed.parameters())
    holder[key] = packed
    return True


class NativeRMSNorm(nn.Module):
    """`nn.RMSNorm` as one `_cpu_ops` primitive: on the CPU, `mx.fast.rms_norm` runs as its fallback of
    ~6 MLX ops, and a decode step of the demo model has 61 norms."""

    def __init__(self, norm: nn.RMSNorm, native) -> None:
        super().__init__()
        self._native, self.eps = native, norm.eps
        self.weight = norm.weight

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype == mx.float32:
            return self._native.rms_norm(x, self["weight"], self.eps)
        return mx.fast.rms_norm(x, self["weight"], self.eps)


def swap_norms(model: nn.Module, native) -> int:
    """Swap every float32 `nn.RMSNorm` (layer norms, the final norm, qwen3's q/k norms) for a
    NativeRMSNorm; returns how many."""
    if native is None:
        return 0
    return swap_modules(model, lambda child: NativeRMSNorm(child, native)
                        if type(child) is nn.RMSNorm and child.weight.dtype == mx.float32 else None)


@dataclass(frozen=True)
class RopeTable:
    """What `_cpu_ops.rope` needs to compute a RoPE module's rotation: mx.fast.rope's parameters with the
    inverse frequencies computed as its CPU fallback computes them."""

    dims: int
    traditional: bool
    scale: float
    inv_freq: mx.array


def rope_table(rope: nn.Module) -> RopeTable | None:
    """The table of an `nn.RoPE` or mlx-lm's `Llama3RoPE` (their parameters say all they do); None for any
    other RoPE, which keeps running as it is."""
    kind = type(rope).__name__
    if type(rope) is nn.RoPE:
        half = rope.dims // 2
        inv = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(math.log(rope.base) / half, mx.float32))
        table = RopeTable(rope.dims, rope.traditional, float(rope.scale), inv)
    elif kind == "Llama3RoPE" and type(rope).__module__.startswith("mlx_lm."):
        table = RopeTable(rope.dims, rope.traditional, 1.0, mx.reciprocal(rope._freqs.astype(mx.float32)))
    else:
        return None
    mx.eval(table.inv_freq)
    return table


def packed_local(layer: nn.Module) -> PackedLinear | None:
    """The PackedLinear computing `layer` on this rank with no collective after it: the layer itself, or
    the local matmul of a column shard (AllToShardedLinear); else None."""
    if type(layer) is PackedLinear:
        return layer
    if type(layer) is ShardedLinear and not layer._reduce and type(layer.local) is PackedLinear:
        return layer.local
    return None


class _SharedGemm:
    """What the parts of one fused GEMM share: the input they were last called with and its outputs
    (a plain object, so the modules do not count it as a child)."""

    def __init__(self, owner: "FusedPart", sizes: list[int], native) -> None:
        self.owner, self.sizes, self.native = owner, sizes, native
        self.x: mx.array | None = None
        self.outs: list[mx.array] = []

    def output(self, x: mx.array, index: int) -> mx.array:
        if x is not self.x:
            bias = self.owner["bias"] if "bias" in self.owner else None
            self.x, self.outs = x, self.native.packed_linear_split(x, self.owner["weight_p"], self.sizes, bias)
        out = self.outs[index]
        if index == len(self.sizes) - 1:  # the last part: nothing to keep for the next input
            self.x, self.outs = None, []
        return out


class FusedPart(nn.Module):
    """One of the linear layers of a layer that all read the same input (attention's q, k and v), as a
    slice of one packed GEMM with one output each (`packed_linear_split`): one graph node and one pass of
    the GEMM threads where there were three. The first part holds the fused weight (and bias); called
    with the same input object, the others take their output from the same GEMM, as mlx-lm's layers
    call `q_proj(x), k_proj(x), v_proj(x)`; called with another input, a part runs its own panels."""

    def __init__(self, shared: _SharedGemm, index: int, panels: tuple[int, int]) -> None:
        super().__init__()
        self._shared, self._index = shared, index
        self._first, self._end = panels  # this part's panels of the fused weight

    @property
    def weight(self) -> mx.array:
        """This part's (out, in) weight, for code that reads a layer's shape (lazy: copied if evaluated)."""
        w = self._shared.owner["weight_p"][self._first : self._end]
        return w.transpose(1, 0, 2).reshape(w.shape[1], -1).T

    def __call__(self, x: mx.array) -> mx.array:
        shared = self._shared
        if x is shared.x or self._index == 0:
            return shared.output(x, self._index)
        a, b = self._first, self._end  # called alone: its own panels, a contiguous slice of the fused weight
        owner = shared.owner
        bias = owner["bias"][a * shared.native.panel : b * shared.native.panel] if "bias" in owner else None
        return shared.native.packed_linear(x, owner["weight_p"][a:b], bias)


def fuse_linears(layers: list[nn.Module], native) -> list[FusedPart] | None:
    """`layers` (packed, or column shards of packed, all biased or none) as FusedParts of one GEMM; None
    when they cannot be (another kind of layer, mixed biases, or no split GEMM in `native`)."""
    locals_ = [packed_local(layer) for layer in layers]
    if native is None or any(x is None for x in locals_):
        return None
    biased = {"bias" in x for x in locals_}
    if len(biased) != 1:
        return None
    weights = [x["weight_p"] for x in locals_]
    sizes = [w.shape[0] * native.panel for w in weights]
    ends = list(itertools.accumulate(w.shape[0] for w in weights))
    parts: list[FusedPart] = []
    shared = _SharedGemm(None, sizes, native)  # owner set below: the first part
    for i in range(len(layers)):
        parts.append(FusedPart(shared, i, (ends[i - 1] if i else 0, ends[i])))
    owner = parts[0]
    shared.owner = owner
    owner.weight_p = mx.concatenate(weights)
    if biased.pop():
        owner.bias = mx.concatenate([x["bias"] for x in locals_])
    mx.eval(owner.parameters())
    return parts


def fuse_layer_projections(layer: nn.Module, native) -> int:
    """Fuse a decoder layer's q/k/v projections (`fuse_linears`) and its MLP's gate and up
    (`GatedMLP.fuse`); returns how many GEMMs it saved per forward."""
    saved = 0
    attn = layer.self_attn
    names = ("q_proj", "k_proj", "v_proj")
    if not any(isinstance(attn[n], FusedPart) for n in names):
        parts = fuse_linears([attn[n] for n in names], native)
        if parts is not None:
            for n, part in zip(names, parts):
                attn[n] = part
            saved += 2
    fuse = getattr(layer.mlp, "fuse", None)
    if fuse is not None and fuse(native):
        saved += 2
    return saved
