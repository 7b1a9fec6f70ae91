"""Wiring for `meshlm serve`: model -> executor -> engine -> HTTP, and an orderly shutdown."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import signal
import socket
import threading
import time

import uvicorn

from meshlm.api import listener
from meshlm.api.body import BodyLimits
from meshlm.api.connections import AcceptErrors, DeadlineProtocol
from meshlm.api.prompts import PromptBuilder
from meshlm.api.server import create_app
from meshlm.api.serving import SamplingDefaults, Serving
from meshlm.config import ServeConfig
from meshlm.engine.engine import Engine
from meshlm.engine.grammar import Grammars
from meshlm.engine.step_work import StepWork, keys_per_token
from meshlm.executor.local import LocalExecutor
from meshlm.executor.rank import RankState, build_rank
from meshlm.disagg import wiring as disagg
from meshlm.kv.blocks import BlockManager, CacheStats
from meshlm.kv.context_blocks import ContextBlocks, WholeStats
from meshlm.kv.received import ReceivedBlocks, ReceivedThenSSD
from meshlm.metrics import AllReduceCollector, ContextBlocksCollector, PrefixCacheCollector, RankTimesCollector
from meshlm.model.loader import LoadedModel, load_model
from meshlm.platform import kv_budget_bytes
from meshlm.process_exit import end_process
from meshlm.spec.draft import load_draft

log = logging.getLogger(__name__)

FATAL_EXIT_DELAY_SECONDS = 5.0  # an engine failed for good: /health explains it this long, then the process exits
EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE


class FatalExit:
    """The engine's `on_fatal`: the process exits with EXIT_ENGINE_FAILED a few seconds after the engine
    failed for good (clients get their errors and /health shows why meanwhile), for a supervisor to restart."""

    def __init__(self, delay: float = FATAL_EXIT_DELAY_SECONDS) -> None:
        self.delay = delay
        self.code = 0
        self.server: uvicorn.Server | None = None

    def __call__(self, reason: str) -> None:
        if self.code:
            return
        self.code = EXIT_ENGINE_FAILED
        log.error("exiting with status %d in %.0f s: %s", self.code, self.delay, reason)
        timer = threading.Timer(self.delay, self._stop)
        timer.daemon = True
        timer.start()

    def _stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    def exit(self) -> None:
        """After the orderly shutdown: end the process with its status (EXIT_ENGINE_FAILED, else 0), without
        the interpreter's teardown, which a cluster's MLX backend does not survive (process_exit.py)."""
        end_process(self.code)


def step_work(long_prefill_context: int, args) -> StepWork | None:
    """How the scheduler bounds a long context's steps; None when asked not to, or the model's shapes do not
    say what attention costs against its matrices (the token budget alone then)."""
    if not long_prefill_context:
        return None
    keys = keys_per_token(args)
    if keys is None:
        log.warning("--long-prefill-context: the model's config does not say its attention's shape; a long "
                    "prompt's chunks keep the token budget's size")
        return None
    log.info("prompt chunks past %d tokens of context are shortened to a whole chunk's work there "
             "(--long-prefill-context; a query against %.0f keys costs a token's matrices)", long_prefill_context, keys)
    return StepWork(keys, long_prefill_context)


def build_engine(config: ServeConfig, loaded: LoadedModel, executor=None, rank: RankState | None = None,
                 watchdog=None, on_fatal=None, kv_blocks: int | None = None,
                 received: ReceivedBlocks | None = None) -> Engine:
    """An engine over `executor` (default: this process alone); `rank` is the leader's own share, whose
    block size and SSD tier the block manager plans for; `kv_blocks`: how many blocks every rank can
    hold (default: the leader's budget); `received`: blocks from prefill servers, found like SSD hits."""
    if executor is None:
        rank = build_rank(loaded, config.model, config.cache, kv_budget_bytes(config.scheduler))
        executor = LocalExecutor(rank)
    kv_blocks = kv_blocks or rank.max_blocks
    kv_tokens = kv_blocks * rank.block_size
    max_len = min(config.model.max_model_len or loaded.context_length, kv_tokens)
    if max_len < 2:
        if kv_tokens < 2:
            raise ValueError(f"KV budget holds only {kv_tokens} tokens; raise --kv-cache-memory")
        given = "--max-model-len" if config.model.max_model_len else "the model's max_position_embeddings"
        raise ValueError(f"a context of {max_len} position(s) ({given}) leaves no room to generate: at least 2")
    if config.model.max_model_len and max_len < config.model.max_model_len:
        # vLLM refuses to start here; serving the shorter context keeps a cluster whose smallest rank holds
        # less usable, but the operator who asked for more must hear it (it was a line at INFO)
        log.warning("--max-model-len %d lowered to %d: the KV budget holds %d blocks of %d tokens%s (raise "
                    "--kv-cache-memory for more)", config.model.max_model_len, max_len, kv_blocks, rank.block_size,
                    " on the smallest rank" if kv_blocks < rank.max_blocks else "")
    if max_len > loaded.context_length:  # served (long-context runs use it), but say so, as vLLM refuses it
        log.warning("max model len %d (--max-model-len) is beyond the model's own context (%d positions): "
                    "positions past it were never trained, and output there may be garbage", max_len,
                    loaded.context_length)
    log.info("KV budget: %d blocks of %d tokens (%d bytes each); max model len %d", kv_blocks,
             rank.block_size, rank.store.shape.block_bytes, max_len)
    stats = CacheStats()  # one set of counters across engine restarts

    tiers = rank.ssd if received is None else ReceivedThenSSD(received, rank.ssd)

    cp = config.parallel  # --cp-min-tokens implies context parallelism (ParallelConfig checks)
    whole_stats = WholeStats([0] * cp.context_parallel) if cp.cp_min_tokens else None

    def new_blocks() -> BlockManager | ContextBlocks:
        blocks = BlockManager(kv_blocks, rank.block_size, rank.salt, tiers, stats=stats)
        if whole_stats is not None:
            return ContextBlocks(blocks, cp.context_parallel, config.cache.block_size, cp.cp_min_tokens, whole_stats)
        return blocks

    draft = None
    if config.speculative.method == "draft":  # on this process alone, whatever the target's layout
        draft = load_draft(config.speculative, config.model, loaded, kv_budget_bytes(config.scheduler),
                           rank.block_size)
    engine = Engine(executor, loaded.tokenizer, config.scheduler, max_len, new_blocks, loaded.eos_token_ids,
                    watchdog=watchdog, vocab_size=loaded.vocab_size, on_fatal=on_fatal,
                    speculative=config.speculative, draft=draft, grammars=load_grammars(loaded),
                    work=step_work(config.scheduler.long_prefill_context, loaded.model.args))
    if rank.salt is not None:
        engine.metrics.registry.register(PrefixCacheCollector(lambda: engine.scheduler.blocks, rank))
    engine.metrics.registry.register(RankTimesCollector(executor.rank_times))
    if executor.all_reduce_stats() is not None:
        engine.metrics.registry.register(AllReduceCollector(executor.all_reduce_stats))
    if whole_stats is not None:
        engine.metrics.registry.register(ContextBlocksCollector(lambda: engine.scheduler.blocks))
    return engine


def load_grammars(loaded: LoadedModel) -> Grammars | None:
    """llguidance's view of the tokenizer (structured outputs); None, with a warning, when it cannot
    read this tokenizer: constrained requests then get a 400, the rest are served."""
    try:
        return Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    except Exception as exc:
        log.warning("structured outputs disabled: llguidance cannot use this tokenizer (%s: %s)",
                    type(exc).__name__, exc)
        return None


def serve(config: ServeConfig, sock: socket.socket | None, start=None) -> None:
    """Serve until stopped. `sock`: rank 0's HTTP socket, bound before anything loads (api/listener.py);
    `start`: a cluster's ClusterStart (cluster/ranks.py), None for one process. Worker ranks never return."""
    fatal = FatalExit()
    if start is None:
        # Before the model loads: a missing secret is a start-up error.
        secret = disagg.secret() if config.disagg.enabled else None
        loaded = load_model(config.model)
        budget = kv_budget_bytes(config.scheduler)
        rank = build_rank(loaded, config.model, config.cache, budget)
        received = disagg.received_blocks(config, budget)
        engine = build_engine(config, loaded, LocalExecutor(rank), rank, on_fatal=fatal, received=received)
        service = disagg.enable(config, loaded, rank, engine, received, secret)
        try:
            run_http(config, loaded, engine, fatal, sock)
        finally:
            if service is not None:
                service.close()
        fatal.exit()
        return
    from meshlm.cluster.ranks import start_cluster

    leader = start_cluster(config, start)  # worker ranks never return
    try:
        engine = build_engine(config, leader.loaded, leader.executor, leader.rank, watchdog=leader.watchdog,
                              on_fatal=fatal, kv_blocks=leader.kv_blocks)
        leader.fail = engine.fail
        run_http(config, leader.loaded, engine, fatal, sock)
    finally:
        leader.close()
    fatal.exit()


def run_http(config: ServeConfig, loaded: LoadedModel, engine: Engine, fatal: FatalExit, sock: socket.socket) -> None:
    """Serve on `sock` (bound by `listener.bind`) until SIGINT/SIGTERM, then drain: in-flight requests get a
    grace period to finish, the rest end with an error event, and the engine stops its ranks. An engine
    that failed for good (`fatal`) ends the process with a non-zero status."""
    s = config.server
    defaults = SamplingDefaults.resolve(loaded.generation_defaults, s.default_temperature, s.default_top_p)
    log.info("sampling defaults for requests that omit them: %s", defaults.describe())
    prompts = PromptBuilder(loaded.tokenizer, loaded.vocab_size, engine.max_model_len, s.chat_template,
                            s.chat_template_kwargs, s.tool_call_parser)
    serving = Serving(engine, prompts, loaded.name, s.max_tokens_default, defaults, s.reasoning_parser)
    app = create_app(serving, limits=BodyLimits(s.max_request_bytes, stall_seconds=s.client_timeout),
                     allowed_origins=s.allowed_origins, api_key=s.api_key)
    host, port = config.server.host, sock.getsockname()[1]  # --port 0: the one the system chose
    listener.listen(sock, host, port)  # another server bound beside this one while it loaded: refused here
    engine.start()
    log.info("serving %s on http://%s:%d/v1", loaded.name, f"[{host}]" if ":" in host else host, port)
    protocol = functools.partial(DeadlineProtocol, timeout=s.client_timeout)
    server = _DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=config.server.log_level,
                                            http=protocol, timeout_graceful_shutdown=1), engine,
                             config.server.shutdown_timeout)
    fatal.server = server
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()


