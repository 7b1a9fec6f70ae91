"""Stop strings matched across token boundaries, never leaked into the output.

Text that could still be the start of a stop string is held back until the
next piece either completes the match (the stop string and everything after
it are dropped) or rules it out (the held text is released).
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add decoded text; return what may be shown now. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        self.text += piece
        if not self.stops:
            return self._emit(len(self.text))
        longest = max(len(s) for s in self.stops)
        search_from = max(0, self.emitted - longest + 1)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit(min(hits))
        return self._emit(len(self.text) - self._held_back())

    def flush(self) -> str:
        """Release held-back text when the sequence ends for another reason."""
        return "" if self.stopped else self._emit(len(self.text))

    def _held_back(self) -> int:
        for n in range(min(len(self.text), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _emit(self, end: int) -> str:
        end = max(end, self.emitted)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
