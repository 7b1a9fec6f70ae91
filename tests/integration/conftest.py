"""Real servers over real sockets: each fixture starts `python -m meshlm serve` as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from meshlm.cluster import bootstrap

FAULT_ENTRY = str(Path(__file__).with_name("fault_entry.py"))


def fault_entry(kind: str, arg: int) -> list[str]:
    """The command prefix of a meshlm process with a planted fault (see fault_entry.py)."""
    return [sys.executable, FAULT_ENTRY, kind, str(arg)]


def free_port(avoid: range = range(0)) -> int:
    return bootstrap.free_port(avoid=avoid)


def healthy(url: str) -> bool:
    """The server at `url` answers /health with 200 now (not up yet, or failed: False)."""
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def free_port_run(n: int) -> range:
    """n consecutive free ports (a ring hostfile's ranks listen on base + rank), outside the ephemeral range."""
    while True:
        base = free_port()
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base + 1, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return range(base, base + n)
        except OSError:
            continue


class ServerProcess:
    def __init__(self, model: Path | str, *args: str, log_dir: Path, entry: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        """`entry`: the program to run instead of `python -m meshlm` (fault_entry.py with its fault)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"server-{self.port}.log"
        cmd = [*(entry or [sys.executable, "-m", "meshlm"]), "serve", "--model", str(model), "--port",
               str(self.port), "--kv-cache-dir", str(log_dir / "kv"), *args]
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # ~120 servers start per run: a coarse poll adds up
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from meshlm.model.demo import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama", layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """A tiny-model server with a small context so over-long prompts are cheap to build."""
    srv = ServerProcess(tiny_model, "--max-model-len", "512", "--max-batch-size", "16",
                        "--max-tokens-per-step", "256", log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


COMPLETIONS_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def unread_stream(port: int) -> socket.socket:
    """A connection that asks for a ~13 MB stream (4 choices of 4,000 tokens with 20 logprobs each) and reads
    none of it: once the kernel's buffers are full, the server's writes stay paused."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": "go", "max_tokens": 4000, "n": 4, "logprobs": 20, "ignore_eos": True,
                       "stream": True}).encode()
    s.sendall(COMPLETIONS_HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


def closed_within(s: socket.socket, seconds: float) -> tuple[float, bytes]:
    """How long until the server closed `s`, and what it sent first; fails if it held it `seconds`."""
    t0, got = time.monotonic(), b""
    s.settimeout(seconds)
    try:
        while chunk := s.recv(4096):
            got += chunk
    except socket.timeout:
        pytest.fail(f"the server held a silent connection {seconds} s (sent {got[:80]!r})")
    except ConnectionResetError:  # closed while the client still sent: as closed as an EOF
        pass
    return time.monotonic() - t0, got


def children(pid: int) -> list[int]:
    """The pids of `pid`'s child processes (a local cluster's other ranks)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def process_environ(pid: int) -> dict[str, str]:
    """The environment process `pid` was exec'd with."""
    entries = Path(f"/proc/{pid}/environ").read_text().split("\0")
    return dict(v.split("=", 1) for v in entries if "=" in v)


def stream_then(url: str, action, after: int = 6) -> list[str]:
    """Stream a long completion; call `action()` once `after` lines have arrived; return every line."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            req = {"prompt": "go", "max_tokens": 500, "stream": True, "ignore_eos": True}
            async with c.stream("POST", "/v1/completions", json=req) as r:
                lines = []
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == after:
                        action()
                return lines
    return asyncio.run(run())


def stream_error(lines: list[str]) -> str:
    """The message of the error event among a stream's `data:` lines."""
    errors = [json.loads(line[len("data: "):])["error"]["message"] for line in lines if '"error"' in line]
    assert len(errors) == 1, lines[-5:]
    return errors[0]


def stop_ending_at(text: str, end: int) -> str:
    """The shortest stop string whose first match in `text` ends at `end`: the sequence that wrote the
    text stops on the token holding text[end - 1]."""
    start = end - 1
    while text.find(text[start:end]) != start:
        start -= 1
    return text[start:end]


async def complete_all(url: str, prompts: list, n: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        rs = await asyncio.gather(*[c.post("/v1/completions", json={
            "prompt": p, "max_tokens": n, "temperature": 0, "logprobs": 2}) for p in prompts])
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    return [r.json() for r in rs]


def assert_parity(got: list[dict], want: list[dict], tol: float = 1e-4) -> None:
    """Greedy tokens identical (else: the first differing token and its rivals); chosen-token logprobs within `tol`."""
    for i, (g, w) in enumerate(zip(got, want)):  # name the first differing token and how close its rivals were
        a, b = g["choices"][0]["logprobs"], w["choices"][0]["logprobs"]
        j = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        assert j is None, f"prompt {i}, token {j}: got {a['top_logprobs'][j]}, one process {b['top_logprobs'][j]}"
    assert [g["choices"][0]["text"] for g in got] == [w["choices"][0]["text"] for w in want]
    for g, w in zip(got, want):
        a, b = g["choices"][0]["logprobs"]["token_logprobs"], w["choices"][0]["logprobs"]["token_logprobs"]
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


# Prompt logprobs against stock mlx-lm's forward: meshlm's CPU kernels (base-2 softmax, fused layers) and
# batching round differently, up to 8e-4 seen on the tiny qwen3's 300-token prompt (logprobs near -10); a
# token scored at the wrong position is off by units.
SCORE_TOL = 2e-3


def scored_prompts(seed: int = 7, lengths: tuple[int, ...] = (5, 40, 300)) -> list[list[int]]:
    """Token-id prompts to score: one short, one within a scoring chunk, one across two (SCORING_ROWS)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def reference_scores(path: Path, prompts: list[list[int]], adapter: Path | None = None) -> list[list[float]]:
    """Each prompt token's logprob after the first, from stock mlx-lm's forward over the whole prompt (with
    `adapter` applied as mlx-lm applies one: unfused)."""
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(path), adapter_path=None if adapter is None else str(adapter))
    out = []
    for ids in prompts:
        logits = model(mx.array([ids]))[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out.append(mx.take_along_axis(lp[:-1], mx.array(ids[1:])[:, None], axis=-1)[:, 0].tolist())
    return out


async def score_all(url: str, prompts: list[list[int]]) -> list[list[float]]:
    """The server's logprobs of each prompt's tokens, all at once: OpenAI's echo with max_tokens 0."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        rs = await asyncio.gather(*[c.post("/v1/completions", json={
            "prompt": p, "max_tokens": 0, "echo": True, "logprobs": 1}) for p in prompts])
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    out = []
    for p, r in zip(prompts, rs):
        choice = r.json()["choices"][0]
        lps = choice["logprobs"]["token_logprobs"]
        assert choice["finish_reason"] == "length" and len(lps) == len(p) and lps[0] is None
        out.append(lps[1:])
    return out


def assert_scores(got: list[list[float]], want: list[list[float]], tol: float) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w), (i, len(g), len(w))
        worst = max(abs(x - y) for x, y in zip(g, w))
        assert worst < tol, f"prompt {i}: a prompt token's logprob {worst:.2e} from the reference"
