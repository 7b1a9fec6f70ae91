"""Pipeline stages: the layer split, the rank <-> stage map, a stage loading only its weights (tied
embeddings too), and the stage link's authenticated handshake."""

from __future__ import annotations

import json
import socket
import threading
import time

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from meshlm.cluster.stages import StageLayout
from meshlm.config import ModelConfig
from meshlm.model import cpu_kernels, demo
from meshlm.model.adapt import adapt
from meshlm.model.loader import StageSlice, load_model
from meshlm.transport import stage_link
from meshlm.transport.auth import ClusterSecret
from meshlm.transport.stage_link import ActivationSpec, StageLinkError

SECRET = ClusterSecret("a" * 64)


def test_even_uneven_and_proportional_splits():
    assert StageLayout.create(30, 2).split == (15, 15)
    assert StageLayout.create(30, 2, (10, 20)).layers(1) == (10, 30)
    assert StageLayout.create(7, 3).split in ((3, 2, 2), (2, 3, 2), (2, 2, 3))
    assert StageLayout.create(30, 2, weights=(16.0, 48.0)).split == (8, 22)  # a bigger host holds more layers
    assert sum(StageLayout.create(5, 5).split) == 5
    # memory_gb is any finite number: two of 1e308 summed to inf, and the split was "cannot convert NaN"
    assert StageLayout.create(4, 2, weights=(1e308, 1e308)).split == (2, 2)


@pytest.mark.parametrize("split, words", [((10, 19), "covers 29 layers"), ((30, 0), "at least one layer"),
                                          ((10, 10, 10), "names 3 stages")])
def test_a_split_that_does_not_fit_is_refused(split, words):
    with pytest.raises(ValueError, match=words):
        StageLayout.create(30, 2, split)


def test_the_leader_runs_the_last_stage():
    layout = StageLayout.create(12, 3)
    assert [layout.rank_of(s) for s in range(3)] == [1, 2, 0]
    assert [layout.stage_of(r) for r in range(3)] == [2, 0, 1]
    assert layout.name == "pp4-4-4"


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = demo.make_tiny(tmp_path_factory.mktemp("tied"), "llama", layers=4)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))
    return path


def _names(loaded) -> set[str]:
    return {k for k, _ in tree_flatten(loaded.model.parameters())}


def test_each_stage_holds_only_its_weights(tied):
    cfg = ModelConfig(str(tied))
    first = load_model(cfg, stage=StageSlice(0, 1, embeds=True, logits=False))
    middle = load_model(cfg, stage=StageSlice(1, 3, embeds=False, logits=False))
    last = load_model(cfg, stage=StageSlice(3, 4, embeds=False, logits=True))
    assert "model.embed_tokens.weight" in _names(first) and "model.norm.weight" not in _names(first)
    assert not any("embed" in n or n == "model.norm.weight" for n in _names(middle))
    assert {n.split(".")[2] for n in _names(middle) if n.startswith("model.layers.")} == {"0", "1"}  # two layers
    # Tied embeddings: the table is the head, so the last stage holds it (and no lm_head).
    assert "model.embed_tokens.weight" in _names(last) and not any(n.startswith("lm_head") for n in _names(last))
    whole = sum(v.nbytes for _, v in tree_flatten(load_model(cfg).model.parameters()))
    assert sum(v.nbytes for _, v in tree_flatten(middle.model.parameters())) < whole / 2


@pytest.mark.skipif(cpu_kernels.native_ops()[0] is None, reason="the compiled kernels are not built")
def test_only_the_stage_computing_logits_packs_a_tied_table(tied):
    """The packed table serves the LM head; the first stage only looks rows up, so it keeps the plain table."""
    cfg, native = ModelConfig(str(tied)), cpu_kernels.native_ops()[0]
    first = load_model(cfg, stage=StageSlice(0, 1, embeds=True, logits=False))
    last = load_model(cfg, stage=StageSlice(3, 4, embeds=False, logits=True))
    assert type(adapt(first.model, True, native).embed) is nn.Embedding
    assert isinstance(adapt(last.model, True, native).embed, cpu_kernels.PackedEmbedding)


def _pair(accept_secret=SECRET, connect_secret=SECRET, claim=(0, 1), timeout=5.0, liveness=5.0):
    server = stage_link.listen("127.0.0.1", 0)
    port = server.getsockname()[1]
    out: dict = {}

    def accept():
        try:
            out["accepted"] = stage_link.accept(server, accept_secret, 1, 0, timeout, liveness)
        except StageLinkError as exc:
            out["accept_error"] = exc

    t = threading.Thread(target=accept)
    t.start()
    try:
        out["connected"] = stage_link.connect(f"127.0.0.1:{port}", connect_secret, claim[0], claim[1], timeout,
                                              liveness)
    except StageLinkError as exc:
        out["connect_error"] = exc
    t.join()
    server.close()
    return out


