"""The n-gram (prompt lookup) proposer: drafts the tokens that followed the last occurrence of the
sequence's own last n tokens, in its prompt or output. No model, host only.

Each sequence keeps an index per n (n-gram -> where its most recent earlier
occurrence ended), extended as tokens arrive, so a proposal costs a few dict
lookups rather than a scan of a long prompt. The longest n is tried first: a
longer match predicts the continuation better. The most recent occurrence
wins: when a text is being copied, the place it was copied from last is where
it goes on.
"""

from __future__ import annotations

from typing import Protocol


class Tokens(Protocol):
    """A sequence's token ids (prompt then output), sliceable without copying the whole."""

    def __len__(self) -> int: ...

    def __getitem__(self, s: slice) -> list[int]: ...


class NgramIndex:
    """The index of one token sequence (grows with it; the caller passes the whole sequence each time)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self._indexed = 0  # grams ending before this position are in the index

    def propose(self, tokens: Tokens, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        length = len(tokens)
        self._extend(tokens, length - 1)  # every gram with a continuation; the suffix itself has none yet
        if k <= 0:
            return []
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            end = self._ends[n].get(tuple(tokens[length - n:]))
            if end is not None:
                return list(tokens[end:min(end + k, length)])
        return []

    def _extend(self, tokens: Tokens, upto: int) -> None:
        """Index the grams ending at positions [self._indexed, upto) (end = the position after the gram)."""
        for end in range(max(self._indexed, self.n_min), upto + 1):
            for n, ends in self._ends.items():
                if n <= end:
                    ends[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, upto + 1)


class NgramProposer:
    """Per-sequence indexes; `propose` takes the sequence's token ids and how many drafts are wanted."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, uid: int, tokens: Tokens, k: int) -> list[int]:
        index = self._indexes.get(uid)
        if index is None:
            index = self._indexes[uid] = NgramIndex(self.n_min, self.n_max)
        return index.propose(tokens, k)

    def drop(self, uid: int) -> None:
        self._indexes.pop(uid, None)
