"""A decoder layer of a decode step as one graph node: `_cpu_ops.decode_layer` (CPU kernels only).

With every weight packed and every small op compiled, a one-row decode step of
the demo model was still ~780 MLX nodes, 26 per layer (four GEMMs, nine small
ops, their views), and each node costs the thread that builds and launches
the step, a task hand-off and a wake-up of the GEMM helper: ~3.5 ms of a
~10 ms step whose GEMMs take ~6.7 ms at the read bandwidth. When every row of
a step is a decode row (one new token; `Batch.build` also splits short verify
chunks into such rows), each layer whose parts are all meshlm's CPU forms runs
instead as one node (q/k/v with RoPE, the two KV writes, the attention, o and
the MLP; its outputs are the layer's output and the two written pools) calling
the same kernels on the same values in the same order, so the outputs are the
module path's bit for bit (tests/unit/test_decode_layer.py holds them to it).
A demo step is then 59 nodes, which MLX's CPU stream takes all at once: with
four nodes a layer (149), it let the launching thread queue only ~100
dispatches ahead and woke it ~15 times a step, each wake taking a core from
the GEMM threads. Under tensor parallelism o and down are row shards summed
over the ranks: the layer is cut at the two sums (`split`), which stay the
same collectives.

A layer fuses only when nothing in it is other than what the kernel computes:
RMSNorms as `NativeRMSNorm`, q/k/v as one packed GEMM (`FusedPart`s), o and down
packed (alone, or as row shards with their sum), gate and up fused, RoPE with a
table, and the llama / qwen2 / qwen3 block (`h + attn(norm(h))`, then
`+ mlp(norm(.))`; qwen2's q/k/v biases, qwen3's q/k norms). Everything else,
and every step with a prefill chunk, runs mlx-lm's modules through the
attention seam as before, which is also the path on Metal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from meshlm.kv.store import KVStore
from meshlm.model import cpu_kernels
from meshlm.model.attention import LOG2E
from meshlm.model.batch import Batch
from meshlm.transport.collectives import all_sum

# The mlx-lm modules whose decoder block is the one the kernel computes (mistral runs as llama).
FUSABLE_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


@dataclass(frozen=True)
class DecodeLayer:
    """One layer's weights as `_cpu_ops.decode_layer` takes them (the modules' own arrays, not copies)."""

    native: object
    weights: tuple[mx.array, ...]  # input norm, q/k/v panels, o panels, post norm, gate/up panels, down panels, inv_freq
    heads: int
    eps: tuple[float, float, float]  # input norm, post-attention norm, q/k norms (1.0 when there are none)
    rope: cpu_kernels.RopeTable
    q_scale: float  # the softmax scale in base 2
    qkv_bias: mx.array | None = None
    o_bias: mx.array | None = None
    q_norm: mx.array | None = None
    k_norm: mx.array | None = None
    group: object = None  # tensor parallelism: what o's and down's partial outputs are summed over

    def __call__(self, h: mx.array, batch: Batch, store: KVStore, layer: int) -> mx.array:
        rows = batch.decode
        weights, eps = self.weights, self.eps
        split = self.group is not None
        out, keys, values = self.native.decode_layer(
            h, weights, store.keys[layer], store.values[layer], batch.slots, batch.positions,
            rows.tables, rows.lengths, self.heads, eps, self.rope.dims, self.rope.traditional,
            self.rope.scale, store.block_size, self.q_scale, self.qkv_bias, None if split else self.o_bias,
            self.q_norm, self.k_norm, split)
        store.replace(layer, keys, values)  # the store's old pools go: the node may then update them in place
        if not split:
            return out
        # As ShardedLinear and mlx-lm's block compute it: sum, o's bias, the residual, the MLP's sum, the residual.
        attention = all_sum(out, self.group)
        if self.o_bias is not None:
            attention = attention + self.o_bias
        h, partial = self.native.decode_mlp(h, attention, weights, eps)
        return h + all_sum(partial, self.group)


def decode_layer(layer: nn.Module, native) -> DecodeLayer | None:
    """`layer` fused, or None when any part of it is not what the kernel computes."""
    if native is None or not native.packed_gemm:
        return None
    if type(layer).__module__ not in FUSABLE_MODULES:
        return None
    attn, mlp = layer.get("self_attn"), layer.get("mlp")
    norms = (layer.get("input_layernorm"), layer.get("post_attention_layernorm"))
    if attn is None or mlp is None or any(type(n) is not cpu_kernels.NativeRMSNorm for n in norms):
        return None
    qkv = [attn.get(n) for n in ("q_proj", "k_proj", "v_proj")]
    if any(type(p) is not cpu_kernels.FusedPart for p in qkv):
        return None
    shared = qkv[0]._shared
    if any(p._shared is not shared for p in qkv) or [p._index for p in qkv] != [0, 1, 2]:
        return None
    o, down = _row_layer(attn.get("o_proj")), _row_layer(mlp.get("down_proj"))
    if o is None or down is None or o.group is not down.group or "bias" in down.packed or "bias" in down.bias_holder:
        return None
    if "gate_up_p" not in mlp:
        return None
    rope = getattr(attn.get("rope"), "_table", None)
    if rope is None:
        return None
    q_norm, k_norm = attn.get("q_norm"), attn.get("k_norm")
    if (q_norm is None) != (k_norm is None):
        return None
    if q_norm is not None and (type(q_norm) is not cpu_kernels.NativeRMSNorm or type(k_norm) is not cpu_kernels.NativeRMSNorm
                               or q_norm.eps != k_norm.eps):
        return None
    owner = shared.owner
    weights = (norms[0]["weight"], owner["weight_p"], o.packed["weight_p"], norms[1]["weight"], mlp["gate_up_p"],
               down.packed["weight_p"], rope.inv_freq)
    return DecodeLayer(
        native, weights, attn.n_heads, (norms[0].eps, norms[1].eps, q_norm.eps if q_norm is not None else 1.0),
        rope, attn.scale * LOG2E, owner["bias"] if "bias" in owner else None,
        o.bias_holder["bias"] if "bias" in o.bias_holder else None,
        q_norm["weight"] if q_norm is not None else None, k_norm["weight"] if k_norm is not None else None,
        o.group)


class RowLayer(NamedTuple):
    """o or down as the kernel takes it."""

    packed: cpu_kernels.PackedLinear  # its panels
    group: object  # what its outputs are summed over (tensor parallelism), or None
    bias_holder: nn.Module  # where its bias lives: a row shard's is added after the sum


def _row_layer(layer: nn.Module | None) -> RowLayer | None:
    """A PackedLinear on one rank, or a tensor-parallel row shard (ShardedLinear with a sum)."""
    if type(layer) is cpu_kernels.PackedLinear:
        return RowLayer(layer, None, layer)
    if type(layer) is cpu_kernels.ShardedLinear and layer._reduce and type(layer.local) is cpu_kernels.PackedLinear:
        return RowLayer(layer.local, layer._group, layer)
    return None


def decode_layers(layers: list[nn.Module], native) -> list[DecodeLayer] | None:
    """Every layer fused, or None (a step runs all its layers one way)."""
    fused = [decode_layer(layer, native) for layer in layers]
    return None if not fused or any(f is None for f in fused) else fused


def runs_fused(batch: Batch, store: KVStore, h: mx.array) -> bool:
    """A step of decode rows only, float32 activations over float32 pools."""
    return (batch.decode is not None and not batch.extend and h.dtype == mx.float32 and bool(store.keys)
            and store.keys[0].dtype == mx.float32)
