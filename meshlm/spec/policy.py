"""When speculation pays: per-sequence acceptance against the measured cost of verifying more tokens.

A step's time is modelled as a + b * T (T: tokens in the step), fitted online
from the engine's own steps. Drafting k tokens for a row costs b * k more; it
gains the drafts the target accepts, E(alpha, k) = alpha (1 - alpha^k) /
(1 - alpha) for a per-token acceptance alpha. The step as a whole emits R
tokens (one per decoding row) in a + b * T, so the drafts are worth it when

    E(alpha, k) / (b * k)  >  R / (a + b * T),

i.e. the extra tokens per extra second beat the step's own rate. At one
stream on the demo model (b/a ~ 0.1) that asks for alpha above ~0.1; at
sixteen streams, far more. alpha is tracked per sequence as accepted /
(accepted + rejections), decayed so it follows the text. A sequence that is
not speculating keeps being measured in the shadow: its proposals are
compared with the tokens it then generates, which is exactly what greedy
verification would have accepted, so it resumes when the text becomes
predictable again. A draft model's forwards cost D seconds more per step,
which joins b * k on the left (`extra` = D / a).
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight of a sequence's past per verify (or shadow) outcome
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0  # alpha starts at 0.5
PRIOR_SLOPE = 0.1  # b / a before the steps have shown otherwise (demo model, CPU, measured 2026-11-23)
COST_DECAY = 0.99
PROBE_STEPS = 16  # a sequence stopped with a model draft speculates again after this many steps,
MAX_PROBE_STEPS = 256  # ... doubling after each try that did not pay, up to this
MARGIN = 1.2  # the gain must clear the model's error: a verify row's attention costs more than a decode row's


@dataclass
class Acceptance:
    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    shadow: tuple[int, ...] = ()  # a proposal being checked against the tokens that follow
    matched: int = 0
    idle: int = 0  # steps since a model draft last ran for this sequence
    probe_after: int = PROBE_STEPS  # ... and how many to wait before trying it again
    k: int = 0  # n-gram drafts to propose next (0: the configured K), grown while every draft is accepted

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, accepted: int, rejected: bool) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if rejected else 0.0)

    def follow(self, tokens: list[int]) -> None:
        """Tokens the sequence generated; settles a pending shadow proposal."""
        for t in tokens:
            if not self.shadow:
                return
            if t == self.shadow[self.matched]:
                self.matched += 1
                if self.matched == len(self.shadow):
                    self.observe(self.matched, False)
                    self.shadow, self.matched = (), 0
            else:
                self.observe(self.matched, True)
                self.shadow, self.matched = (), 0


def expected_accepted(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k)
    return alpha * (1 - alpha**k) / (1 - alpha)


class StepCost:
    """Online least-squares fit of step seconds = a + b * tokens, with exponential forgetting."""

    def __init__(self) -> None:
        self._s = [0.0] * 5  # weight, sum x, sum y, sum xx, sum xy

    def record(self, tokens: int, seconds: float) -> None:
        x, y = float(tokens), seconds
        self._s = [COST_DECAY * s + v for s, v in zip(self._s, (1.0, x, y, x * x, x * y))]

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds per token, or None before any step."""
        n, sx, sy, sxx, sxy = self._s
        if n < 1e-9:
            return None
        mean_x, mean_y = sx / n, sy / n
        var = sxx / n - mean_x**2
        if n > 4 and var > 1.0:
            b = (sxy / n - mean_x * mean_y) / var
            a = mean_y - b * mean_x
            if a > 0 and b > 0:
                return a, b
        a = mean_y / (1 + PRIOR_SLOPE * mean_x)  # too little spread in T to tell a from b
        return a, PRIOR_SLOPE * a

    def slope_ratio(self) -> float:
        c = self.coefficients()
        return PRIOR_SLOPE if c is None else c[1] / c[0]


def worth_it(alpha: float, k: int, rows: int, tokens: int, b_over_a: float, extra: float = 0.0) -> bool:
    """Do k drafts at acceptance alpha beat plain decoding in a step of `rows` decoding rows and `tokens`
    tokens? (Both sides of the inequality in the module docstring divided by a.) `extra`: what
    proposing costs besides the verify tokens (a draft model's forwards), in units of a."""
    if k <= 0:
        return False
    return expected_accepted(alpha, k) * (1 + b_over_a * tokens) > MARGIN * (b_over_a * k + extra) * rows
