"""Disaggregated prefill between real servers: a prefill server, a decode server handing it long prompts,
and a plain server for reference (parity). Faults are planted by a relay between the decode and prefill
servers: it forwards the real protocol and, when told, corrupts a KV packet, sends NaN KV with a valid CRC,
dies mid-transfer, stalls, drips blocks just inside the timeout, or claims another model or KV dtype."""

from __future__ import annotations

import asyncio
import re
import secrets
import socket
import threading
import time
import zlib

import httpx
import msgspec
import pytest

from meshlm.disagg import prefill_wire as pw
from meshlm.transport import stage_wire
from meshlm.transport.auth import ClusterSecret

from conftest import ServerProcess, free_port

pytestmark = pytest.mark.slow

MIN_TOKENS = 64
TIMEOUT = 3.0  # the decode server's --prefill-timeout: the stalling relay outlasts it


class Relay:
    """Sits between the decode server and the prefill server; `mode` plants one fault per job."""

    def __init__(self, upstream: str, secret: ClusterSecret) -> None:
        self.upstream, self.secret = upstream, secret
        self.mode = "pass"
        self.jobs = 0
        self._count = threading.Lock()  # one relay thread a job: `jobs += 1` from several lost counts
        self.info: pw.PeerInfo | None = None  # what the prefill server last said of itself
        self.after_block = lambda sent: None  # called once each block was forwarded
        self.server = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(sock,), daemon=True).start()

    def _relay(self, sock: socket.socket) -> None:
        mode = self.mode
        down = up = None
        try:
            # Upstream first: the decode server's handshake with the relay then lasts until the relay's with
            # the prefill server is done, so its cap on handshakes in flight (HANDSHAKES_PER_PEER) holds for
            # both. Accepted first, the relay's own upstream handshakes piled up past the prefill server's
            # per-address cap, which reset two of them: two prompts prefilled locally, a CI failure.
            up = pw.connect(self.upstream, self.secret, 5)
            down = pw.accept(sock, "decode", self.secret, 5)
            dl = lambda: time.monotonic() + 30  # noqa: E731
            up.send_message(down.recv_message(dl()), dl())
            info = self.info = up.recv_message(dl())
            if mode == "fingerprint":
                info = msgspec.structs.replace(info, fingerprint="0" * 16)
            elif mode == "dtype":
                info = msgspec.structs.replace(info, kv_dtype="float16")
            down.send_message(info, dl())
            up.send_message(down.recv_message(dl()), dl())
            with self._count:
                self.jobs += 1
            sent = 0
            while True:
                msg = up.recv_message(dl())
                raw = bytearray()
                if isinstance(msg, pw.Block):
                    def recv(n: int) -> bytes:
                        data = up.recv_exactly(n, dl())
                        raw.extend(data)
                        return data
                    stage_wire.read_packet(recv, stage_wire.Expect())
                    if sent == 2 and mode == "die":
                        return
                    if sent == 1 and mode == "corrupt":
                        raw[-3] ^= 0x40  # one bit of the last value's payload
                    if sent == 1 and mode == "stall":
                        time.sleep(TIMEOUT + 1.5)
                    if mode == "drip":  # each block inside the silence limit; all of them far past it
                        time.sleep(TIMEOUT - 0.5)
                    if sent >= 1 and mode == "nan":  # a peer holding the secret: the CRC matches
                        raw[-64:] = b"\xc0\x7f" * 32  # NaN in float32, float16 and bfloat16 alike
                        msg = msgspec.structs.replace(msg, crc=zlib.crc32(raw))
                    sent += 1
                down.send_message(msg, dl())
                down.send(bytes(raw), dl())
                if isinstance(msg, pw.Block):
                    self.after_block(sent)
                if isinstance(msg, (pw.Done, pw.Failed)):
                    return
        except pw.PrefillWireError:
            pass
        finally:
            if down is None:  # the upstream could not be reached: the decode server is not kept waiting
                sock.close()
            for conn in (down, up):
                if conn is not None:
                    conn.close()


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    secret = secrets.token_hex(32)
    env = {"MESHLM_CLUSTER_SECRET": secret}
    logs = tmp_path_factory.mktemp("disagg")
    common = ("--max-model-len", "4096", "--max-tokens-per-step", "256", "--no-ssd-cache")
    port = free_port()
    prefill = ServerProcess(tiny_model, *common, "--role", "prefill", "--prefill-port", str(port),
                            log_dir=logs, env=env)
    relay = Relay(f"127.0.0.1:{port}", ClusterSecret(secret))
    decode = ServerProcess(tiny_model, *common, "--prefill-peer", relay.addr, "--disagg-min-tokens", str(MIN_TOKENS),
                           "--prefill-timeout", str(TIMEOUT), log_dir=logs, env=env)
    single = ServerProcess(tiny_model, *common, log_dir=logs)
    yield prefill, decode, single, relay
    for s in (decode, single, prefill):
        s.stop()


