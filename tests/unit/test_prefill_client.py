"""The decode side's handoffs share transfers: prompts whose blocks one transfer fetches wait on it.

The network part of a transfer (`_transfer`) is replaced by one the test releases; the real wire runs in
tests/integration/test_disaggregated.py."""

import threading

import mlx.core as mx
import pytest

from meshlm.config import DisaggConfig
from meshlm.disagg.prefill_client import PrefillClient
from meshlm.kv.keys import CacheSalt
from meshlm.kv.received import ReceivedBlocks
from meshlm.metrics import Metrics

BS = 4


class HeldTransfers:
    """Stands in for the socket work: each transfer runs until the test releases it, or is cancelled."""

    def __init__(self) -> None:
        self.started: list = []
        self.release = threading.Event()

    def __call__(self, peer: str, transfer) -> None:
        self.started.append(transfer)
        while not (self.release.is_set() or transfer.cancelled):
            self.release.wait(0.01)


@pytest.fixture
def client(monkeypatch):
    config = DisaggConfig(peers=("127.0.0.1:1",), min_tokens=8)
    c = PrefillClient(config, None, None, CacheSalt("m", "float32", "tp1", BS), mx.float32,
                      ReceivedBlocks(1 << 20), Metrics())
    held = HeldTransfers()
    monkeypatch.setattr(c, "_transfer", held)
    return c, held


class Done:
    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self) -> None:
        assert not self.event.is_set(), "done called twice"
        self.event.set()


def plan(c: PrefillClient, ids: list[int], cached: int = 0):
    return c.plan(ids, lambda keys: min(cached, len(keys)))


def test_prompts_with_the_same_blocks_wait_on_one_transfer(client):
    c, held = client
    prompt = list(range(40))
    dones = [Done() for _ in range(3)]
    waiters = [c.start(plan(c, prompt), d) for d in dones]
    shorter = Done()  # a prompt whose blocks are a prefix of the running transfer's joins it too
    c.start(plan(c, prompt[:21]), shorter)
    other = Done()  # other tokens: a transfer of their own
    c.start(plan(c, list(range(1, 41))), other)
    later = Done()  # its first blocks are held here, so it needs only the transfer's later ones
    c.start(plan(c, prompt, cached=2), later)
    assert len({id(w.transfer) for w in waiters}) == 1
    assert c.metrics.disagg_joined._value.get() == 4 and c.metrics.disagg_handoffs._value.get() == 2
    assert not any(d.event.wait(0.1) for d in dones)
    held.release.set()
    assert all(d.event.wait(5) for d in dones + [shorter, other, later])
    assert len(held.started) == 2


def test_a_transfer_starting_later_in_the_prompt_is_not_joined(client):
    c, held = client
    prompt = list(range(40))
    c.start(plan(c, prompt, cached=3), Done())
    c.start(plan(c, prompt), Done())  # needs the blocks the running transfer skips
    assert c.metrics.disagg_joined._value.get() == 0
    held.release.set()


def test_a_prompt_leaving_a_shared_transfer_ends_at_once_and_the_transfer_goes_on(client):
    c, held = client
    prompt = list(range(40))
    first, second = Done(), Done()
    w1 = c.start(plan(c, prompt), first)
    w2 = c.start(plan(c, prompt), second)
    w1.cancel()
    assert first.event.wait(5)
    assert not w1.transfer.cancelled and not second.event.wait(0.1)
    w1.cancel()  # twice: nothing more
    w2.cancel()  # the last one: the transfer is cancelled, and its done comes as it ends
    assert second.event.wait(5) and w2.transfer.cancelled
    third = Done()  # a cancelled transfer is not joined
    w3 = c.start(plan(c, prompt), third)
    assert w3.transfer is not w2.transfer
    held.release.set()
    assert third.event.wait(5)


def test_a_burst_of_handoffs_keeps_its_handshakes_under_the_peers_cap(monkeypatch):
    """The prefill server drops an address's connections past MAX_HANDSHAKES_PER_HOST still authenticating,
    and the decode server then backs off from the peer: its own burst of transfers must never get there.
    Each handshake here holds its slot a while and then finds the peer unreachable."""
    from meshlm.disagg import prefill_client as pc

    config = DisaggConfig(peers=("127.0.0.1:1",), min_tokens=8)
    c = PrefillClient(config, None, None, CacheSalt("m", "float32", "tp1", BS), mx.float32,
                      ReceivedBlocks(1 << 20), Metrics())
    lock, now, most = threading.Lock(), [0], [0]

    def connect(peer, secret, timeout, on_socket=None):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        threading.Event().wait(0.05)
        with lock:
            now[0] -= 1
        raise pc.Unreachable(f"{peer}: unreachable: test")

    monkeypatch.setattr(pc, "connect", connect)
    monkeypatch.setattr(c, "_down", lambda peer, seconds: None)  # every transfer reaches the handshake
    dones = [Done() for _ in range(12)]
    for i, d in enumerate(dones):
        c.start(plan(c, [i] + list(range(100, 139))), d)
    for d in dones:
        assert d.event.wait(10)
    assert most[0] == pc.HANDSHAKES_PER_PEER < pc.MAX_HANDSHAKES_PER_HOST


def test_a_peer_that_accepts_and_says_nothing_is_a_timeout_not_a_refusal():
    """A stopped or hung prefill server (it accepts, then never answers the handshake) was counted as
    `refused` in meshlm_disagg_fallbacks_total, which the docs keep for a wrong secret or build."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:
        config = DisaggConfig(peers=(f"127.0.0.1:{silent.getsockname()[1]}",), min_tokens=8, timeout=0.3)
        c = PrefillClient(config, None, None, CacheSalt("m", "float32", "tp1", BS), mx.float32,
                          ReceivedBlocks(1 << 20), Metrics())
        done = Done()
        c.start(plan(c, list(range(100, 140))), done)
        assert done.event.wait(10)
    reasons = {s.labels["reason"]: s.value for m in c.metrics.disagg_fallbacks.collect() for s in m.samples
               if s.name.endswith("_total")}
    assert reasons == {"timeout": 1.0}, reasons


def test_health_shows_a_peer_in_its_backoff_and_why():
    """/health's prefill_peers: a peer nothing listens on is down for its backoff, with the reason."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed again: nothing listens there now
    config = DisaggConfig(peers=(f"127.0.0.1:{port}",), min_tokens=8, timeout=1)
    c = PrefillClient(config, None, None, CacheSalt("m", "float32", "tp1", BS), mx.float32,
                      ReceivedBlocks(1 << 20), Metrics())
    (fresh,) = c.peer_status()
    assert fresh == {"address": f"127.0.0.1:{port}", "up": True, "jobs_done": 0, "fallbacks": 0,
                     "last_fallback": None}
    done = Done()
    c.start(plan(c, list(range(100, 140))), done)
    assert done.event.wait(10)
    (peer,) = c.peer_status()
    assert peer["up"] is False and peer["fallbacks"] == 1 and peer["jobs_done"] == 0
    assert peer["last_fallback"]["reason"] == "unreachable" and str(port) in peer["last_fallback"]["message"]
    assert plan(c, list(range(200, 240))) is None  # in its backoff: the next long prompt is prefilled here
