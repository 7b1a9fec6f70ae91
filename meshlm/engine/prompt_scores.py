"""Prompt logprobs: each prompt token's logprob given the tokens before it (the leader only).

vLLM's `prompt_logprobs`, and what OpenAI's completions return with `echo` and
`logprobs` (lm-eval's loglikelihood). A sequence that asks for them is computed
whole, without prefix-cache hits, and its prompt chunks return every
position's logits (scheduler `_chunk`, `LOGITS_ALL`). The leader takes those
rows out of the step's result before anything samples: a chunk that does not
reach the sequence's end samples nothing, one that does only from its last row.
Scores come from the raw logits (vLLM's default): no penalty, bias, mask or
temperature, which shape only what is generated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from meshlm.engine.plan import LOGITS_ALL, StepPlan
from meshlm.engine.request import Sequence, TokenLogprob
from meshlm.engine.sampler import top_alternatives
from meshlm.model.runner import StepResult


@dataclass
class Scores:
    """One chunk's scores of consecutive prompt tokens, evaluating with the step."""

    uid: int
    first: int  # the prompt index of the token the first row scores
    token_ids: list[int]
    chosen: mx.array  # (rows,) each token's logprob
    ranks: mx.array  # (rows,) 1 + how many tokens were likelier
    top_ids: mx.array | None  # (rows, k), likeliest first; None when k is 0
    top_values: mx.array | None

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.ranks, self.top_ids, self.top_values) if a is not None]

    def read(self) -> list[TokenLogprob]:
        """The scores as logprob entries (waits for them)."""
        mx.eval(self.arrays)
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else [[]] * len(chosen)
        values = self.top_values.tolist() if self.top_values is not None else [[]] * len(chosen)
        return [TokenLogprob(t, lp, top_alternatives(i, v), rank)
                for t, lp, rank, i, v in zip(self.token_ids, chosen, ranks, ids, values)]


def take_scores(plan: StepPlan, result: StepResult,
                sequence: Callable[[int], Sequence | None]) -> tuple[StepResult, list[Scores]]:
    """Split a step's result: the scores of the prompt tokens its scoring chunks reached (lazy), and the
    result to sample from, which keeps of each scoring chunk only the row that samples, if any.
    `sequence`: a uid's sequence, None for one that ended meanwhile (its rows are left for the sampler,
    which drops them)."""
    rows_of: dict[int, list[int]] = {}
    for i, uid in enumerate(result.uids):
        rows_of.setdefault(uid, []).append(i)
    scoring: dict[int, int | None] = {}  # uid -> the row that samples
    scores: list[Scores] = []
    for c in plan.chunks:
        seq = sequence(c.uid)
        rows = rows_of.get(c.uid)
        if (c.logits != LOGITS_ALL or seq is None or rows is None or seq.params.prompt_logprobs is None
                or c.verifies(seq.num_tokens)):
            continue
        end = c.start + len(c.token_ids)
        if len(rows) != len(c.token_ids):
            raise ValueError(f"step {plan.step_id}: {len(rows)} logit rows for uid {c.uid}'s chunk of "
                             f"{len(c.token_ids)} positions")
        scoring[c.uid] = rows[-1] if end == seq.num_tokens else None
        # Position p's logits score prompt token p + 1; those scored before (a recompute) are not again.
        lo, hi = max(seq.scored - 1, c.start), min(end, len(seq.prompt_ids) - 1)
        if lo < hi:
            scores.append(_score(result.logits, rows[lo - c.start : hi - c.start], seq.prompt_ids[lo + 1 : hi + 1],
                                 seq.params.prompt_logprobs, c.uid, lo + 1))
    if not scoring:
        return result, []
    keep = [i for i, uid in enumerate(result.uids) if uid not in scoring or scoring[uid] == i]
    logits = result.logits[mx.array(keep)] if keep else None
    return dataclasses.replace(result, uids=[result.uids[i] for i in keep], logits=logits), scores


def _score(logits: mx.array, rows: list[int], token_ids: list[int], k: int, uid: int, first: int) -> Scores:
    x = logits[mx.array(rows)]
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(token_ids)[:, None], axis=-1)[:, 0]
    ranks = mx.sum(lp > chosen[:, None], axis=-1) + 1
    top_ids = top_values = None
    if k:
        k = min(k, lp.shape[-1])
        part = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]  # the k likeliest, unordered: no full sort
        values = mx.take_along_axis(lp, part, axis=-1)
        order = mx.argsort(-values, axis=-1)
        top_ids = mx.take_along_axis(part, order, axis=-1)
        top_values = mx.take_along_axis(values, order, axis=-1)
    return Scores(uid, first, list(token_ids), chosen, ranks, top_ids, top_values)
