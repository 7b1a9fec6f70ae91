"""StepPlan: the scheduler's decision for one step, the only control message that crosses ranks.

New sequences travel in full (their first chunk, cached-prefix length and
sampling parameters), running ones as diffs (the next chunk of token ids; for a
decoding sequence that is the single token the leader sampled last step).
Every rank applies the plan and checks `fingerprint` against its own batch.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from meshlm.engine.request import SamplingParams


@dataclass(frozen=True)
class NewSequence:
    uid: int
    cached_len: int  # tokens restored from the prefix cache; the first chunk starts here
    params: SamplingParams
    prefix_ids: tuple[int, ...] = ()  # the cached tokens themselves, so every rank derives the block keys


@dataclass(frozen=True)
class Chunk:
    """Tokens of one sequence to run this step, starting at position `start`."""

    uid: int
    start: int
    token_ids: tuple[int, ...]
    sample: bool  # True when this chunk reaches the end of the sequence's tokens


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    new: tuple[NewSequence, ...] = ()
    chunks: tuple[Chunk, ...] = ()
    removed: tuple[int, ...] = ()
    fingerprint: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not (self.new or self.chunks or self.removed)


def batch_fingerprint(lengths: dict[int, int]) -> int:
    """64-bit digest of the active batch (uid -> tokens in KV after the step).

    Ranks compute it independently after applying a plan; any difference means
    they no longer hold the same batch (split brain).
    """
    h = hashlib.blake2b(digest_size=8)
    for uid in sorted(lengths):
        h.update(struct.pack("<qq", uid, lengths[uid]))
    return int.from_bytes(h.digest(), "little")
