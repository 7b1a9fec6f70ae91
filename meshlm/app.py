"""Wiring for `meshlm serve`: model -> executor -> engine -> HTTP, and an orderly shutdown."""

from __future__ import annotations

import logging
import os
import threading
import time

from pathlib import Path

import uvicorn

from meshlm.api.server import create_app
from meshlm.api.serving import Serving
from meshlm.cache.keys import CacheSalt
from meshlm.cache.pool import BlockPool
from meshlm.cache.prefix import PrefixCache
from meshlm.cache.ssd import SSDConfig, SSDTier
from meshlm.config import ServeConfig
from meshlm.metrics import PrefixCacheCollector
from meshlm.engine.engine import Engine
from meshlm.model.loader import LoadedModel, load_model
from meshlm.parallel.local import LocalExecutor

log = logging.getLogger(__name__)

DEFAULT_KV_FRACTION = 0.25  # of physical RAM, when --kv-cache-memory is not given
DEFAULT_KV_CAP = 8 * 2**30
SHUTDOWN_GRACE_SECONDS = 2  # in-flight requests get this long to finish on SIGTERM


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_budget_bytes(config: ServeConfig) -> int:
    return config.scheduler.kv_cache_memory or min(int(physical_memory() * DEFAULT_KV_FRACTION), DEFAULT_KV_CAP)


def build_prefix_cache(config: ServeConfig, loaded: LoadedModel, layout: str = "tp1", rank: int = 0):
    """Salt, RAM pool and (unless turned off) the SSD tier for this rank; None when disabled."""
    c = config.cache
    if not c.enabled:
        return None
    salt = CacheSalt(loaded.fingerprint, loaded.dtype, layout, c.block_size)
    ssd = None
    if c.ssd:
        ssd_config = SSDConfig(Path(c.cache_dir).expanduser(), int(c.ssd_cache_gb * 2**30), c.ssd_ttl_days)
        ssd = SSDTier(ssd_config, salt, rank)
    # Partial-block matches only on one rank: see PrefixCache.
    return PrefixCache(salt, BlockPool(kv_budget_bytes(config)), ssd, partial=layout == "tp1")


def build_engine(config: ServeConfig, loaded: LoadedModel, executor=None, prefix=None, watchdog=None) -> Engine:
    """An engine over `executor` (default: this process alone, with its own prefix cache)."""
    budget = kv_budget_bytes(config)
    if executor is None:
        prefix = build_prefix_cache(config, loaded)
        executor = LocalExecutor(loaded.model, prefix, budget)
    per_token = executor.kv_bytes_per_token()
    kv_tokens = max(budget // per_token, 1)
    max_len = min(config.model.max_model_len or loaded.context_length, kv_tokens)
    if max_len < 2:
        raise ValueError(f"KV budget holds only {kv_tokens} tokens; raise --kv-cache-memory")
    log.info("KV budget: %d tokens (%d bytes/token); max model len %d", kv_tokens, per_token, max_len)
    engine = Engine(executor, loaded.tokenizer, config.scheduler, max_len, kv_tokens, loaded.eos_token_ids,
                    prefix=prefix, watchdog=watchdog)
    if prefix is not None:
        engine.metrics.registry.register(PrefixCacheCollector(prefix))
    return engine


def serve(config: ServeConfig, argv: list[str] | None = None, ports=None) -> None:
    if config.parallel.distributed:
        from meshlm.parallel.cluster import ClusterPorts, serve_tensor_parallel

        serve_tensor_parallel(config, argv or [], ports or ClusterPorts())
        return
    loaded = load_model(config.model)
    run_http(config, loaded, build_engine(config, loaded))


def run_http(config: ServeConfig, loaded: LoadedModel, engine: Engine) -> None:
    """Serve until SIGINT/SIGTERM, then drain: in-flight requests get a grace period to finish,
    the rest end with an error event, and the engine stops its ranks."""
    serving = Serving(engine, loaded.tokenizer, loaded.name, engine.max_model_len, config.server.max_tokens_default)
    app = create_app(serving)
    engine.start()
    log.info("serving %s on http://%s:%d/v1", loaded.name, config.server.host, config.server.port)
    server = _DrainingServer(uvicorn.Config(app, host=config.server.host, port=config.server.port,
                                            log_level=config.server.log_level, timeout_graceful_shutdown=1), engine)
    try:
        server.run()
    finally:
        engine.stop()


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:  # a second signal: stop now
            return super().handle_exit(sig, frame)
        self._draining = True
        threading.Thread(target=self._drain, args=(sig, frame), name="meshlm-drain", daemon=True).start()

    def _drain(self, sig, frame) -> None:
        self.engine.drain(SHUTDOWN_GRACE_SECONDS)
        time.sleep(0.2)  # let the error events reach the clients before connections close
        super().handle_exit(sig, frame)
