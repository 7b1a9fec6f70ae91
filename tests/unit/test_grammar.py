"""Grammar-constrained sampling on a real tokenizer: masks, sampling, verification of drafts, refusals."""

from __future__ import annotations

import json
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from meshlm.engine.grammar import GrammarError, Grammars
from meshlm.engine.request import SamplingParams
from meshlm.engine.sampler import SeqSampling, sample
from meshlm.model import demo
from meshlm.spec.rejection import Proposal, verify

EOS = 2
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "kind": {"enum": ["cat", "dog"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "minItems": 1, "maxItems": 2},
    "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["id"], "additionalProperties": False}},
    "required": ["name", "kind", "age", "tags", "owner"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return demo.make_tiny(tmp_path_factory.mktemp("tiny"), "llama", layers=1, hidden=32, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, 520, frozenset({EOS}))  # 520 > the tokenizer's 512: padding rows are masked


def state(grammars, grammar: str, **kw) -> SeqSampling:
    params = SamplingParams(max_tokens=400, seed=kw.pop("seed", 0), grammar=grammar, **kw)
    return SeqSampling.create(params, eos_token_ids=frozenset({EOS}), constraint=grammars.constraint(grammar))


def generate(s: SeqSampling, rng: np.random.Generator, limit: int = 400) -> list[int]:
    """Sample from random logits until EOS: only the grammar can make the text valid."""
    out: list[int] = []
    while len(out) < limit:
        [tok], _ = sample(mx.array(rng.normal(size=(1, 520)).astype(np.float32) * 3), [s])
        if tok == EOS:
            return out
        out.append(tok)
    raise AssertionError("no EOS within the limit")


@pytest.mark.parametrize("seed", range(5))
def test_random_logits_give_json_that_matches_the_schema(grammars, tokenizer, seed):
    g = grammars.from_json_schema(SCHEMA)
    text = tokenizer.decode(generate(state(grammars, g, seed=seed), np.random.default_rng(seed)))
    jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_lark(grammars, tokenizer):
    rng = np.random.default_rng(1)
    text = tokenizer.decode(generate(state(grammars, grammars.from_regex(r"[a-z]{2,5}@[a-z]{2,4}\.com")), rng))
    assert re.fullmatch(r"[a-z]{2,5}@[a-z]{2,4}\.com", text)
    lark = 'start: "yes" | "no" | "a-b (c)?"'
    assert tokenizer.decode(generate(state(grammars, grammars.from_lark(lark)), rng)) in ("yes", "no", "a-b (c)?")


def test_greedy_masks_the_argmax_away(grammars):
    """The unconstrained argmax is forbidden: the constrained choice is the best allowed token."""
    s = state(grammars, grammars.from_regex("b+"), temperature=0)
    allowed, _ = s.constraint.allowed()
    ok = np.flatnonzero(np.array(allowed))
    logits = np.arange(520, dtype=np.float32)[None]  # the highest ids lead, most of them forbidden
    [tok], _ = sample(mx.array(logits), [s])
    assert tok == ok.max()


def test_verification_rejects_a_forbidden_draft(grammars, tokenizer):
    """Greedy verification under a grammar gives the tokens plain constrained greedy decoding gives."""
    g = grammars.from_regex("(ab)+c")
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in ("a", "b", "c")]
    assert all(len(i) == 1 for i in ids)
    a, b, c = (i[0] for i in ids)
    logits = np.zeros((4, 520), dtype=np.float32)
    logits[:, c] = 5.0  # the model wants "c" everywhere; the grammar allows it only after "ab"
    logits[:, a] = 4.0
    logits[:, b] = 3.0
    plain_state, plain = state(grammars, g, temperature=0), []
    for j in range(4):
        [t], _ = sample(mx.array(logits[j : j + 1]), [plain_state])
        plain.append(t)
    s = state(grammars, g, temperature=0)
    [v] = verify([Proposal(mx.array(logits), (a, c, c), s)])  # "c" after "a" is forbidden: rejected
    assert v.tokens == plain[:2] and v.accepted == 1
    assert s.constraint.valid_prefix((c,)) == 1  # the state advanced past "ab": "c" may end it now


def test_ngram_drafts_are_cut_where_the_grammar_forbids(grammars, tokenizer):
    s = state(grammars, grammars.from_regex("[ab]+"))
    a, c = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "c"))
    assert s.constraint.valid_prefix((a, a, c, a)) == 2


