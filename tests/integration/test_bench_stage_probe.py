"""benchmarks/stage_probe.py on a tiny model: real processes pinned to cores, a report that holds
together (every stage measured alone and side by side, their windows overlapping, the ceiling derived
from what was measured)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import stage_probe  # noqa: E402

from meshlm.model import demo  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_probe_times_every_stage_alone_and_side_by_side(tmp_path):
    model = demo.make_tiny(tmp_path / "tiny", model_type="llama", layers=4, seed=0)
    report = stage_probe.probe(model, stages=2, streams=4, context=24, workdir=tmp_path)
    assert sum(report["split"]) == 4 and len(report["split"]) == 2
    times = [report["one_core_ms"], *report["stage_alone_ms"], *report["stage_side_by_side_ms"]]
    assert all(t > 0 for t in times) and len(times) == 5
    assert report["side_by_side_overlap"] > 0.5  # the stages' timed steps ran at the same time
    assert min(report["side_by_side_steps"]) >= stage_probe.TIMED_STEPS // 4  # the medians are of those steps
    slowest = max(report["stage_side_by_side_ms"])
    assert report["decode_ceiling"] == round(report["one_core_ms"] / (2 * slowest), 3)
    assert report["side_by_side_slowdown"] == [round(b / a, 3) for a, b in
                                               zip(report["stage_alone_ms"], report["stage_side_by_side_ms"])]


def test_a_failing_probe_process_is_a_clear_error(tmp_path):
    model = demo.make_tiny(tmp_path / "tiny", model_type="llama", layers=4, seed=0)
    for weights in model.glob("*.safetensors"):  # a model its processes cannot load
        weights.write_bytes(b"not safetensors")
    with pytest.raises(RuntimeError, match="probe process failed"):
        stage_probe.probe(model, stages=2, streams=4, context=24, workdir=tmp_path)
