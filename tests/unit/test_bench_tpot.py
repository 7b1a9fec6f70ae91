"""The benchmarks' time per output token counts tokens, not SSE chunks: a token that completes no
character streams with the next one, so counting chunks made a decode look slower than it ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _peer  # noqa: E402


def test_tokens_from_the_usage_chunk_divide_the_span():
    # 3 chunks carried 5 tokens (two held back as parts of characters): 4 gaps between tokens.
    res = _peer.StreamResult(ok=True, itls=[0.3, 0.1], content_chunks=3, completion_tokens=5)
    assert res.tpot == pytest.approx(0.1)


def test_without_usage_each_chunk_counts_as_a_token():
    res = _peer.StreamResult(ok=True, itls=[0.3, 0.1], content_chunks=3)
    assert res.tpot == pytest.approx(0.2)


@pytest.mark.parametrize("itls, tokens", [([], 1), ([], 4)])
def test_no_gap_has_no_tpot(itls, tokens):
    assert _peer.StreamResult(ok=True, itls=itls, content_chunks=1, completion_tokens=tokens).tpot is None