class _UnjoinedExecutor(concurrent.futures.ThreadPoolExecutor):
    """The HTTP loop's default executor (asyncio.to_thread: chat templates, tokenizing, grammars), not waited
    for once serving ends: a model's chat template that never finishes kept its thread, and with it the
    stopped server, running past SIGTERM (the loop's close joins its default executor's threads). What
    still runs there ends with the process (`FatalExit.exit`)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Engine, grace: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace = grace  # --shutdown-timeout
        self._draining = False

    async def serve(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(AcceptErrors(log))
        loop.set_default_executor(_UnjoinedExecutor(thread_name_prefix="meshlm-http-work"))
        # A hang-up (the terminal or ssh session closing) drains as SIGTERM does, as `meshlm launch` takes
        # it: by default it killed the process, streams cut without an error and SSD writes lost.
        hangup = signal.signal(signal.SIGHUP, self.handle_exit) if _main_thread() else None
        try:
            await super().serve(sockets)
        finally:
            if hangup is not None:
                signal.signal(signal.SIGHUP, hangup)

    def handle_exit(self, sig, frame) -> None:
        # A second signal skips the rest of the grace period, but still stops in order: the streams get
        # their error event, and the engine stops and flushes its SSD writes once `run` returns.
        grace, self._draining = (0.0 if self._draining else self.grace), True
        # Said at once: uvicorn's own "Shutting down" comes only once the drain is over
        log.info("%s: draining (%s)", signal.Signals(sig).name if sig else "stop",
                 "ending running requests now" if not grace else f"running requests get {grace:g} s")
        threading.Thread(target=self._drain, args=(grace,), name="meshlm-drain", daemon=True).start()

    def _drain(self, grace: float) -> None:
        if self.engine.drain(grace):
            time.sleep(0.2)  # let the error events reach the clients before connections close
        # Not super().handle_exit: uvicorn would re-raise the signal once serving ends, and its default
        # action would kill the process before the engine stops (the SSD tier's pending writes lost).
        self.should_exit = True


def _main_thread() -> bool:
    """Only the main thread may set signal handlers (tests serve on others)."""
    return threading.current_thread() is threading.main_thread()
