"""What the engine knows of a request: sampling parameters and sequence state.

A Sequence is scheduled by token accounting: `num_computed_tokens` (tokens
whose KV is in the cache) against `num_tokens` (prompt + generated). Chunked
prefill, decode and recompute after preemption are all the same thing: schedule
the difference.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily (`SamplingParams.greedy`)


@dataclass(frozen=True)
class Reasoning:
    """A thinking model's reasoning comes before its constrained answer (--reasoning-parser): the grammar
    applies once it is over, as vLLM's structured outputs with a reasoning parser (engine/grammar.py)."""

    start: int  # `<think>`'s token id
    end: int  # `</think>`'s
    open: bool  # the prompt opened the think block: the output is reasoning from its first token


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # 0: compute the prompt (its logprobs, with `prompt_logprobs`) and generate nothing
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: prompt and output tokens' logits divided (or, if < 0, multiplied)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: when given, every other token is masked (EOS too)
    # vLLM's bad_words, tokenized: a sequence's last token is masked where the output so far ends with the rest
    bad_words: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None  # None: none; k: chosen token plus top-k alternatives
    # Of each prompt token after the first, its logprob and the top-k alternatives (vLLM's prompt_logprobs;
    # OpenAI's echo with logprobs): from the raw logits of the position before it. None: not computed.
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: a matched stop string ends the text
    skip_special_tokens: bool = True  # False: the text shows special tokens (EOS too, when it is shown)
    keep_token_ids: tuple[int, ...] = ()  # special tokens shown even so (a thinking model's think tags)
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prefix blocks
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    ignore_eos: bool = False
    speculative: bool = True  # False: this request never speculates, whatever the server does
    grammar: str | None = None  # an llguidance grammar (engine/grammar.py): output is constrained to it
    reasoning: Reasoning | None = None  # with a grammar: it applies after the reasoning

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("top_logprobs must be between 0 and 20")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError("prompt_logprobs must be between 0 and 20")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be between -100 and 100")

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE sampling is greedy in all but name, and dividing float32 logits by a
        # temperature near 1e-38 overflows to inf: the draw was then NaN, and random. vLLM cuts at 1e-5 too.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Sequence:
    """One generation stream. Owned by the scheduler; the runner sees only uids."""

    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt served from the cache at its first admission (usage's cached_tokens)
    cache_counted: bool = False  # num_cached_tokens is set (a recompute for blocks no rank loaded resets it)
    num_written_tokens: int = 0  # prompt tokens whose blocks it made findable in the prefix cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    aborted: bool = False
    num_preemptions: int = 0
    # Disaggregated prefill, on the prefill server: the prompt's blocks from this index on are handed
    # to the KV exporter as they become final (None: nothing is exported); `exported`: blocks handed so far.
    export_from: int | None = None
    exported: int = 0
    # Prompt logprobs (`params.prompt_logprobs`): the prompt tokens before this index have theirs (the
    # first token has none). Kept across a preemption, so a recompute does not report a token twice.
    scored: int = 1

    @property
    def scoring(self) -> bool:
        """Prompt tokens whose logprobs are still to be computed: each needs the logits of the position
        before it, so no prefix-cache hit may skip those positions."""
        return self.params.prompt_logprobs is not None and self.scored < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without copying the whole sequence."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def tokens(self) -> "TokenView":
        return TokenView(self)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(frozen=True)
class TokenView:
    """A sequence's prompt + output ids, sliced without concatenating them (proposers read these)."""

    seq: Sequence

    def __len__(self) -> int:
        return self.seq.num_tokens

    def __getitem__(self, s: slice) -> list[int]:
        start, stop, _ = s.indices(self.seq.num_tokens)
        return self.seq.token_slice(start, stop)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs)


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one sequence, handed from the engine to the API."""

    uid: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    # The prompt's, once (on a sequence's first output): one per prompt token after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    # vLLM's stop_reason: the stop string or the `stop_token_ids` id that ended it; None for EOS or another end
    stop_reason: str | int | None = None
    error: str | None = None
    # `error` is the request's own (a grammar that cannot go on, no token left to sample): its 400's code;
    # "" where it is the server's
    request_fault: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # prompt tokens this request added to the prefix cache (Responses' usage)
