"""The sampler (leader only): turns a step's logits into tokens.

Per-sequence state lives in `SeqSampling`: the seed, from which each output
token's PRNG key is derived by the token's index alone (so a seeded request
draws the same tokens whatever else shares its batch, and whether or not a
step verified drafts: spec/rejection.py), the counts of generated tokens for
presence/frequency penalties, and what the logit processors need (the
prompt's tokens for the repetition penalty, the tokens banned until
`min_tokens`).

Order, as vLLM applies it: logit bias and the min_tokens ban, then the
repetition, frequency and presence penalties (logprobs are reported from
here), then temperature, top-k, min-p and top-p.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from meshlm.engine.grammar import Constraint
from meshlm.engine.request import SamplingParams, TokenLogprob


def _mix(seed: int, index: int) -> int:
    """splitmix64 of the seed stepped `index + 1` times: unrelated-looking 64-bit values for neighbouring
    indices and seeds."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


@dataclass
class SeqSampling:
    params: SamplingParams
    seed: int  # the request's (mod 2**64), or a random one
    counts: Counter = field(default_factory=Counter)
    prompt_ids: frozenset[int] = frozenset()  # only kept when a repetition penalty needs them
    banned: tuple[int, ...] = ()  # EOS and stop token ids, masked until min_tokens are generated
    constraint: Constraint | None = None  # the grammar's state (structured outputs)
    _only: mx.array | None = None  # `allowed_token_ids` as a mask over the vocabulary, made on first use
    recent: tuple[int, ...] = ()  # the last output tokens, as many as `bad_words` can need
    generated: int = 0  # tokens taken so far
    _key: mx.array | None = None  # next_key's chain
    fault: str | None = None  # set when the request's constraints left no token to sample (`take`)

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: list[int] = (),
               eos_token_ids: frozenset[int] = frozenset(), constraint: Constraint | None = None) -> "SeqSampling":
        # Any integer is a valid OpenAI seed; MLX keys take an unsigned 64-bit value.
        seed = params.seed % 2**64 if params.seed is not None else random.getrandbits(63)
        prompt = frozenset(prompt_ids) if params.repetition_penalty != 1 else frozenset()
        banned = tuple(sorted(set(eos_token_ids) | set(params.stop_token_ids))) if params.min_tokens else ()
        return cls(params, seed, prompt_ids=prompt, banned=banned, constraint=constraint)

    def token_key(self, ahead: int = 0) -> mx.array:
        """The key that draws output token number `generated + ahead`: a function of the seed and that
        index alone, however many keys other draws took (a verify step's, a draft model's)."""
        return mx.random.key(_mix(self.seed, self.generated + ahead))

    def next_key(self) -> mx.array:
        """A fresh key for draws that decide no output token by themselves (a draft model's drafts,
        rejection sampling's uniforms and residuals)."""
        if self._key is None:
            self._key = mx.random.key(_mix(self.seed, -1))
        self._key, sub = mx.random.split(self._key)
        return sub

    def only(self, vocab: int) -> mx.array | None:
        """`allowed_token_ids` as a bool mask over `vocab` ids, or None when not given."""
        if not self.params.allowed_token_ids:
            return None
        if self._only is None:
            bits = np.zeros(vocab, dtype=np.bool_)
            bits[[t for t in self.params.allowed_token_ids if t < vocab]] = True
            self._only = mx.array(bits)
        return self._only

    def banned_words(self, ahead: tuple[int, ...] = ()) -> list[int]:
        """The tokens `bad_words` forbid next, after the output so far and `ahead`."""
        tail = self.recent + ahead
        return [w[-1] for w in self.params.bad_words
                if len(w) == 1 or (len(tail) >= len(w) - 1 and tail[len(tail) - len(w) + 1:] == w[:-1])]

    def record(self, tokens: list[int]) -> None:
        """The tokens a step took: counted for the penalties, consumed by the grammar."""
        for t in tokens:
            self.counts[t] += 1
        self.generated += len(tokens)
        if self.params.bad_words:
            keep = max(len(w) for w in self.params.bad_words) - 1
            self.recent = (self.recent + tuple(tokens))[-keep:] if keep else ()
        if self.constraint is not None:
            self.constraint.advance(tokens)


