"""The engine's speculative-decoding side: which decoding sequences speculate this step, with which
drafts, and what verification told us (leader only; workers only ever see the drafts in a plan).

Per step: `propose` picks drafts for the decoding sequences (none above
`--speculative-max-batch-size`, none for a request that turned it off, none
where the policy says the drafts would not pay, never past max_tokens or the
context); the scheduler runs each as one chunk of current token + drafts with
logits for every position; `verified` records the outcome (metrics, the
sequence's acceptance); `generated` feeds every sequence's new tokens to its
shadow proposal.

With a draft model, the drafts come from one batched call for all speculating
rows (spec/draft.py), whose time counts against the gain; a sequence the
policy has stopped is tried again after PROBE_STEPS steps (then twice as
long after each probe that did not pay), since measuring a model draft in
the shadow would cost the forwards speculation is saving.
"""

from __future__ import annotations

import logging
from typing import Callable

import mlx.core as mx

from meshlm.config import SpeculativeConfig
from meshlm.engine.request import Sequence
from meshlm.engine.sampler import SeqSampling
from meshlm.metrics import Metrics
from meshlm.spec.draft import DraftModel, DraftRow
from meshlm.spec.ngram import NgramProposer
from meshlm.spec.policy import MAX_PROBE_STEPS, PROBE_STEPS, Acceptance, StepCost, worth_it

log = logging.getLogger(__name__)
# A draft model failing this many times in a row is given up: the server decodes plainly from then on.
MAX_DRAFT_FAILURES = 3


