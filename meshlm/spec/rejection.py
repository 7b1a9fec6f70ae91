"""Verification of drafted tokens against the target's logits (leader only).

A speculating row ran its current token plus K drafts in one forward, so it
has K + 1 rows of logits: row j is the target's distribution for the token
after draft j (row 0: after the current token). Each row is processed exactly
as plain decoding would process it at that position: logit bias, the
min_tokens ban and the penalties see the drafts before it as generated
(they are, if row j is reached at all), then temperature, top-k, min-p and
top-p (engine/sampler.py's own functions).

- Greedy: accept drafts while each equals the argmax of its row; the argmax of
  the first row that disagrees (or of the last row, when all agree) is the
  target's own next token. The text is exactly plain greedy decoding's.
- Sampling: standard speculative sampling (Leviathan et al. 2023, Chen et al.
  2023): accept draft j with probability min(1, p_j(d_j) / q_j(d_j)); at the
  first rejection sample from normalize(max(0, p_j - q_j)); when every draft
  is accepted, sample a bonus token from p_K. The emitted tokens are then
  distributed exactly as plain sampling's. An n-gram draft is a point mass
  (q_j(d_j) = 1), so acceptance is p_j(d_j) and the residual is p_j without d_j.
- Seeded sampling: row j draws the target's own token with the key plain
  decoding would draw output token j with (`SeqSampling.token_key`), and
  drafts are accepted while they equal those draws, as greedy's argmaxes. The
  text is then exactly plain seeded sampling's, whatever the drafts, the
  batch or the load (with rejection sampling a seeded request drew other
  numbers on a step that verified, and whether a step verifies depends on
  other traffic). Each token is still drawn from p_j. For an n-gram draft the
  acceptance is p_j(d_j), as rejection sampling's; for a model draft it is
  sum(p q), below rejection sampling's sum(min(p, q)): the price of
  reproducibility.

Everything for a batch of rows is built lazily and evaluated once.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from meshlm.engine.request import TokenLogprob
from meshlm.engine.sampler import (NOTHING_TO_SAMPLE, SeqSampling, filter_logits, host_argmax, left_to_sample,
                                   may_exclude_all, process_logits, reads_on_host, top_alternatives)


@dataclass(frozen=True)
class Proposal:
    """One speculating row: its target logits (K + 1, vocab), its K drafts, and the draft's
    distributions (K, vocab) when they came from a model (None: an n-gram point mass)."""

    logits: mx.array
    drafts: tuple[int, ...]
    state: SeqSampling
    draft_probs: mx.array | None = None


@dataclass(frozen=True)
class Verified:
    tokens: list[int]  # accepted drafts, then the target's own token: 1..K+1 tokens
    accepted: int  # drafts accepted
    logprobs: list[TokenLogprob] | None = None  # per emitted token, when the request asked for them


def verify(proposals: list[Proposal], on_host: bool = False) -> list[Verified]:
    """Accept or reject every row's drafts; updates each row's sampling state (counts, PRNG key).
    `on_host`: a `plain_greedy` row's argmaxes are read on the host (engine/sampler.py's `host_argmax`)."""
    for p in proposals:
        if p.logits.shape[0] != len(p.drafts) + 1:
            raise ValueError(f"{p.logits.shape[0]} rows of logits for {len(p.drafts)} drafts")
    graphs = [_HostGreedy(p.logits) if reads_on_host(p.logits, [p.state], on_host) else _graph(p)
              for p in proposals]
    mx.eval([a for g in graphs for a in g.arrays])
    decided = [g.decide(p.drafts) for p, g in zip(proposals, graphs)]
    # Rows whose constraints may leave no token: each emitted token's processed logit must be finite, or
    # the row takes none and its state's `fault` ends it with a 400 (as `sampler.take`).
    checks = {i: mx.stack([left_to_sample(g.rows[j], mx.array(t)) for j, t in enumerate(tokens)])
              for i, ((tokens, _), p, g) in enumerate(zip(decided, proposals, graphs))
              if not isinstance(g, _HostGreedy) and may_exclude_all(p.state)}
    mx.eval(list(checks.values()))
    out = []
    for i, (p, g) in enumerate(zip(proposals, graphs)):
        tokens, accepted = decided[i]
        if i in checks and not all(checks[i].tolist()):
            p.state.fault = NOTHING_TO_SAMPLE
            out.append(Verified(tokens, accepted))
            continue
        p.state.record(tokens)
        out.append(Verified(tokens, accepted, _logprobs(g.rows, tokens, p.state) if p.state.params.logprobs
                            is not None else None))
    return out


@dataclass
class _Targets:
    """Drafts accepted while they equal the target's own token per row: its argmax, or a seeded row's
    draw with that position's key."""

    targets: mx.array  # (K + 1,)
    rows: list[mx.array]

    @property
    def arrays(self) -> list[mx.array]:
        return [self.targets]

    def decide(self, drafts: tuple[int, ...]) -> tuple[list[int], int]:
        return _accept_greedy(drafts, self.targets.tolist())


