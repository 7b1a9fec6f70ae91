"""The draft-model proposer: a smaller model with the target's tokenizer, on the leader alone.

The draft has its own weights, its own KV store (the same paged `KVStore` and
`Runner` the target uses, with a block allocator of its own and no prefix
cache) and runs as a TP=1 model even when the target is tensor-parallel: it is
small, and keeping it off the collectives means the workers never see it.

Per step, for the speculating rows only, in batched forwards:
1. catch up: each row feeds the tokens the draft has not seen (the whole
   prompt the first time, afterwards the target's own token and whatever the
   previous verification accepted) and gets the distribution of draft 1;
2. K - 1 one-token forwards, each feeding the previous draft.
Rollback is implicit: before a row runs, the draft keeps only its longest
prefix that still agrees with the sequence's tokens (a `Trim`, as the target
does), so rejected drafts are forgotten on the next step.

Drafts are drawn from the draft's distribution processed as the target's rows
are (logit bias, penalties, temperature, top-k/p, min-p): that distribution is
q in the rejection sampler, and greedy requests draft the argmax.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx

from meshlm.config import CacheConfig, ModelConfig, SpeculativeConfig
from meshlm.engine.plan import LOGITS_LAST, Chunk, NewSequence, StepPlan, TableUpdate, Trim
from meshlm.engine.request import Sequence
from meshlm.engine.sampler import SeqSampling, filter_logits, process_logits
from meshlm.kv.blocks import BlockManager, common_prefix

log = logging.getLogger(__name__)

TIME_DECAY = 0.8  # weight of past draft-step times in the running estimate


@dataclass(frozen=True)
class DraftRow:
    seq: Sequence
    state: SeqSampling
    k: int  # drafts wanted (>= 1)


@dataclass(frozen=True)
class Drafted:
    tokens: tuple[int, ...]
    probs: mx.array | None  # (len(tokens), vocab): q per position for a sampled row; None when greedy


@dataclass
class _Held:
    """What the draft's KV holds for one sequence: its first `synced` tokens, then `extra` (drafts fed
    after them). Tracked this way so a step costs O(K), not a copy of a long prompt."""

    synced: int = 0
    extra: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.synced + len(self.extra)


class DraftModel:
    def __init__(self, rank, max_blocks: int, context_length: int, vocab_size: int | None = None) -> None:
        """`vocab_size`: the target's, when the draft's embedding has another number of rows (padding
        only: the tokenizers are the same); its logits are cut or padded to it."""
        self.rank = rank  # a RankState: the draft's parts, KV store and runner
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.blocks = BlockManager(max_blocks, rank.block_size)  # no salt: no prefix cache for the draft
        self._held: dict[int, _Held] = {}
        self._removed: list[int] = []
        self._step_ids = itertools.count()
        self.seconds = 0.0  # running estimate of one propose call (all K forwards)
        self.last_seconds = 0.0  # the latest call's

    def room(self, seq: Sequence) -> int:
        """How many drafts the draft's context allows after `seq`'s tokens."""
        return self.context_length - seq.num_tokens

    def propose(self, rows: list[DraftRow]) -> dict[int, Drafted]:
        t0 = time.perf_counter()
        rows = [r for r in rows if r.k > 0]
        plan_rows = self._place(rows)
        if not plan_rows:
            return {}
        new, tables, trims, chunks = [], [], [], []
        for row, fresh, trim, blocks in plan_rows:
            held = self._held[row.seq.uid]
            if fresh:
                new.append(NewSequence(row.seq.uid, 0))
            if trim is not None:
                trims.append(trim)
            if blocks:
                tables.append(TableUpdate(row.seq.uid, tuple(blocks)))
            chunks.append(Chunk(row.seq.uid, held.length, tuple(row.seq.token_slice(held.length, row.seq.num_tokens)),
                                LOGITS_LAST))
        plan = self._plan(chunks, new=new, tables=tables, trims=trims)
        active = [r for r, *_ in plan_rows]
        drafts: dict[int, list[int]] = {r.seq.uid: [] for r in active}
        probs: dict[int, list[mx.array]] = {r.seq.uid: [] for r in active}
        for j in range(max(r.k for r in active)):
            result = self.rank.step(plan)
            self._sample(result, {r.seq.uid: r for r in active}, drafts, probs)
            for r in active:
                self._held[r.seq.uid].synced = r.seq.num_tokens
                self._held[r.seq.uid].extra = drafts[r.seq.uid][:-1]
            active = [r for r in active if r.k > j + 1]
            if not active:
                break
            plan = self._plan([Chunk(r.seq.uid, r.seq.num_tokens + j, (drafts[r.seq.uid][-1],), LOGITS_LAST)
                               for r in active])
        elapsed = self.last_seconds = time.perf_counter() - t0
        self.seconds = elapsed if not self.seconds else TIME_DECAY * self.seconds + (1 - TIME_DECAY) * elapsed
        return {uid: Drafted(tuple(d), mx.stack(probs[uid]) if probs[uid] else None) for uid, d in drafts.items()}

    def _place(self, rows: list[DraftRow]) -> list[tuple[DraftRow, bool, Trim | None, list[int]]]:
        """Per row: roll the draft's KV back to what still agrees with the sequence, and blocks for the
        positions this step feeds. A row that does not fit, even after dropping the sequences not
        drafting now, is dropped too and drafts nothing this step."""
        placed = []
        wanted = {r.seq.uid for r in rows}
        for row in rows:
            uid, seq = row.seq.uid, row.seq
            fresh = uid not in self._held
            held = self._held.setdefault(uid, _Held())
            agree = held.synced + common_prefix(held.extra, seq.token_slice(held.synced, held.length))
            # The step feeds at least the sequence's last token: its logits draw the first draft. The draft's
            # KV may already hold it (drafts cut by the token budget, the target's own token equal to the
            # next draft, a row that decoded plainly): an empty chunk failed the engine's step.
            agree = min(agree, seq.num_tokens - 1)
            trim = None
            if agree < held.length:
                self.blocks.trim(uid, agree)
                trim = Trim(uid, agree, len(self.blocks.table(uid)))
                if agree < held.synced:  # the row was drafted, then left out of the target's step
                    held.synced, held.extra = agree, []
                else:
                    held.extra = held.extra[: agree - held.synced]
            blocks = self.blocks.allocate(uid, seq.num_tokens + row.k - 1)
            if blocks is None:
                self._evict(keep=wanted)
                blocks = self.blocks.allocate(uid, seq.num_tokens + row.k - 1)
            if blocks is None:
                log.debug("draft KV full: uid %d drafts nothing this step", uid)
                if fresh:  # the runner never heard of it
                    self._held.pop(uid)
                    self.blocks.free(uid)
                else:
                    self.drop(uid)
                continue
            placed.append((row, fresh, trim, blocks))
        return placed

    def _evict(self, keep: set[int]) -> None:
        for uid in [u for u in self._held if u not in keep]:
            self.drop(uid)

    def _plan(self, chunks: list[Chunk], new=(), tables=(), trims=()) -> StepPlan:
        removed, self._removed = tuple(self._removed), []
        return StepPlan(next(self._step_ids), new=tuple(new), chunks=tuple(chunks), removed=removed,
                        tables=tuple(tables), trims=tuple(trims), num_blocks=self.blocks.high_water)

    def _sample(self, result, rows: dict[int, DraftRow], drafts: dict[int, list[int]],
                probs: dict[int, list[mx.array]]) -> None:
        """One draft per row of `result`, drawn from the processed draft distribution (batched: one eval)."""
        picks, qs = [], []
        all_logits = self._in_target_vocab(result.logits)
        for i, uid in enumerate(result.uids):
            row = rows[uid]
            logits = process_logits(all_logits[i], row.state, tuple(drafts[uid]))
            if row.state.params.greedy:
                picks.append(mx.argmax(logits))
                qs.append(None)
            else:
                filtered = filter_logits(logits, row.state.params)
                picks.append(mx.random.categorical(filtered, key=row.state.next_key()))
                qs.append(mx.softmax(filtered))
        tokens = mx.stack(picks)
        mx.eval(tokens, *[q for q in qs if q is not None])
        for uid, token, q in zip(result.uids, tokens.tolist(), qs):
            drafts[uid].append(token)
            if q is not None:
                probs[uid].append(q)

    def _in_target_vocab(self, logits: mx.array) -> mx.array:
        """Rows of the target's width: padding rows past it cut, those it has beyond the draft's never drawn."""
        have = logits.shape[-1]
        if self.vocab_size is None or have == self.vocab_size:
            return logits
        if have > self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = mx.full((logits.shape[0], self.vocab_size - have), -mx.inf, dtype=logits.dtype)
        return mx.concatenate([logits, pad], axis=-1)

    def drop(self, uid: int) -> None:
        """A sequence ended (or was evicted): free its draft KV; runners learn at the next draft step."""
        if self._held.pop(uid, None) is not None:
            self.blocks.free(uid)
            self._removed.append(uid)

    def reset(self) -> None:
        """After an engine failure: forget every sequence (the pools stay allocated)."""
        self.rank.reset()
        self.blocks = BlockManager(self.blocks.num_blocks, self.rank.block_size)
        self._held.clear()
        self._removed.clear()


def load_draft(spec: SpeculativeConfig, model_cfg: ModelConfig, target, kv_budget: int, block_size: int) -> DraftModel:
    """Load `--draft-model` for `target` (a LoadedModel) on this process alone; refuse a draft whose
    tokenizer or vocabulary differs from the target's (its ids would mean other tokens)."""
    from dataclasses import replace

    from meshlm.executor.rank import build_rank
    from meshlm.model.loader import load_model

    cfg = replace(model_cfg, path=spec.draft_model, served_name=None, max_model_len=None, adapter_path=None)
    loaded = load_model(cfg)
    problem = tokenizer_mismatch(loaded, target)
    if problem:
        raise ValueError(f"--draft-model {spec.draft_model}: {problem}; a draft must use the target's tokenizer")
    try:
        rank = build_rank(loaded, cfg, CacheConfig(enabled=False, ssd=False, block_size=block_size), kv_budget)
    except ValueError as exc:  # the budget's message names the target's flag: say whose blocks they were
        raise ValueError(f"--draft-model {spec.draft_model}: its KV: {exc}") from None
    log.info("draft model %s: %d KV blocks of %d tokens at most, context %d", loaded.path, rank.max_blocks,
             rank.block_size, loaded.context_length)
    return DraftModel(rank, rank.max_blocks, loaded.context_length, target.vocab_size)


def tokenizer_mismatch(draft, target) -> str | None:
    """Why `draft`'s token ids cannot be verified by `target` (None: they can). The embeddings may have
    other numbers of rows (a family's small and large models pad theirs differently, as Qwen2.5's 0.5B
    and 7B) as long as every id the shared tokenizer makes has a row in both."""
    vocab_d, vocab_t = _vocab(draft.tokenizer), _vocab(target.tokenizer)
    if vocab_d != vocab_t:
        differ = sorted(set(vocab_d.items()) ^ set(vocab_t.items()), key=lambda kv: kv[1])[:3]
        return f"its tokenizer maps tokens to other ids (e.g. {differ})"
    top = max(vocab_t.values(), default=-1)
    if draft.vocab_size != target.vocab_size and top >= min(draft.vocab_size, target.vocab_size):
        return (f"its vocabulary has {draft.vocab_size} ids, the target's {target.vocab_size}, and the "
                f"tokenizer uses ids up to {top}")
    return None


def _vocab(tokenizer) -> dict[str, int]:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return dict(inner.get_vocab())
