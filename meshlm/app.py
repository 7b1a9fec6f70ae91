"""Wiring for `meshlm serve`: model -> executor -> engine -> HTTP, and an orderly shutdown."""

from __future__ import annotations

import logging
import os

import uvicorn

from meshlm.api.server import create_app
from meshlm.api.serving import Serving
from meshlm.config import ServeConfig
from meshlm.engine.engine import Engine
from meshlm.model.loader import LoadedModel, load_model
from meshlm.parallel.local import LocalExecutor

log = logging.getLogger(__name__)

DEFAULT_KV_FRACTION = 0.25  # of physical RAM, when --kv-cache-memory is not given
DEFAULT_KV_CAP = 8 * 2**30


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_budget_tokens(config: ServeConfig, per_token: int) -> int:
    budget = config.scheduler.kv_cache_memory or min(int(physical_memory() * DEFAULT_KV_FRACTION), DEFAULT_KV_CAP)
    return max(budget // per_token, 1)


def build_engine(config: ServeConfig, loaded: LoadedModel) -> Engine:
    executor = LocalExecutor(loaded.model)
    per_token = executor.kv_bytes_per_token()
    kv_tokens = kv_budget_tokens(config, per_token)
    max_len = min(config.model.max_model_len or loaded.context_length, kv_tokens)
    if max_len < 2:
        raise ValueError(f"KV budget holds only {kv_tokens} tokens; raise --kv-cache-memory")
    log.info("KV budget: %d tokens (%d bytes/token); max model len %d", kv_tokens, per_token, max_len)
    return Engine(executor, loaded.tokenizer, config.scheduler, max_len, kv_tokens, loaded.eos_token_ids)


def serve(config: ServeConfig) -> None:
    loaded = load_model(config.model)
    engine = build_engine(config, loaded)
    serving = Serving(engine, loaded.tokenizer, loaded.name, engine.max_model_len, config.server.max_tokens_default)
    app = create_app(serving)
    engine.start()
    log.info("serving %s on http://%s:%d/v1", loaded.name, config.server.host, config.server.port)
    try:
        uvicorn.run(app, host=config.server.host, port=config.server.port, log_level=config.server.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        engine.stop()
