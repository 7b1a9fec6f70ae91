"""Fitting a loaded mlx-lm model to meshlm's KV store, without forking its modules.

Model code stays mlx-lm's; this module changes instances, never classes:
- each attention layer's RoPE is wrapped (`TokenRoPE`) so a flattened batch
  rotates every token by its own position;
- the model's module gets the attention seam once (model/attention.py): its
  `scaled_dot_product_attention` sends meshlm's caches to meshlm's backends
  and everything else to mlx-lm's original, so other users of the module are
  untouched and the seam holds no settings;
- on the CPU, MLPs get meshlm's SwiGLU and linear layers keep their weights
  transposed or packed (model/cpu_kernels.py).

Only the families whose layers meshlm has checked (llama and mistral, which
mlx-lm runs as llama, qwen2 and qwen3) are accepted; others are refused with
a clear error at load rather than run wrong.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from meshlm.model import cpu_kernels
from meshlm.model.attention import TokenPositions, install_seam
from meshlm.model.decode_layer import DecodeLayer, decode_layers
from meshlm.model.vocab_parallel import TiedVocabSplit, VocabShardedHead
from meshlm.kv.store import KVShape

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModel(ValueError):
    """A model family the KV store does not run (yet)."""


def check_supported(config: dict) -> None:
    """Refuse, before loading, what meshlm cannot run exactly (config.json's view)."""
    kind = config.get("model_type")
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedModel(f"model type {kind!r} is not supported; meshlm runs {', '.join(SUPPORTED_TYPES)}")
    scaling = config.get("rope_scaling") if isinstance(config.get("rope_scaling"), dict) else {}
    if (scaling.get("rope_type") or scaling.get("type")) == "dynamic":
        # mlx-lm's dynamic NTK RoPE takes one offset for the whole batch, never one per token
        raise UnsupportedModel("rope_scaling type 'dynamic' is not supported (config.json): its RoPE takes one "
                               "position offset per batch, where meshlm's rows each have their own")
    if "sliding_attention" in (config.get("layer_types") or ()):
        raise UnsupportedModel(f"{kind} with sliding-window layers is not supported (every layer must attend "
                               "to the whole sequence)")


class TokenRoPE(nn.Module):
    """A model's RoPE, applied per token when the offset is meshlm's `TokenPositions`.

    (1, H, T, D) is viewed as T rows of one position each, the layout in which
    `mx.fast.rope` takes one offset per row; any other offset goes to the
    wrapped RoPE unchanged. With `_cpu_ops` and a RoPE whose table it knows
    (`cpu_kernels.rope_table`), float32 runs as one primitive that reads the
    head-major view in place and returns it stored token-major, the layout
    the projection produced and the KV write and attention read."""

    def __init__(self, rope: nn.Module, native=None) -> None:
        super().__init__()
        self.inner = rope
        self._native = native
        self._table = cpu_kernels.rope_table(rope) if native is not None else None

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if not isinstance(offset, TokenPositions):
            return self.inner(x, offset=offset)
        t = self._table
        if t is not None and x.dtype == mx.float32:
            return self._native.rope(x, offset.positions, t.inv_freq, t.dims, t.traditional, t.scale)
        return self.inner(x.transpose(2, 1, 0, 3), offset=offset.positions).transpose(2, 1, 0, 3)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with meshlm's SwiGLU: the MLP of every supported family. `fuse` turns
    gate, up and the SwiGLU into one compiled GEMM (`packed_swiglu`) where they are packed."""

    def __init__(self, mlp: nn.Module, act: Callable[[mx.array, mx.array], mx.array]) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._act = act
        self._native = None

    def fuse(self, native) -> bool:
        """Hold gate's panels then up's as one weight (`gate_up_p`) when both are packed, unbiased, on
        this rank without a collective; True if done (or already)."""
        if "gate_up_p" in self:
            return True
        gate, up = cpu_kernels.packed_local(self.gate_proj), cpu_kernels.packed_local(self.up_proj)
        if (native is None or gate is None or up is None or "bias" in gate or "bias" in up
                or gate["weight_p"].shape != up["weight_p"].shape):
            return False
        self.gate_up_p = mx.concatenate([gate["weight_p"], up["weight_p"]])
        mx.eval(self.gate_up_p)
        del self["gate_proj"], self["up_proj"]
        self._native = native
        return True

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_p" in self:
            return self.down_proj(self._native.packed_swiglu(x, self["gate_up_p"]))
        return self.down_proj(self._act(self.gate_proj(x), self.up_proj(x)))


@dataclass
class ModelParts:
    """What a forward walks: the embedding (first stage), a contiguous range of layers, and the final norm
    and head (last stage). A whole model is one stage holding everything."""

    embed: nn.Module | None
    layers: list[nn.Module]
    norm: nn.Module | None
    lm_head: nn.Module | None  # None with tied embeddings: the embedding table projects
    first_layer: int = 0  # index of layers[0] in the whole model
    num_layers: int = 0  # of the whole model
    # Each layer as one node for steps of decode rows (model/decode_layer.py); None: the modules always.
    decode_layers: list[DecodeLayer] | None = None

    @property
    def computes_logits(self) -> bool:
        return self.norm is not None

    def head(self, h: mx.array) -> mx.array:
        h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else self.embed.as_linear(h)


def model_parts(model: nn.Module) -> ModelParts:
    inner = model.model
    layers = list(inner.layers)
    stage = getattr(model, "meshlm_stage", None)  # set by loader.keep_stage for a pipeline stage
    if stage is not None:
        s, total, tied = stage
        embed = inner.embed_tokens if "embed_tokens" in inner else None
        if not s.logits:
            return ModelParts(embed if s.embeds else None, layers, None, None, s.first, total)
        return ModelParts(embed, layers, inner.norm, None if tied else model.lm_head, s.first, total)
    tied = getattr(model.args, "tie_word_embeddings", False) or "lm_head" not in model
    return ModelParts(inner.embed_tokens, layers, inner.norm, None if tied else model.lm_head, 0, len(layers))


def kv_shape(model: nn.Module, parts: ModelParts, block_size: int, dtype: mx.Dtype) -> KVShape:
    """This rank's KV per block: its layers, its share of the KV heads (after any TP sharding)."""
    args = model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    kv_heads = parts.layers[0].self_attn.n_kv_heads
    return KVShape(len(parts.layers), kv_heads, head_dim, block_size, dtype)


def adapt(model: nn.Module, cpu_kernels_on: bool, native=None, sum_group=None, half_weights: bool = True,
          fused_decode: bool = True) -> ModelParts:
    """Prepare `model` (this engine's own instance) for meshlm's forward; returns its parts. `sum_group`:
    what tensor-parallel layers sum over instead of their MLX group (transport/local_reduce.py);
    `half_weights`: packed layers whose weights are all exact bfloat16 (or float16) values keep them so;
    `fused_decode`: steps of decode rows run each layer as one node where every layer can."""
    module = sys.modules[type(model).__module__]
    install_seam(module)
    on_cpu = cpu_kernels_on and mx.default_device() == mx.cpu
    # Only where the table is the LM head: a pipeline's first stage only looks rows up (packed, a lookup
    # gathers from panels, and the log claimed a head the stage does not have).
    if on_cpu and model_parts(model).computes_logits and cpu_kernels.pack_tied_embedding(model, native, half_weights):
        half = cpu_kernels.half_table(model)
        log.info("CPU kernels: the tied embedding table is packed for the LM head%s",
                 f" ({half}: every value exactly one)" if half else "")
    if on_cpu and cpu_kernels.swap_norms(model, native):
        log.info("CPU kernels: RMSNorm and RoPE run as single primitives")
    layers = model_parts(model).layers
    for layer in layers:
        attn = layer.self_attn
        if not isinstance(attn.rope, TokenRoPE):
            attn.rope = TokenRoPE(attn.rope, native if on_cpu else None)
    if on_cpu:
        act = cpu_kernels.swiglu_for(native)
        for layer in layers:
            if not isinstance(layer.mlp, GatedMLP):
                layer.mlp = GatedMLP(layer.mlp, act)
        swapped = cpu_kernels.transpose_linears(model, native, sum_group, half_weights)
        if sum_group is not None:
            for split in (model.get("lm_head"), model.model.get("embed_tokens")):
                if isinstance(split, (VocabShardedHead, TiedVocabSplit)):
                    split.sum_over(sum_group)
        if swapped:
            half = ", ".join(f"{n} {name}" for name, n in cpu_kernels.half_layers(model).items())
            log.info("CPU kernels: %d linear layers hold their weights %s%s", swapped,
                     "in 16-column panels" if native is not None and native.packed_gemm else "transposed",
                     f" ({half} of them: every weight exactly one)" if half else "")
        saved = sum(cpu_kernels.fuse_layer_projections(layer, native) for layer in layers)
        if saved:
            log.info("CPU kernels: q/k/v and gate/up fused, %d GEMMs fewer per forward", saved)
    # Read after the swaps: parts taken before them kept an untied LM head as the nn.Linear it replaced
    # (MLX's `x @ W.T`, ~3x the packed GEMM's time at decode batch sizes).
    parts = model_parts(model)
    if on_cpu and fused_decode:
        parts.decode_layers = decode_layers(parts.layers, native)
        if parts.decode_layers:
            log.info("CPU kernels: a step of decode rows runs its %d layers fused, one node each%s",
                     len(parts.layers), " and two sums" if parts.decode_layers[0].group is not None else "")
    return parts
