"""The decode server's side of disaggregated prefill: hand a long prompt to a prefill server, receive its
KV blocks, and stage them where the prefix cache finds them (kv/received.py).

Prompts whose blocks a running transfer already fetches (a request's n > 1
choices, or the same prompt sent again meanwhile) wait on that transfer
instead of starting their own: one job, one copy of the KV on the wire.

A handoff never costs a request: whatever goes wrong (no peer reachable,
another model or KV dtype, a peer that dies, hangs or sends a bad packet), the
transfer ends, the log says why, and the prompt is prefilled here. Blocks that
arrived whole and checked before the failure are kept: their keys chain from
the prompt's start, so the local prefill begins after them.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from meshlm.config import DisaggConfig
from meshlm.kv.keys import CacheSalt, block_keys
from meshlm.kv.received import ReceivedBlocks
from meshlm.metrics import Metrics
from meshlm.disagg.prefill_wire import (MAX_HANDSHAKES_PER_HOST, Block, Conn, Done, Failed, Job, PeerInfo,
                                        PrefillWireError, Unreachable, Waiting, WireClosed, WireTimeout, connect,
                                        read_block)

log = logging.getLogger(__name__)

CONNECT_SECONDS = 5.0
# A peer that could not be reached (or failed the handshake) is not tried again for this long. One that
# answers with another model is tried each time: the answer costs a round trip, and it may be fixed.
UNREACHABLE_BACKOFF_SECONDS = 5.0
SMALL_MESSAGE_BYTES = 64 << 10
# Handshakes in flight to one peer at once. The peer drops an address's connections past
# MAX_HANDSHAKES_PER_HOST still authenticating, and this server answered a burst of 16 prompts (a loaded
# machine) with one dropped and the peer then backed off as unreachable: three prompts prefilled here.
# Half the cap leaves room for another decode server on this host and for the peer's count to catch up.
HANDSHAKES_PER_PEER = MAX_HANDSHAKES_PER_HOST // 2
# A job may take --prefill-timeout once, plus once per this many tokens it sends (at the default 30 s: at
# least ~34 tokens/s). Without it a peer sending each block just inside the silence limit stretches a
# request to blocks x timeout.
TOKENS_PER_TIMEOUT = 1024


@dataclass(frozen=True)
class Handoff:
    """A prompt's whole blocks to be computed elsewhere, from the first one this server lacks."""

    job_id: int
    token_ids: list[int]
    first_block: int
    keys: list[bytes]


@dataclass
class _PeerRecord:
    """What /health says of one prefill peer: jobs it finished, and the last fallback it caused."""

    done: int = 0
    fallbacks: int = 0
    last_reason: str | None = None
    last_message: str | None = None
    last_at: float | None = None  # time.monotonic()


@dataclass(frozen=True)
class _Deadlines:
    """One transfer's clock: each read or write may wait `silence` seconds, and all of them end at `end`."""

    silence: float
    end: float

    def next(self) -> float:
        return min(time.monotonic() + self.silence, self.end)

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.end


