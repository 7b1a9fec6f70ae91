"""StepPlan: the scheduler's decision for one step, the only control message that crosses ranks.

New sequences travel in full (their cached-prefix length), running ones as
diffs: the next chunk of token ids (for a decoding sequence, the one token the
leader sampled last step) and the blocks appended to their tables. Block ops
(copies for partial prefix hits, SSD loads and saves) say what every rank does
to its KV pools before and after the forward. Every rank applies the plan and
checks `fingerprint` against its own batch.

Workers read every field here; what only the leader needs (sampling
parameters, prompts, stop strings) never travels.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

LOGITS_NONE, LOGITS_LAST, LOGITS_ALL = 0, 1, 2  # which positions of a chunk get logits


@dataclass(frozen=True)
class NewSequence:
    uid: int
    cached_len: int  # positions whose KV the sequence holds from the prefix cache once the step's ops ran
    holder: int = -1  # context parallelism: the rank holding all its KV (--cp-min-tokens), -1: split over all


@dataclass(frozen=True)
class Chunk:
    """Tokens of one sequence to run this step, at positions `start`, `start + 1`, ..."""

    uid: int
    start: int
    token_ids: tuple[int, ...]
    logits: int = LOGITS_NONE  # LOGITS_LAST: this chunk reaches the end of the sequence's tokens

    @property
    def sample(self) -> bool:
        return self.logits != LOGITS_NONE

    def verifies(self, num_tokens: int) -> bool:
        """A speculative verify chunk: it runs past the sequence's `num_tokens` (its drafts are not the
        sequence's yet). The other kind with every position's logits scores a prompt, and samples only
        where it reaches the sequence's end."""
        return self.logits == LOGITS_ALL and self.start + len(self.token_ids) > num_tokens


@dataclass(frozen=True)
class TableUpdate:
    uid: int
    blocks: tuple[int, ...]  # appended to the sequence's block table


@dataclass(frozen=True)
class Trim:
    """Keep a sequence's first `length` positions (speculative rollback); its table keeps `blocks` blocks."""

    uid: int
    length: int
    blocks: int


@dataclass(frozen=True)
class BlockCopy:
    src: int
    dst: int
    tokens: int  # the first `tokens` positions of `src` (a partial prefix hit, copy-on-write)


@dataclass(frozen=True)
class BlockLoad:
    key: bytes
    block: int  # read the block named `key` from this rank's SSD tier into `block`


@dataclass(frozen=True)
class BlockSave:
    block: int
    key: bytes  # after the forward, write `block` to this rank's SSD tier as `key`


@dataclass(frozen=True)
class BlockExport:
    uid: int
    index: int  # the block's place in the sequence's table
    block: int  # before the forward, hand a copy of `block` to this rank's KV exporter (disaggregated prefill)


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    new: tuple[NewSequence, ...] = ()
    chunks: tuple[Chunk, ...] = ()
    removed: tuple[int, ...] = ()
    tables: tuple[TableUpdate, ...] = ()
    trims: tuple[Trim, ...] = ()
    copies: tuple[BlockCopy, ...] = ()
    loads: tuple[BlockLoad, ...] = ()
    saves: tuple[BlockSave, ...] = ()
    exports: tuple[BlockExport, ...] = ()
    touches: tuple[bytes, ...] = ()  # keys whose SSD files to refresh (their blocks are hot in RAM)
    num_blocks: int = 0  # block ids below this may appear: every rank's pools must hold them
    fingerprint: int = 0
    # Planned before the tokens its rows decode were sampled (a pipeline's next step of the same sequences):
    # its chunks hold placeholder ids, and a TOKENS frame right after it carries the real ones.
    ids_follow: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def empty(self) -> bool:
        """Nothing for any rank to do: a pipeline's engine drops such a plan while others are in flight, so
        every field a rank applies counts (table updates, copies and loads were once left out)."""
        return not (self.new or self.chunks or self.removed or self.tables or self.trims or self.copies
                    or self.loads or self.saves or self.exports)


def batch_fingerprint(lengths: dict[int, int]) -> int:
    """64-bit digest of the active batch (uid -> positions in KV after the step).

    Ranks compute it independently after applying a plan; any difference means
    they no longer hold the same batch (split brain).
    """
    h = hashlib.blake2b(digest_size=8)
    for uid in sorted(lengths):
        h.update(struct.pack("<qq", uid, lengths[uid]))
    return int.from_bytes(h.digest(), "little")
