"""A tensor-parallel LM head split by vocabulary (vLLM's ParallelLMHead): each rank multiplies the hidden
states of the rows that need logits by its slice of the head's rows, and one sum over the ranks gathers
the slices into whole logits on every rank.

mlx-lm's `shard()` leaves an untied head whole on every rank, so each rank read all of it every step, on
the leader's critical path (a 128K-token vocabulary's head is ~0.5-1B parameters). Split, each rank reads
1/N of it; the gather is a sum of zero-padded slices (`transport/collectives.all_sum`, the shared-memory
sums between local ranks), so each logit is exactly what the whole head computes: x + 0 is x.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from meshlm.transport.collectives import all_sum


class VocabShardedHead(nn.Module):
    """Rows [rank * V/N, (rank + 1) * V/N) of an `nn.Linear` head; called, the whole (..., V) logits."""

    def __init__(self, head: nn.Linear, rank: int, size: int, group) -> None:
        super().__init__()
        vocab, hidden = head.weight.shape
        if vocab % size:
            raise ValueError(f"a vocabulary of {vocab} does not split over {size} ranks")
        per = vocab // size
        rows = slice(rank * per, (rank + 1) * per)
        self.local = nn.Linear(hidden, per, bias="bias" in head)
        self.local.weight = mx.contiguous(head.weight[rows])
        if "bias" in head:
            self.local.bias = mx.contiguous(head.bias[rows])
        self._rank, self._size, self._per = rank, size, per
        self._group = group

    def sum_over(self, group) -> None:
        """Gather over `group` instead (a SharedMemoryGroup between local ranks)."""
        self._group = group

    def padded(self, x: mx.array) -> mx.array:
        """This rank's logits of `x` in place among zeros: the ranks' sum is the whole head's."""
        part = self.local(x)
        before, after = self._rank * self._per, (self._size - 1 - self._rank) * self._per
        return mx.pad(part, [(0, 0)] * (part.ndim - 1) + [(before, after)])

    def __call__(self, x: mx.array) -> mx.array:
        return all_sum(self.padded(x), self._group)


def shard_vocab_head(model: nn.Module, group) -> bool:
    """Replace `model`'s untied float head by this rank's VocabShardedHead over `group` (an MLX group of
    the tensor-parallel ranks); False when it keeps the whole head (tied to the embedding, quantized, or a
    vocabulary the ranks do not divide)."""
    head = model.get("lm_head")
    size = group.size()
    if (type(head) is not nn.Linear or size < 2 or getattr(model.args, "tie_word_embeddings", False)
            or head.weight.shape[0] % size):
        return False
    model.lm_head = VocabShardedHead(head, group.rank(), size, group)
    return True