class Speculator:
    def __init__(self, config: SpeculativeConfig, metrics: Metrics, max_model_len: int,
                 draft: DraftModel | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        self.draft = draft
        self.cost = StepCost()
        self._seqs: dict[int, Acceptance] = {}
        self._probs: dict[int, mx.array] = {}  # this step's draft distributions (sampled rows of a model draft)
        self._drafting = 0.0  # seconds the draft model took before this step
        self._draft_failures = 0  # in a row

    def propose(self, running: list[Sequence],
                sampling: Callable[[int], SeqSampling | None]) -> dict[int, tuple[int, ...]]:
        """Drafts per uid for this step. Each decoding row runs one token without drafts: the step's
        R rows and T tokens of the cost model are both len(decoding). `sampling(uid)`: the sequence's
        sampling state (None once it ended), which a draft model samples with."""
        self._probs, self._drafting = {}, 0.0
        decoding = [s for s in running if s.remaining == 1 and not s.finished and not s.aborted]
        if not decoding or len(decoding) > self.config.max_batch_size:
            return {}
        candidates = []
        most = self.config.num_tokens if self.draft is not None else self.config.grown_num_tokens
        for seq in decoding:
            if not seq.params.speculative:
                continue
            k = min(most, seq.params.max_tokens - len(seq.output_ids) - 1, self.max_model_len - seq.num_tokens - 1)
            if self.draft is not None:
                k = min(k, self.draft.room(seq))
            if k > 0:
                candidates.append((seq, k))
        if self.draft is not None:
            return self._propose_draft(candidates, len(decoding), sampling)
        return self._propose_ngram(candidates, len(decoding), sampling)

    def _propose_ngram(self, candidates: list[tuple[Sequence, int]], rows: int,
                       sampling: Callable[[int], SeqSampling | None]) -> dict[int, tuple[int, ...]]:
        ratio = self.cost.slope_ratio()
        drafts: dict[int, tuple[int, ...]] = {}
        base = self.config.num_tokens
        for seq, k in candidates:
            acc = self._seqs.setdefault(seq.uid, Acceptance())
            proposal = tuple(self.proposer.propose(seq.uid, seq.tokens, min(k, acc.k or base)))
            state = sampling(seq.uid) if proposal else None
            if state is not None and state.constraint is not None:
                # A point-mass draft the grammar forbids is surely rejected: verifying it is wasted work.
                proposal = proposal[: state.constraint.valid_prefix(proposal)]
            if not proposal:
                continue
            if self.config.adaptive and not worth_it(acc.alpha, len(proposal), rows, rows, ratio):
                if len(proposal) > base and worth_it(acc.alpha, base, rows, rows, ratio):
                    proposal = proposal[:base]  # grown too far for what this sequence accepts
                else:
                    if not acc.shadow:
                        acc.shadow, acc.matched = proposal, 0
                    continue
            acc.shadow, acc.matched = (), 0  # the verify step measures it now
            drafts[seq.uid] = proposal
        return drafts

    def _propose_draft(self, candidates: list[tuple[Sequence, int]], rows: int,
                       sampling: Callable[[int], SeqSampling | None]) -> dict[int, tuple[int, ...]]:
        coefficients = self.cost.coefficients()
        ratio = self.cost.slope_ratio()
        extra = self.draft.seconds / coefficients[0] if coefficients else 0.0
        batch = []
        for seq, k in candidates:
            state = sampling(seq.uid)
            if state is None:
                continue
            acc = self._seqs.setdefault(seq.uid, Acceptance())
            if self.config.adaptive and not worth_it(acc.alpha, k, rows, rows, ratio, extra):
                acc.idle += 1
                if acc.idle < acc.probe_after:
                    continue
                acc.probe_after = min(2 * acc.probe_after, MAX_PROBE_STEPS)  # probes that keep failing: rarer
            else:
                acc.probe_after = PROBE_STEPS
            acc.idle = 0
            batch.append(DraftRow(seq, state, k))
        if not batch or self._draft_failures >= MAX_DRAFT_FAILURES:
            return {}
        try:
            drafted = self.draft.propose(batch)
        except Exception:  # drafts only ever save time: the target decodes plainly instead of failing
            self._draft_failed()
            return {}
        self._draft_failures = 0
        self._drafting = self.draft.last_seconds
        self._probs = {uid: d.probs for uid, d in drafted.items() if d.probs is not None}
        return {uid: d.tokens for uid, d in drafted.items() if d.tokens}

    def draft_probs(self, uid: int, k: int) -> mx.array | None:
        """q for the first `k` drafts of `uid` this step (None: greedy or an n-gram point mass)."""
        q = self._probs.get(uid)
        return None if q is None else q[:k]

    def _draft_failed(self) -> None:
        """Verification keeps the output exact whatever the drafts, so a failing draft model costs speed,
        never requests (it failed the engine, and a cluster for good). It starts afresh; after
        MAX_DRAFT_FAILURES in a row it is given up."""
        self._draft_failures += 1
        self._probs, self._drafting = {}, 0.0
        given_up = self._draft_failures >= MAX_DRAFT_FAILURES
        log.exception("the draft model failed (%d in a row); this step decodes plainly%s", self._draft_failures,
                      ", and so does every later one" if given_up else "")
        try:
            self.draft.reset()
        except Exception:
            log.exception("the draft model could not be reset; it is given up")
            self._draft_failures = MAX_DRAFT_FAILURES

    def verified(self, uid: int, drafted: int, accepted: int) -> None:
        """The policy's view of one verify: every match weighs, whatever a stop later drops."""
        acc = self._seqs.setdefault(uid, Acceptance())
        acc.observe(accepted, accepted < drafted)
        base = self.config.num_tokens
        if accepted < drafted:
            acc.k = base
        elif drafted >= (acc.k or base):  # a full proposal, all accepted: the text is being copied
            acc.k = min(2 * drafted, self.config.grown_num_tokens)

    def count(self, drafted: int, accepted: int, emitted: int) -> None:
        """The metrics of one verify, once the engine knows how many of its tokens were `emitted` (shown):
        those after a stop (an EOS, a stop token, a stop string) are dropped, and counting them made
        accepted exceed emitted."""
        m = self.metrics
        m.spec_verifies.inc()
        m.spec_drafted.inc(drafted)
        kept = min(accepted, emitted)
        m.spec_accepted.inc(kept)
        m.spec_emitted.inc(emitted)
        for pos in range(kept):
            m.spec_accepted_at.labels(position=str(pos)).inc()

    def generated(self, uid: int, tokens: list[int]) -> None:
        acc = self._seqs.get(uid)
        if acc is not None and acc.shadow:
            acc.follow(tokens)

    def step_done(self, tokens: int, seconds: float, verified: bool) -> None:
        """One step's time, from the end of the previous step: the draft model's part is not the target's."""
        seconds = max(seconds - self._drafting, 1e-6)
        self.cost.record(tokens, seconds)
        if verified:
            self.metrics.spec_verify_step_time.observe(seconds)

    def drop(self, uid: int) -> None:
        self._seqs.pop(uid, None)
        self.proposer.drop(uid)
        if self.draft is not None:
            self.draft.drop(uid)

    def reset(self) -> None:
        """After an engine failure every sequence is gone, on the draft too."""
        for uid in list(self._seqs):
            self.drop(uid)
        if self.draft is not None:
            self.draft.reset()
