"""Shared helpers for the benchmark scripts: servers, readiness, RSS, SSE client.

The scripts run as `python benchmarks/NAME.py`, so they import this module
through their own directory on sys.path:

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _peer

Everything here talks to servers over HTTP only (OpenAI-compatible
`/v1/chat/completions` with streaming), so the same code drives meshlm,
mlx_lm.server or any other compatible server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import httpx

import _http

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so"
READY_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0
RSS_INTERVAL_S = 0.2


# -- small utilities ----------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now, outside the ephemeral range (see meshlm.cluster.bootstrap)."""
    from meshlm.cluster.bootstrap import free_port as pick

    return pick(host)


def free_ports(n: int, taken: set[int]) -> list[int]:
    """n distinct free ports, none in `taken` (which gains them): a cluster's control and HTTP ports
    beside the ring or stage ports its ranks listen on."""
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in taken:
            taken.add(port)
            ports.append(port)
    return ports


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def openblas_path() -> str | None:
    return OPENBLAS if os.path.exists(OPENBLAS) else None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "openblas": openblas_path(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import mlx.core as mx

        info["mlx"] = mx.__version__
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        import mlx_lm

        info["mlx_lm"] = getattr(mlx_lm, "__version__", None)
    except Exception:  # noqa: BLE001
        pass
    return info


# -- process tree: RSS and loaded libraries -----------------------------------


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """/proc/<pid>/stat from field 3 (state) on, or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces/parens: split after the last ')'.
    return stat[stat.rfind(b")") + 2 :].split()


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        rest = _stat_fields(name)
        if rest is not None and len(rest) >= 2:
            children.setdefault(int(rest[1]), []).append(int(name))
    return children


def process_tree(pid: int) -> list[int]:
    """`pid` and all its live descendants."""
    if not os.path.exists(f"/proc/{pid}"):
        return []
    children = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def tree_rss_mb(pid: int) -> float:
    return sum(rss_kb(p) for p in process_tree(pid)) / 1024.0


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_s(pid: int) -> float:
    """user+system CPU seconds of the live processes of the tree (and their waited-for children)."""
    total = 0
    for p in process_tree(pid):
        rest = _stat_fields(p)
        if rest is not None:  # fields 14-17 (utime stime cutime cstime) are rest[11:15]
            total += sum(int(x) for x in rest[11:15])
    return total / _CLK_TCK


def system_busy_cpu_s() -> float:
    """Non-idle CPU seconds of the whole machine since boot (all cores summed)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user/nice
    return (sum(fields) - idle - guest) / _CLK_TCK


class CpuMeter:
    """CPU seconds spent by a server tree, this process, and everything else over a span.

    `other_cpu_s` well above zero means something else on the machine competed
    with the benchmark (e.g. a test run), so its numbers are less trustworthy.
    """

    def __init__(self, server_pid: int | None):
        self.server_pid = server_pid

    def _read(self) -> tuple[float, float, float, float]:
        t = os.times()
        server = tree_cpu_s(self.server_pid) if self.server_pid else 0.0
        return time.monotonic(), system_busy_cpu_s(), server, t.user + t.system

    def __enter__(self) -> "CpuMeter":
        self._start = self._read()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = self._read()
        wall, busy, server, client = (b - a for a, b in zip(self._start, end))
        self.result = {
            "cpu_cores": os.cpu_count(),
            "server_cpu_s": round(server, 2) if self.server_pid else None,
            "client_cpu_s": round(client, 2),
            "other_cpu_s": round(max(0.0, busy - server - client), 2) if self.server_pid else None,
            "machine_busy_frac": round(busy / (wall * (os.cpu_count() or 1)), 3) if wall > 0 else None,
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
        # Others used over 10% of the machine while this ran: numbers are noisy.
        if self.server_pid and wall > 0:
            other = max(0.0, busy - server - client)
            self.result["contended"] = other > 0.1 * wall * (os.cpu_count() or 1)


def tree_maps_contain(pid: int, needle: str) -> bool:
    """Whether any process of the tree has a mapping whose path contains `needle`."""
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/maps") as f:
                if needle in f.read():
                    return True
        except OSError:
            continue
    return False


class RssSampler:
    """Samples the summed VmRSS of a process tree every `interval` seconds.

    `peak_mb` is the maximum since start or the last `reset()`; `overall_peak_mb`
    is never reset. Use as a context manager or call start()/stop().
    """

    def __init__(self, pid: int | None, interval: float = RSS_INTERVAL_S):
        self.pid = pid
        self.interval = interval
        self.peak_mb = 0.0
        self.overall_peak_mb = 0.0
        self.last_mb = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def sample(self) -> float:
        if self.pid is None:
            return 0.0
        mb = tree_rss_mb(self.pid)
        with self._lock:
            self.last_mb = mb
            self.samples += 1
            self.peak_mb = max(self.peak_mb, mb)
            self.overall_peak_mb = max(self.overall_peak_mb, mb)
        return mb

    def reset(self) -> None:
        with self._lock:
            self.peak_mb = self.last_mb

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def start(self) -> "RssSampler":
        if self.pid is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def __enter__(self) -> "RssSampler":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# -- server processes ---------------------------------------------------------


class ServerError(RuntimeError):
    def __init__(self, message: str, log_path: str | None = None):
        super().__init__(message)
        self.log_path = log_path


@dataclass
class ServerProcess:
    """A server started in its own session, its output going to a log file.

    stop() sends SIGTERM to the whole process group (and any descendant that
    left it), then SIGKILL after `STOP_GRACE_S`. Safe to call more than once.
    """

    name: str
    cmd: list[str]
    url: str
    env: dict[str, str] | None = None
    ready_path: str = "/health"
    cwd: str | None = None
    log_path: str = ""
    proc: subprocess.Popen | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    _cleanup_dirs: list[str] = field(default_factory=list)

    def start(self) -> "ServerProcess":
        fd, self.log_path = tempfile.mkstemp(prefix=f"bench-{self.name}-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            log.write("$ " + " ".join(self.cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        _LIVE.add(self)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = READY_TIMEOUT_S, path: str | None = None) -> float:
        """Poll GET url+path until it answers 200; returns seconds waited."""
        path = path or self.ready_path
        t0 = time.monotonic()
        last = "no answer yet"
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() - t0 < timeout:
                if not self.alive():
                    code = self.proc.returncode if self.proc else None
                    raise ServerError(
                        f"{self.name} exited with code {code} before it was ready; log {self.log_path}:\n"
                        + self.log_tail(),
                        self.log_path,
                    )
                try:
                    r = client.get(self.url + path)
                    if r.status_code == 200:
                        return time.monotonic() - t0
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as e:
                    last = f"{type(e).__name__}: {e}"
                time.sleep(0.25)
        raise ServerError(
            f"{self.name} not ready after {timeout:.0f}s (GET {path}: {last}); log {self.log_path}:\n"
            + self.log_tail(),
            self.log_path,
        )

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        pid = self.proc.pid
        tree = process_tree(pid)
        if self.proc.poll() is None:
            _signal_group(pid, signal.SIGTERM)
            for p in tree:  # only those that left the group: a second SIGTERM makes meshlm stop at once
                if _pgid(p) != pid:
                    _signal_pid(p, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        # Anything of the tree still around (a child that outlived its parent).
        deadline = time.monotonic() + 2
        for p in tree:
            if p == pid:
                continue
            while os.path.exists(f"/proc/{p}") and time.monotonic() < deadline:
                time.sleep(0.05)
            _signal_pid(p, signal.SIGKILL)
        _signal_group(pid, signal.SIGKILL)
        _LIVE.discard(self)
        for d in self._cleanup_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._cleanup_dirs.clear()
        return self.proc.returncode

    def remove_log(self) -> None:
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __hash__(self) -> int:
        return id(self)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


_LIVE: set[ServerProcess] = set()


def stop_all() -> None:
    """Stop every server this process started and has not stopped yet."""
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


@contextlib.contextmanager
def recording(report: dict[str, Any], cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """Run a benchmark's measurements: Ctrl-C or an error is recorded in `report` (what was measured
    still prints), then `cleanup` runs and every server started here is stopped."""
    try:
        yield
    except KeyboardInterrupt:
        report["interrupted"] = True
    except Exception as e:  # noqa: BLE001 - still print what was measured
        report["error"] = describe_error(e)
    finally:
        if cleanup is not None:
            cleanup()
        stop_all()


def install_signal_handlers() -> None:
    """Turn SIGTERM/SIGHUP into KeyboardInterrupt so `finally:` blocks stop the servers."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
    import atexit

    atexit.register(stop_all)


def meshlm_command() -> list[str]:
    """`<venv>/bin/meshlm` beside this interpreter, else `python -m meshlm`."""
    exe = Path(sys.executable).with_name("meshlm")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "meshlm"]


def start_meshlm(
    model: str,
    *,
    dtype: str | None = None,
    max_batch_size: int | None = None,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Start `meshlm serve` on a free port (not waiting for readiness).

    Without a `--kv-cache-dir` in `extra_args` the server gets a fresh temporary
    one, removed when it stops: the default SSD tier outlives runs, and the
    benchmarks' prompts repeat from run to run, so it would hand meshlm the
    previous run's prefills."""
    port = port or free_port(host)
    named = any(a == "--kv-cache-dir" or a.startswith("--kv-cache-dir=") for a in extra_args)
    fresh_kv = None if named else tempfile.mkdtemp(prefix="bench-kv-")
    extra_args = [*extra_args, *(["--kv-cache-dir", fresh_kv] if fresh_kv else [])]
    cmd = [*meshlm_command(), "serve", "--model", str(model), "--host", host, "--port", str(port)]
    if dtype:
        cmd += ["--dtype", dtype]
    if max_batch_size:
        cmd += ["--max-batch-size", str(max_batch_size)]
    cmd += list(extra_args)
    server = ServerProcess("meshlm", cmd, f"http://{host}:{port}", env=env, ready_path="/health")
    if fresh_kv:
        server._cleanup_dirs.append(fresh_kv)
    server.extra["flags"] = cmd[len(meshlm_command()) :]
    return server.start()


MLX_LM_DEFAULT_DECODE_CONCURRENCY = 32
MLX_LM_DEFAULT_PROMPT_CONCURRENCY = 8


def start_mlx_lm(
    model_dir: str | os.PathLike,
    *,
    concurrency: int = 1,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int | None = None,
    openblas: bool = True,
) -> ServerProcess:
    """Start `python -m mlx_lm.server` on a free port (not waiting for readiness).

    - `/v1/models` scans the Hugging Face cache and raises when it is missing,
      so the peer gets an empty temp HF_HUB_CACHE and HF_HUB_OFFLINE=1.
    - Its batching limits (--decode-concurrency 32, --prompt-concurrency 8 by
      default) are raised to `concurrency` when that is larger, so N streams
      can be decoded and prefilled together.
    - Requests must send model "default_model" (or omit it): any other value
      is treated as a path or Hugging Face repo to load.
    - LD_PRELOAD of Debian's OpenBLAS when present and `openblas` is true.
    """
    port = port or free_port(host)
    decode = max(MLX_LM_DEFAULT_DECODE_CONCURRENCY, concurrency)
    prompt = max(MLX_LM_DEFAULT_PROMPT_CONCURRENCY, concurrency)
    flags = [
        "--model", str(model_dir), "--host", host, "--port", str(port),
        "--decode-concurrency", str(decode), "--prompt-concurrency", str(prompt),
        *extra_args,
    ]  # fmt: skip
    hf_cache = tempfile.mkdtemp(prefix="bench-hf-cache-")
    env = dict(os.environ)
    env["HF_HUB_CACHE"] = hf_cache
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("MESHLM_OPENBLAS", None)
    blas = openblas_path() if openblas else None
    if blas:
        env["LD_PRELOAD"] = ":".join(p for p in (blas, env.get("LD_PRELOAD", "")) if p)
    cmd = [sys.executable, "-m", "mlx_lm.server", *flags]
    server = ServerProcess("mlx-lm", cmd, f"http://{host}:{port}", env=env, ready_path="/v1/models")
    server._cleanup_dirs.append(hf_cache)
    server.extra["flags"] = flags
    server.extra["request_model"] = "default_model"
    server.extra["env"] = {"HF_HUB_CACHE": "<empty temp dir>", "HF_HUB_OFFLINE": "1", "LD_PRELOAD": blas}
    return server.start()


def served_model_id(url: str, default: str | None = None) -> str | None:
    """The first id from GET /v1/models, else `default`."""
    try:
        r = httpx.get(url + "/v1/models", timeout=10.0)
        r.raise_for_status()
        data = r.json().get("data") or []
        if data and data[0].get("id"):
            return data[0]["id"]
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return default


# -- prompts ------------------------------------------------------------------

_WORDS = (
    "river mountain city garden teacher student window morning evening story "
    "village market bread music travel ocean forest winter summer friend "
    "library question answer machine light paper letter family dinner bridge "
    "train station journey country history science number picture colour road "
    "little quiet bright happy careful ancient modern simple strong gentle "
    "walked opened found carried watched remembered built wrote painted asked "
    "near under above across through beside behind before after during"
).split()


def resolve_model_dir(model: str, dtype: str) -> Path:
    """'demo' -> the exported SmolLM2 dir for `dtype` (float32 unless a stored dtype is asked); else a
    model directory, which must hold a config.json."""
    if model == "demo":
        from meshlm.model.demo import demo_model_dir

        return demo_model_dir(dtype if dtype in ("float32", "float16", "bfloat16") else "float32")
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise SystemExit(f"{path} is not a model directory (no config.json)")
    return path


def prepare_model(model: str | None, tiny_dir: Path, tiny_flags: list[str]) -> tuple[Path, dict[str, Any]]:
    """`model` (a directory or 'demo'), or else a tiny random model made in `tiny_dir` with
    `meshlm demo-model --tiny <tiny_flags>`; with what the report says of it (shape, size, origin)."""
    if model:
        path = resolve_model_dir(model, "float32")
        source = "--model"
    else:
        path = tiny_dir
        cmd = [*meshlm_command(), "demo-model", "--tiny", str(path), *tiny_flags]
        subprocess.run(cmd, check=True, capture_output=True)
        source = "meshlm " + " ".join(cmd[len(meshlm_command()):]).replace(str(path), "OUT")
    config = json.loads((path / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    info = {
        "dir": str(path),
        "made_by": source,
        "model_type": config.get("model_type"),
        "layers": int(config["num_hidden_layers"]),
        "hidden": config.get("hidden_size"),
        "intermediate": config.get("intermediate_size"),
        "heads": heads,
        "kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or config["hidden_size"] // heads),
        "vocab": config.get("vocab_size"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "tie_word_embeddings": config.get("tie_word_embeddings"),
        "stored_dtype": config.get("torch_dtype"),
        "weights_mb": round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20, 1),
    }
    return path, info


def add_run_args(p) -> None:
    """The flags every server benchmark takes: readiness, retries, logs, output file."""
    p.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S)
    p.add_argument("--retries", type=int, default=2, help="retries of a request whose connection fails early")
    p.add_argument("--keep-logs", action="store_true", help="keep server logs even when all went well")
    p.add_argument("--out", help="also write the JSON here")


def refuse_tiny_flags(p: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Flags that shape the tiny model a script makes (`names`, as dests) do nothing beside --model: refuse
    them rather than report a run they did not shape (a float16 comparison once measured float32 twice)."""
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) != p.get_default(n)]
    if args.model and given:
        p.error(f"{', '.join(given)} shape the tiny model this script makes; --model serves the checkpoint as it "
                "is (round its weights with --meshlm-args=--dtype=float16)")


def parse_levels(parser, text: str) -> list[int]:
    """`--streams 1,8,16` -> [1, 8, 16]; a parser error for anything else."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--streams must be a comma list of integers, got {text!r}")
    if not levels or min(levels) < 1:
        parser.error("--streams needs positive integers")
    return levels


def make_prompt(index: int, words: int, seed: int = 0) -> str:
    """A prompt of roughly `words` words, different for every `index`.

    The request number comes first so no two prompts share a long prefix.
    """
    rng = random.Random(seed * 1_000_003 + index)
    body_words = max(1, words - 16)
    body = " ".join(rng.choice(_WORDS) for _ in range(body_words))
    return (
        f"Request {index}. Here are some notes: {body}. "
        "Now write a long, detailed story that uses these notes."
    )


# -- streaming client ---------------------------------------------------------


@dataclass
class StreamResult:
    ok: bool
    error: str | None = None
    status: int | None = None
    ttft: float | None = None  # request sent -> first content chunk
    latency: float | None = None  # request sent -> [DONE]
    itls: list[float] = field(default_factory=list)  # between content chunks
    content_chunks: int = 0
    completion_tokens: int | None = None  # from the usage chunk, if any
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    finish_reason: str | None = None
    text: str = ""
    retries: int = 0  # transport errors before any response, retried

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.content_chunks

    @property
    def tpot(self) -> float | None:
        """Seconds a token between the first and the last content chunk. Per token, not per chunk: a
        token that completes no character (part of a multi-byte one) streams with the next."""
        return sum(self.itls) / (self.tokens - 1) if self.itls and self.tokens > 1 else None


def chat_payload(model: str | None, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        payload["model"] = model
    payload.update(extra)
    return payload


def describe_error(e: BaseException) -> str:
    """`Type: message` of an exception and its causes (httpx often wraps an empty-message error)."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        msg = str(e)
        parts.append(f"{type(e).__name__}: {msg}" if msg else type(e).__name__)
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


async def stream_chat(client: _http.Client, url: str, payload: dict[str, Any], retries: int = 2) -> StreamResult:
    """POST a streaming chat completion and time its SSE chunks until `data: [DONE]`.

    A transport error before any response arrives (e.g. a connection dropped
    because the server's listen backlog overflowed) is retried up to `retries`
    times; the time lost still counts in TTFT and the retries are counted.
    """
    res = StreamResult(ok=False)
    t0 = time.perf_counter()
    for attempt in range(retries + 1):
        res.retries = attempt
        await _stream_once(client, url, payload, res, t0)
        if res.ok or res.status is not None or res.content_chunks or attempt == retries:
            break
        await asyncio.sleep(0.1 * (attempt + 1))
    return res


async def _stream_once(
    client: _http.Client, url: str, payload: dict[str, Any] | None, res: StreamResult, t0: float,
    path: str = "/v1/chat/completions", body: bytes | None = None,
) -> None:
    """One streamed request to `path` (chat deltas or completion texts), timed from `t0`; `body`: the
    request already encoded (a long prompt's JSON encoding kept out of TTFT), else `payload`."""
    last: float | None = None
    done = False
    if body is None:
        body = json.dumps(payload).encode()
    try:
        async with client.request("POST", url + path, body) as r:
            res.status = r.status
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:500]}"
                return
            async for line in r.lines():
                if done or not line.startswith("data:"):
                    continue  # after [DONE]: only the stream's end, read so the connection is kept
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except ValueError:
                    res.error = f"bad SSE data: {data[:200]}"
                    return
                if not isinstance(chunk, dict):
                    res.error = f"SSE data is not an object: {data[:200]}"
                    return
                if chunk.get("error"):
                    res.error = f"error event: {json.dumps(chunk['error'])[:500]}"
                    return
                usage = chunk.get("usage")
                if usage:
                    res.completion_tokens = usage.get("completion_tokens")
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if content:
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itls.append(now - last)
                        last = now
                        res.content_chunks += 1
                        res.text += content
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
            if done:
                res.latency = time.perf_counter() - t0
    except OSError as e:
        phase = "before the response" if res.status is None else f"after {res.content_chunks} content chunks"
        res.error = f"{describe_error(e)} ({phase})"
        return
    if not done:
        res.error = "stream ended without data: [DONE]"
        return
    res.error = None
    res.ok = True


def async_client(timeout: float | None = 600.0) -> _http.Client:
    """The benchmarks' streaming client (benchmarks/_http.py: lean, so it takes little CPU from the
    servers it measures); connections are opened as needed and kept."""
    return _http.Client(timeout=timeout, connect_timeout=10.0)


async def run_load(
    url: str,
    model: str | None,
    prompts: Sequence[str],
    streams: int,
    max_tokens: int,
    retries: int = 2,
    **extra: Any,
) -> tuple[list[StreamResult], float]:
    """`streams` workers pull prompts from a shared queue, one request at a time each.

    Returns the results (in prompt order) and the wall time of the whole load.
    """
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[StreamResult | None] = [None] * len(prompts)

    async with async_client() as client:

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results[i] = await stream_chat(
                    client, url, chat_payload(model, prompts[i], max_tokens, **extra), retries=retries
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def summarize(results: Sequence[StreamResult], wall: float) -> dict[str, Any]:
    """Latency percentiles and throughput of one load."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    tokens = sum(r.tokens for r in ok)
    out: dict[str, Any] = {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "wall_s": rounded(wall, 3),
        "completion_tokens": tokens,
        "tokens_per_s": rounded(tokens / wall if wall > 0 else None, 2),
        "ttft_p50": rounded(percentile(ttfts, 50)),
        "ttft_p95": rounded(percentile(ttfts, 95)),
        "itl_p50": rounded(percentile(itls, 50), 6),
        "itl_p95": rounded(percentile(itls, 95), 6),
        # per request: (last chunk - first chunk) / (tokens - 1), robust to chunk bunching
        "tpot_p50": rounded(percentile(tpots, 50), 6),
        "latency_p50": rounded(percentile([r.latency for r in ok if r.latency is not None], 50), 3),
        "mean_completion_tokens": rounded(tokens / len(ok), 1) if ok else None,
        "mean_content_chunks": rounded(sum(r.content_chunks for r in ok) / len(ok), 1) if ok else None,
        "tokens_from_usage": all(r.completion_tokens is not None for r in ok) if ok else None,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        # prompt tokens served from a prefix cache: a fair comparison of compute keeps this near 0
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "finish_reasons": _count(r.finish_reason for r in ok),
        "retried_requests": sum(1 for r in results if r.retries),
    }
    errors = [r.error for r in results if not r.ok]
    if errors:
        out["errors"] = sorted(set(e or "unknown" for e in errors))[:5]
    return out


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, digits)
