"""The runner: executes a StepPlan as batched forwards over an mlx-lm model.

KV layout: sequences that are decoding share one left-padded `BatchKVCache`
per layer (rows join with `extend`, leave with `filter`); a sequence still
reading its prompt in chunks keeps its own per-layer `KVCache` until its last
chunk, when it joins the decode batch. Last chunks of prompts, fresh or
continuing a cached prefix, are prefilled together in left-padded forwards
grouped by length.

The runner is rank-agnostic: under tensor parallelism every rank runs it on its
own shard of the model with the same plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from meshlm.cache.prefix import PrefixCache
from meshlm.model.head import last_logits
from meshlm.engine.plan import Chunk, NewSequence, StepPlan, batch_fingerprint


# Padding a row may take to share a batched prefill: padded positions cost as much compute as real
# ones, so past about what a separate forward's extra pass over the weights costs (demo model on CPU:
# ~90 ms, the compute of ~40 prompt tokens) the row is better off in a forward of its own.
PREFILL_PAD_LIMIT = 64


def _prefill_groups(chunks: list[Chunk]) -> list[list[Chunk]]:
    """Final prefill chunks grouped by length, each within PREFILL_PAD_LIMIT tokens of its group's
    longest: one long prompt does not pad fifteen short ones to its length."""
    groups: list[list[Chunk]] = []
    for c in sorted(chunks, key=lambda c: len(c.token_ids), reverse=True):
        if groups and len(groups[-1][0].token_ids) - len(c.token_ids) <= PREFILL_PAD_LIMIT:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


class SplitBrain(RuntimeError):
    """This rank's batch no longer matches the plan's fingerprint."""


@dataclass
class StepResult:
    uids: list[int]  # rows of `logits`, in order
    logits: mx.array | None  # (len(uids), vocab), float32, evaluating asynchronously
    launch_seconds: float = 0.0  # host time spent building and launching the step


class Runner:
    def __init__(self, model: nn.Module, prefix_cache: PrefixCache | None = None) -> None:
        self.model = model
        self.prefix_cache = prefix_cache
        self.tokens: dict[int, list[int]] = {}  # token ids whose KV each sequence holds
        self.num_layers = len(model.layers)
        self.decode_uids: list[int] = []
        self.decode_cache: list[BatchKVCache] | None = None
        self.prefill_caches: dict[int, list[KVCache]] = {}

    @property
    def lengths(self) -> dict[int, int]:
        """Tokens in KV per sequence: what the batch fingerprint is computed over."""
        return {uid: len(ids) for uid, ids in self.tokens.items()}

    # -- plan application -------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self._remove(plan.removed)
        for new in plan.new:
            self._admit(new)
        self._check_continuity(plan)
        by_uid = {c.uid: c for c in plan.chunks}
        rows: list[tuple[list[int], mx.array]] = []
        if self.decode_uids:
            rows.append((list(self.decode_uids), self._decode(by_uid)))
        prefill = [c for c in plan.chunks if c.uid not in self.decode_uids]
        joiners: list[tuple[int, list[KVCache] | list[BatchKVCache]]] = []
        for uids, logits, caches in self._prefill(prefill):
            if logits is not None:
                rows.append((uids, logits))
                joiners.append((uids, caches))
        for c in plan.chunks:  # continuity was checked: each chunk extends its sequence's tokens
            self.tokens.setdefault(c.uid, []).extend(c.token_ids)
        for uids, caches in joiners:
            self._join(uids, caches)
        if plan.fingerprint and batch_fingerprint(self.lengths) != plan.fingerprint:
            raise SplitBrain(f"step {plan.step_id}: batch fingerprint mismatch")
        if not rows:
            return StepResult([], None)
        uids = [u for us, _ in rows for u in us]
        logits = mx.concatenate([lg for _, lg in rows], axis=0).astype(mx.float32)
        mx.async_eval(logits)
        return StepResult(uids, logits, time.perf_counter() - t0)

    def _check_continuity(self, plan: StepPlan) -> None:
        """Every chunk must start where this rank's KV ends: a rank that missed or replayed a step stops here."""
        for c in plan.chunks:
            held = len(self.tokens.get(c.uid, ()))
            if c.start != held:
                raise SplitBrain(f"step {plan.step_id}: uid {c.uid} chunk starts at {c.start}, this rank holds {held}")

    def _admit(self, new: NewSequence) -> None:
        if not new.prefix_ids:
            return
        if self.prefix_cache is None:
            raise SplitBrain(f"sequence {new.uid} has a cached prefix but this rank has no prefix cache")
        cache = [KVCache() for _ in range(self.num_layers)]
        for c, (k, v) in zip(cache, self.prefix_cache.restore(list(new.prefix_ids))):
            c.state = (k, v, k.shape[2])
        self.prefill_caches[new.uid] = cache
        self.tokens[new.uid] = list(new.prefix_ids)

    def _remove(self, removed: tuple[int, ...]) -> None:
        gone = set(removed)
        keep = [i for i, u in enumerate(self.decode_uids) if u not in gone]
        if len(keep) < len(self.decode_uids):
            for i, uid in enumerate(self.decode_uids):
                if uid in gone:
                    self._store(uid, [c.extract(i) for c in self.decode_cache], write_through=False)
            self.decode_uids = [self.decode_uids[i] for i in keep]
            if keep:
                idx = mx.array(keep)
                for c in self.decode_cache:
                    c.filter(idx)
            else:
                self.decode_cache = None
        for uid in gone:
            self.prefill_caches.pop(uid, None)
            self.tokens.pop(uid, None)

    def _decode(self, by_uid: dict[int, Chunk]) -> mx.array:
        missing = [u for u in self.decode_uids if u not in by_uid]
        if missing:
            raise SplitBrain(f"decode rows without a token this step: {missing}")
        tokens = mx.array([[by_uid[u].token_ids[0] for u in self.decode_uids]]).T
        return last_logits(self.model, tokens, self.decode_cache)

    def _prefill(self, chunks: list[Chunk]):
        """Yield (uids, last-position logits or None, caches) per prefill forward: final chunks in
        length-grouped batches, each other chunk alone (it only extends its sequence's own KV)."""
        batched: set[int] = set()
        for group in _prefill_groups([c for c in chunks if c.sample]):
            if len(group) > 1:
                batched.update(c.uid for c in group)
                yield self._prefill_batch(group)
        for c in chunks:
            if c.uid in batched:
                continue
            cache = self.prefill_caches.setdefault(c.uid, [KVCache() for _ in range(self.num_layers)])
            logits = last_logits(self.model, mx.array([c.token_ids]), cache)
            if c.sample:
                del self.prefill_caches[c.uid]
                yield [c.uid], logits, cache
            else:
                # Materialise the chunk now so the graph does not grow across steps.
                mx.eval([x for kv in cache for x in (kv.keys, kv.values)])

    def _prefill_batch(self, chunks: list[Chunk]):
        """One left-padded forward over the last chunks of several prompts, fresh or continuing a
        restored prefix (or earlier chunks). Rows must end aligned, and the padding of a row must sit
        before all of its KV: so a shorter chunk that has a prefix recomputes the prefix's last tokens
        instead of taking pads (the forward computes `width` positions per row either way)."""
        width = max(len(c.token_ids) for c in chunks)
        rows, prefixes, pads = [], [], []
        for c in chunks:
            cache = self.prefill_caches.pop(c.uid, None)
            recompute = min(c.start, width - len(c.token_ids))  # c.start = tokens held: continuity was checked
            if cache is not None and recompute:
                for kv in cache:
                    kv.trim(recompute)
            ids = self.tokens.get(c.uid, [])[c.start - recompute :] + list(c.token_ids)
            pads.append(width - len(ids))  # > 0 only for a row with no prefix left
            rows.append([0] * pads[-1] + ids)
            prefixes.append(cache if c.start > recompute else None)
        # Rows without a prefix merge as empty caches; the pads then extend every row's left padding.
        padding = mx.array(pads)
        caches = []
        for layer in range(self.num_layers):
            bc = BatchKVCache.merge([p[layer] if p is not None else KVCache() for p in prefixes])
            bc.left_padding = bc.left_padding + padding
            bc.offset = bc.offset - padding
            caches.append(bc)
        return [c.uid for c in chunks], last_logits(self.model, mx.array(rows), caches), caches

    def _join(self, uids: list[int], caches) -> None:
        if not isinstance(caches[0], BatchKVCache):
            self._store(uids[0], caches)
            caches = [BatchKVCache.merge([c]) for c in caches]
        else:
            for i, uid in enumerate(uids):
                self._store(uid, [c.extract(i) for c in caches])
        if self.decode_cache is None:
            self.decode_cache = caches
        else:
            for mine, theirs in zip(self.decode_cache, caches):
                mine.extend(theirs)
        self.decode_uids.extend(uids)

    def _store(self, uid: int, cache: list[KVCache], write_through: bool = True) -> None:
        """Give a sequence's full blocks to the prefix cache: after prefill (written through to
        disk) and when it leaves (RAM; disk only on eviction)."""
        if self.prefix_cache is None:
            return
        ids = self.tokens.get(uid, [])[: cache[0].offset]
        if len(ids) >= self.prefix_cache.block_size:
            self.prefix_cache.store(ids, [(c.keys, c.values) for c in cache], write_through)

    # -- introspection ----------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        caches = list(self.decode_cache or []) + [c for cs in self.prefill_caches.values() for c in cs]
        return sum(c.nbytes for c in caches)

    def kv_bytes_per_token(self) -> int:
        """Measure KV bytes per token with a one-token forward (also warms the model up)."""
        cache = [KVCache() for _ in range(self.num_layers)]
        mx.eval(self.model(mx.array([[0]]), cache=cache))
        allocated = sum(c.keys.shape[2] for c in cache[:1])
        return sum(c.nbytes for c in cache) // allocated
