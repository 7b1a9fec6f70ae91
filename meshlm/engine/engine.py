"""The engine: owns the scheduler and the step loop, on its own thread.

Each step is five moves (after nano-vllm): schedule, execute, sample, update,
emit. The HTTP layer talks to it only through `submit` and `abort`, both
thread-safe, and receives `StepOutput`s through the callback it passed in.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

import mlx.core as mx

from meshlm.config import SchedulerConfig, SpeculativeConfig
from meshlm.engine.detokenizer import IncrementalDetokenizer
from meshlm.engine.grammar import Grammars
from meshlm.engine.plan import LOGITS_ALL, LOGITS_LAST, StepPlan
from meshlm.engine.prompt_scores import Scores, take_scores
from meshlm.engine.request import FinishReason, SamplingParams, Sequence, StepOutput
from meshlm.engine.scheduler import Finished, QueueFull, Scheduler
from meshlm.kv.blocks import BlockManager
from meshlm.engine.stop import StopMatcher
from meshlm.engine.step_work import StepWork
from meshlm.metrics import Metrics
from meshlm.model.runner import StepResult
from meshlm.engine.sampler import Draw, SeqSampling, draw, sample, take
from meshlm.spec.draft import DraftModel
from meshlm.spec.rejection import Proposal, verify
from meshlm.spec.speculator import Speculator
from meshlm.step_times import StepTimes

log = logging.getLogger(__name__)

OutputCallback = Callable[[StepOutput], None]
IDLE_POLL_SECONDS = 0.25
PREEMPTION_LOG_SECONDS = 60.0  # the most often the log says sequences were preempted
RESTART_BACKOFF_SECONDS = 1.0  # a failed single-process engine answers 503 this long, then serves again
CRASH_LOOP_FAILURES, CRASH_LOOP_SECONDS = 3, 60.0  # this many failures this fast: exit for a supervisor


class Executor(Protocol):
    """Runs a plan on every rank and returns rank 0's logits.

    A pipeline executor also has `depth` > 1 (plans the engine keeps in flight, one micro-batch per
    stage) and `submit(plan)`, which starts a plan on the first stages; `execute` then finishes the
    oldest submitted plan on the leader's stage; `send_ids(step_id, ids)` sends the sampled input ids of a
    plan submitted with `ids_follow` before they were known. An executor with `plans_ahead` true also takes
    `execute(plan, tokens)`: a decode plan whose input ids are the previous step's unread samples
    (asynchronous scheduling). An executor with `host_work_meanwhile` true also takes
    `execute(plan, meanwhile=f)`: it calls `f` (the leader's host work) once every other rank has the plan
    and before this rank builds its share of the step."""

    def execute(self, plan: StepPlan) -> StepResult: ...

    def missing_loads(self, plan: StepPlan, result: StepResult) -> frozenset[bytes]:
        """Keys of blocks `plan` loads that some rank could not read (`result`: its leader's), known before
        the plan's results are sampled. The engine calls it for every plan with loads, and only then."""
        ...

    def kv_bytes(self) -> int: ...

    @property
    def times(self) -> StepTimes:
        """The leader rank's time by phase (the engine adds its own host work to it)."""
        ...

    def rank_times(self) -> dict[int, tuple[float, ...]]:
        """Every rank's seconds by phase so far (workers' as of their last ACK), in PHASES order."""
        ...

    def all_reduce_stats(self) -> dict[int, tuple[int, float, float]] | None:
        """Each rank's shared-memory all-reduces, {rank: (count, seconds, seconds waiting)} (workers' as of
        their last ACK); None where there are none."""
        ...

    def idle(self) -> None:
        """Called about every IDLE_POLL_SECONDS with nothing to run (heartbeats, liveness checks)."""
        ...

    def diagnose(self, error: str) -> str:
        """What a failed step's clients are told: `error`, or the cause it is a symptom of (a cluster's
        collective failing names no rank; the control channel names the lost one within ms)."""
        ...

    def reset(self, error: str) -> str | None:
        """Drop all sequence state after a failed step; None if recovered, else what /health should say."""
        ...

    def known_failure(self, exc: BaseException) -> bool:
        """Whether a step's exception is a failure this executor names itself (a rank lost, a link closed),
        logged in one line rather than as a bug with its traceback."""
        ...

    def close(self) -> None: ...


class PromptTooLong(ValueError):
    pass


class Handoff(Protocol):
    """Disaggregated prefill, decode side (disagg/prefill_client.py): long prompts' KV computed elsewhere."""

    def plan(self, prompt_ids: list[int], cached: Callable[[list[bytes]], int]): ...

    def start(self, handoff, done: Callable[[], None]):
        """Runs the handoff on another thread; returns something with `cancel()`."""
        ...

    def peer_status(self) -> list[dict]:
        """Each prefill peer's state, for /health."""
        ...


@dataclass(frozen=True)
class Export:
    """Disaggregated prefill, prefill side: hand the prompt's blocks from `first_block` on to `sink(index,
    block data)` as they become final (on the engine thread, before the step that follows them runs)."""

    first_block: int
    sink: Callable[[int, object], None]


@dataclass
class _Pending:
    """A step's results waiting to be streamed while the next step computes."""

    sampled: dict[int, list[int]]  # the tokens each sequence took this step (several after a verify)
    logprobs: dict[int, list]
    finished: list[Finished]
    verified: dict = field(default_factory=dict)  # uid -> (drafted, accepted): counted once shown


@dataclass
class _Launched:
    """A step whose forward and sampling are launched and not yet read (asynchronous scheduling): the next
    step may be planned and launched on its tokens before they are known."""

    plan: StepPlan
    result: StepResult
    draw: Draw
    uids: list[int]  # the sequence of each sampled row, in order

    def tokens_for(self, plan: StepPlan) -> mx.array:
        """The sampled tokens as the input of `plan`'s chunks (planned ahead: one row per chunk)."""
        if [c.uid for c in plan.chunks] == self.uids:
            return self.draw.tokens
        row = {u: i for i, u in enumerate(self.uids)}
        return mx.take(self.draw.tokens, mx.array([row[c.uid] for c in plan.chunks]))


@dataclass
class _Tracked:
    seq: Sequence
    sampling: SeqSampling
    detok: IncrementalDetokenizer
    stop: StopMatcher
    emit: OutputCallback
    last_token_time: float | None = None
    logprobs: list = field(default_factory=list)
    export: Export | None = None
    prompt_logprobs: list = field(default_factory=list)  # scored so far (`params.prompt_logprobs`)
    prompt_logprobs_sent: bool = False

    def take_prompt_logprobs(self) -> tuple | None:
        """The prompt's logprobs for the sequence's first output, None after it (or when not asked for)."""
        if self.seq.params.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return tuple(self.prompt_logprobs)


class Engine:
    def __init__(
        self,
        executor: Executor,
        tokenizer,
        config: SchedulerConfig,
        max_model_len: int,
        new_blocks: Callable[[], BlockManager],
        eos_token_ids: frozenset[int],
        metrics: Metrics | None = None,
        watchdog=None,
        vocab_size: int | None = None,
        on_fatal: Callable[[str], None] | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: DraftModel | None = None,
        grammars: Grammars | None = None,
        work: StepWork | None = None,
    ) -> None:
        # A deadline on each forward (distributed runs): a hung collective cannot time out itself.
        self._deadline = watchdog.step if watchdog is not None else (lambda label: contextlib.nullcontext())
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        # Wraps each batch of outputs the loop emits (the HTTP layer's Outbox.holding: one wake-up per step).
        self.output_batch: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.metrics = metrics or Metrics()
        # A restart after a failure starts from fresh block accounting (every rank's sequences are gone too).
        self._new_scheduler = lambda: Scheduler(config, new_blocks(), max_model_len, eos_token_ids, work)
        self.scheduler = self._new_scheduler()
        self._tracked: dict[int, _Tracked] = {}
        self._uids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._preemptions_seen = 0
        self._preempted_unlogged = 0
        self._preemption_logged_at = -math.inf
        self.error: str | None = None  # set when the engine failed; /health reports it
        self._draining = False
        self._closed = False  # the drain's grace is over: nothing more is queued
        self._admitted = 0  # HTTP requests that came before any drain, not yet answered (api/admission.py)
        self._admission = threading.Lock()
        self._failing = threading.RLock()  # the engine thread and the watchdog may fail it at once
        self._failures: list[float] = []  # monotonic times of recent failures (crash-loop detection)
        self._restart_at: float | None = None
        self._given_up = False  # failed for good: later failures (the watchdog's) only end requests
        self._on_fatal = on_fatal or (lambda reason: None)
        self.speculator = (Speculator(speculative, self.metrics, max_model_len, draft)
                           if speculative is not None and speculative.enabled else None)
        self._last_collect: float | None = None  # when the previous step's results were in (step cost model)
        # Plans submitted but not yet computed: a pipeline keeps one per stage in flight (micro-batches).
        self._depth = max(1, getattr(executor, "depth", 1))
        self._in_flight: collections.deque[StepPlan] = collections.deque()
        self._scores: dict[int, list[Scores]] = {}  # step id -> its prompt scores, read with its results
        self.handoff: Handoff | None = None  # set by disagg/wiring.py on a server with --prefill-peer
        self._handing_off: dict[int, tuple[Sequence, Any]] = {}  # uid -> (sequence, its transfer)
        self.times = executor.times
        # Asynchronous scheduling: plain decode steps are planned and launched while the previous step
        # runs, on its sampled tokens still on the device (see `_step_ahead`). By default only on a GPU: a
        # CPU forward keeps every core busy, so the host's work only moves (docs/BENCHMARKS.md). Speculation
        # plans each step from the last one's tokens, and a pipeline overlaps micro-batches instead.
        wanted = config.async_scheduling == "on" or (config.async_scheduling == "auto" and
                                                     mx.default_device() == mx.gpu)
        self._ahead = wanted and getattr(executor, "plans_ahead", False) and self.speculator is None and self._depth == 1
        # Tensor parallelism: a plan made ahead reaches the workers before its ids are known; they follow.
        self._workers_take_ids = self._ahead and hasattr(executor, "settle")
        # A pipeline whose only micro-batch in flight is the one the leader's stage computes (one stream, or
        # a few) would leave every other stage idle while the leader samples, schedules and broadcasts: the
        # next step of the same sequences is planned and broadcast before the ids are sampled, and they
        # follow (`_plan_ids_ahead`). The earlier stages are idle then, so this is on unless turned off.
        self._ids_follow = (self._depth > 1 and hasattr(executor, "send_ids") and self.speculator is None
                            and config.async_scheduling != "off")
        # A cluster whose leader returns from launching a step only near the forward's end (MLX's CPU
        # stream) streams the last step's tokens between sending the workers the next plan and building
        # its own share of it, while they build theirs: after the launch, they waited for that host work
        # at the next step's first sums. Elsewhere it follows the launch and overlaps the forward.
        self._emit_meanwhile = self._depth == 1 and getattr(executor, "host_work_meanwhile", False)
        # Greedy rows' argmax read on the host where the device is the CPU (engine/sampler.py, host_argmax).
        self._argmax_on_host = mx.default_device() == mx.cpu

    # -- public, thread-safe ----------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, emit: OutputCallback,
               export: Export | None = None) -> int:
        """Queue a sequence. Raises PromptTooLong, QueueFull, ValueError (an id outside the vocabulary:
        the API checks first, this is the last line before the model), or RuntimeError when unhealthy.
        A long prompt may first go to a prefill server (`handoff`); it joins the queue once its KV is here."""
        return self.submit_all([(prompt_ids, params, emit)], export)[0]

    def submit_all(self, items: list[tuple[list[int], SamplingParams, OutputCallback]],
                   export: Export | None = None, admitted: bool = False) -> list[int]:
        """Queue every sequence of one request (its prompts times n), or none: each is checked first, and a
        queue without room for all of them raises QueueFull before any is queued or counted (one queued
        and then aborted for its sibling's 429 was counted as an aborted request). `admitted`: the request
        came before a drain (`admit`), and is queued during its grace."""
        if self.error or self._closed or (self._draining and not admitted):
            raise RuntimeError(f"engine unavailable: {self.problem}")
        constraints = [self._checked(prompt_ids, params) for prompt_ids, params, _ in items]
        with self._wake:
            waiting = self._num_queued
            if len(items) > 1 and waiting + len(items) > self.max_waiting:
                raise QueueFull(f"{waiting} requests already waiting, and this one needs {len(items)} places")
            uids = [self._queue(prompt_ids, params, emit, constraint, export)
                    for (prompt_ids, params, emit), constraint in zip(items, constraints)]
            self._wake.notify()
        return uids

    def _checked(self, prompt_ids: list[int], params: SamplingParams):
        """Check a sequence before anything is queued; returns its grammar's constraint, if any."""
        self._check_vocab(prompt_ids, "prompt")
        self._check_vocab([t for t, _ in params.logit_bias] + list(params.stop_token_ids)
                          + list(params.allowed_token_ids), "sampling parameters")
        if len(prompt_ids) > self.max_model_len - min(params.max_tokens, 1):  # max_tokens 0 generates nothing
            room = " (at least one must be left to generate)" if params.max_tokens else ""
            raise PromptTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt has {len(prompt_ids)} tokens{room}."
            )
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise ValueError("this server does not support constrained output")
        return self.grammars.constraint(params.grammar, params.reasoning)  # GrammarError (a ValueError) if refused

    def _queue(self, prompt_ids: list[int], params: SamplingParams, emit: OutputCallback, constraint,
               export: Export | None) -> int:
        """Under the lock: track a checked sequence and queue it (or start its handoff)."""
        uid = next(self._uids)
        seq = Sequence(uid, list(prompt_ids), params, arrival=time.monotonic())
        if export is not None:
            seq.export_from = export.first_block
        sampling = SeqSampling.create(params, prompt_ids, self.eos_token_ids, constraint)
        tracked = _Tracked(seq, sampling, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, prompt_ids,
                                                                 params.keep_token_ids),
                           StopMatcher(params.stop, params.include_stop_str), emit, export=export)
        handoff = self._plan_handoff(seq) if export is None else None
        if handoff is None:
            self.scheduler.add(seq)  # may raise QueueFull; nothing is tracked then
        else:  # its end waits for this lock, so the entry is in place before it is looked for
            self._handing_off[uid] = (seq, self.handoff.start(handoff, lambda: self._handed_back(uid)))
        self._tracked[uid] = tracked
        if export is None:  # a prefill job (disaggregated prefill) is not a client's request: counted as a job
            self.metrics.prompt_tokens.inc(len(prompt_ids))
        self.metrics.queue_depth.set(self._num_queued)
        return uid

    @property
    def _num_queued(self) -> int:
        """Sequences holding a place in the queue: waiting, or waiting for a prefill server's KV."""
        return len(self.scheduler.waiting) + len(self._handing_off)

    def _plan_handoff(self, seq: Sequence):
        """Under the lock: a handoff for this prompt, or None to prefill it here. A handoff takes a place
        in the waiting queue from now on (QueueFull when there is none)."""
        # A prefill server scores nothing, and keys blocks without a request's cache_salt
        if self.handoff is None or seq.params.prompt_logprobs is not None or seq.params.cache_salt is not None:
            return None
        handoff = self.handoff.plan(seq.prompt_ids, self.scheduler.blocks.cached_prefix)
        waiting = self._num_queued
        if handoff is not None and waiting >= self.scheduler.config.max_waiting:
            raise QueueFull(f"{waiting} requests already waiting")
        return handoff

    def _handed_back(self, uid: int) -> None:
        """A handoff ended (its blocks are in the received tier, or it failed): the sequence queues to be
        admitted, finding the received blocks like prefix-cache hits. Called from the transfer's thread."""
        with self._wake:
            entry = self._handing_off.pop(uid, None)
            if entry is None:  # the engine failed meanwhile: the request has its error already
                return
            self.scheduler.add(entry[0], reserved=True)
            self.metrics.queue_depth.set(self._num_queued)
            self._wake.notify()

    def deliver(self, uid: int, index: int, data) -> None:
        """The runner's KV exporter: block `index` of `uid` is final (on the engine thread)."""
        t = self._tracked.get(uid)
        if t is not None and t.export is not None:
            t.export.sink(index, data)

    def _check_vocab(self, ids: list[int], what: str) -> None:
        if ids and self.vocab_size is not None and not (0 <= min(ids) and max(ids) < self.vocab_size):
            raise ValueError(f"{what} holds a token id outside the vocabulary (0..{self.vocab_size - 1})")

    def abort(self, uid: int) -> None:
        with self._wake:
            self.scheduler.abort(uid)
            entry = self._handing_off.get(uid)
            if entry is not None:  # it is reaped as an abort once its transfer has ended
                entry[0].aborted = True
                entry[1].cancel()
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="meshlm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        """Stop stepping; requests still in flight end with an error; the executor shuts its ranks down.
        A cluster's step in flight is waited for as long as its watchdog would allow it (--step-timeout):
        its control channel closed under it, the workers took the orderly stop for a leader that died."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(max(timeout, getattr(self.executor, "step_timeout", 0.0)))
        self._fail("server shutting down", recover=False)
        self.executor.close()

    @property
    def max_waiting(self) -> int:
        """Sequences the waiting queue holds at most (--max-queue)."""
        return self.scheduler.config.max_waiting

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the loop -----------------------------------------------------------
    def _loop(self) -> None:
        """Double-buffered: while step t+1's forward runs (`mx.async_eval`), the
        host detokenizes and streams step t's tokens (a pipeline's leader: while
        it waits for step t+1's activation; a tensor-parallel leader on the CPU:
        while the workers build step t+1, `_emit_meanwhile`). A stop string found
        then ends its sequence one step late; the extra token is discarded. Any
        exception, wherever it arises in a step, goes to `_engine_failed`."""
        pending: _Pending | None = None
        while not self._stopping:
            try:
                pending = self._step(pending)
            except Exception as exc:
                pending = None
                self._in_flight.clear()
                self._scores.clear()
                if self.executor.known_failure(exc):
                    log.error("engine step failed: %s: %s", type(exc).__name__, exc)
                else:
                    log.exception("engine step failed")
                self._engine_failed(f"{type(exc).__name__}: {exc}")

    def _step(self, carry: "_Pending | _Launched | None") -> "_Pending | _Launched | None":
        if isinstance(carry, _Launched):
            return self._step_ahead(carry)
        pending = carry
        if self._depth == 1:
            plan, ended = self._next_plan(block=pending is None)
            with self._emitting():
                self._finish_all(ended)
        else:
            plan = self._fill(block=pending is None)
            if pending is not None:
                # The leader's stage now waits for the activation of the plan it runs (`link`): streaming
                # the last micro-batch's tokens fills that wait. After the forward, as below, that host
                # work shared the leader's core with it and delayed every stage's next plan: PP=2 served
                # 1.49-1.51x one core that way, 1.55-1.58x this way (docs/BENCHMARKS.md).
                self._emit(pending)
                pending = None
        meanwhile = None
        if plan is not None and pending is not None and self._emit_meanwhile:
            meanwhile, pending = functools.partial(self._emit, pending), None
        result = self._execute(plan, meanwhile=meanwhile) if plan is not None else None
        if plan is not None:
            with self.times.timing("schedule"):
                self._prefetch_masks(plan)
                with self._lock:
                    self._update_gauges()
        if pending is not None:
            self._emit(pending)
        if plan is None or result is None:
            return None
        launched = self._launch_draw(plan, result) if self._ahead else None
        ahead = self._plan_ids_ahead(plan, result) if self._ids_follow else None
        pending = launched or self._collect_within_deadline(plan, result)
        if ahead is not None:
            self._send_ids(ahead, pending)
        return pending

    def _plan_ids_ahead(self, plan: StepPlan, result: StepResult) -> StepPlan | None:
        """A pipeline with no other micro-batch in flight: plan and broadcast the next step of `plan`'s
        sequences (`Scheduler.continue_ahead`) while the leader's stage computes `plan`, its ids to follow
        once sampled (`_send_ids`). The other stages apply it meanwhile and wait only for the ids. None
        where the next step needs `schedule` (see continue_ahead), or other micro-batches keep the stages
        busy anyway."""
        if result.logits is None or self._in_flight:
            return None
        uids = result.uids
        if not uids or len(set(uids)) != len(uids) or any(u not in self._tracked for u in uids):
            return None  # a verify chunk's several rows, or a sequence that ended meanwhile
        with self.times.timing("schedule"):
            with self._lock:
                ahead = self.scheduler.continue_ahead(plan, list(uids))
        if ahead is None:
            return None
        ahead = dataclasses.replace(ahead, ids_follow=True)
        with self._deadline(f"step {ahead.step_id}"):
            self.executor.submit(ahead)
        self._in_flight.append(ahead)
        self.metrics.steps_ahead.inc()
        return ahead

    def _send_ids(self, ahead: StepPlan, pending: "_Pending") -> None:
        """The ids `ahead`'s chunks decode: each sequence's token just sampled. A sequence that took none (it
        ended meanwhile) gets any valid id: its row runs and its result is dropped, as a row planned ahead
        in one process is."""
        ids = [(pending.sampled.get(c.uid) or [0])[0] for c in ahead.chunks]
        with self._deadline(f"step {ahead.step_id}"):
            self.executor.send_ids(ahead.step_id, ids)
        # The leader's copy holds the real ids too (its stage does not embed them; the scheduler reads lengths).
        real = dataclasses.replace(ahead, chunks=tuple(dataclasses.replace(c, token_ids=(i,))
                                                       for c, i in zip(ahead.chunks, ids)))
        for i, p in enumerate(self._in_flight):
            if p.step_id == ahead.step_id:
                self._in_flight[i] = real

    def _step_ahead(self, launched: _Launched) -> "_Pending | _Launched | None":
        """Asynchronous scheduling (vLLM's async scheduling, mlx-lm's generate loop): plan and launch the
        next step of the same decoding sequences on `launched`'s sampled tokens before they are read, then
        read them, update the scheduler and stream them while the next forward runs. This takes the
        host's planning, graph building and sampling off the path between two forwards. A sequence that
        ended on the read tokens ran one row too many in the next step: its result is dropped. Anything
        else (an arrival to admit, an abort, a save, too few blocks) makes `continue_ahead` decline, and
        the next step is planned normally once this one is read."""
        with self.times.timing("schedule"):
            with self._lock:
                ahead = self.scheduler.continue_ahead(launched.plan, launched.uids)
        result = None
        if ahead is not None:
            if self._workers_take_ids:
                ahead = dataclasses.replace(ahead, ids_follow=True)
            result = self._execute(ahead, launched.tokens_for(ahead))
            self.metrics.steps_ahead.inc()
        pending = self._collect_within_deadline(launched.plan, launched.result, launched)
        if self._workers_take_ids:  # every rank confirms the step before its tokens are streamed
            with self._deadline(f"step {launched.plan.step_id}"):
                self.executor.settle(keep=0 if ahead is None else 1)
        self._emit(pending)
        if ahead is None:
            return None
        ahead = dataclasses.replace(ahead, chunks=tuple(
            dataclasses.replace(c, token_ids=tuple(pending.sampled.get(c.uid, c.token_ids)[:1])) for c in ahead.chunks))
        return self._launch_draw(ahead, result) or self._collect_within_deadline(ahead, result)

    def _launch_draw(self, plan: StepPlan, result: StepResult) -> _Launched | None:
        """Build the sampling of a plain decode step on the device, unread; None when the step needs
        `_sample`'s full path (no logits, a verify chunk: several rows of one sequence, a grammar, which
        needs the previous token)."""
        if result.logits is None:
            return None
        rows = [i for i, u in enumerate(result.uids) if u in self._tracked]
        uids = [result.uids[i] for i in rows]
        states = [self._tracked[u].sampling for u in uids]
        if not uids or len(set(uids)) != len(uids) or any(s.constraint is not None for s in states):
            return None
        logits = result.logits if len(rows) == len(result.uids) else result.logits[mx.array(rows)]
        return _Launched(plan, result, draw(logits, states), uids)

    def _fill(self, block: bool) -> StepPlan | None:
        """A pipeline: plan and submit micro-batches until `depth` are in flight (or nothing more can
        run), then return the oldest, whose results the last stage computes next. Each plan takes the
        sequences not in flight, at most an even share of them, so every stage has work."""
        while len(self._in_flight) < self._depth:
            busy = frozenset(c.uid for p in self._in_flight for c in p.chunks)
            plan, ended = self._next_plan(block=block and not self._in_flight, busy=busy)
            with self._emitting():
                self._finish_all(ended)
            if plan is None or (plan.empty and self._in_flight):
                break
            with self._deadline(f"step {plan.step_id}"):
                self.executor.submit(plan)
            self._in_flight.append(plan)
            if not plan.chunks:
                break
        return self._in_flight.popleft() if self._in_flight else None

    def _next_plan(self, block: bool, busy: frozenset[int] = frozenset()) -> tuple[StepPlan | None, list[Finished]]:
        """The next step's plan; while idle, let the executor heartbeat and check its ranks."""
        while True:
            self._maybe_restart()
            with self._wake:
                if self._stopping:
                    return None, []
                if self.error:  # failed: wait for the restart (or the process to exit)
                    self._wake.wait(IDLE_POLL_SECONDS)
                    return None, []
                if self.scheduler.has_work:
                    break
                if not block:
                    return None, []
                self._wake.wait(IDLE_POLL_SECONDS)
                if self.scheduler.has_work or self._stopping or self.error:
                    continue
            self.executor.idle()
        with self.times.timing("schedule"):
            # Outside the lock: a draft model's forwards take a while, and only this thread changes the
            # running sequences (an abort meanwhile only marks one; the scheduler then ignores its drafts).
            drafts = self._drafts(busy)
            with self._wake:
                if self._depth == 1:
                    return self.scheduler.schedule(drafts)
                active = len(self.scheduler.running) + len(self.scheduler.waiting)
                # A pipeline's micro-batch takes 1/(2 * depth) of --max-tokens-per-step: a wave of prompts
                # then runs as many small plans, and the stages idle only for one of them while the
                # pipeline fills and drains, not for a whole step's prefill. Below that, per-step costs
                # win: PP=2 served 1.39x one core with 1,024 tokens a plan, 1.52-1.55x with 512, 1.68x
                # with 256, 1.55-1.60x with 128 (docs/BENCHMARKS.md, issue 13).
                share = max(1, -(-self.scheduler.config.max_tokens_per_step // (2 * self._depth)))
                return self.scheduler.schedule(drafts, busy, max_rows=max(1, -(-active // self._depth)),
                                               max_tokens=share)

    def _execute(self, plan: StepPlan, tokens: mx.array | None = None,
                 meanwhile: Callable[[], None] | None = None) -> StepResult:
        with self._deadline(f"step {plan.step_id}"):
            if meanwhile is not None:
                result = self.executor.execute(plan, meanwhile=meanwhile)
            else:
                result = self.executor.execute(plan) if tokens is None else self.executor.execute(plan, tokens)
            result = self._check_loads(plan, result) if plan.loads else result
        if result.logits is None or all(c.logits != LOGITS_ALL for c in plan.chunks):
            return result
        result, scores = take_scores(plan, result, lambda uid: t.seq if (t := self._tracked.get(uid)) else None)
        if scores:
            self._scores[plan.step_id] = scores
        return result

    def _check_loads(self, plan: StepPlan, result: StepResult) -> StepResult:
        """The leader lists a block and verifies its own copy before planning a load, but every rank reads
        its own: one evicted, expired, deleted or bad there is reported, not raised (runner `_read`). What
        read it is recomputed and its rows of this step dropped here, before anything is sampled or
        planned on them, so no token read from it reaches a client and no request is lost."""
        missing = self.executor.missing_loads(plan, result)
        if not missing:
            return result
        with self._lock:
            uids = set(self.scheduler.recompute_unloaded(plan, missing, tuple(self._in_flight)))
        log.warning("step %d: %d prefix block(s) could not be loaded on every rank; recomputing %d sequence(s) "
                    "without them", plan.step_id, len(missing), len(uids))
        keep = [i for i, u in enumerate(result.uids) if u not in uids]
        if len(keep) == len(result.uids):
            return result
        logits = result.logits[mx.array(keep)] if keep else None
        return dataclasses.replace(result, uids=[result.uids[i] for i in keep], logits=logits)

    def _prefetch_masks(self, plan: StepPlan) -> None:
        """Grammar masks for the rows this plan samples, computed while its forward runs."""
        for c in plan.chunks:
            t = self._tracked.get(c.uid) if c.sample else None
            if t is None or t.sampling.constraint is None:
                continue
            if c.verifies(t.seq.num_tokens):
                t.sampling.constraint.prefetch(tuple(c.token_ids[1:]))
            elif c.logits == LOGITS_LAST or c.start + len(c.token_ids) == t.seq.num_tokens:  # else it scores only
                t.sampling.constraint.prefetch(())

    def _collect_within_deadline(self, plan: StepPlan, result: StepResult,
                                 launched: _Launched | None = None) -> "_Pending":
        with self._deadline(f"step {plan.step_id}"):
            return self._collect(plan, result, launched)

    def _drafts(self, busy: frozenset[int] = frozenset()) -> dict[int, tuple[int, ...]]:
        if self.speculator is None:
            return {}
        return self.speculator.propose([s for s in self.scheduler.running if s.uid not in busy],
                                       self._sampling_state)

    def _sampling_state(self, uid: int) -> SeqSampling | None:
        t = self._tracked.get(uid)
        return None if t is None else t.sampling

    def _collect(self, plan: StepPlan, result: StepResult, launched: _Launched | None = None) -> "_Pending":
        t0 = time.perf_counter()
        if result.logits is not None:  # the device's time, not sampling's
            mx.eval(result.logits if launched is None else launched.draw.tokens)
        waited = time.perf_counter() - t0
        self.times.add("device", waited)
        self._record_scores(self._scores.pop(plan.step_id, ()))
        sampled, logprobs, verified = self._sample(plan, result) if launched is None else self._read(launched)
        with self._lock:
            finished, taken = self.scheduler.update(plan, sampled)
            finished = self._refused(taken) + finished  # the first finish of a sequence is the one told
            self._update_gauges()
        now = time.perf_counter()
        self.metrics.step_time.observe(now - t0 + result.launch_seconds)
        if self.speculator is not None:
            for uid, (drafted, accepted) in verified.items():
                self.speculator.verified(uid, drafted, accepted)
            for uid, tokens in taken.items():
                self.speculator.generated(uid, tokens)
            # Back-to-back steps: the gap is one step's time. Only decode and verify steps are fitted: a
            # prefill chunk's tokens cost another rate, and drafts are weighed against decoding. A step with
            # no chunks (one that only retires sequences) costs ~1 ms for 0 tokens: fitted, it doubled the
            # slope b, and the policy then stopped sequences whose drafts were paying.
            decoding = bool(plan.chunks) and all(len(c.token_ids) == 1 or c.uid in verified for c in plan.chunks)
            if self._last_collect is not None and decoding:
                self.speculator.step_done(plan.num_tokens, now - self._last_collect, bool(verified))
            self._last_collect = now
        self.times.add("sample", time.perf_counter() - t0 - waited)
        return _Pending(taken, {u: lp[: len(taken.get(u, ()))] for u, lp in logprobs.items()}, finished,
                        verified)

    def _record_scores(self, scores: list[Scores]) -> None:
        """Keep a step's prompt scores with their sequences, for each one's first output."""
        for s in scores:
            t = self._tracked.get(s.uid)
            if t is None:  # ended meanwhile
                continue
            if s.first > t.seq.scored:  # chunks run in order, each scored as it is read: never expected
                raise RuntimeError(f"uid {s.uid}: prompt scores from token {s.first}, {t.seq.scored} expected")
            entries = s.read()[t.seq.scored - s.first:]
            t.prompt_logprobs.extend(entries)
            t.seq.scored += len(entries)

    def _refused(self, taken: dict[int, list[int]]) -> list[Finished]:
        """Under the lock: sequences whose grammar refused a token they took end with its error, the token
        unshown. Every token is masked first, so this is a last line against a bug (a NaN in the sampler
        once made one) or llguidance refusing a token its own mask allowed (the request's fault then: a
        400), not a path: the client is told, never handed unconstrained text as constrained."""
        ended = []
        for uid in list(taken):
            t = self._tracked.get(uid)
            if t is None:
                continue
            c = t.sampling.constraint
            if t.sampling.fault is not None:  # nothing left to sample: the request's constraints (a 400)
                error, fault = t.sampling.fault, "no_token_to_sample"
            elif c is not None and c.error is not None:
                error, fault = c.error, "grammar_error" if c.request_fault else ""
            else:
                continue
            del taken[uid]
            self.scheduler.finish(t.seq, FinishReason.ERROR)
            ended.append(Finished(t.seq, FinishReason.ERROR, error, fault))
        return ended

    @contextlib.contextmanager
    def _emitting(self) -> Iterator[None]:
        with self.times.timing("emit"), self.output_batch():
            yield

    def _emit(self, pending: "_Pending") -> None:
        with self._emitting():
            for uid, tokens in pending.sampled.items():
                shown = self._emit_tokens(uid, tokens, pending.logprobs.get(uid) or [])
                if uid in pending.verified and self.speculator is not None:
                    self.speculator.count(*pending.verified[uid], shown)
            self._finish_all(pending.finished)

    def _read(self, launched: _Launched) -> tuple[dict[int, list[int]], dict[int, list], dict]:
        """`_sample`'s results from a draw launched with its step (`_launch_draw`); a sequence that ended
        meanwhile (a stop string, a failure) is dropped, as there."""
        with self._lock:
            kept = self.scheduler.kept(launched.plan.step_id, launched.uids)
        kept = {u for u in kept if u in self._tracked}
        tokens, lps = take(launched.draw, [u in kept for u in launched.uids])
        sampled = {u: [tok] for u, tok in zip(launched.uids, tokens) if u in kept}
        return sampled, {u: [lp] for u, lp in zip(launched.uids, lps) if lp is not None and u in sampled}, {}

    def _sample(self, plan: StepPlan, result: StepResult):
        """Tokens (and logprobs) per sequence: one sampled token per plain row; for a verified chunk, its
        accepted drafts plus the target's token. Also returns (drafted, accepted) per verified uid."""
        if result.logits is None:
            return {}, {}, {}
        # A sequence ended meanwhile (a stop string found while this step ran, or a failure from the
        # watchdog's thread) has no sampling state any more, and one preempted while this plan was in
        # flight (a pipeline's next micro-batch needed its blocks) keeps nothing of it: their rows are
        # dropped, so no sampler state records a token the sequence does not take.
        with self._lock:
            kept = self.scheduler.kept(plan.step_id, set(result.uids))
        tracked = {u: t for u in result.uids if u in kept and (t := self._tracked.get(u)) is not None}
        rows: dict[int, list[int]] = {}
        for i, uid in enumerate(result.uids):
            if uid in tracked:
                rows.setdefault(uid, []).append(i)
        drafts = {c.uid: c.token_ids[1:] for c in plan.chunks if c.uid in rows and len(rows[c.uid]) > 1}
        plain = [u for u in rows if u not in drafts]
        sampled: dict[int, list[int]] = {}
        logprobs: dict[int, list] = {}
        if plain:
            index = mx.array([rows[u][0] for u in plain]) if len(plain) < len(result.uids) else None
            tokens, lps = sample(result.logits if index is None else result.logits[index],
                                 [tracked[u].sampling for u in plain], on_host=self._argmax_on_host)
            for u, tok, lp in zip(plain, tokens, lps):
                sampled[u] = [tok]
                if lp is not None:
                    logprobs[u] = [lp]
        verified: dict[int, tuple[int, int]] = {}
        if drafts:
            q = self.speculator.draft_probs if self.speculator is not None else (lambda uid, k: None)
            outcomes = verify([Proposal(result.logits[rows[u][0]:rows[u][-1] + 1], d, tracked[u].sampling,
                                        q(u, len(d))) for u, d in drafts.items()], on_host=self._argmax_on_host)
            for (u, d), v in zip(drafts.items(), outcomes):
                sampled[u] = v.tokens
                verified[u] = (len(d), v.accepted)
                if v.logprobs is not None:
                    logprobs[u] = v.logprobs
        return sampled, logprobs, verified

    def _emit_tokens(self, uid: int, tokens: list[int], logprobs: list) -> int:
        """Stream a sequence's new tokens (an accepted run arrives as one chunk); a stop string found
        inside the run ends the sequence there, and what follows it is neither shown nor counted. Returns
        how many were shown."""
        t = self._tracked.get(uid)
        if t is None or t.seq.aborted:
            return 0
        now = time.monotonic()
        served = t.export is None  # a prefill job's token reaches no client (disaggregated prefill)
        if served and t.last_token_time is None:
            self.metrics.ttft.observe(now - t.seq.arrival)
        elif served:
            self.metrics.itl.observe(now - t.last_token_time)
        t.last_token_time = now
        text, shown = "", 0
        before = len(t.seq.output_ids) - len(tokens)  # generated before this run
        # The token a run ended on (EOS or a stop token id) is not shown, unless include_stop_str_in_output
        # asks for it, as vLLM's detokenizer (EOS, a special token, decodes to nothing then).
        stop_token = t.seq.finished and t.seq.finish_reason is FinishReason.STOP and not t.stop.include
        for i, token in enumerate(tokens):
            if stop_token and i == len(tokens) - 1:
                shown = i + 1
                break
            text += t.stop.feed(t.detok.add(token), armed=before + i + 1 > t.seq.params.min_tokens)
            shown = i + 1
            if t.stop.stopped:
                break
        if served:
            self.metrics.generation_tokens.inc(shown)
        lps = tuple(lp for lp in logprobs[:shown] if lp is not None)
        prompt = t.take_prompt_logprobs()
        # A last token without text still goes out: its id (return_token_ids) and the count must agree
        # whether or not logprobs were asked for.
        if text or lps or shown or prompt is not None or not t.seq.finished:
            t.emit(StepOutput(uid, text, tuple(tokens[:shown]), lps, prompt_logprobs=prompt))
        if not t.stop.stopped:
            return shown
        ended = t.seq.finish_reason  # the scheduler's, which sees no text: None, or the run's last token's
        with self._lock:
            if shown < len(tokens):  # the rest of the run was never shown: it was not generated (nor counted)
                del t.seq.output_ids[len(t.seq.output_ids) - (len(tokens) - shown):]
            if ended in (None, FinishReason.LENGTH):
                # A stop string matched on the last allowed token is a stop: vLLM checks stop strings before
                # the length limit.
                self.scheduler.finish(t.seq, FinishReason.STOP)
        if ended in (None, FinishReason.LENGTH):
            self._finish(uid, FinishReason.STOP)  # else the scheduler's finish follows, with the trimmed count
        return shown

    def _finish_all(self, finished: list[Finished]) -> None:
        for f in finished:
            self._finish(f.seq.uid, f.reason, f.error, f.request_fault)

    def _finish(self, uid: int, reason: FinishReason, error: str | None = None, request_fault: str = "") -> None:
        t = self._tracked.pop(uid, None)
        if self.speculator is not None:
            self.speculator.drop(uid)
        if t is None:
            return
        # A dangling partial character and text held back as a possible stop string's start are released
        # however the sequence ended (as vLLM's detokenizer, which holds nothing back once finished); after
        # a matched stop string the matcher releases nothing. (EOS used to drop them: "Paris." with stop
        # ["..."] ended "Paris".)
        tail = t.stop.feed(t.detok.flush()) + t.stop.flush()
        if t.stop.stopped and reason is FinishReason.LENGTH:
            # a stop string in the last, unfinished character's text: seen only now, and it cut the text
            reason = FinishReason.STOP
        stop_reason = None
        if reason is FinishReason.STOP and t.stop.stopped:
            stop_reason = t.stop.matched
        elif reason is FinishReason.STOP and t.seq.output_ids:
            last = t.seq.output_ids[-1]
            eos = not t.seq.params.ignore_eos and last in self.eos_token_ids  # EOS is no stop_reason (vLLM)
            stop_reason = last if last in t.seq.params.stop_token_ids and not eos else None
        if t.export is None:  # a prefill job's end is meshlm_disagg_prefill_jobs_total's
            self.metrics.requests.labels(status=reason.value).inc()
            self.metrics.cached_tokens.inc(t.seq.num_cached_tokens)
        t.emit(
            StepOutput(
                uid,
                tail,
                prompt_logprobs=t.take_prompt_logprobs(),
                finish_reason=reason,
                stop_reason=stop_reason,
                error=error,
                request_fault=request_fault,
                prompt_tokens=len(t.seq.prompt_ids),
                completion_tokens=len(t.seq.output_ids),
                cached_tokens=t.seq.num_cached_tokens,
                cache_write_tokens=min(t.seq.num_written_tokens, len(t.seq.prompt_ids) - t.seq.num_cached_tokens),
            )
        )

    # -- failures -----------------------------------------------------------
    def _engine_failed(self, message: str) -> None:
        self._fail(message)

    def _fail(self, message: str, recover: bool = True) -> None:
        """End every in-flight request with an error; then (`recover`) restart or give up.

        Order matters: /health turns 503 before any client reads its error. A
        single process restarts in place (fresh KV state, same weights) after
        RESTART_BACKOFF_SECONDS; a cluster cannot (its collectives are broken),
        nor can an engine failing CRASH_LOOP_FAILURES times within
        CRASH_LOOP_SECONDS: then `on_fatal` asks the process to exit non-zero so
        a supervisor restarts it (README, "Failures")."""
        with self._failing:
            self.error = self.error or message
            if recover and not self._given_up:
                message = self.executor.diagnose(message)  # /health is 503 meanwhile (up to ~1 s)
            with self._lock:
                seqs = self.scheduler.fail_all()
                handing_off, self._handing_off = list(self._handing_off.values()), {}
            for seq, transfer in handing_off:
                transfer.cancel()
                seqs.append(seq)
            for seq in seqs:
                self._finish(seq.uid, FinishReason.ERROR, error=message)
            with self._lock:  # else the gauges showed the failed batch until a restart (or the exit) updated them
                self._update_gauges()
            if recover and not self._given_up:
                self._recover_or_give_up(message)

    def _recover_or_give_up(self, message: str) -> None:
        try:
            problem = self.executor.reset(message)
        except Exception:  # a reset that fails leaves the engine failed, never the thread dead
            log.exception("executor reset failed")
            problem = message
        now = time.monotonic()
        self._failures = [t for t in self._failures if now - t < CRASH_LOOP_SECONDS] + [now]
        if problem is None and len(self._failures) < CRASH_LOOP_FAILURES:
            self.error = f"engine restarting after a failure: {message}"
            self._restart_at = now + RESTART_BACKOFF_SECONDS
            log.error("%s; serving again in %.0f s", self.error, RESTART_BACKOFF_SECONDS)
            return
        if problem is None:
            problem = f"{len(self._failures)} engine failures within {CRASH_LOOP_SECONDS:.0f} s, the last: {message}"
        self.error = problem
        self._restart_at = None
        self._given_up = True
        log.error("engine failed for good: %s", problem)
        self._on_fatal(problem)

    def _maybe_restart(self) -> None:
        """On the engine thread, once the back-off has passed: a fresh scheduler, healthy again."""
        if self._restart_at is None or time.monotonic() < self._restart_at:
            return
        with self._wake:
            self.scheduler = self._new_scheduler()
            if self.speculator is not None:
                self.speculator.reset()
            self._preemptions_seen = 0
            self._restart_at = None
            self.error = None
        self._update_gauges()  # else they kept the failed step's batch and queue until the next request
        log.info("engine restarted")

    @property
    def problem(self) -> str | None:
        """What /health reports: None when serving."""
        return self.error or ("server shutting down" if self._draining else None)

    def admit(self) -> bool:
        """An HTTP request arrives: False while draining (it is refused), else counted until `release`."""
        with self._admission:
            if self._draining:
                return False
            self._admitted += 1
            return True

    def release(self) -> None:
        with self._admission:
            self._admitted -= 1

    def drain(self, grace: float, settle: float = 1.0) -> bool:
        """Refuse new requests, give running and admitted ones `grace` seconds, then end the rest with an
        error (admitted ones not yet queued get a 503 at submit, given `settle` seconds to reach it); True
        when some were ended that way."""
        with self._admission:
            self._draining = True
        deadline = time.monotonic() + grace
        while (self._tracked or self._admitted) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._closed = True
        failed = bool(self._tracked)
        if failed:
            self._fail("server shutting down", recover=False)
        deadline = time.monotonic() + settle
        while self._admitted and time.monotonic() < deadline:
            time.sleep(0.05)
        return failed or bool(self._admitted)

    def fail(self, message: str) -> None:
        """End every in-flight request with an error, from any thread (the watchdog's too)."""
        self._fail(message)

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(self._num_queued)
        self.metrics.batch_size.set(len(self.scheduler.running))
        self.metrics.kv_bytes.set(self.executor.kv_bytes())
        self.metrics.kv_blocks_used.set(self.scheduler.blocks.num_used)
        self.metrics.kv_blocks_cached.set(self.scheduler.blocks.num_cached)
        new = self.scheduler.num_preemptions - self._preemptions_seen
        if new:
            self.metrics.preemptions.inc(new)
            self._preempted_unlogged += new
            now = time.monotonic()
            if now - self._preemption_logged_at >= PREEMPTION_LOG_SECONDS:
                # An operator sees the cause of a throughput drop in the log, not only in /metrics; at most one
                # line a minute, as a server short of KV preempts on every step
                log.warning("%d sequence(s) preempted for want of KV blocks since the last such line (they are "
                            "recomputed: meshlm_preemptions_total); raise --kv-cache-memory, or lower "
                            "--max-batch-size", self._preempted_unlogged)
                self._preemption_logged_at, self._preempted_unlogged = now, 0
        self._preemptions_seen = self.scheduler.num_preemptions


__all__ = ["Engine", "Executor", "PromptTooLong", "QueueFull"]