def test_an_activation_crosses_a_link():
    out = _pair()
    a, b = out["connected"], out["accepted"]
    hidden = mx.random.normal((1, 3, 8))
    a.send_activation(7, 12, hidden, 5.0)
    got = b.recv_activation(7, 12, 3, ActivationSpec(8, mx.float32), 5.0)
    assert mx.array_equal(got, hidden)
    a.send_activation(8, 15, hidden, 5.0)
    with pytest.raises(StageLinkError, match="stage 0 sent a bad activation packet.*expected step 9"):
        b.recv_activation(9, 15, 3, ActivationSpec(8, mx.float32), 5.0)
    a.close()  # after a bad packet the stream cannot be trusted: the cluster stops (it never reads on)
    b.close()
    out = _pair()
    a, b = out["connected"], out["accepted"]
    for bad in (mx.nan, mx.inf):  # well-formed, but what the next stages would compute and cache on
        a.send_activation(7, 12, mx.concatenate([hidden[:, :2], mx.full((1, 1, 8), bad)], axis=1), 5.0)
        with pytest.raises(StageLinkError, match="stage 0 sent activations that are not finite"):
            b.recv_activation(7, 12, 3, ActivationSpec(8, mx.float32), 5.0)
    a.close()
    b.close()
    out = _pair()
    out["connected"].close()
    with pytest.raises(StageLinkError, match="stage 0 closed the link"):
        out["accepted"].recv_activation(0, 0, 3, ActivationSpec(8, mx.float32), 5.0)
    out["accepted"].close()


def test_a_large_activation_waits_for_a_busy_stage_longer_than_the_liveness():
    """The next stage computing another micro-batch for longer than --worker-timeout leaves an activation
    larger than the socket buffers unread: the kernel's unacked-send limit (TCP_USER_TIMEOUT, which counts
    zero-window probes) reset the healthy link after ~1 s, and the sender said "timed out after 60 s".
    The send's own deadline is the step's."""
    out = _pair(liveness=0.5)
    a, b = out["connected"], out["accepted"]
    hidden = mx.ones((1, 1024, 4096))  # 16 MiB
    mx.eval(hidden)
    got: dict = {}

    def busy_then_read():
        threading.Event().wait(2.0)  # four times the liveness
        got["hidden"] = b.recv_activation(3, 0, 1024, ActivationSpec(4096, mx.float32), 30.0)

    t = threading.Thread(target=busy_then_read)
    t.start()
    a.send_activation(3, 0, hidden, 30.0)
    t.join()
    assert mx.array_equal(got["hidden"], hidden)
    a.close()
    b.close()


def test_a_flood_of_refused_connections_is_counted_not_kept():
    """Every refused connection's text was kept until the deadline: ~45 MB in 35 s of a flood (helper-61).
    The deadline's message counts them and names the last few."""
    server = stage_link.listen("127.0.0.1", 0)
    port = server.getsockname()[1]
    got: dict = {}

    def accept():
        try:
            stage_link.accept(server, SECRET, 1, 0, 2.0, 5.0)
        except StageLinkError as exc:
            got["error"] = str(exc)

    t = threading.Thread(target=accept)
    t.start()
    for _ in range(60):  # each says something that is not a handshake, then hangs up
        with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
            c.sendall(b"x" * 200)
    t.join()
    server.close()
    assert "stage 0 did not connect to stage 1 within 2 s (refused" in got["error"]
    refused = int(got["error"].split("(refused ")[1].split(":")[0])
    assert refused >= 50 and got["error"].count("127.0.0.1:") <= 3, got["error"]