def test_min_tokens_yields_to_a_complete_grammar(grammars, tokenizer):
    """The grammar allows only EOS once "x" is out; min_tokens would ban EOS: the grammar wins."""
    s = state(grammars, grammars.from_regex("x"), temperature=0, min_tokens=5)
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    logits = mx.zeros((1, 520))
    assert sample(logits, [s])[0] == [x]
    assert sample(logits, [s])[0] == [EOS]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_repetition_penalty_keeps_forbidden_tokens_forbidden(grammars, tokenizer, temperature):
    """A penalised token the grammar forbids stays at -inf: scaling -inf once gave NaN (-inf - -inf),
    which greedy then picked, and a server returned "oooooooo" as JSON-schema output with a 200."""
    o = tokenizer.encode("o", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=400, seed=0, grammar=grammars.from_regex("[ab]+"),
                            temperature=temperature, repetition_penalty=4.0)
    s = SeqSampling.create(params, prompt_ids=[o], eos_token_ids=frozenset({EOS}),
                           constraint=grammars.constraint(params.grammar))
    logits = mx.zeros((1, 520)).at[0, o].add(50.0)  # the model wants the penalised, forbidden "o"
    for _ in range(5):
        allowed = np.flatnonzero(np.array(s.constraint.allowed()[0]))
        [tok], _ = sample(logits, [s])
        assert tok in allowed and tok != o and s.constraint.error is None
        if tok == EOS:
            break


def test_min_tokens_yields_when_it_would_ban_every_allowed_token(grammars, tokenizer):
    """The grammar allows only "x", which the request also names a stop token; banning it until
    min_tokens would leave no token at all: the grammar wins, as for a complete grammar."""
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    s = state(grammars, grammars.from_regex("x+"), temperature=1.0, min_tokens=5, stop_token_ids=(x,))
    assert sample(mx.zeros((1, 520)), [s])[0] == [x]
    assert s.constraint.error is None


def test_a_refused_token_is_reported_not_swallowed(grammars, tokenizer):
    """Should a token the mask forbids ever be taken, the constraint says so (the engine then ends the
    sequence with an error) instead of carrying on with output the grammar does not allow."""
    s = state(grammars, grammars.from_regex("[ab]+"))
    o = tokenizer.encode("o", add_special_tokens=False)[0]
    s.record([o])
    assert "refused" in s.constraint.error and str(o) in s.constraint.error


def test_compiled_grammars_are_cached(grammars):
    g = grammars.from_json_schema({"type": "object", "properties": {"q": {"type": "integer"}}})
    grammars.check(g)
    assert grammars._compiled(g) is grammars._compiled(g)


def test_the_cache_holds_a_bounded_amount_of_grammar_text(grammars, monkeypatch):
    """A compiled matcher holds ~50x its text: the cache is bounded by text, not only by count."""
    from meshlm.engine import grammar as module

    monkeypatch.setattr(module, "CACHE_CHARS", 3000)
    texts = [grammars.from_regex(f"x{i}" + "[ab]" * 200) for i in range(6)]  # ~1 KB each
    for t in texts:
        grammars.check(t)
    assert grammars._cache_chars <= 3000 and texts[-1] in grammars._cache and texts[0] not in grammars._cache
    assert grammars._cache_chars == sum(len(t) for t in grammars._cache)


@pytest.mark.parametrize("make, words", [
    (lambda g: g.from_json_schema({"type": "strin"}), "strin"),
    (lambda g: g.from_json_schema({"type": "object", "if": {"type": "object"}, "then": {}}), "if"),
    (lambda g: g.from_json_schema({"$ref": "#/nowhere"}), "nowhere"),
    (lambda g: g.from_regex("(unclosed"), ""),
    (lambda g: g.from_lark("start: nothing_defined"), "nothing_defined"),
    # llguidance builds lexers lazily: a grammar whose first step alone is slow is refused at the door
    (lambda g: g.from_regex("((a{1000}){1000}){1000}"), "too complex"),
    (lambda g: g.from_json_schema({"enum": [f"v{i}" for i in range(100_000)]}), "too large"),
    # llguidance holds schema numbers as float64: these were enforced rounded (2**53 + 1 gave 2**53)
    (lambda g: g.from_json_schema({"type": "integer", "minimum": 2**53 + 1, "maximum": 2**53 + 1}), "2**53"),
    (lambda g: g.from_json_schema({"const": 2**53 + 1}), "9007199254740993"),
    (lambda g: g.from_json_schema('{"properties": {"x": {"enum": [1, {"y": [-1152921504606846977]}]}}}'),
     "-1152921504606846977"),
    # JSON Schema wants multipleOf > 0; llguidance enforced -1 as 1 and 0 as anything
    (lambda g: g.from_json_schema({"type": "integer", "multipleOf": -1}), "multipleOf must be greater than 0"),
    (lambda g: g.from_json_schema({"properties": {"n": {"type": "number", "multipleOf": 0}}}), "got 0"),
])
def test_bad_grammars_are_refused(grammars, make, words):
    with pytest.raises(GrammarError) as info:
        grammars.check(make(grammars))
    assert words in str(info.value)


def test_large_numbers_that_float64_holds_exactly_are_kept(grammars):
    for schema in ({"type": "integer", "maximum": 2**53}, {"const": 2**53}, {"minimum": -2**53},
                   {"properties": {"minimum": {"type": "string"}}, "default": 2**60},
                   {"type": "number", "multipleOf": 0.5}, {"properties": {"multipleOf": {"const": -1}}}):
        grammars.check(grammars.from_json_schema(schema))


