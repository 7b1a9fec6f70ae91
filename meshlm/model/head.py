"""Last-position logits without computing the LM head for every prompt position.

A prefill chunk needs logits for its last token only; calling the whole model
would project every position onto the vocabulary (for SmolLM2, 49,152 x 576
per token: more FLOPs than the layers themselves on a short prompt). mlx-lm's
decoder models (llama, qwen2, qwen3, mistral...) share one shape,
`model.model` (the transformer) then a tied or untied head, which this
mirrors; other models fall back to the full call.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

_SPLIT_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def last_logits(model: nn.Module, tokens: mx.array, cache) -> mx.array:
    """(B, vocab) logits of the last position of `tokens` (B, L), advancing `cache`."""
    if getattr(model, "model_type", None) not in _SPLIT_HEAD_TYPES:
        return model(tokens, cache=cache)[:, -1, :]
    hidden = model.model(tokens, cache)[:, -1:, :]
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)[:, -1, :]
    return model.lm_head(hidden)[:, -1, :]
