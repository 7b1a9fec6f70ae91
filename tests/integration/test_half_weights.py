"""A checkpoint stored in bfloat16 (or float16), served with its packed layers held in 16 bits (the default
on the CPU), by one process and by real tensor- and pipeline-parallel ranks: each gives the text and
logprobs of one process holding every layer in float32 (`--no-half-weights`). The kernels widen the same values
back, so a forward matches bit for bit (unit tests); here, logprobs within each suite's tolerance (how
concurrent prompts are batched and chunked, and a shard's or a stage's summation order, differ between
runs: test_parity.py, test_pipeline_parallel.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conftest import ServerProcess, assert_parity, complete_all

pytestmark = pytest.mark.slow

PROMPTS = [f"prompt {i}: " + "the river runs past the old mill " * (i % 3 + 1) for i in range(8)]
HELD = "bfloat16 of them"  # adapt()'s log line, once per rank that holds bf16 layers


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from meshlm.model.demo import make_tiny

    return make_tiny(tmp_path_factory.mktemp("bf16") / "tiny", "llama", layers=4, hidden=64, heads=4, kv_heads=2,
                     dtype="bfloat16")


@pytest.fixture(scope="module")
def float32_reference(model, tmp_path_factory):
    srv = ServerProcess(model, "--max-model-len", "512", "--no-prefix-cache", "--no-half-weights",
                        log_dir=tmp_path_factory.mktemp("f32"))
    try:
        yield asyncio.run(complete_all(srv.url, PROMPTS, 12))
    finally:
        srv.stop()
    assert HELD not in srv.log.read_text()


@pytest.mark.parametrize("flags,ranks,tol", [((), 1, 1e-4), (("--tensor-parallel", "2"), 2, 1e-4),
                                             (("--pipeline-parallel", "2"), 2, 1e-3)],
                         ids=["one-process", "tp2", "pp2"])
def test_bf16_layers_serve_what_float32_layers_do(model, float32_reference, tmp_path, flags, ranks, tol):
    srv = ServerProcess(model, "--max-model-len", "512", "--no-prefix-cache", *flags, log_dir=tmp_path)
    try:
        got = asyncio.run(complete_all(srv.url, PROMPTS, 12))
    finally:
        srv.stop()
    assert srv.log.read_text().count(HELD) == ranks
    assert_parity(got, float32_reference, tol=tol)


def test_dtype_bfloat16_rounds_a_float32_checkpoint_alike_in_one_process_and_a_pipeline(tmp_path):
    """`--dtype bfloat16` on the CPU rounds the weights once and computes in float32: a pipeline's stages
    round theirs alike, so two stages serve one process's text (within the pipeline suite's tolerance)."""
    from meshlm.model.demo import make_tiny

    model = make_tiny(tmp_path / "f32", "llama", layers=4, hidden=64, heads=4, kv_heads=2)
    outs, logs = [], []
    for flags in ((), ("--pipeline-parallel", "2")):
        srv = ServerProcess(model, "--max-model-len", "512", "--no-prefix-cache", "--dtype", "bfloat16", *flags,
                            log_dir=tmp_path)
        try:
            outs.append(asyncio.run(complete_all(srv.url, PROMPTS, 12)))
        finally:
            srv.stop()
        logs.append(srv.log.read_text())
    assert [log.count("bfloat16 weights, float32 compute") for log in logs] == [1, 2]
    assert [log.count(HELD) for log in logs] == [1, 2]
    assert_parity(outs[1], outs[0], tol=1e-3)


def test_a_float16_checkpoint_keeps_float16_layers_in_one_process_and_a_pipeline(tmp_path):
    """float16 panels (F16C widening) serve what float32 layers do, in one process and in two stages."""
    from meshlm.model.demo import make_tiny

    model = make_tiny(tmp_path / "f16", "llama", layers=4, hidden=64, heads=4, kv_heads=2, dtype="float16")
    outs, logs = [], []
    for flags in (("--no-half-weights",), (), ("--pipeline-parallel", "2")):
        srv = ServerProcess(model, "--max-model-len", "512", "--no-prefix-cache", *flags, log_dir=tmp_path)
        try:
            outs.append(asyncio.run(complete_all(srv.url, PROMPTS, 12)))
        finally:
            srv.stop()
        logs.append(srv.log.read_text())
    assert [log.count(" float16 of them") for log in logs] == [0, 1, 2]
    assert_parity(outs[1], outs[0], tol=1e-4)
    assert_parity(outs[2], outs[0], tol=1e-3)
