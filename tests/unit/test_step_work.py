"""The step's work model: what a chunk costs against its context, and the most tokens a work budget holds."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from meshlm.engine.step_work import StepWork, keys_per_token


def brute_cost(start: int, n: int, k: float) -> float:
    return sum(1 + (start + i + 1) / k for i in range(n))


@pytest.mark.parametrize("k", [3.5, 64.0, 3072.0])
def test_cost_counts_each_query_against_the_keys_before_it(k):
    work = StepWork(k, 0)
    for start, n in [(0, 1), (0, 100), (517, 33), (10_000, 1)]:
        assert work.cost(start, n) == pytest.approx(brute_cost(start, n, k))


def test_tokens_within_is_the_most_that_fits():
    rng = random.Random(0)
    for _ in range(2_000):
        work = StepWork(rng.uniform(1, 5_000), 0)
        start, budget = rng.randrange(0, 2_000_000), rng.uniform(0, 50_000)
        n = work.tokens_within(start, budget)
        assert work.cost(start, n) <= budget < work.cost(start, n + 1)
    assert StepWork(10, 0).tokens_within(5, 0) == StepWork(10, 0).tokens_within(5, -3) == 0


def test_a_whole_chunk_at_or_before_the_reference_context_fits_the_limit_and_later_ones_shrink():
    work = StepWork(3072, 8192)
    limit = work.limit(1024)
    assert work.tokens_within(0, limit) > 1024 and work.tokens_within(8192, limit) == 1024
    sizes = [work.tokens_within(start, limit) for start in (16_384, 131_072, 1_048_576)]
    assert 1024 > sizes[0] > sizes[1] > sizes[2] > 0


def test_keys_per_token_from_the_configs_shapes():
    smollm2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                              intermediate_size=1536)
    # q, k, v, o: 576 x 64 x (9 + 3 + 3 + 9); gate, up, down: 3 x 576 x 1536; per query head and key: 2 x 64
    assert keys_per_token(smollm2) == pytest.approx((576 * 64 * 24 + 3 * 576 * 1536) / (2 * 9 * 64))
    moe = SimpleNamespace(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, num_experts_per_tok=8, moe_intermediate_size=768)
    assert keys_per_token(moe) == pytest.approx((2048 * 128 * 72 + 3 * 2048 * 8 * 768) / (2 * 32 * 128))
    mixtral = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              intermediate_size=14336, num_experts_per_tok=2, num_local_experts=8)
    assert keys_per_token(mixtral) == pytest.approx((4096 * 128 * 80 + 3 * 4096 * 2 * 14336) / (2 * 32 * 128))
    assert keys_per_token(SimpleNamespace(hidden_size=64)) is None


@pytest.mark.parametrize("bad", [(0.0, 10), (-1.0, 10), (float("nan"), 10), (8.0, -1)])
def test_a_bad_model_is_refused(bad):
    with pytest.raises(ValueError):
        StepWork(*bad)


@pytest.mark.parametrize("context", [0, 64])
def test_the_engine_schedules_with_the_models_work_unless_told_not_to(tmp_path, context):
    from meshlm.app import build_engine
    from meshlm.config import CacheConfig, ModelConfig, SchedulerConfig, ServeConfig
    from meshlm.model import demo
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1)
    cfg = ServeConfig(model=ModelConfig(str(model)), cache=CacheConfig(enabled=False),
                      scheduler=SchedulerConfig(kv_cache_memory=2**20, long_prefill_context=context))
    loaded = load_model(cfg.model)
    work = build_engine(cfg, loaded).scheduler.work
    assert work == (StepWork(keys_per_token(loaded.model.args), 64) if context else None)
