"""One forward over a flattened batch: this rank's layers, its KV store, the attention backend.

The walk is mlx-lm's own (embedding, each decoder layer, final norm, head),
run over a contiguous range of layers: all of them for a whole model, a
pipeline stage's for a stage. The LM head runs only on the positions whose
logits are wanted (the last token of a prefill chunk, every verified token),
not on every prompt position; and after the model's last attention, only
those positions go on (llama.cpp's `inp_out_ids`): the other positions' K and
V are all the step keeps of them, so their residual, norm and MLP there are
never computed. In a prefill chunk of 256 tokens that is most of the last
layer's arithmetic; a pipeline's last stage, which also samples, gains it
most.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from meshlm.kv.store import KVStore
from meshlm.model.adapt import ModelParts
from meshlm.model.attention import AttentionBackend, LayerKV
from meshlm.model.batch import Batch
from meshlm.model.decode_layer import FUSABLE_MODULES, runs_fused


def forward(parts: ModelParts, batch: Batch, store: KVStore, backend: AttentionBackend,
            hidden: mx.array | None = None) -> mx.array:
    """Logits (len(batch.logit_index), vocab) when this rank computes them, else the hidden state
    (1, T, hidden_size) after its last layer. `hidden`: the previous stage's output (None: embed)."""
    h = parts.embed(batch.tokens[None]) if hidden is None else hidden
    if parts.decode_layers is not None and runs_fused(batch, store, h):
        for i, layer in enumerate(parts.decode_layers):
            h = layer(h, batch, store, i)
        return parts.head(h[:, batch.logit_index]).squeeze(0) if parts.computes_logits else h
    # Every rank of a tensor-parallel group takes the same branch: the batch decides it, and its sums match.
    narrow = parts.computes_logits and 0 < len(batch.logit_rows) < batch.num_tokens
    last = len(parts.layers) - 1
    for i, layer in enumerate(parts.layers):
        kv = LayerKV(store, i, batch, backend)
        if i == last and narrow and narrows(layer):
            h = rows_after_attention(layer, h, kv, batch.logit_index)
            return parts.head(h).squeeze(0)
        h = layer(h, None, kv)
    if not parts.computes_logits:
        return h
    return parts.head(h[:, batch.logit_index]).squeeze(0)


def narrows(layer: nn.Module) -> bool:
    """Whether `rows_after_attention` computes this layer: the block of every family meshlm runs."""
    return type(layer).__module__ in FUSABLE_MODULES


def rows_after_attention(layer: nn.Module, h: mx.array, kv: LayerKV, index: mx.array) -> mx.array:
    """mlx-lm's llama / qwen2 / qwen3 block (`h + attn(norm(h))`, then `+ mlp(norm(.))`) with every
    position attending and writing its K and V, and only `index`'s rows after that."""
    r = layer.self_attn(layer.input_layernorm(h), None, kv)
    h = h[:, index] + r[:, index]
    return h + layer.mlp(layer.post_attention_layernorm(h))
