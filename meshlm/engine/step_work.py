"""What a step's tokens cost, so that a prompt chunk against a long context stays a step of bounded length.

A token budget (--max-tokens-per-step) bounds a step's work only while contexts are short: a chunk's
attention reads every earlier position for each of its queries, so a 1,024-token chunk at a 1M-token
context costs ~300 times one at the start of the prompt on SmolLM2-135M. Such a step stalls every
stream in the batch for as long, and can outlive the cluster's step deadline (--step-timeout), which
then ends the whole cluster for a valid request.

Work is counted in tokens at context zero: a query attending to `c` keys costs `1 + c / keys_per_token`,
where `keys_per_token` is how many keys a query attends to for the work of one token through the layers'
matrices (the model's shapes say: `keys_per_token`). A step may do the work of a full
--max-tokens-per-step chunk starting at `--long-prefill-context`; a prompt chunk starting later is
shortened to fit, never below `MIN_CHUNK` tokens for the step's first prompt chunk (so prompts always
progress). Decode rows are never shortened (each is one token), but they count first. A chunk starting at
or before the reference context is what the token budget alone gives unless decode rows at long contexts
took the step's work (16 rows at 100K keys take ~14 % of it on SmolLM2-135M).

Approximate by design: the matrices and the attention are counted by their multiply-adds, as the kernels
of either run near the same rate here; sliding-window or linear-attention layers and MLA, in families
meshlm does not serve yet, would need their own terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The fewest tokens the step's first prompt chunk takes when decode rows have used the step's work: a
# prompt always progresses.
MIN_CHUNK = 16


@dataclass(frozen=True)
class StepWork:
    keys_per_token: float  # keys a query attends to for the work of one token through the matrices
    reference_context: int  # chunks starting here or before keep the token budget's size

    def __post_init__(self) -> None:
        if not self.keys_per_token > 0 or self.reference_context < 0:
            raise ValueError(f"bad step work model: {self}")

    def cost(self, start: int, n: int) -> float:
        """Work of `n` tokens at positions start..start+n-1 (query i attends to start + i + 1 keys)."""
        return n * (1.0 + (start + (n + 1) / 2) / self.keys_per_token)

    def limit(self, budget: int) -> float:
        """The most work a step of `budget` tokens may do: a whole chunk at the reference context."""
        return self.cost(self.reference_context, budget)

    def tokens_within(self, start: int, work: float) -> int:
        """The most tokens from position `start` whose work is at most `work` (0 when none fits)."""
        if work <= 0:
            return 0
        k = self.keys_per_token
        b = 1.0 + (start + 0.5) / k  # cost(start, n) = n * b + n^2 / (2k)
        n = int(k * (math.sqrt(b * b + 2.0 * work / k) - b))
        while n > 0 and self.cost(start, n) > work:  # the root's rounding
            n -= 1
        while self.cost(start, n + 1) <= work:
            n += 1
        return n


def keys_per_token(args) -> float | None:
    """From a model's config (mlx-lm's ModelArgs): a layer's multiply-adds per token through its matrices
    over those of one query against one key (q.k and the weighted v, over every query head). A mixture of
    experts counts the experts a token runs through. None when the config does not say enough."""
    hidden = getattr(args, "hidden_size", None)
    heads = getattr(args, "num_attention_heads", None)
    if not hidden or not heads:
        return None
    head_dim = getattr(args, "head_dim", None) or hidden // heads
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    ffn = getattr(args, "intermediate_size", None) or 4 * hidden
    experts = getattr(args, "num_experts_per_tok", None)
    if experts:  # Qwen's MoE names each expert's width; Mixtral's experts are intermediate_size wide
        expert_ffn = getattr(args, "moe_intermediate_size", None) or ffn
        ffn = experts * expert_ffn + (getattr(args, "shared_expert_intermediate_size", None) or 0)
    matrices = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * ffn
    return matrices / (2 * heads * head_dim)
