"""A tensor-parallel LM head split by vocabulary (vLLM's ParallelLMHead): each rank multiplies the hidden
states of the rows that need logits by its slice of the head's rows, and one sum over the ranks gathers
the slices into whole logits on every rank.

mlx-lm's `shard()` leaves an untied head whole on every rank, so each rank read all of it every step, on
the leader's critical path (a 128K-token vocabulary's head is ~0.5-1B parameters). Split, each rank reads
1/N of it; the gather is a sum of zero-padded slices (`transport/collectives.all_sum`, the shared-memory
sums between local ranks), so each logit is exactly what the whole head computes: x + 0 is x.

A tied head is the embedding table, so `TiedVocabSplit` keeps the table whole for lookups (a few rows a
step) and multiplies by this rank's rows only for the logits: the table is read 1/N per rank per step,
held as before.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from meshlm.transport.collectives import all_sum


class _VocabSlice(nn.Module):
    """This rank's vocabulary rows [first, end) = [rank * V/N, (rank + 1) * V/N) of a head, and the sum
    that gathers the ranks' zero-padded logits."""

    def __init__(self, vocab: int, rank: int, size: int, group) -> None:
        super().__init__()
        if vocab % size:
            raise ValueError(f"a vocabulary of {vocab} does not split over {size} ranks")
        per = vocab // size
        self._rank, self._size, self._per = rank, size, per
        self._first, self._end = rank * per, (rank + 1) * per
        self._group = group

    def sum_over(self, group) -> None:
        """Gather over `group` instead (a SharedMemoryGroup between local ranks)."""
        self._group = group

    def _in_place(self, part: mx.array) -> mx.array:
        """This rank's logits `part` among zeros: the ranks' sum is the whole head's."""
        after = (self._size - 1 - self._rank) * self._per
        return mx.pad(part, [(0, 0)] * (part.ndim - 1) + [(self._first, after)])


class VocabShardedHead(_VocabSlice):
    """Rows [rank * V/N, (rank + 1) * V/N) of an `nn.Linear` head; called, the whole (..., V) logits."""

    def __init__(self, head: nn.Linear, rank: int, size: int, group) -> None:
        vocab, hidden = head.weight.shape
        super().__init__(vocab, rank, size, group)
        rows = slice(self._first, self._end)
        self.local = nn.Linear(hidden, self._per, bias="bias" in head)
        self.local.weight = mx.contiguous(head.weight[rows])
        if "bias" in head:
            self.local.bias = mx.contiguous(head.bias[rows])

    def padded(self, x: mx.array) -> mx.array:
        """This rank's logits of `x` in place among zeros."""
        return self._in_place(self.local(x))

    def __call__(self, x: mx.array) -> mx.array:
        return all_sum(self.padded(x), self._group)


class TiedVocabSplit(_VocabSlice):
    """A tied embedding `table` (an nn.Embedding, or cpu_kernels' PackedEmbedding once adapt packs it):
    lookups read the whole table; `as_linear` computes this rank's rows [rank * V/N, (rank + 1) * V/N) of
    the logits and sums the zero-padded slices over the ranks."""

    def __init__(self, table: nn.Module, rank: int, size: int, group) -> None:
        super().__init__(table.weight.shape[0], rank, size, group)
        self.table = table

    @property
    def weight(self) -> mx.array:
        return self.table.weight

    def __call__(self, ids: mx.array) -> mx.array:
        return self.table(ids)

    def padded(self, x: mx.array) -> mx.array:
        """This rank's logits of `x` in place among zeros."""
        first, end = self._first, self._end
        rows_linear = getattr(self.table, "rows_linear", None)  # PackedEmbedding: its panels for those rows
        return self._in_place(rows_linear(x, first, end) if rows_linear is not None
                              else x @ self.table.weight[first:end].T)

    def as_linear(self, x: mx.array) -> mx.array:
        return all_sum(self.padded(x), self._group)


# Rows per rank of a split tied table: whole 16-row panels of the packed GEMM (cpu_kernels.PackedEmbedding).
TIED_ROWS_MULTIPLE = 16


def shard_vocab_head(model: nn.Module, group) -> bool:
    """Split `model`'s float LM head by vocabulary over `group` (an MLX group of the tensor-parallel ranks):
    an untied head becomes this rank's VocabShardedHead, a tied one's table a TiedVocabSplit. False when
    the whole head stays (quantized, or a vocabulary the ranks do not divide, tied: into whole panels)."""
    size = group.size()
    if size < 2:
        return False
    if getattr(model.args, "tie_word_embeddings", False) or "lm_head" not in model:
        inner = model.model
        table = inner.get("embed_tokens")
        if (type(table) is not nn.Embedding or not mx.issubdtype(table.weight.dtype, mx.floating)
                or table.weight.shape[0] % (size * TIED_ROWS_MULTIPLE)):
            return False
        inner.embed_tokens = TiedVocabSplit(table, group.rank(), size, group)
        return True
    head = model.get("lm_head")
    if type(head) is not nn.Linear or head.weight.shape[0] % size:
        return False
    model.lm_head = VocabShardedHead(head, group.rank(), size, group)
    return True