@dataclass
class _HostGreedy:
    """A `plain_greedy` row (no logprobs, so no processed rows to keep): the argmax of its raw logits,
    taken on the host."""

    logits: mx.array  # (K + 1, vocab)

    @property
    def arrays(self) -> list[mx.array]:
        return [self.logits]

    def decide(self, drafts: tuple[int, ...]) -> tuple[list[int], int]:
        return _accept_greedy(drafts, host_argmax(self.logits))


def _accept_greedy(drafts: tuple[int, ...], targets: list[int]) -> tuple[list[int], int]:
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return list(drafts[:a]) + [targets[a]], a


@dataclass
class _Stochastic:
    accept: mx.array  # (K,) bool: u_j < min(1, p_j(d_j) / q_j(d_j))
    residual: mx.array  # (K,) a token drawn from normalize(max(0, p_j - q_j)) per position
    bonus: mx.array  # () a token drawn from p_K
    rows: list[mx.array]

    @property
    def arrays(self) -> list[mx.array]:
        return [self.accept, self.residual, self.bonus]

    def decide(self, drafts: tuple[int, ...]) -> tuple[list[int], int]:
        accept = self.accept.tolist() if drafts else []
        a = 0
        while a < len(drafts) and accept[a]:
            a += 1
        last = self.bonus.item() if a == len(drafts) else self.residual.tolist()[a]
        return list(drafts[:a]) + [last], a


def _graph(p: Proposal) -> _Targets | _Stochastic:
    k = len(p.drafts)
    c = p.state.constraint
    rows = [process_logits(p.logits[j], p.state, p.drafts[:j], c.allowed(j, p.drafts) if c else None)
            for j in range(k + 1)]
    params = p.state.params
    if params.greedy:
        return _Targets(mx.argmax(mx.stack(rows), axis=-1), rows)
    filtered = mx.stack([filter_logits(r, params) for r in rows])  # (K + 1, vocab), -inf outside the kept set
    if params.seed is not None:
        return _Targets(mx.stack([mx.random.categorical(filtered[j], key=p.state.token_key(j))
                                  for j in range(k + 1)]), rows)
    probs = mx.softmax(filtered, axis=-1)
    bonus = mx.random.categorical(filtered[k], key=p.state.next_key())
    if k == 0:
        return _Stochastic(mx.zeros((0,), dtype=mx.bool_), mx.zeros((0,), dtype=mx.uint32), bonus, rows)
    d = mx.array(p.drafts, dtype=mx.int32)
    p_d = mx.take_along_axis(probs[:k], d[:, None], axis=-1)[:, 0]
    if p.draft_probs is None:
        ratio = p_d
        residual = mx.where(mx.arange(probs.shape[-1])[None] == d[:, None], 0.0, probs[:k])
    else:
        q = p.draft_probs
        q_d = mx.take_along_axis(q, d[:, None], axis=-1)[:, 0]
        ratio = mx.minimum(1.0, p_d / mx.maximum(q_d, 1e-30))
        residual = mx.maximum(probs[:k] - q, 0.0)
    # A residual with no mass left arises only by rounding (q >= p at every token, where acceptance was all
    # but certain); its draw from log(0) everywhere was uniform over the whole vocabulary. Its limit is p.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, probs[:k])
    u = mx.random.uniform(shape=(k,), key=p.state.next_key())
    # log(0) = -inf excludes a token
    res_tokens = mx.random.categorical(mx.log(residual), axis=-1, key=p.state.next_key())
    return _Stochastic(u < ratio, res_tokens, bonus, rows)


def _logprobs(rows: list[mx.array], tokens: list[int], state: SeqSampling) -> list[TokenLogprob]:
    """Logprobs of the emitted tokens under the processed target rows (as plain decoding reports them)."""
    k = state.params.logprobs or 0
    parts = []
    for row, tok in zip(rows, tokens):
        lp = row - mx.logsumexp(row)
        top = mx.argsort(-lp)[:k] if k else mx.array([], dtype=mx.uint32)
        parts.append((lp[tok], top, lp[top] if k else mx.array([])))
    mx.eval(parts)
    return [TokenLogprob(tok, chosen.item(), top_alternatives(top.tolist(), vals.tolist()))
            for tok, (chosen, top, vals) in zip(tokens, parts)]