def words(n: int, seed: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 31) % 997}" for i in range(n))


async def _complete(url: str, prompts: list[str], n: int = 12) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        rs = await asyncio.gather(*[c.post("/v1/completions", json={
            "prompt": p, "max_tokens": n, "temperature": 0, "logprobs": 1}) for p in prompts])
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    return [r.json() for r in rs]


def complete(url: str, prompts: list[str], n: int = 12) -> list[dict]:
    return asyncio.run(_complete(url, prompts, n))


def texts(results: list[dict]) -> list[str]:
    return [r["choices"][0]["text"] for r in results]


def fallbacks(server: ServerProcess, reason: str) -> float:
    try:
        return server.metric(f'meshlm_disagg_fallbacks_total{{reason="{reason}"}}')
    except KeyError:
        return 0.0


def peer_status(server: ServerProcess) -> dict:
    """The one prefill peer as the decode server's /health shows it."""
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200, r.text
    (peer,) = r.json()["prefill_peers"]
    return peer


def metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_parity_16_concurrent_prompts_with_cached_prefixes(cluster):
    prefill, decode, single, relay = cluster
    shared = [words(150, 1), words(300, 2)]
    complete(decode.url, shared, 2)  # the decode server caches these prefixes (handed off themselves)
    jobs_before, bytes_before = relay.jobs, metric(decode, 'meshlm_disagg_kv_bytes_total{direction="received"}')
    requests_before = metric(prefill, 'meshlm_requests_total{status="length"}')
    prompt_tokens_before = metric(prefill, "meshlm_prompt_tokens_total")
    busy_before = fallbacks(decode, "busy")
    done_before = prefill.metric('meshlm_disagg_prefill_jobs_total{outcome="done"}')
    prompts = []
    for i in range(16):
        if i % 4 == 0:
            prompts.append(words(8 + i // 4, 10 + i))  # short: prefilled locally
        elif i % 4 == 1:
            prompts.append(shared[i % 2] + " " + words(40 + 5 * i, 30 + i))  # cached prefix, the rest sent
        else:
            prompts.append(words(60 + 30 * i, 50 + i))  # long and new
    got, want = complete(decode.url, prompts), complete(single.url, prompts)
    assert texts(got) == texts(want)
    for g, w in zip(got, want):
        a, b = g["choices"][0]["logprobs"]["token_logprobs"], w["choices"][0]["logprobs"]["token_logprobs"]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    # Every prompt but the 4 short ones is handed off, or (on a loaded machine) prefilled here because
    # this server's own burst of handshakes with the peer outlasted --prefill-timeout: counted as busy
    handed, busy = relay.jobs - jobs_before, fallbacks(decode, "busy") - busy_before
    reasons = {r: fallbacks(decode, r) for r in ("busy", "unreachable", "refused", "timeout", "closed", "error")}
    assert handed + busy == 12 and handed >= 8, f"{handed} handed off; fallbacks {reasons}"
    assert metric(decode, 'meshlm_disagg_kv_bytes_total{direction="received"}') > bytes_before
    assert peer_status(decode)["jobs_done"] >= 2 + handed and peer_status(decode)["up"]
    # Received blocks are their own tier's hits: they were counted as SSD hits on a server without one
    assert metric(decode, 'meshlm_prefix_cache_hits_total{tier="received"}') > 0
    assert metric(decode, 'meshlm_prefix_cache_hits_total{tier="ssd"}') == 0  # --no-ssd-cache
    assert "prefill_peers" not in httpx.get(single.url + "/health").json()
    assert prefill.metric('meshlm_disagg_prefill_jobs_total{outcome="done"}') - done_before == handed
    # A prefill job is not a client's request: it counted as one on the prefill server (review helper-45)
    assert metric(prefill, 'meshlm_requests_total{status="length"}') == requests_before
    assert metric(prefill, "meshlm_prompt_tokens_total") == prompt_tokens_before
    assert fallbacks(decode, "bad_packet") + fallbacks(decode, "closed") + fallbacks(decode, "timeout") == 0
    # A cached prefix is not sent again: the shared prompt's blocks came once.
    usage = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
    assert all(u > 0 for u, i in zip(usage, range(16)) if i % 4 != 0)


def test_cached_prompt_is_not_handed_off(cluster):
    _, decode, _, relay = cluster
    prompt = words(300, 99)
    complete(decode.url, [prompt], 2)
    jobs = relay.jobs
    complete(decode.url, [prompt + " tail"], 2)  # most of it is held here now: under MIN_TOKENS left
    assert relay.jobs == jobs


@pytest.mark.parametrize("job, says", [
    (pw.Job(1, [5] * 31, 0), "whole blocks of 32 tokens"),
    (pw.Job(1, [5] * 64, 2), "first_block 2"),
    (pw.Job(1, [10**9] * 32, 0), "outside the vocabulary"),
    (pw.Job(1, [2**63] * 32, 0), "outside the vocabulary"),  # was an OverflowError hashing the keys: no reply
    (pw.Job(1, [-1] + [5] * 31, 0), "outside the vocabulary"),
    (pw.Job(-1, [5] * 32, 0), "job id -1"),
    (pw.Done(0), "expected a job"),
])
def test_prefill_server_refuses_bad_jobs(cluster, job, says):
    prefill, decode, _, relay = cluster
    complete(decode.url, [words(200, 3)], 1)  # a handoff, so the relay has seen the prefill server's info
    conn = pw.connect(relay.upstream, relay.secret, 5)
    try:
        conn.send_message(relay.info, time.monotonic() + 5)
        assert conn.recv_message(time.monotonic() + 5) == relay.info
        conn.send_message(job, time.monotonic() + 5)
        answer = conn.recv_message(time.monotonic() + 5)
    finally:
        conn.close()
    assert isinstance(answer, pw.Failed) and says in answer.reason
    assert httpx.get(prefill.url + "/health").status_code == 200


def test_prefill_port_refuses_strangers(cluster):
    prefill, _, _, relay = cluster
    with pytest.raises(pw.PrefillWireError, match="did not prove"):
        pw.connect(relay.upstream, ClusterSecret("x" * 64), 5)
    host, port = relay.upstream.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:  # not the protocol at all
        sock.sendall(b"GET / HTTP/1.1\r\n".ljust(pw._HELLO.size, b" "))  # a hello's length: read whole
        assert sock.recv(100) == b""  # dropped, nothing answered
    assert httpx.get(prefill.url + "/health").status_code == 200


@pytest.mark.parametrize("mode, reason, says", [
    ("corrupt", "bad_packet", "fails its CRC"),
    ("die", "closed", "connection closed"),
    ("stall", "timeout", "nothing received in time"),
    ("nan", "bad_packet", "holds NaN or inf"),
    ("fingerprint", "refused", "model fingerprint"),
    ("dtype", "refused", "KV dtype float16"),
])
def test_faults_fall_back_to_local_prefill(cluster, mode, reason, says):
    _, decode, single, relay = cluster
    relay.mode = mode
    try:
        before, peer_before = fallbacks(decode, reason), peer_status(decode)
        prompt = [words(400, sum(map(ord, mode)))]
        assert texts(complete(decode.url, prompt)) == texts(complete(single.url, prompt))
        assert fallbacks(decode, reason) == before + 1
        assert says in decode.log.read_text()
        # /health stays 200 (the prompt was prefilled here) and says why the peer was not used
        peer = peer_status(decode)
        assert peer["address"] == relay.addr and peer["fallbacks"] == peer_before["fallbacks"] + 1
        assert peer["jobs_done"] == peer_before["jobs_done"]
        last = peer["last_fallback"]
        assert last["reason"] == reason and says in last["message"] and 0 <= last["seconds_ago"] < 60
    finally:
        relay.mode = "pass"


def test_non_finite_kv_never_reaches_the_cache(cluster):
    _, decode, single, relay = cluster
    prompt = words(400, 4242)
    relay.mode = "nan"
    try:
        r = httpx.post(decode.url + "/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
    finally:
        relay.mode = "pass"
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == texts(complete(single.url, [prompt]))[0]
    # The honest peer is back; a prompt sharing the prefix finds it cached here, computed locally, not NaN.
    longer = [prompt + " " + words(5, 4243)]  # under MIN_TOKENS uncached: not handed off
    jobs = relay.jobs
    assert texts(complete(decode.url, longer)) == texts(complete(single.url, longer))
    assert relay.jobs == jobs  # served from this server's cache, not sent again


def test_a_peer_dripping_blocks_is_given_up_by_the_job_deadline(cluster):
    _, decode, single, relay = cluster
    prompt = [words(400, 4343)]  # ~1,500 tokens: the job's limit is TIMEOUT * (1 + 1,504 / 1,024), ~7.4 s
    relay.mode = "drip"
    try:
        before = fallbacks(decode, "timeout")
        t0 = time.monotonic()
        got = complete(decode.url, prompt)
        elapsed = time.monotonic() - t0
    finally:
        relay.mode = "pass"
    assert texts(got) == texts(complete(single.url, prompt))
    assert elapsed < 20, elapsed  # not ~48 blocks x (TIMEOUT - 0.5) s
    assert fallbacks(decode, "timeout") == before + 1
    assert re.search(r"the job took over \d+\.\d s, its limit for \d+ tokens", decode.log.read_text())


def test_a_prompt_waiting_for_a_prefill_server_counts_in_the_queue_gauge(cluster):
    """Regression: a handoff holds a place in the queue (a 429 counts it), but meshlm_queue_depth showed 0."""
    import threading

    _, decode, single, relay = cluster
    prompt = [words(400, 4545)]
    relay.mode = "stall"  # the transfer waits after its first block until the job gives up
    try:
        result: list = []
        worker = threading.Thread(target=lambda: result.append(complete(decode.url, prompt)))
        worker.start()
        seen, deadline = 0.0, time.monotonic() + TIMEOUT
        while not seen and time.monotonic() < deadline:
            seen = metric(decode, "meshlm_queue_depth")
            time.sleep(0.05)
        worker.join(60)
    finally:
        relay.mode = "pass"
    assert seen == 1
    assert texts(result[0]) == texts(complete(single.url, prompt)) and metric(decode, "meshlm_queue_depth") == 0


def test_n_choices_share_one_transfer(cluster):
    """Regression: n > 1 handed the same prompt off n times (n jobs, n copies of its KV on the wire)."""
    prefill, decode, single, relay = cluster
    body = {"prompt": words(500, 777), "max_tokens": 8, "temperature": 0, "n": 3}
    jobs, joined = relay.jobs, metric(decode, "meshlm_disagg_joined_total")
    sent, received = (metric(prefill, 'meshlm_disagg_kv_bytes_total{direction="sent"}'),
                      metric(decode, 'meshlm_disagg_kv_bytes_total{direction="received"}'))
    got = httpx.post(decode.url + "/v1/completions", json=body, timeout=120)
    assert got.status_code == 200, got.text
    want = httpx.post(single.url + "/v1/completions", json={**body, "n": 1}, timeout=120).json()
    assert [c["text"] for c in got.json()["choices"]] == [want["choices"][0]["text"]] * 3
    assert relay.jobs - jobs == 1 and metric(decode, "meshlm_disagg_joined_total") - joined == 2
    # The two servers' byte counters agree (the sender counted the packets' headers too)
    sent = metric(prefill, 'meshlm_disagg_kv_bytes_total{direction="sent"}') - sent
    assert sent > 0 and sent == metric(decode, 'meshlm_disagg_kv_bytes_total{direction="received"}') - received


def test_a_salted_prompt_is_prefilled_here(cluster):
    """A prefill server keys its blocks without a request's cache_salt: such a prompt is not handed off
    (its blocks would land in the unsalted chain)."""
    _, decode, single, relay = cluster
    body = {"prompt": words(500, 4242), "max_tokens": 6, "temperature": 0, "cache_salt": "tenant-a"}
    jobs = relay.jobs
    got = httpx.post(decode.url + "/v1/completions", json=body, timeout=120)
    assert got.status_code == 200, got.text
    want = httpx.post(single.url + "/v1/completions", json=body, timeout=120).json()
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"] and relay.jobs == jobs


def test_prefill_server_killed_mid_transfer(cluster):
    prefill, decode, single, relay = cluster
    prompts = [words(900, 500 + i) for i in range(3)]
    relay.after_block = lambda sent: sent == 3 and prefill.proc.kill()  # the 4th block has just gone out
    got = complete(decode.url, prompts)
    assert prefill.proc.wait(5) is not None
    assert texts(got) == texts(complete(single.url, prompts))
    assert re.search(r"prefilling locally \([1-9]\d* of \d+ blocks received\)", decode.log.read_text())
    # With the peer gone, long prompts are served locally at once.
    assert complete(decode.url, [words(800, 777)])



def test_received_blocks_are_written_through_to_the_ssd_tier(tiny_model, tmp_path):
    """Before, only blocks computed here reached the SSD tier: after a restart a handed-off prompt found
    nothing cached (a plain server finds its whole blocks). Its own prefill server: the module's is killed
    by a test before."""
    env = {"MESHLM_CLUSTER_SECRET": secrets.token_hex(32)}
    common = ("--max-model-len", "4096", "--max-tokens-per-step", "256")
    port = free_port()
    (tmp_path / "prefill").mkdir()
    prefill = ServerProcess(tiny_model, *common, "--no-ssd-cache", "--role", "prefill", "--prefill-port", str(port),
                            log_dir=tmp_path / "prefill", env=env)
    prompt = words(300, 123)
    decode = ServerProcess(tiny_model, *common, "--prefill-peer", f"127.0.0.1:{port}", "--disagg-min-tokens",
                           str(MIN_TOKENS), log_dir=tmp_path, env=env)
    try:
        first = complete(decode.url, [prompt], 2)[0]
        assert prefill.metric('meshlm_disagg_prefill_jobs_total{outcome="done"}') == 1  # handed off
    finally:
        decode.stop()  # flushes the SSD writer
        prefill.stop()
    again = ServerProcess(tiny_model, *common, log_dir=tmp_path)
    try:
        second = complete(again.url, [prompt], 2)[0]
    finally:
        again.stop()
    received = first["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert received >= 1024 and second["usage"]["prompt_tokens_details"]["cached_tokens"] == received
    assert texts([second]) == texts([first])
