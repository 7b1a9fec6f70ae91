"""The benchmarks' arguments: flags that shape the tiny model a script makes are refused beside --model,
which they would not affect (a float16 comparison once measured float32 twice that way)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import pipeline_parallel  # noqa: E402
import scaling  # noqa: E402


def test_tiny_model_flags_apply_without_model():
    args = scaling.parse_args(["--pipeline-parallel", "2", "--dtype", "float16", "--layers", "4"])
    assert (args.layout, args.ranks, args.dtype, args.layers) == ("pipeline", 2, "float16", 4)


@pytest.mark.parametrize("flags", [["--dtype", "float16"], ["--layers", "4"], ["--kv-heads", "4"]])
def test_tiny_model_flags_beside_model_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        scaling.parse_args(["--pipeline-parallel", "2", "--model", "/tmp/x", *flags])
    assert f"{flags[0]} shape the tiny model" in capsys.readouterr().err


def test_model_alone_is_accepted():
    assert scaling.parse_args(["--tensor-parallel", "2", "--model", "/tmp/x"]).model == "/tmp/x"


def test_pipeline_benchmark_refuses_them_too(capsys):
    assert pipeline_parallel.parse_args(["--dtype", "float16"]).dtype == "float16"
    with pytest.raises(SystemExit):
        pipeline_parallel.parse_args(["--model", "/tmp/x", "--model-type", "llama"])
    assert "--model-type shape the tiny model" in capsys.readouterr().err
