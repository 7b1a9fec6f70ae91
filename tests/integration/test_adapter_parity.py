"""--adapter-path through the server, in one process and split over two, against mlx-lm applying the same
adapter unfused (the fused weights themselves: tests/unit/test_adapters.py)."""

from __future__ import annotations

import asyncio

import pytest

from conftest import SCORE_TOL, ServerProcess, assert_scores, reference_scores, score_all, scored_prompts
from test_parity import meshlm_greedy_texts, mlx_lm_greedy

pytestmark = pytest.mark.slow


# One process serves the same fused weights as tests/unit/test_adapters.py checks, and a pipeline stage
# only drops the fused layers it does not hold (loader.keep_stage, as for any model): tensor parallelism,
# which slices each fused matrix, is the layout to run here.
@pytest.mark.parametrize("layout", [("--tensor-parallel", "2")])
def test_an_adapter_is_served_as_mlx_lm_applies_it(tiny_model, tmp_path, layout):
    """--adapter-path (mlx_lm.server's flag): the adapter is fused into the weights before shards or stages
    are cut; greedy tokens equal mlx-lm's with the adapter unfused, and prompt logprobs are within SCORE_TOL,
    split over two tensor-parallel ranks."""
    from mlx_lm import load as _load

    from meshlm.model.demo import make_tiny_adapter

    adapter = make_tiny_adapter(tiny_model, tmp_path / "lora")
    _, tok = _load(str(tiny_model))
    ids = tok.encode("the quick brown fox")
    want = [tok.decode([t]) for t in mlx_lm_greedy(tiny_model, ids, 24, adapter)]
    assert want != [tok.decode([t]) for t in mlx_lm_greedy(tiny_model, ids, 24)]  # the adapter matters
    srv = ServerProcess(tiny_model, "--adapter-path", str(adapter), *layout, log_dir=tmp_path)
    try:
        assert meshlm_greedy_texts(srv.url, ids, 24) == want
        prompts = scored_prompts(lengths=(5, 40))
        assert_scores(asyncio.run(score_all(srv.url, prompts)), reference_scores(tiny_model, prompts, adapter),
                      SCORE_TOL)
    finally:
        srv.stop()