def process_logits(row: mx.array, state: SeqSampling, ahead: tuple[int, ...] = (),
                   allowed: tuple[mx.array, bool] | None = None) -> mx.array:
    """The grammar's mask, allowed_token_ids, logit bias, the min_tokens ban and the penalties, for one row. `ahead`:
    tokens taken after the state's (accepted drafts before this position), counted as if already
    generated. `allowed`: the constraint's (mask, ends) for this position."""
    p = state.params
    counts = state.counts
    ends = False
    if allowed is not None:
        mask, ends = allowed
        row = mx.where(mask, row, mx.array(-float("inf"), dtype=row.dtype))
    only = state.only(row.shape[-1])
    if only is not None:
        row = mx.where(only, row, mx.array(-float("inf"), dtype=row.dtype))
    if ahead and (p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0):
        counts = counts + Counter(ahead)
    if p.bad_words and (bad := state.banned_words(ahead)):
        row = row.at[mx.array(bad)].add(-float("inf"))
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        row = row.at[mx.array(ids)].add(mx.array(bias, dtype=row.dtype))
    if state.banned and state.generated + len(ahead) < p.min_tokens and not ends:  # a complete grammar wins
        banned = row.at[mx.array(state.banned)].add(-float("inf"))
        # So does a grammar (or allowed_token_ids) that allows nothing but banned tokens: no token would be left.
        row = banned if allowed is None and only is None else mx.where(banned.max() > -float("inf"), banned, row)
    if p.repetition_penalty != 1 and (counts or state.prompt_ids):
        ids = mx.array(sorted(state.prompt_ids | counts.keys()))
        picked = row[ids]
        scaled = mx.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        # A token the grammar or the ban made -inf stays so: its change would be -inf - -inf, NaN.
        row = row.at[ids].add(mx.where(picked > -float("inf"), scaled - picked, 0.0))
    if counts and (p.presence_penalty != 0 or p.frequency_penalty != 0):
        ids = mx.array(list(counts.keys()))
        values = mx.array(list(counts.values()), dtype=mx.float32)
        row = row.at[ids].add(-(p.presence_penalty + p.frequency_penalty * values))
    return row


def filter_logits(row: mx.array, p: SamplingParams) -> mx.array:
    """Apply temperature, top-k, top-p and min-p to one row of logits."""
    row = row / p.temperature
    neg_inf = mx.array(-float("inf"), dtype=row.dtype)
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = mx.sort(row)[-p.top_k]
        row = mx.where(row < kth, neg_inf, row)
    if p.min_p > 0:
        probs = mx.softmax(row)
        row = mx.where(probs < p.min_p * probs.max(), neg_inf, row)
    if p.top_p < 1:
        probs = mx.softmax(row)
        sorted_probs = mx.sort(probs)[::-1]
        # Keep the smallest prefix whose mass reaches top_p, the first token always: a top_p below the
        # probabilities' smallest value (5e-324 in float32 is 0) kept none, and id 0 was drawn every time.
        before = mx.cumsum(sorted_probs) - sorted_probs
        keep = (before < p.top_p) | (mx.arange(before.shape[-1]) == 0)
        cutoff = mx.where(keep, sorted_probs, mx.array(2.0)).min()
        row = mx.where(probs < cutoff, neg_inf, row)
    return row


@dataclass
class Draw:
    """A step's tokens, sampled on the device and not yet read: the next step's forward may take them as
    its input before they are known (engine.py, asynchronous scheduling)."""

    tokens: mx.array  # (rows,) the sampled ids, lazy
    logprob_parts: list[mx.array]  # three per row that wants logprobs (`_logprob_graph`)
    states: list[SeqSampling]
    want_lp: list[int]  # rows whose logprobs are reported
    # Rows whose constraints may leave no token (`may_exclude_all`), and lazily whether each had one
    # (`left_to_sample`); None when no row is checked
    checked: list[int]
    possible: mx.array | None


NOTHING_TO_SAMPLE = ("no token is left to sample: this request's allowed_token_ids, bad_words and structured "
                     "output together exclude every token of the vocabulary")


def may_exclude_all(state: "SeqSampling") -> bool:
    """Whether a row's constraints could leave it no token (what `left_to_sample` then checks)."""
    p = state.params
    return bool(state.constraint is not None or p.allowed_token_ids or p.bad_words)


def left_to_sample(row: mx.array, token: mx.array) -> mx.array:
    """Whether a row had a token to sample: the chosen one's processed logit is above -inf. A row that
    allowed_token_ids, bad_words and a grammar left all -inf (or a penalty turned NaN) still yields an
    argmax or a categorical draw, a token outside everything the request allowed."""
    return row[token] > -float("inf")


