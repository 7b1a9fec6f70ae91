"""Grammar-constrained sampling (leader only): llguidance matchers and the token masks they allow.

A constrained request carries an llguidance grammar (JSON Schema, regex, Lark
or a choice list, compiled to llguidance's own JSON form by the API). The
`Grammars` object owns the tokenizer llguidance needs and a cache of
validated grammars, so a schema that many requests share is compiled once;
each sequence gets a copy of the cached matcher (`Constraint`).

Sampling only happens on the leader, so constraints work unchanged whatever
the layout of the ranks (tensor, pipeline, context parallel). The engine asks
each constrained sequence for its next mask right after it launches a forward
(`prefetch`), so the mask is computed while the ranks compute logits.

Speculative decoding: row j of a verified chunk is masked with the grammar's
state after drafts[:j]; a draft the grammar forbids has probability 0 under
the masked target, so it is rejected like any other, and the rows after it
are never reached. Masks along the drafts are computed by consuming them and
rolling back.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time

import mlx.core as mx
import numpy as np

from meshlm.engine.request import Reasoning

log = logging.getLogger(__name__)

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar text larger than this is refused before compiling
MAX_FIRST_MASK_SECONDS = 0.1  # a grammar whose first token mask takes longer is refused
CACHE_SIZE = 256  # validated grammars kept (LRU), each with a compiled matcher to copy
# ... and at most this much grammar text among them: a compiled matcher holds ~50x its text (4-5 MB for an
# 80 KB schema here), so 256 large grammars, one client's to send, would have held GBs.
CACHE_CHARS = 4 * 2**20
# llguidance's own fuel limits bound compile and mask time (its defaults are generous: ~20 ms of
# lexer work to build a grammar, ~15 ms per mask step at most); these are tighter.
LIMITS = dict(initial_lexer_fuel=500_000, step_lexer_fuel=100_000, step_max_items=40_000,
              max_lexer_states=100_000, max_grammar_size=200_000)


# llguidance resolves a schema's references and a grammar's rules recursively on the native stack: a
# chain of 2,500 `$ref`s (an 88 KB schema) or 1,000 objects nested through them overflowed a thread's
# 8 MiB and killed the server (SIGSEGV). Up to MAX_GRAMMAR_CHARS 64 MiB was enough here; grammars compile
# on a thread of their own with this much (address space, touched only as deep as a grammar goes).
COMPILE_STACK_BYTES = 256 * 2**20

# JSON as json.dumps writes it: no free whitespace, which a model (a random one above all) could spend
# its whole budget on. A schema's own "x-guidance" options still override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar llguidance refuses (invalid, unsupported features, too complex): a client error."""


class _Slow(GrammarError):
    pass


