"""What a listener holds for connections still proving themselves: bounded slots per host and in all,
and a log of the connections it refused that a flood cannot turn into a flood of lines.

A stranger may connect to any of meshlm's listeners (the control port, a pipeline stage's port, a
prefill server's port) and send nothing, or garbage, or a slow handshake. Bounding the slots per host
keeps one flooding host from taking every slot a real peer on another host needs; bounding them in all
keeps many hosts from exhausting file descriptors.
"""

from __future__ import annotations

import collections
import logging
import threading
import time


def host_key(address: str) -> str:
    """The host a connection's address names: an IPv4 peer of a dual-stack listener (`::ffff:a.b.c.d`)
    counts as the same host as on an IPv4 one."""
    return address[7:] if address.startswith("::ffff:") and "." in address else address


class HandshakeSlots:
    def __init__(self, per_host: int, total: int) -> None:
        self.per_host, self.total = per_host, total
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def take(self, host: str) -> bool:
        """A slot for one more connection from `host`, or False when the host or the listener is full."""
        with self._lock:
            mine = self._held.get(host, 0)
            if mine >= self.per_host or sum(self._held.values()) >= self.total:
                return False
            self._held[host] = mine + 1
            return True

    def release(self, host: str) -> None:
        with self._lock:
            self._held[host] -= 1
            if not self._held[host]:
                del self._held[host]


class RefusalLog:
    """Each of the first `first` refusals in a line of its own, then a line at most every `every` seconds
    saying how many more there were: a localhost flood wrote ~1,500 warnings a second."""

    def __init__(self, log: logging.Logger, line: str, first: int = 5, every: float = 10.0, keep: int = 5) -> None:
        """`line`: the warning, with %s for the peer and then the reason; `keep`: how many of the latest
        refusals `latest` names (a deadline's message), the rest only counted (a flood's held ~45 MB)."""
        self.log, self.line, self.first, self.every = log, line, first, every
        self._lock = threading.Lock()
        self.count = 0  # refusals so far
        self._latest: collections.deque[str] = collections.deque(maxlen=keep)
        self._unsaid = 0  # refusals since the last line
        self._last = 0.0

    def latest(self) -> list[str]:
        """The latest refusals, `peer: reason`, oldest first."""
        with self._lock:
            return list(self._latest)

    def close(self) -> None:
        """Once the listener stops taking connections: the refusals no line has counted yet, in one."""
        with self._lock:
            more, self._unsaid = self._unsaid, 0
        if more:
            self.log.warning(self.line, "other peers", f"{more} more connection(s) refused since the last such line")

    def refused(self, peer: str, reason: str) -> None:
        with self._lock:
            self.count += 1
            self._latest.append(f"{peer}: {reason}")
            now = time.monotonic()
            if self.count > self.first and now - self._last < self.every:
                self._unsaid += 1
                return
            more, self._unsaid, self._last = self._unsaid, 0, now
        tail = f" ({more} more refused since the last such line)" if more else ""
        self.log.warning(self.line + "%s", peer, reason, tail)