def test_masks_along_drafts_ending_in_eos_leave_the_state_where_it_was(grammars, tokenizer):
    """Regression (n-gram drafts copy a turn's end): drafts that complete the grammar and then end with EOS
    were rolled back one token too far (llguidance takes EOS after a complete grammar as a no-op), so the
    masks followed the text one token behind: the next real token was refused (a 400), or the grammar
    let through text it forbids ("xaabby" for x[ab]{0,3}y)."""
    x, a, b, y = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "xaby")
    c = grammars.constraint(grammars.from_regex("x[ab]{0,3}y"))
    c.advance([x, a])
    drafts = (a, y, EOS)
    c.prefetch(drafts)
    assert c.allowed(1, drafts)[0][b].item()  # after "xaa", "b" may follow
    c.advance([a, b])  # the verify step took "a", then the target's "b": "xaab"
    mask, _ = c.allowed()
    assert not mask[b].item() and not mask[a].item() and mask[y].item() and c.error is None  # only "y" now
    c.advance([y])
    assert c.allowed()[1]  # complete: only the end remains


# -- a grammar after a thinking model's reasoning (--reasoning-parser) ------------------------------------

def _tags(tokenizer):
    """Stand-ins for <think> and </think>: single tokens the grammar below never takes."""
    return tuple(tokenizer.encode(t, add_special_tokens=False)[0] for t in ("s", "e"))


def test_the_grammar_waits_for_the_reasoning_to_end(grammars, tokenizer):
    from meshlm.engine.request import Reasoning

    start, end = _tags(tokenizer)
    x, a, y, q = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "xayq")
    g = grammars.from_regex("x[ab]{0,3}y")
    opened = grammars.constraint(g, Reasoning(start, end, open=True))  # the prompt opened the reasoning
    mask, ends = opened.allowed()
    assert mask[q].item() and mask[end].item() and not mask[EOS].item() and not ends  # free, but no EOS
    opened.advance([q, q, end])
    mask, _ = opened.allowed()
    assert mask[x].item() and not mask[q].item() and not mask[end].item()  # the grammar's, from its start
    opened.advance([x, a, y])
    assert opened.allowed()[1] and opened.error is None

    leading = grammars.constraint(g, Reasoning(start, end, open=False))  # a leading <think> may open it
    mask, _ = leading.allowed()
    assert mask[start].item() and mask[x].item() and not mask[q].item()
    leading.advance([x])  # no reasoning: the grammar took the first token
    assert not leading.allowed()[0][start].item() and leading.phase == "answer"


def test_drafts_across_the_end_of_the_reasoning(grammars, tokenizer):
    """Masks along drafts follow the phases (free, then the grammar's), a draft the grammar refuses after
    the end tag cuts them, an EOS draft within the reasoning too; the state is left where it was."""
    from meshlm.engine.request import Reasoning

    start, end = _tags(tokenizer)
    x, a, y, q = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "xayq")
    c = grammars.constraint(grammars.from_regex("x[ab]{0,3}y"), Reasoning(start, end, open=True))
    assert c.valid_prefix((q, end, x, q)) == 3 and c.valid_prefix((q, EOS, end)) == 1
    drafts = (q, end, x, a)
    c.prefetch(drafts)
    assert c.allowed(1, drafts)[0][q].item()  # still reasoning after the first draft
    assert not c.allowed(2, drafts)[0][q].item() and c.allowed(2, drafts)[0][x].item()  # the grammar's start
    assert c.allowed(4, drafts)[0][y].item() and not c.allowed(4, drafts)[0][x].item()  # after "xa"
    assert c.phase == "think" and c.allowed()[0][q].item()  # nothing consumed
    c.advance([q, end, x])
    assert c.phase == "answer" and c.allowed()[0][a].item() and not c.allowed()[0][x].item()


DEEP = r'''
import pathlib, sys, threading
from mlx_lm.tokenizer_utils import load as load_tokenizer
from meshlm.engine.grammar import GrammarError, Grammars
g = Grammars(load_tokenizer(pathlib.Path(sys.argv[1])), 520, frozenset({2}))
n = 2500
refs = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)} | {f"d{n}": {"type": "object"}},
        "$ref": "#/$defs/d0"}
nested = {"$defs": {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
                    for i in range(1200)} | {"d1200": {"type": "integer"}}, "$ref": "#/$defs/d0"}
rules = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(8000)) + 'r8000: "x"\n'

def run():  # on a thread of the default size, as the API's worker threads are
    for grammar in (g.from_json_schema(refs), g.from_json_schema(nested), g.from_lark(rules)):
        try:
            g.check(grammar)
            print("ok")
        except GrammarError as exc:
            print("refused", exc)

t = threading.Thread(target=run)
t.start()
t.join()
'''


def test_deep_schemas_and_grammars_compile_without_overflowing_the_stack(tiny_dir, tmp_path):
    """llguidance resolves references recursively: these (88, 80 and 100 KB, under the size limit) killed
    the server with SIGSEGV when compiled on an API worker thread's 8 MiB stack."""
    import subprocess
    import sys

    script = tmp_path / "deep.py"
    script.write_text(DEEP)
    proc = subprocess.run([sys.executable, str(script), str(tiny_dir)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:3] == ["ok"] * 3, proc.stdout