def draw(logits: mx.array, states: list[SeqSampling]) -> Draw:
    """Build the sampling graph of one token per row. `logits` is (rows, vocab) float32; `states` one per
    row. Each row draws with its next token's key (`SeqSampling.token_key`)."""
    rows = [process_logits(logits[i], s, allowed=s.constraint.allowed() if s.constraint else None)
            for i, s in enumerate(states)]
    tokens = []
    for row, s in zip(rows, states):
        if s.params.greedy:
            tokens.append(mx.argmax(row))
        else:
            tokens.append(mx.random.categorical(filter_logits(row, s.params), key=s.token_key()))
    tokens_arr = mx.stack(tokens)
    want_lp = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    checked = [i for i, s in enumerate(states) if may_exclude_all(s)]
    possible = mx.stack([left_to_sample(rows[i], tokens[i]) for i in checked]) if checked else None
    d = Draw(tokens_arr, _logprob_graph(rows, tokens_arr, states, want_lp), states, want_lp, checked, possible)
    # Launched on its own: MLX signals an evaluation's arrays together at its end, so were the draw first
    # evaluated inside the next step's forward (which takes its tokens), reading them would wait for that
    # whole forward, and under tensor parallelism for ever (the workers wait for these ids to join it).
    mx.async_eval(d.tokens, *d.logprob_parts, *([d.possible] if d.possible is not None else []))
    return d


def take(d: Draw, record: list[bool] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """Read a draw's tokens and logprobs (waiting for them) and record the tokens in each row's state
    (`record`: in the rows it marks only; a row whose token will not be kept records nothing). A row
    with no token left records none and sets its state's `fault`: the engine ends it with a 400."""
    mx.eval(d.tokens, *d.logprob_parts, *([d.possible] if d.possible is not None else []))
    ids = d.tokens.tolist()
    empty = {i for i, ok in zip(d.checked, d.possible.tolist() if d.possible is not None else []) if not ok}
    for i, (tok, s) in enumerate(zip(ids, d.states)):
        if record is not None and not record[i]:
            continue
        if i in empty:
            s.fault = NOTHING_TO_SAMPLE
        else:
            s.record([tok])
    logprobs: list[TokenLogprob | None] = [None] * len(d.states)
    for j, i in enumerate(d.want_lp):
        chosen, top_ids, top_vals = d.logprob_parts[3 * j : 3 * j + 3]
        top = top_alternatives(top_ids.tolist(), top_vals.tolist())
        logprobs[i] = TokenLogprob(ids[i], chosen.item(), top)
    return ids, logprobs


def sample(logits: mx.array, states: list[SeqSampling],
           on_host: bool = False) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample one token per row. `logits` is (rows, vocab) float32; `states` one per row. `on_host`:
    when every row is `plain_greedy`, take the argmax on the host (`host_argmax`, the CPU device's seam)."""
    if reads_on_host(logits, states, on_host):
        ids = host_argmax(logits)
        for tok, s in zip(ids, states):
            s.record([tok])
        return ids, [None] * len(states)
    return take(draw(logits, states))


def plain_greedy(state: SeqSampling) -> bool:
    """Greedy with nothing to apply to the logits and no logprobs to report: the token is the raw
    logits' argmax."""
    p = state.params
    return (p.greedy and state.constraint is None and not p.logit_bias and not state.banned
            and not p.allowed_token_ids and not p.bad_words
            and p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0
            and p.logprobs is None)


def reads_on_host(logits: mx.array, states: list[SeqSampling], on_host: bool) -> bool:
    """Whether the tokens of these rows (all `plain_greedy`, float32) are taken by `host_argmax`."""
    return on_host and logits.dtype == mx.float32 and all(plain_greedy(s) for s in states)


def host_argmax(logits: mx.array) -> list[int]:
    """Each row's argmax (ties to the lowest id, as `mx.argmax`), read with numpy from the evaluated
    float32 array. MLX's CPU argmax is a scalar loop: 0.33 ms for 8 x 49,152 logits on one core here,
    numpy's 0.017 ms, and on a pipeline's leader that time delays every stage's next step."""
    mx.eval(logits)
    return np.asarray(logits).argmax(axis=-1).tolist()


def top_alternatives(ids: list[int], values: list[float]) -> tuple[tuple[int, float], ...]:
    """The top-k (id, logprob) pairs, without tokens a mask made impossible (-inf is not JSON, and a
    token the grammar or the bias forbids is no alternative)."""
    return tuple((i, v) for i, v in zip(ids, values) if v != float("-inf"))


def _logprob_graph(rows, tokens, states, want):
    parts = []
    for i in want:
        lp = rows[i] - mx.logsumexp(rows[i])
        k = states[i].params.logprobs or 0
        top_ids = mx.argsort(-lp)[:k] if k else mx.array([], dtype=mx.uint32)
        parts += [lp[tokens[i]], top_ids, lp[top_ids] if k else mx.array([])]
    return parts
