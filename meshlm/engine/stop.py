"""Stop strings matched across token boundaries, never leaked into the output (unless asked for).

Text that could still be the start of a stop string is held back until the
next piece either completes the match (the stop string and everything after
it are dropped) or rules it out (the held text is released).

Each stop string runs a Knuth-Morris-Pratt automaton over the characters as
they arrive, so feeding a piece costs O(len(piece)) per stop string, whatever
the stop string's length or the text's: one client's long stop string cannot
slow the engine thread that every stream shares.
"""

from __future__ import annotations


def _failure(pattern: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of pattern[:i + 1]."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class _Automaton:
    """How much of one stop string the text's tail currently matches."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.fail = _failure(pattern)
        self.state = 0  # characters of `pattern` matched by the end of the text so far

    def step(self, ch: str) -> bool:
        """Advance by one character; True when the whole pattern has just been matched."""
        p, k = self.pattern, self.state
        while k and ch != p[k]:
            k = self.fail[k - 1]
        if ch == p[k]:
            k += 1
        # After a whole match, what can still grow into the next one is its longest border (a match that
        # was no stop, StopMatcher.feed's `armed`, is followed on from there).
        self.state = self.fail[k - 1] if k == len(p) else k
        return k == len(p)


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        self.automata = [_Automaton(s) for s in dict.fromkeys(stops) if s]
        self.include = include  # vLLM's include_stop_str_in_output: the matched stop string is shown too
        self.pending = ""  # received, not yet shown: at most the longest stop string's length
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped it (vLLM's stop_reason)

    def feed(self, piece: str, armed: bool = True) -> str:
        """Add decoded text; return what may be shown now. Sets `stopped` on a match. `armed` false: a
        match ending in this piece is no stop (the piece's token is within min_tokens; as vLLM, whose
        detokenizer checks stop strings only past them), but the text is still followed for later ones."""
        if self.stopped:
            return ""
        if not self.automata:
            return piece
        self.pending += piece
        base = len(self.pending) - len(piece)
        for i, ch in enumerate(piece):
            done = [a for a in self.automata if a.step(ch)]
            if done and armed:
                self.stopped = True
                self.matched = max((a.pattern for a in done), key=len)  # the one cut from the text
                end = base + i + 1
                return self.pending[: end if self.include else end - len(self.matched)]
        held = max(a.state for a in self.automata)
        out, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held :]
        return out

    def flush(self) -> str:
        """Release held-back text when the sequence ends for another reason."""
        if self.stopped:
            return ""
        out, self.pending = self.pending, ""
        return out
