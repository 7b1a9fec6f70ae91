"""Logprob layouts always serialize: a non-finite logprob (a masked token's -inf, NaN from broken logits)
must never turn a finished response into a 500 or a stream chunk no JSON parser reads."""

from __future__ import annotations

import json
import math

import pytest
from transformers import PreTrainedTokenizerFast

from meshlm.api.serving import MIN_LOGPROB, Serving, json_logprob
from meshlm.api.token_bytes import TextCursor, TokenBytes
from meshlm.engine.request import TokenLogprob
from meshlm.model.demo import tiny_tokenizer


@pytest.fixture(scope="module")
def layouts() -> Serving:
    # The layouts need only the token bytes; a Serving without an engine is enough to call them.
    serving = Serving.__new__(Serving)
    serving.token_bytes = TokenBytes(PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer()))
    return serving


@pytest.mark.parametrize("value, want", [(-0.5, -0.5), (0.0, 0.0), (-math.inf, MIN_LOGPROB),
                                         (math.nan, MIN_LOGPROB), (math.inf, MIN_LOGPROB)])
def test_json_logprob(value, want):
    assert json_logprob(value) == want


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_non_finite_logprobs_serialize_as_json(layouts, bad):
    lps = [TokenLogprob(65, bad, ((65, bad), (66, -1.0))), TokenLogprob(66, -0.25, ((66, -0.25),))]
    for body in (layouts.completion_logprobs(lps, TextCursor()), layouts.chat_logprobs(lps, TextCursor())):
        json.dumps(body, allow_nan=False)  # as the response does (Starlette); raises on NaN and inf
    completion = layouts.completion_logprobs(lps, TextCursor())
    assert completion["token_logprobs"] == [MIN_LOGPROB, -0.25]
    assert list(completion["top_logprobs"][0].values()) == [MIN_LOGPROB, -1.0]
    chat = layouts.chat_logprobs(lps, TextCursor())["content"]
    assert [c["logprob"] for c in chat] == [MIN_LOGPROB, -0.25] and chat[0]["top_logprobs"][0]["logprob"] == MIN_LOGPROB