def test_a_stage_with_the_wrong_secret_or_place_is_refused():
    out = _pair(connect_secret=ClusterSecret("b" * 64), timeout=1.5)
    assert "did not prove it holds the cluster secret" in str(out["connect_error"])
    assert "did not connect" in str(out["accept_error"]) and "refused" in str(out["accept_error"])
    out = _pair(claim=(2, 1), timeout=1.5)
    assert "stage 1 takes only stage 0" in str(out["accept_error"])
    # Told so, the connecting stage fails at once: a bare close would have it retry until its deadline
    server = stage_link.listen("127.0.0.1", 0)
    t = threading.Thread(target=lambda: pytest.raises(StageLinkError, stage_link.accept, server, SECRET, 1, 0, 3.0, 5.0))
    t.start()
    t0 = time.monotonic()
    with pytest.raises(StageLinkError, match="stage 1 refused the link from stage 2: it takes only stage 0"):
        stage_link.connect(f"127.0.0.1:{server.getsockname()[1]}", SECRET, 2, 1, 20.0, 5.0)
    assert time.monotonic() - t0 < 2.0
    t.join()
    server.close()


def test_a_silent_neighbour_is_a_timeout_not_a_hang():
    server = stage_link.listen("127.0.0.1", 0)
    port = server.getsockname()[1]
    lurker = socket.create_connection(("127.0.0.1", port))  # connects, never says a word
    with pytest.raises(StageLinkError, match="did not connect to stage 1 within 1 s.*handshake timed out"):
        stage_link.accept(server, SECRET, 1, 0, 1.0, 5.0)
    lurker.close()
    server.close()


def test_a_silent_connection_does_not_keep_the_real_neighbour_out(monkeypatch):
    """A connection that says nothing had the whole start deadline for its handshake: the real stage 0,
    connected right behind it, failed with it and the cluster never formed. Each connection now has
    HANDSHAKE_SECONDS."""
    monkeypatch.setattr(stage_link, "HANDSHAKE_SECONDS", 0.5, raising=False)
    server = stage_link.listen("127.0.0.1", 0)
    port = server.getsockname()[1]
    lurker = socket.create_connection(("127.0.0.1", port))
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault(
        "link", stage_link.connect(f"127.0.0.1:{port}", SECRET, 0, 1, 10.0, 5.0)))
    t.start()
    link = stage_link.accept(server, SECRET, 1, 0, 10.0, 5.0)
    t.join()
    hidden = mx.ones((1, 2, 8))
    out["link"].send_activation(0, 0, hidden, 5.0)
    assert mx.array_equal(link.recv_activation(0, 0, 2, ActivationSpec(8, mx.float32), 5.0), hidden)
    for s in (lurker, server, link, out["link"]):
        s.close()


def test_silent_strangers_from_another_host_do_not_hold_the_neighbour_back():
    """The listener took one handshake at a time, HANDSHAKE_SECONDS each, behind a backlog of 4: five
    silent strangers delayed a real neighbour 25 s, and a flood of them failed the start."""
    server = stage_link.listen("127.0.0.1", 0)
    port = server.getsockname()[1]
    strangers = []
    for _ in range(10):
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.connect(("127.0.0.1", port))
        strangers.append(s)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault(
        "link", stage_link.connect(f"127.0.0.1:{port}", SECRET, 0, 1, 10.0, 5.0)))
    t0 = time.monotonic()
    t.start()
    link = stage_link.accept(server, SECRET, 1, 0, 10.0, 5.0)
    t.join()
    assert time.monotonic() - t0 < 2.0
    hidden = mx.ones((1, 2, 8))
    out["link"].send_activation(0, 0, hidden, 5.0)
    assert mx.array_equal(link.recv_activation(0, 0, 2, ActivationSpec(8, mx.float32), 5.0), hidden)
    for s in (*strangers, server, link, out["link"]):
        s.close()


def test_a_neighbour_dropped_while_its_hosts_slots_are_full_tries_again(monkeypatch):
    monkeypatch.setattr(stage_link, "HANDSHAKES_PER_HOST", 1)
    monkeypatch.setattr(stage_link, "HANDSHAKE_SECONDS", 0.5)
    server = stage_link.listen("127.0.0.1", 0)
    port = server.getsockname()[1]
    out: dict = {}

    def accept():
        out["link"] = stage_link.accept(server, SECRET, 1, 0, 10.0, 5.0)

    t = threading.Thread(target=accept)
    t.start()
    lurker = socket.create_connection(("127.0.0.1", port))  # the host's only slot, for 0.5 s
    time.sleep(0.1)
    link = stage_link.connect(f"127.0.0.1:{port}", SECRET, 0, 1, 10.0, 5.0)  # dropped at first, then in
    t.join()
    hidden = mx.ones((1, 2, 8))
    link.send_activation(0, 0, hidden, 5.0)
    assert mx.array_equal(out["link"].recv_activation(0, 0, 2, ActivationSpec(8, mx.float32), 5.0), hidden)
    for s in (lurker, server, link, out["link"]):
        s.close()
