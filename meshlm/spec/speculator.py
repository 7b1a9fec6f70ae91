"""The engine's speculative-decoding side: which decoding sequences speculate this step, with which
drafts, and what verification told us (leader only; workers only ever see the drafts in a plan).

Per step: `propose` picks drafts for the decoding sequences (none above
`--speculative-max-batch-size`, none for a request that turned it off, none
where the policy says the drafts would not pay, never past max_tokens or the
context); the scheduler runs each as one chunk of current token + drafts with
logits for every position; `verified` records the outcome (metrics, the
sequence's acceptance); `generated` feeds every sequence's new tokens to its
shadow proposal.
"""

from __future__ import annotations

from meshlm.config import SpeculativeConfig
from meshlm.engine.request import Sequence
from meshlm.metrics import Metrics
from meshlm.spec.ngram import NgramProposer
from meshlm.spec.policy import Acceptance, StepCost, worth_it


class Speculator:
    def __init__(self, config: SpeculativeConfig, metrics: Metrics, max_model_len: int) -> None:
        self.config = config
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        self.cost = StepCost()
        self._seqs: dict[int, Acceptance] = {}

    def propose(self, running: list[Sequence]) -> dict[int, tuple[int, ...]]:
        """Drafts per uid for this step. Each decoding row runs one token without drafts: the step's
        R rows and T tokens of the cost model are both len(decoding)."""
        decoding = [s for s in running if s.remaining == 1 and not s.finished and not s.aborted]
        if not decoding or len(decoding) > self.config.max_batch_size:
            return {}
        ratio = self.cost.slope_ratio()
        drafts: dict[int, tuple[int, ...]] = {}
        for seq in decoding:
            if not seq.params.speculative:
                continue
            k = min(self.config.num_tokens, seq.params.max_tokens - len(seq.output_ids) - 1,
                    self.max_model_len - seq.num_tokens - 1)
            proposal = tuple(self.proposer.propose(seq.uid, seq.tokens, max(k, 0)))
            if not proposal:
                continue
            acc = self._seqs.setdefault(seq.uid, Acceptance())
            if self.config.adaptive and not worth_it(acc.alpha, len(proposal), len(decoding), len(decoding), ratio):
                if not acc.shadow:
                    acc.shadow, acc.matched = proposal, 0
                continue
            acc.shadow, acc.matched = (), 0  # the verify step measures it now
            drafts[seq.uid] = proposal
        return drafts

    def verified(self, uid: int, drafted: int, accepted: int, emitted: int) -> None:
        acc = self._seqs.setdefault(uid, Acceptance())
        acc.observe(accepted, accepted < drafted)
        m = self.metrics
        m.spec_verifies.inc()
        m.spec_drafted.inc(drafted)
        m.spec_accepted.inc(accepted)
        m.spec_emitted.inc(emitted)
        for pos in range(accepted):
            m.spec_accepted_at.labels(position=str(pos)).inc()

    def generated(self, uid: int, tokens: list[int]) -> None:
        acc = self._seqs.get(uid)
        if acc is not None and acc.shadow:
            acc.follow(tokens)

    def step_done(self, tokens: int, seconds: float, verified: bool) -> None:
        self.cost.record(tokens, seconds)
        if verified:
            self.metrics.spec_verify_step_time.observe(seconds)

    def drop(self, uid: int) -> None:
        self._seqs.pop(uid, None)
        self.proposer.drop(uid)
