"""One rank's share of the work, written once: its layers, its KV store and SSD tier, and the runner
that applies plans to them. The single-process executor, the tensor-parallel leader and every worker
each hold one.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from meshlm.kv.keys import CacheSalt
from meshlm.kv.ssd import SSDConfig, SSDTier
from meshlm.config import CacheConfig, ModelConfig
from meshlm.engine.plan import StepPlan
from meshlm.kv.store import KVStore
from meshlm.model import cpu_kernels
from meshlm.model.adapt import ModelParts, adapt, kv_shape
from meshlm.model.attention import AttentionBackend, attention_backend
from meshlm.model.ring_attention import RingContext
from meshlm.model.runner import Prepared, Runner, StepResult
from meshlm.platform import cores_for_this_process
from meshlm.step_times import StepTimes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """Where this rank sits: the layout names its SSD directory and salts the prefix cache's keys;
    `ranks_here`: its cluster's ranks on this machine, which share the SSD tier's default size (one disk)."""

    layout: str = "tp1"
    rank: int = 0
    ranks_here: int = 1


class RankState:
    def __init__(self, parts: ModelParts, store: KVStore, backend: AttentionBackend, ssd: SSDTier | None = None,
                 vocab_size: int | None = None, salt: CacheSalt | None = None, ring: RingContext | None = None) -> None:
        self.parts, self.store, self.backend, self.ssd = parts, store, backend, ssd
        self.vocab_size = vocab_size
        self.salt = salt  # None: the prefix cache is off
        self.ring = ring
        self.received = None  # disaggregated prefill: blocks a prefill server sent (kv/received.py)
        self.exporter = None  # ... or, on a prefill server, where exported blocks go
        self.times = StepTimes()  # this rank's time by phase, kept across resets
        self.runner = self._new_runner()

    def _new_runner(self) -> Runner:
        return Runner(self.parts, self.store, self.backend, self.ssd, self.vocab_size, self.ring,
                      self.received, self.exporter, self.times)

    def attach(self, received=None, exporter=None) -> None:
        """Disaggregated prefill: where received blocks are looked up, and where exported blocks go."""
        self.received, self.exporter = received, exporter
        self.runner.received, self.runner.exporter = received, exporter

    @property
    def block_size(self) -> int:
        """Positions per block id in the plans (context parallelism: every rank's share together)."""
        return self.runner.block_size

    @property
    def max_blocks(self) -> int:
        return self.store.max_blocks

    @property
    def kv_bytes(self) -> int:
        return self.store.nbytes

    def step(self, plan: StepPlan, hidden: mx.array | None = None, tokens: mx.array | None = None,
             on_ids=None) -> StepResult:
        return self.runner.execute(plan, hidden, tokens, on_ids)

    def prepare(self, plan: StepPlan) -> Prepared:
        """What of `plan` needs no activation (a pipeline stage's work while it waits for one)."""
        return self.runner.prepare(plan)

    def launch(self, prepared: Prepared, hidden: mx.array | None = None, tokens: mx.array | None = None) -> StepResult:
        return self.runner.launch(prepared, hidden, tokens)

    def reset(self) -> None:
        """Forget every sequence (after a failed step); the pools stay allocated, their contents unused."""
        self.runner = self._new_runner()
        if self.received is not None:  # the failed step's plans will not load what they pinned
            self.received.unpin_all()

    def flush(self, timeout: float = 5.0) -> None:
        """Blocks saved so far reach the SSD tier."""
        if self.ssd is not None:
            self.ssd.flush(timeout)


def build_rank(loaded, model_cfg: ModelConfig, cache_cfg: CacheConfig, kv_budget: int,
               spec: RankSpec = RankSpec(), ring: RingContext | None = None, sum_group=None) -> RankState:
    """Adapt `loaded.model` (this rank's own instance) and allocate its KV store within `kv_budget` bytes.
    `sum_group`: a SharedMemoryGroup its tensor-parallel layers sum over instead of their MLX group."""
    native, status = cpu_kernels.native_ops() if model_cfg.native_kernels else (None, "off (--no-native-kernels)")
    cpu = mx.default_device() == mx.cpu
    backend = attention_backend(cpu, model_cfg.cpu_kernels, native, cores_for_this_process())
    parts = adapt(loaded.model, model_cfg.cpu_kernels, native, sum_group, model_cfg.half_weights,
                  model_cfg.fused_decode)
    if cpu and model_cfg.cpu_kernels:
        log.info("CPU kernels: native: %s", status)
        if native is not None:
            # A process-wide setting of the compiled GEMM: this process's share of the cores.
            native.set_gemm_threads(cores_for_this_process())
            if model_cfg.huge_pages:
                cpu_kernels.in_huge_pages(loaded.model, native)
    log.info("attention: %s", backend.name)
    shape = kv_shape(loaded.model, parts, cache_cfg.block_size, getattr(mx, loaded.dtype))
    max_blocks = kv_budget // shape.block_bytes
    if max_blocks < 1:
        raise ValueError(f"--kv-cache-memory {kv_budget} bytes holds no KV block ({shape.block_bytes} bytes each); "
                         "raise it or lower --block-size")
    salt = CacheSalt(loaded.fingerprint, loaded.dtype, spec.layout, cache_cfg.block_size) if cache_cfg.enabled else None
    ssd = None
    if salt is not None and cache_cfg.ssd:
        ssd_config = SSDConfig(Path(cache_cfg.cache_dir).expanduser(), cache_cfg.ssd_bytes(spec.ranks_here),
                               cache_cfg.ssd_ttl_days)
        ssd = SSDTier(ssd_config, salt, spec.rank, shape)
    if ring is not None:
        args = loaded.model.args
        ring = dataclasses.replace(ring, kv_heads=shape.kv_heads, q_heads=args.num_attention_heads)
    # The compiled kernels reserve the pools at the whole budget (resident only where written); the
    # portable path grows them by copying (fast on Metal; seconds at GiB sizes on the CPU).
    reserve = native.untouched_zeros if cpu and native is not None else None
    store = KVStore(shape, max_blocks, reserve=reserve, write_rows=native.kv_write if reserve is not None else None)
    return RankState(parts, store, backend, ssd, loaded.vocab_size, salt, ring)
