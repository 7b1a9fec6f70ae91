"""Turning disaggregated prefill on for one server: the decode side's handoff client, or the prefill
side's job service, over the engine and the leader's rank built as usual."""

from __future__ import annotations

import os

import mlx.core as mx

from meshlm.config import ServeConfig
from meshlm.disagg.prefill_client import PrefillClient
from meshlm.disagg.prefill_server import PrefillService
from meshlm.disagg.prefill_wire import PeerInfo
from meshlm.engine.engine import Engine
from meshlm.executor.rank import RankState
from meshlm.kv.keys import CacheSalt
from meshlm.kv.received import ReceivedBlocks
from meshlm.transport.auth import SECRET_ENV, ClusterSecret


def peer_info(config: ServeConfig, loaded, rank: RankState) -> PeerInfo:
    shape = rank.store.shape
    return PeerInfo(loaded.fingerprint, loaded.dtype, config.parallel.layout, rank.block_size, (0, shape.num_layers),
                    shape.kv_heads, shape.head_dim, loaded.vocab_size)


def salt(config: ServeConfig, loaded, rank: RankState) -> CacheSalt:
    """The prefix cache's salt, also when the cache is off (a prefill server names blocks by it)."""
    return rank.salt or CacheSalt(loaded.fingerprint, loaded.dtype, config.parallel.layout, rank.block_size)


def secret() -> ClusterSecret:
    text = os.environ.get(SECRET_ENV)
    if text is None:
        raise ValueError(f"disaggregated prefill needs {SECRET_ENV}, the same on the prefill and decode servers "
                         "(generate one with `openssl rand -hex 32`)")
    return ClusterSecret(text, SECRET_ENV)


def received_blocks(config: ServeConfig, kv_budget: int) -> ReceivedBlocks | None:
    """Where a decode server stages blocks a prefill server sent: at most the KV budget's bytes."""
    return ReceivedBlocks(kv_budget) if config.disagg.peers else None


def enable(config: ServeConfig, loaded, rank: RankState, engine: Engine, received: ReceivedBlocks | None,
           cluster_secret: ClusterSecret | None) -> PrefillService | None:
    """Attach the decode side (`received` is the engine's staging tier) or start the prefill side."""
    d = config.disagg
    if not d.enabled:
        return None
    info, key_salt = peer_info(config, loaded, rank), salt(config, loaded, rank)
    if d.peers:
        rank.attach(received=received)
        engine.handoff = PrefillClient(d, cluster_secret, info, key_salt, getattr(mx, loaded.dtype), received,
                                       engine.metrics)
        return None
    service = PrefillService(engine, info, key_salt, cluster_secret, config.server.host, d.prefill_port, d.timeout,
                             engine.metrics)
    rank.attach(exporter=engine)
    service.start()
    return service
