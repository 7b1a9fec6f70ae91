"""One forward over a flattened batch: this rank's layers, its KV store, the attention backend.

The walk is mlx-lm's own (embedding, each decoder layer, final norm, head),
run over a contiguous range of layers: all of them for a whole model, a
pipeline stage's for a stage. The LM head runs only on the positions whose
logits are wanted (the last token of a prefill chunk, every verified token),
not on every prompt position.
"""

from __future__ import annotations

import mlx.core as mx

from meshlm.kv.store import KVStore
from meshlm.model.adapt import ModelParts
from meshlm.model.attention import AttentionBackend, LayerKV
from meshlm.model.batch import Batch
from meshlm.model.decode_layer import runs_fused


def forward(parts: ModelParts, batch: Batch, store: KVStore, backend: AttentionBackend,
            hidden: mx.array | None = None) -> mx.array:
    """Logits (len(batch.logit_index), vocab) when this rank computes them, else the hidden state
    (1, T, hidden_size) after its last layer. `hidden`: the previous stage's output (None: embed)."""
    h = parts.embed(batch.tokens[None]) if hidden is None else hidden
    if parts.decode_layers is not None and runs_fused(batch, store, h):
        for i, layer in enumerate(parts.decode_layers):
            h = layer(h, batch, store, i)
    else:
        for i, layer in enumerate(parts.layers):
            h = layer(h, None, LayerKV(store, i, batch, backend))
    if not parts.computes_logits:
        return h
    return parts.head(h[:, batch.logit_index]).squeeze(0)