class Grammars:
    """llguidance's view of the tokenizer plus the cache of compiled grammars (thread-safe: the API
    validates on worker threads while the engine thread creates constraints)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        backend = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF one
        self.tokenizer = llguidance.hf.from_tokenizer(backend, n_vocab=vocab_size,
                                                      eos_token=list(self.eos_token_ids) or None)
        self._limits = llguidance.LLParserLimits(**LIMITS)
        # grammar text -> an LLMatcher at its start state (copied for each sequence), or why it was refused
        self._cache: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._cache_chars = 0  # grammar text held in the cache (CACHE_CHARS)
        self._lock = threading.Lock()
        self._stack_lock = threading.Lock()  # held while threading.stack_size is the compile thread's

    # -- grammar sources -> llguidance grammars (no compile yet) -----------
    def from_json_schema(self, schema: dict | str) -> str:
        problem = _unsound_number(schema)
        if problem is not None:
            raise GrammarError(f"invalid JSON schema: {problem}")
        try:
            return self._ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except Exception as exc:  # llguidance raises ValueError, but a schema is anything a client sent
            raise GrammarError(f"invalid JSON schema: {exc}") from None

    def from_regex(self, regex: str) -> str:
        # A trailing lone backslash escapes nothing, an error in any regex dialect. llguidance writes the
        # regex into a Lark /.../ literal, where it escaped the closing slash instead: "a\\" became a
        # valid grammar of another language, and a 200 answered it.
        if (len(regex) - len(regex.rstrip("\\"))) % 2:
            raise GrammarError("invalid regex: it ends in a lone backslash (escape it as \\\\ to match one)")
        return self._ll.LLMatcher.grammar_from_regex(regex)

    def from_lark(self, lark: str) -> str:
        return self._ll.LLMatcher.grammar_from_lark(lark)

    # -- compile and cache -------------------------------------------------
    def check(self, grammar: str) -> None:
        """Compile (or find cached) `grammar`; GrammarError saying why it cannot be used."""
        self._compiled(grammar)

    def constraint(self, grammar: str, reasoning: "Reasoning | None" = None) -> "Constraint":
        return Constraint(self._compiled(grammar).deep_copy(), self.vocab_size, self.eos_token_ids, reasoning)

    def _compiled(self, grammar: str):
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
        if hit is None:
            # Outside the lock: compiling can take a while (it drops the GIL).
            hit = self._on_compile_stack(lambda: self._compile(grammar))
            if isinstance(hit, _Slow):  # timed, so not quite repeatable: refused now, not remembered
                raise GrammarError(str(hit))
            with self._lock:
                if grammar not in self._cache:  # another thread may have compiled it meanwhile
                    self._cache[grammar] = hit
                    self._cache_chars += len(grammar)
                while len(self._cache) > CACHE_SIZE or (self._cache_chars > CACHE_CHARS and len(self._cache) > 1):
                    self._cache_chars -= len(self._cache.popitem(last=False)[0])
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def _on_compile_stack(self, compile_):
        """`compile_()` on a thread with COMPILE_STACK_BYTES of stack: its result, or its exception."""
        out: list = []

        def run() -> None:
            try:
                out.append((compile_(), None))
            except BaseException as exc:  # handed to the caller's thread
                out.append((None, exc))

        with self._stack_lock:  # the size is the process's, for any thread started meanwhile
            old = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                thread = threading.Thread(target=run, name="meshlm-grammar-compile", daemon=True)
                thread.start()
            except RuntimeError:  # no room for such a stack (a strict overcommit policy): as before
                log.warning("cannot start a thread with a %d MiB stack to compile a grammar; compiling on this "
                            "one", COMPILE_STACK_BYTES >> 20)
                thread = None
            finally:
                threading.stack_size(old)
        if thread is None:
            return compile_()
        thread.join()
        value, exc = out[0]
        if exc is not None:
            raise exc
        return value

    def _compile(self, grammar: str):
        """An LLMatcher, or the GrammarError saying why not (returned, so that refusals are cached too)."""
        if len(grammar) > MAX_GRAMMAR_CHARS:
            return GrammarError(f"the grammar is too large ({len(grammar)} characters after compilation to "
                                f"llguidance's form; at most {MAX_GRAMMAR_CHARS})")
        try:
            is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer,
                                                                                   limits=self._limits)
        except Exception as exc:
            return GrammarError(f"invalid grammar: {exc}")
        if is_error:  # without an error, `messages` holds warnings only
            return GrammarError(messages[0] if messages else "invalid grammar")
        matcher = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        # llguidance builds its lexer lazily: the first mask is where a pathological grammar costs.
        # Computing it here (on the API's worker thread, not the engine's) bounds that cost per request.
        # This thread's CPU time, not the wall clock: on a busy machine (a CI run, other requests) the
        # wall clock counted time the thread waited for a core, and refused a 2 ms grammar at 116 ms.
        probe = matcher.deep_copy()
        t0 = time.thread_time()
        probe.compute_bitmask()
        took = time.thread_time() - t0
        if matcher.is_error() or probe.is_error():
            return GrammarError(_first_line(matcher.get_error() or probe.get_error()))
        if took > MAX_FIRST_MASK_SECONDS:
            return _Slow(f"the grammar is too complex: its first step took {took * 1000:.0f} ms "
                         f"(at most {MAX_FIRST_MASK_SECONDS * 1000:.0f} ms)")
        return matcher


def _first_line(error: str) -> str:
    """llguidance's error without the parser state and grammar it appends (hundreds of characters the
    client sent or cannot use)."""
    line = next(iter(error.splitlines()), "") or "invalid grammar"
    if line == "NoExtensionBias":  # llguidance's name for "no token can begin this"
        return "the grammar matches no text: no token can begin it"
    return line


EXACT_INTEGER = 2**53  # llguidance reads a schema's numbers as float64: integers beyond this are rounded
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _unsound_number(schema) -> str | None:
    """What llguidance would enforce otherwise than the schema says, or None (also when the text is not
    JSON: llguidance then says why): a bound, `const` or `enum` value that is an integer float64 cannot
    hold (as a bound it would let a neighbouring value through, as a value it would be written rounded),
    or a `multipleOf` that is not positive (JSON Schema's rule; llguidance took -1 as 1)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None
    stack = [(schema, False)]  # (value, inside a const or enum value)
    while stack:
        value, literal = stack.pop()
        if isinstance(value, int) and not isinstance(value, bool):
            if literal and abs(value) > EXACT_INTEGER:
                return (f"{value} is beyond ±2**53, which this server's grammar engine holds only rounded (it "
                        "would allow a neighbouring value instead)")
        elif isinstance(value, list):
            stack.extend((v, literal) for v in value)
        elif isinstance(value, dict):
            for key, v in value.items():
                numeric = not literal and key in _NUMBER_KEYWORDS
                if numeric and key == "multipleOf" and isinstance(v, (int, float)) and not isinstance(v, bool) \
                        and not v > 0:
                    return f"multipleOf must be greater than 0, got {v}"
                stack.append((v, literal or numeric or key in ("const", "enum")))
    return None


# A sequence's phase under a Reasoning: `start` (a leading <think> may open the reasoning; any other token is
# the answer's first), `think` (anything but EOS, until </think>), `answer` (the grammar's).
START, THINK, ANSWER = "start", "think", "answer"


class Constraint:
    """One sequence's grammar state and the masks it allows (bool arrays over the model's vocabulary)."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: tuple[int, ...],
                 reasoning: Reasoning | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.reasoning = reasoning
        self.phase = ANSWER if reasoning is None else THINK if reasoning.open else START
        self._thinking_mask: tuple[mx.array, bool] | None = None  # made on first use
        self._words = (vocab_size + 31) // 32
        self._ahead: tuple[int, ...] = ()  # drafts the cached masks were computed along
        self._masks: list[tuple[mx.array, bool]] = []  # per position: (allowed, only EOS/end allowed)
        self.error: str | None = None  # set when a token the grammar refuses was taken (`advance`)
        # ... and whether the grammar's own mask had allowed it: llguidance contradicting itself (a regex
        # spelling a special token's text, a schema whose forced tokens never end), which the same request
        # would meet again, rather than a sampler taking a masked token (a bug of ours).
        self.request_fault = False

    def prefetch(self, drafts: tuple[int, ...] = ()) -> None:
        """Compute the masks for the next token and along `drafts` (rows of a verified chunk)."""
        if self._masks and self._ahead == drafts:
            return
        # A refused token would put the matcher in its error state for good: consume only valid ones.
        valid = self.valid_prefix(drafts)
        masks = []
        consumed = 0  # what rollback counts: llguidance takes an EOS draft once the grammar is complete (the
        # matcher stopped) as a no-op, and undoing it too rolled back one real token, so later masks
        # followed text one token behind: a refused token (a 400), or masks allowing what the grammar does not
        phase = self.phase
        for j in range(valid + 1):
            masks.append(self._mask(phase))
            if j < valid:
                phase, grammar_token = self._step(phase, drafts[j])
                if grammar_token:
                    consumed += not self.matcher.is_stopped()
                    self.matcher.consume_token(drafts[j])
        if consumed:
            self.matcher.rollback(consumed)
        # Positions after a forbidden draft are never reached (it is rejected); they reuse its mask.
        masks += [masks[-1]] * (len(drafts) + 1 - len(masks))
        self._ahead, self._masks = drafts, masks

    def allowed(self, position: int = 0, drafts: tuple[int, ...] = ()) -> tuple[mx.array, bool]:
        """(mask, ends) for row `position` of a chunk with `drafts`; `ends`: the grammar is complete and
        allows nothing but ending (so a min_tokens ban on EOS must yield)."""
        self.prefetch(drafts)
        return self._masks[position]

    def valid_prefix(self, drafts: tuple[int, ...]) -> int:
        """How many leading drafts the grammar allows (n-gram drafts are cut there: they are a point mass,
        so cutting changes nothing but the wasted work)."""
        phase = self.phase
        for i, t in enumerate(drafts):
            if phase == THINK and t in self.eos_token_ids:
                return i
            phase, grammar_token = self._step(phase, t)
            if grammar_token:  # the answer's (first) token: the grammar judges the rest
                return i + self.matcher.validate_tokens(list(drafts[i:]))
        return len(drafts)

    def _step(self, phase: str, token: int) -> tuple[str, bool]:
        """The phase after `token`, and whether the grammar takes it."""
        if phase == ANSWER:
            return ANSWER, True
        if phase == START:
            return (THINK, False) if token == self.reasoning.start else (ANSWER, True)
        return (ANSWER if token == self.reasoning.end else THINK), False

    def advance(self, tokens: list[int]) -> None:
        """Consume the tokens a step took. A refused token cannot happen (it was masked); should it, the
        matcher stops, every later mask allows only ending, and `error` says why: the engine ends the
        sequence with it rather than pass off text the grammar does not allow as constrained output."""
        masks, self._ahead, self._masks = self._masks, (), []
        for i, t in enumerate(tokens):
            self.phase, grammar_token = self._step(self.phase, t)
            if grammar_token and not self.matcher.consume_token(t):
                reason = next(iter((self.matcher.get_error() or "").splitlines()), "no reason given")
                if self.error is None:
                    self.request_fault = i < len(masks) and 0 <= t < self.vocab_size and bool(masks[i][0][t].item())
                    self.error = (f"the grammar cannot go on: it refused token {t}, which its own mask allowed "
                                  f"({reason})" if self.request_fault else
                                  f"the grammar refused sampled token {t} ({reason})")
                log.error("%s", self.error)
                break

    def _mask(self, phase: str = ANSWER) -> tuple[mx.array, bool]:
        if phase == THINK:  # reasoning is free, but it must end before the answer can
            if self._thinking_mask is None:
                bits = np.ones(self.vocab_size, dtype=np.bool_)
                bits[list(self.eos_token_ids)] = False
                self._thinking_mask = (mx.array(bits), False)
            return self._thinking_mask
        words = np.full(self._words, -1, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size].astype(np.bool_)
        if not bits.any():  # a matcher in its error state allows nothing: end the sequence instead
            bits[list(self.eos_token_ids)] = True
        if phase == START:  # or the reasoning opens first
            bits[self.reasoning.start] = True
            return mx.array(bits), False
        return mx.array(bits), self.matcher.is_stopped()