class _Fallback(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # a metric label: unreachable, refused, busy, timeout, bad_packet, closed


@dataclass(eq=False)
class Transfer:
    """One running handoff, and the prompts waiting on it; `cancel` ends it (every one of them left)."""

    handoff: Handoff
    cancelled: bool = False
    blocks: int = 0  # received so far
    conn: Conn | None = field(default=None, repr=False)
    waiters: list[Waiter] = field(default_factory=list, repr=False)

    def covers(self, handoff: Handoff) -> bool:
        """Its blocks hold all of `handoff`'s: the keys chain, so the same last key means the same prefix."""
        last = len(handoff.keys) - 1
        return (not self.cancelled and self.handoff.first_block <= handoff.first_block
                and last < len(self.handoff.keys) and self.handoff.keys[last] == handoff.keys[last])

    def cancel(self) -> None:
        self.cancelled = True
        conn = self.conn
        if conn is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the transfer thread's read at once
            except OSError:
                pass


@dataclass(eq=False)
class Waiter:
    """One prompt's wait on a transfer; `cancel` when its request was aborted."""

    client: PrefillClient
    transfer: Transfer
    done: Callable[[], None]

    def cancel(self) -> None:
        self.client._leave(self)


class PrefillClient:
    def __init__(self, config: DisaggConfig, secret, info: PeerInfo, salt: CacheSalt, dtype: mx.Dtype,
                 received: ReceivedBlocks, metrics: Metrics) -> None:
        self.config = config
        self.secret = secret
        self.info = info
        self.salt = salt
        self.dtype = dtype
        self.received = received
        self.metrics = metrics
        self._job_ids = itertools.count(1)
        self._down_until: dict[str, float] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._running: list[Transfer] = []
        self._handshakes = {p: threading.BoundedSemaphore(HANDSHAKES_PER_PEER) for p in config.peers}
        self._records = {p: _PeerRecord() for p in config.peers}

    def peer_status(self) -> list[dict]:
        """Each peer as /health shows it: an operator sees why long prompts are prefilled here."""
        now = time.monotonic()
        out = []
        with self._lock:
            for peer, r in self._records.items():
                last = None if r.last_at is None else {
                    "reason": r.last_reason, "message": r.last_message, "seconds_ago": round(now - r.last_at, 1)}
                out.append({"address": peer, "up": self._down_until.get(peer, 0.0) <= now, "jobs_done": r.done,
                            "fallbacks": r.fallbacks, "last_fallback": last})
        return out

    def _record(self, peer: str, fallback: _Fallback | None) -> None:
        with self._lock:
            r = self._records.get(peer)
            if r is None:  # no peer was picked (none up): each peer's own failure is recorded already
                return
            if fallback is None:
                r.done += 1
            else:
                r.fallbacks += 1
                r.last_reason, r.last_message, r.last_at = fallback.reason, str(fallback), time.monotonic()

    def plan(self, prompt_ids: list[int], cached: Callable[[list[bytes]], int]) -> Handoff | None:
        """A handoff for this prompt, or None to prefill it here: too few uncached tokens, or no peer up.
        `cached(keys)`: how many leading blocks this server already holds."""
        bs = self.salt.block_size
        blocks = (len(prompt_ids) - 1) // bs  # the last token is always computed here: its logits are sampled
        if len(prompt_ids) < self.config.min_tokens or blocks == 0:
            return None
        keys = block_keys(prompt_ids[: blocks * bs], self.salt)
        first = cached(keys)
        if len(prompt_ids) - first * bs < self.config.min_tokens or first >= blocks:
            return None
        if not self._peers_up():
            self.metrics.disagg_fallbacks.labels(reason="unreachable").inc()
            return None
        return Handoff(next(self._job_ids), prompt_ids[: blocks * bs], first, keys)

    def _peers_up(self) -> list[str]:
        now = time.monotonic()
        return [p for p in self.config.peers if self._down_until.get(p, 0.0) <= now]

    def _pick(self) -> str:
        with self._lock:
            up = self._peers_up()
            if not up:
                raise _Fallback("unreachable", "no prefill peer is up")
            return up[next(self._turn) % len(up)]

    def _down(self, peer: str, seconds: float) -> None:
        with self._lock:
            self._down_until[peer] = time.monotonic() + seconds

    def start(self, handoff: Handoff, done: Callable[[], None]) -> Waiter:
        """Run the handoff on its own thread, or wait on a running one that fetches all its blocks; `done()`
        is called once it ended, however it ended (or at once on another thread, if this prompt left a
        transfer others still wait on)."""
        with self._lock:
            transfer = next((t for t in self._running if t.covers(handoff)), None)
            joined = transfer is not None
            if not joined:
                transfer = Transfer(handoff)
                self._running.append(transfer)
            waiter = Waiter(self, transfer, done)
            transfer.waiters.append(waiter)
        if joined:
            self.metrics.disagg_joined.inc()
        else:
            threading.Thread(target=self._run, args=(transfer,), name=f"meshlm-handoff-{handoff.job_id}",
                             daemon=True).start()
        return waiter

    def _leave(self, waiter: Waiter) -> None:
        """A waiting prompt's request was aborted: the transfer ends if nobody else waits on it."""
        transfer = waiter.transfer
        with self._lock:
            if waiter not in transfer.waiters:  # the transfer ended: its done is called already
                return
            last = len(transfer.waiters) == 1
            if last:
                transfer.cancelled = True  # under the lock: no prompt joins it from now on
            else:
                transfer.waiters.remove(waiter)
        if last:
            transfer.cancel()  # done is called as the transfer thread ends
        else:  # not under the engine's lock, which the caller may hold
            threading.Thread(target=waiter.done, name="meshlm-handoff-left", daemon=True).start()

    def _run(self, transfer: Transfer) -> None:
        h = transfer.handoff
        t0 = time.monotonic()
        peer = ""
        self.metrics.disagg_handoffs.inc()
        try:
            peer = self._pick()
            self._transfer(peer, transfer)
            self.metrics.disagg_transfer_time.observe(time.monotonic() - t0)
            self._record(peer, None)
        except _Fallback as exc:
            if transfer.cancelled:  # only what this transfer put: the blocks before first_block (and any
                # prefix shared with another prompt) may be another request's received blocks, not yet loaded
                self.received.discard(h.keys[h.first_block:h.first_block + transfer.blocks])
            else:
                self.metrics.disagg_fallbacks.labels(reason=exc.reason).inc()
                self._record(peer, exc)
                log.warning("prefill handoff: %s; prefilling locally (%d of %d blocks received)", exc,
                            transfer.blocks, len(h.keys) - h.first_block)
        except Exception as exc:  # a bug here must cost latency, never the request
            self.metrics.disagg_fallbacks.labels(reason="error").inc()
            self._record(peer, _Fallback("error", f"{type(exc).__name__}: {exc}"))
            log.exception("prefill handoff to %s failed: %s; prefilling locally", peer or "-", exc)
        finally:
            self.received.end(h.job_id)
            with self._lock:
                self._running.remove(transfer)
                waiters, transfer.waiters = transfer.waiters, []
            for waiter in waiters:
                waiter.done()

    def _transfer(self, peer: str, transfer: Transfer) -> None:
        """Receive the job's blocks into the received tier. Raises _Fallback."""
        h = transfer.handoff
        timeout = self.config.timeout
        tokens = (len(h.keys) - h.first_block) * self.salt.block_size
        limit = timeout * (1 + tokens / TOKENS_PER_TIMEOUT)
        clock = _Deadlines(timeout, time.monotonic() + limit)
        wait = min(timeout, CONNECT_SECONDS)
        slot = self._handshakes[peer]
        if not slot.acquire(timeout=wait):  # this server's own burst: not the peer's fault
            raise _Fallback("busy", f"{HANDSHAKES_PER_PEER} handshakes with {peer} took over {wait:.0f} s")
        try:
            conn = connect(peer, self.secret, wait,
                           on_socket=lambda c: setattr(transfer, "conn", c))  # a cancel may shut it from now
        except Unreachable as exc:
            self._down(peer, UNREACHABLE_BACKOFF_SECONDS)
            raise _Fallback("unreachable", str(exc)) from None
        except PrefillWireError as exc:  # it answered, but not as a prefill server of this cluster
            if transfer.cancelled:  # our own cancel shut the socket mid-handshake: the peer is not to blame
                raise _Fallback("cancelled", "the request was aborted") from None
            self._down(peer, UNREACHABLE_BACKOFF_SECONDS)
            # A peer that accepted and then said nothing (stopped, hung) stalled: not a refusal
            reason = "timeout" if isinstance(exc, WireTimeout) else "refused"
            raise _Fallback(reason, f"handshake failed: {exc}") from None
        finally:
            slot.release()
        transfer.conn = conn
        try:
            if transfer.cancelled:
                raise _Fallback("cancelled", "the request was aborted")
            conn.send_message(self.info, clock.next())
            theirs = conn.recv_message(clock.next(), SMALL_MESSAGE_BYTES)
            if isinstance(theirs, Failed):
                raise _Fallback("refused", f"{peer} refused us: {theirs.reason}")
            if not isinstance(theirs, PeerInfo):
                raise _Fallback("bad_packet", f"{peer} sent {type(theirs).__name__} instead of its description")
            why = self.info.mismatch(theirs)
            if why is not None:
                raise _Fallback("refused", f"{peer}'s KV cannot be restored here: {why}")
            conn.send_message(Job(h.job_id, h.token_ids, h.first_block), clock.next())
            index = h.first_block
            while True:
                msg = conn.recv_message(clock.next(), SMALL_MESSAGE_BYTES)
                if isinstance(msg, Block):
                    if msg.index != index or index >= len(h.keys):
                        raise _Fallback("bad_packet", f"{peer} sent block {msg.index}, expected {index} "
                                                      f"of {len(h.keys)}")
                    if msg.key != h.keys[index]:
                        raise _Fallback("bad_packet", f"{peer}: block {index} has key {msg.key.hex()[:16]}..., "
                                                      f"expected {h.keys[index].hex()[:16]}... (other tokens?)")
                    data = read_block(conn, self.info, self.dtype, h.job_id, index, msg.crc, clock.next())
                    self.received.put(msg.key, data, h.job_id)
                    self.metrics.disagg_kv_bytes.labels(direction="received").inc(data.nbytes)
                    transfer.blocks += 1
                    index += 1
                elif isinstance(msg, Done):
                    if index != len(h.keys) or msg.blocks != transfer.blocks:
                        raise _Fallback("bad_packet", f"{peer} said done after {transfer.blocks} of "
                                                      f"{len(h.keys) - h.first_block} blocks")
                    return
                elif isinstance(msg, Failed):
                    raise _Fallback("busy", f"{peer} gave up the job: {msg.reason}")
                elif isinstance(msg, Waiting):  # queued or computing there: the silence limit starts again
                    continue
                else:
                    raise _Fallback("bad_packet", f"{peer} sent {type(msg).__name__} during a job")
        except PrefillWireError as exc:
            if transfer.cancelled:
                raise _Fallback("cancelled", "the request was aborted") from None
            if isinstance(exc, WireTimeout) and clock.passed:
                raise _Fallback("timeout", f"{peer}: the job took over {limit:.1f} s, its limit for "
                                           f"{tokens} tokens") from None
            reason = "timeout" if isinstance(exc, WireTimeout) else "closed" if isinstance(exc, WireClosed) else "bad_packet"
            raise _Fallback(reason, str(exc)) from None
        finally:
            conn.close()
