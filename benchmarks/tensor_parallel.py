"""Tensor-parallel benchmark: meshlm TP=1 and TP=2 against mlx-lm's own server
in its 2-rank distributed mode, on the same model, in the same run. Prints JSON.

    python benchmarks/tensor_parallel.py                    # makes a TP=2-shardable tiny model
    python benchmarks/tensor_parallel.py --model PATH       # any HF-layout dir whose heads TP=2 divides

Per server and concurrency level (1, 8, 16 streams by default): aggregate
output tokens/s (completion tokens from each stream's usage chunk / wall time
of the level), TTFT and inter-token latency, and the peak RSS of every rank.

Control-plane fraction: meshlm's TensorExecutor counts `control_seconds` (ack
collection + plan broadcast) but does not expose it over HTTP, so it is
measured from outside: a micro-benchmark runs the real `ControlLeader` in this
process against one `ControlWorker` in a separate process over loopback TCP,
with plans of 16 decode chunks, in the executor's pipelined pattern (collect
step t-1's acks, broadcast step t, then "compute" while the worker acks). That
control time per step is divided by itself plus the mean engine step time that
`/metrics` (`meshlm_step_seconds` sum/count) reported for TP=2 at each level;
the largest of those fractions is the headline.

meshlm TP=2 runs twice: as a user starts it, and with OPENBLAS_NUM_THREADS set
for rank 0 explicitly, as mlx-lm's ranks get here (`meshlm serve
--tensor-parallel N` sets OPENBLAS_NUM_THREADS=cpus/N for every local rank,
rank 0 included, so the two runs should agree; the second one checks that).

The mlx-lm peer runs `python -m mlx_lm.server` twice (ranks 0 and 1) with a
ring hostfile on loopback ports, MLX_HOSTFILE/MLX_RANK set per process, not
through `mlx.launch` (whose I/O thread spins a core). Its failure or hang is
recorded in the JSON with the log tails instead of ending the run. Servers
run one after the other, never at the same time, and every process is
stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _peer  # noqa: E402

TARGET_VS_PEER = 2.0  # meshlm TP=2 / mlx-lm distributed tokens/s at 16 streams
TARGET_CONTROL_FRACTION = 0.05
DECODE_CHUNKS = 16  # plan shape for the control micro-benchmark: one decode token per stream


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF-layout model dir; default: a tiny random llama that TP=2 can shard")
    p.add_argument("--layers", type=int, default=12, help="tiny model layers (without --model)")
    p.add_argument("--hidden", type=int, default=512, help="tiny model hidden size")
    p.add_argument("--heads", type=int, default=8, help="tiny model attention heads")
    p.add_argument("--kv-heads", type=int, default=4, help="tiny model KV heads")
    p.add_argument("--streams", default="1,8,16", help="comma list of concurrency levels")
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24, help="~words per prompt (each request differs)")
    p.add_argument("--level-timeout", type=float, default=240.0, help="seconds before a level counts as hung")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--control-steps", type=int, default=200, help="steps per control micro-benchmark mode")
    p.add_argument("--skip", default="", help="comma list of servers to skip: tp1,tp2,tp2-blas1,mlx-lm")
    p.add_argument("--meshlm-args", default="", help="extra `meshlm serve` options for every meshlm run, e.g. "
                   "--meshlm-args=--no-ssd-cache (with '=')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", action="store_true", help="keep server logs even when all went well")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    args.levels = _peer.parse_levels(p, args.streams)
    if args.requests_per_stream < 1 or args.max_tokens < 1:
        p.error("--requests-per-stream and --max-tokens need positive integers")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    return args


# -- the model --------------------------------------------------------------------


def prepare_model(args: argparse.Namespace, workdir: Path) -> tuple[Path, dict[str, Any]]:
    path, info = _peer.prepare_model(
        args.model, workdir / f"tiny-l{args.layers}-h{args.hidden}-a{args.heads}-kv{args.kv_heads}",
        ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
         "--kv-heads", str(args.kv_heads), "--seed", str(args.seed)])
    heads, kv = info["heads"], info["kv_heads"]
    if heads % 2 or kv % 2:
        raise SystemExit(f"{path}: TP=2 must divide the heads ({heads}) and KV heads ({kv})")
    return path, info


# -- measuring servers ---------------------------------------------------------------


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def meshlm_rank_pids(leader_pid: int) -> dict[int, int]:
    """rank -> pid: the leader, and its descendants that carry `--rank r`."""
    ranks = {0: leader_pid}
    for pid in _peer.process_tree(leader_pid):
        argv = cmdline(pid)
        if pid != leader_pid and "--rank" in argv:
            try:
                ranks[int(argv[argv.index("--rank") + 1])] = pid
            except (IndexError, ValueError):
                pass
    return ranks


class RankRss:
    """Peak and last VmRSS per rank (each rank's pid alone, sampled every 0.2 s)."""

    def __init__(self, pids: dict[int, int], interval: float = 0.2) -> None:
        self.pids = pids
        self.interval = interval
        self.peak: dict[int, float] = {r: 0.0 for r in pids}
        self.level_peak: dict[int, float] = {r: 0.0 for r in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rank-rss")

    def sample(self) -> dict[int, float]:
        now = {r: _peer.rss_kb(p) / 1024.0 for r, p in self.pids.items()}
        for r, mb in now.items():
            self.peak[r] = max(self.peak[r], mb)
            self.level_peak[r] = max(self.level_peak[r], mb)
        return now

    def reset_level(self) -> None:
        self.level_peak = {r: 0.0 for r in self.pids}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> "RankRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def cpu_seconds(pids: list[int]) -> float:
    """user+system CPU seconds of the live processes of these trees, each process counted once."""
    procs = {q for p in pids for q in _peer.process_tree(p)}
    total = 0
    for q in procs:
        try:
            stat = Path(f"/proc/{q}/stat").read_bytes()
        except OSError:
            continue
        total += sum(int(x) for x in stat[stat.rfind(b")") + 2:].split()[11:13])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples (and the `_sum`/`_count` of histograms) from /metrics."""
    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        m = _METRIC_LINE.match(line.strip())
        if m and not m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out


def level_prompts(level_index: int, n: int, words: int, seed: int) -> list[str]:
    base = (level_index + 1) * 100_000  # distinct across levels, identical across servers
    return [_peer.make_prompt(base + i, words, seed) for i in range(n)]


def run_levels(name: str, url: str, request_model: str | None, pids: dict[int, int], args: argparse.Namespace,
               info: dict[str, Any], metrics: bool, levels: dict[int, dict[str, Any]]) -> None:
    """Warm up, then every concurrency level, filling `levels` {streams: summary} as it goes
    (so a hang or failure keeps what was measured): tokens/s, latencies, per-rank peak RSS."""
    texts: dict[int, list[str | None]] = {}
    info["_texts"] = texts
    with RankRss(pids) as rss:
        t0 = time.perf_counter()
        try:
            warm = asyncio.run(asyncio.wait_for(_peer.run_load(
                url, request_model, [_peer.make_prompt(0, args.prompt_words, args.seed)], 1, args.max_tokens),
                args.level_timeout))[0][0]
        except asyncio.TimeoutError:
            raise RuntimeError(f"{name}: warm-up request not answered within {args.level_timeout:g} s (hung?)")
        info["warmup"] = {"ok": warm.ok, "s": round(time.perf_counter() - t0, 2), "tokens": warm.tokens,
                          "text_head": warm.text[:80]}
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        info["idle_rss_mb_per_rank"] = {str(r): round(mb, 1) for r, mb in rss.sample().items()}
        for li, streams in enumerate(args.levels):
            prompts = level_prompts(li, streams * args.requests_per_stream, args.prompt_words, args.seed)
            rss.reset_level()
            before = scrape(url) if metrics else {}
            cpu0, busy0, w0 = cpu_seconds(list(pids.values())), _peer.system_busy_cpu_s(), time.monotonic()
            me0 = sum(os.times()[:2])
            try:
                results, wall = asyncio.run(asyncio.wait_for(
                    _peer.run_load(url, request_model, prompts, streams, args.max_tokens), args.level_timeout))
            except asyncio.TimeoutError:
                levels[streams] = {"error": f"level did not finish within {args.level_timeout:g} s (hung?)"}
                raise RuntimeError(f"{name}: {streams} streams timed out after {args.level_timeout:g} s")
            span = time.monotonic() - w0
            server_cpu = cpu_seconds(list(pids.values())) - cpu0
            busy = _peer.system_busy_cpu_s() - busy0
            client_cpu = sum(os.times()[:2]) - me0
            summary = _peer.summarize(results, wall)
            for key in ("finish_reasons", "mean_content_chunks", "tokens_from_usage", "ttft_p95", "itl_p95"):
                summary.pop(key, None)
            cores = os.cpu_count() or 1
            summary["server_cpu_cores_used"] = round(server_cpu / span, 2) if span > 0 else None
            summary["machine_busy_frac"] = round(busy / (span * cores), 3) if span > 0 else None
            other = max(0.0, busy - server_cpu - client_cpu)
            summary["other_processes_cpu_s"] = round(other, 2)  # CPU used by neither the servers nor this client
            summary["contended"] = other > 0.1 * span * cores
            rss.sample()
            summary["peak_rss_mb_per_rank"] = {str(r): round(mb, 1) for r, mb in rss.level_peak.items()}
            if metrics:
                after = scrape(url)
                steps = after.get("meshlm_step_seconds_count", 0) - before.get("meshlm_step_seconds_count", 0)
                step_sum = after.get("meshlm_step_seconds_sum", 0) - before.get("meshlm_step_seconds_sum", 0)
                if steps > 0:
                    summary["engine_steps"] = int(steps)
                    summary["step_seconds_mean"] = round(step_sum / steps, 6)  # /metrics meshlm_step_seconds
                    summary["wall_seconds_per_step"] = round(wall / steps, 6)
            texts[streams] = [r.text if r.ok else None for r in results]
            levels[streams] = summary
            print(f"[{name}] streams={streams}: {summary['tokens_per_s']} tok/s, ok {summary['requests_ok']}/"
                  f"{len(results)}, rss {summary['peak_rss_mb_per_rank']}"
                  + (" (CONTENDED: other processes used the CPU)" if summary["contended"] else ""),
                  file=sys.stderr, flush=True)
        info["peak_rss_mb_per_rank"] = {str(r): round(mb, 1) for r, mb in rss.peak.items()}


def finish(servers: list[_peer.ServerProcess], info: dict[str, Any], ok: bool, keep: bool) -> None:
    info["exit_codes"] = {}
    for rank, server in enumerate(servers):
        info["exit_codes"][str(rank)] = server.stop()
        if ok and not keep:
            server.remove_log()
        else:
            info.setdefault("logs", {})[str(rank)] = server.log_path
            if not ok:
                info.setdefault("log_tails", {})[str(rank)] = server.log_tail(25)


def bench_meshlm(model: Path, tp: int, args: argparse.Namespace, workdir: Path,
                 leader_blas_threads: int | None = None) -> tuple[dict, dict]:
    info: dict[str, Any] = {}
    levels: dict[int, dict[str, Any]] = {}
    extra = ["--kv-cache-dir", str(workdir / f"kv-tp{tp}-{leader_blas_threads or 'default'}"),
             *shlex.split(args.meshlm_args)]
    if tp > 1:
        extra += ["--tensor-parallel", str(tp)]
    env = None
    if leader_blas_threads is not None:
        env = {**os.environ, "OPENBLAS_NUM_THREADS": str(leader_blas_threads)}
    server = _peer.start_meshlm(str(model), extra_args=extra, env=env)
    info["command"] = server.extra["flags"]
    if leader_blas_threads is not None:
        info["note"] = (f"OPENBLAS_NUM_THREADS={leader_blas_threads} exported in rank 0's environment (meshlm "
                        "already sets cpus/N for every local rank; this run checks the default matches)")
    elif tp > 1:
        info["note"] = ("as a user runs it: default environment; meshlm preloads OpenBLAS and gives every local "
                        "rank, rank 0 included, OPENBLAS_NUM_THREADS=cpus/N")
    else:
        info["note"] = "as a user runs it: default environment; OpenBLAS preloaded by meshlm"
    ok = False
    try:
        info["ready_s"] = round(server.wait_ready(args.ready_timeout), 2)
        pids = meshlm_rank_pids(server.pid)
        info["ranks_found"] = len(pids)
        info["openblas_loaded"] = _peer.tree_maps_contain(server.pid, "libopenblas")
        model_id = _peer.served_model_id(server.url)
        run_levels(f"meshlm-tp{tp}", server.url, model_id, pids, args, info, True, levels)
        ok = all(not lv.get("requests_failed") and "error" not in lv for lv in levels.values())
    except Exception as e:  # noqa: BLE001 - keep the other servers' numbers
        info["error"] = _peer.describe_error(e)
    finally:
        finish([server], info, ok, args.keep_logs)
    return info, levels


def bench_mlx_lm_distributed(model: Path, args: argparse.Namespace, workdir: Path) -> tuple[dict, dict]:
    """mlx_lm.server as 2 ranks of the ring backend on loopback; rank 0 serves HTTP."""
    info: dict[str, Any] = {}
    levels: dict[int, dict[str, Any]] = {}
    ring = workdir / "mlx-lm-ring.json"
    ring.write_text(json.dumps([[f"127.0.0.1:{_peer.free_port()}"], [f"127.0.0.1:{_peer.free_port()}"]]))
    hf_cache = Path(tempfile.mkdtemp(prefix="bench-hf-cache-", dir=workdir))
    port = _peer.free_port()
    decode = max(_peer.MLX_LM_DEFAULT_DECODE_CONCURRENCY, max(args.levels))
    prompt = max(_peer.MLX_LM_DEFAULT_PROMPT_CONCURRENCY, max(args.levels))
    flags = ["--model", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--decode-concurrency", str(decode), "--prompt-concurrency", str(prompt)]
    blas = _peer.openblas_path()
    servers = []
    for rank in (1, 0):  # rank 1 first: rank 0's HTTP readiness is what we wait for
        env = dict(os.environ)
        env.pop("MESHLM_OPENBLAS", None)
        env.update({"MLX_HOSTFILE": str(ring), "MLX_RANK": str(rank), "HF_HUB_CACHE": str(hf_cache),
                    "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"})
        if blas:
            env["LD_PRELOAD"] = ":".join(p for p in (blas, env.get("LD_PRELOAD", "")) if p)
        cmd = [sys.executable, "-m", "mlx_lm.server", *flags]
        server = _peer.ServerProcess(f"mlx-lm-rank{rank}", cmd, f"http://127.0.0.1:{port}", env=env,
                                     ready_path="/v1/models")
        servers.append(server.start())
    servers.reverse()  # [rank 0, rank 1]
    info["command"] = ["python", "-m", "mlx_lm.server", *flags]
    info["env"] = {"MLX_HOSTFILE": "[[\"127.0.0.1:P0\"], [\"127.0.0.1:P1\"]]", "MLX_RANK": "0 / 1",
                   "HF_HUB_CACHE": "<empty temp dir>", "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1",
                   "LD_PRELOAD": blas}
    ok = False
    try:
        info["ready_s"] = round(servers[0].wait_ready(args.ready_timeout), 2)
        if not servers[1].alive():
            raise _peer.ServerError(f"rank 1 exited with code {servers[1].proc.returncode}:\n"
                                    + servers[1].log_tail())
        pids = {0: servers[0].pid, 1: servers[1].pid}
        info["openblas_loaded"] = all(_peer.tree_maps_contain(p, "libopenblas") for p in pids.values())
        run_levels("mlx-lm-dist2", servers[0].url, "default_model", pids, args, info, False, levels)
        ok = all(not lv.get("requests_failed") and "error" not in lv for lv in levels.values())
        if not servers[1].alive():
            ok = False
            info["error"] = f"rank 1 exited during the run with code {servers[1].proc.returncode}"
    except Exception as e:  # noqa: BLE001 - a failed or hung peer is a result, not a crash
        info["error"] = _peer.describe_error(e)
    finally:
        finish(servers, info, ok, args.keep_logs)
    return info, levels


# -- the control plane ------------------------------------------------------------------

_WORKER = """
import os, sys
from meshlm.transport.auth import SECRET_ENV, ClusterSecret
from meshlm.transport.control import ControlWorker
w = ControlWorker("127.0.0.1", int(sys.argv[1]), 1, "bench", timeout=30.0, world_size=2,
                  secret=ClusterSecret(os.environ[SECRET_ENV]))
w.connect()
while (plan := w.next_plan()) is not None:
    w.ack(plan.step_id, plan.fingerprint)
"""


def decode_plan(step: int, streams: int = DECODE_CHUNKS, prefill_tokens: int = 0):
    """A plan like the engine's at steady state: one sampled token per running stream
    (and optionally one new sequence's prefill chunk)."""
    from meshlm.engine.plan import LOGITS_LAST, Chunk, NewSequence, StepPlan, TableUpdate

    rng = random.Random(step)
    chunks = [Chunk(uid, 200 + step, (rng.randrange(512),), LOGITS_LAST) for uid in range(streams)]
    new, tables = (), ()
    if prefill_tokens:
        uid = 10_000 + step
        new = (NewSequence(uid, 0),)
        chunks.append(Chunk(uid, 0, tuple(rng.randrange(512) for _ in range(prefill_tokens)), LOGITS_LAST))
        tables = (TableUpdate(uid, tuple(range(prefill_tokens // 32 + 1))),)
    return StepPlan(step, new, tuple(chunks), tables=tables, num_blocks=1024, fingerprint=rng.getrandbits(63) | 1)


def control_benchmark(steps: int, compute_s: float) -> dict[str, Any]:
    """Time the leader's side of the control plane against a worker process on loopback."""
    from meshlm.transport import codec
    from meshlm.transport.auth import SECRET_ENV, ClusterSecret
    from meshlm.transport.control import ControlLeader

    secret = ClusterSecret.generate()
    leader = ControlLeader("127.0.0.1", 0, 2, timeout=30.0, fingerprint="bench", secret=secret)
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, str(leader.port)], stdin=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env={**os.environ, SECRET_ENV: secret.reveal()})
    out: dict[str, Any] = {}
    try:
        leader.wait_for_workers(timeout=60)
        step = 0
        plan = decode_plan(0)
        out["plan_bytes_16_decode_chunks"] = codec.HEADER_SIZE + len(codec.encode(plan))
        out["plan_bytes_16_decode_plus_256_token_prefill"] = codec.HEADER_SIZE + len(
            codec.encode(decode_plan(0, prefill_tokens=256)))

        def timed(mode_prefill: int, pipelined: bool, n: int) -> list[float]:
            nonlocal step
            times, unacked = [], None
            for _ in range(n):
                step += 1
                p = decode_plan(step, prefill_tokens=mode_prefill)
                t0 = time.perf_counter()
                if pipelined:
                    if unacked is not None:
                        leader.collect_acks(unacked)
                    leader.broadcast(p)
                    unacked = p.step_id
                    times.append(time.perf_counter() - t0)
                    time.sleep(compute_s)  # rank 0's forward; the worker acks meanwhile
                else:
                    leader.broadcast(p)
                    leader.collect_acks(p.step_id)
                    times.append(time.perf_counter() - t0)
            if unacked is not None:
                leader.collect_acks(unacked)
            return times

        timed(0, False, 20)  # warm-up
        rt = timed(0, False, steps)
        pipe = timed(0, True, steps)
        pipe_prefill = timed(256, True, max(steps // 3, 10))

        def stats(xs: list[float]) -> dict[str, float]:
            return {"mean_us": round(statistics.fmean(xs) * 1e6, 1), "p50_us": round(statistics.median(xs) * 1e6, 1),
                    "p95_us": round(_peer.percentile(xs, 95) * 1e6, 1), "n": len(xs)}

        out["round_trip_broadcast_then_collect_acks"] = stats(rt)
        out["pipelined_as_TensorExecutor"] = stats(pipe)
        out["pipelined_with_256_token_prefill"] = stats(pipe_prefill)
        out["simulated_compute_s"] = round(compute_s, 6)
        leader.shutdown(linger=2.0)
        worker.wait(timeout=10)
    except Exception as e:  # noqa: BLE001
        out["error"] = _peer.describe_error(e)
        err = worker.stderr.read().decode(errors="replace")[-2000:] if worker.poll() is not None else ""
        if err:
            out["worker_stderr"] = err
    finally:
        leader.close()
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    return out


# -- main ----------------------------------------------------------------------------------


def other_servers() -> list[str]:
    """meshlm / mlx_lm processes that this script did not start (they would skew the numbers)."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        argv = cmdline(int(name))
        text = " ".join(argv)
        if ("meshlm" in text and " serve" in text) or "mlx_lm.server" in text or "mlx_lm server" in text:
            found.append(f"{name}: {text[:160]}")
    return found


def end_report(report: dict[str, Any], failed: bool, workdir: Path, keep_logs: bool, out: str | None,
               leftover_mark: str | None = None) -> int:
    """The common tail of every benchmark: note leftover processes, keep the work dir only when it
    explains a failure (or --keep-logs), print the JSON (and write it to --out), the exit status."""
    leftovers = [s for s in other_servers() if str(workdir) in s or (leftover_mark and leftover_mark in s)]
    if leftovers:
        report["leftover_processes"] = leftovers
    failed = bool(failed or report.get("interrupted") or report.get("error"))
    if not keep_logs and not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        report["workdir"] = str(workdir)
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 1 if failed else 0


def same_frac(a: list[str | None], b: list[str | None]) -> float | None:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return round(sum(x == y for x, y in pairs) / len(pairs), 3) if pairs else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _peer.install_signal_handlers()
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    report: dict[str, Any] = {
        "machine": _peer.machine_info(),
        "config": {"streams": args.levels, "requests_per_stream": args.requests_per_stream,
                   "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}},
    }
    if others := other_servers():
        report["warning_other_servers_running"] = others
    servers: dict[str, dict[str, Any]] = {}
    per_server: dict[str, dict[int, dict[str, Any]]] = {}
    report["servers"] = servers
    with _peer.recording(report):
        model, report["model"] = prepare_model(args, workdir)
        blas1 = max(1, (os.cpu_count() or 2) // 2)
        plan = [("meshlm_tp1", "tp1"), ("meshlm_tp2", "tp2"), ("meshlm_tp2_leader_openblas_threads_1", "tp2-blas1"),
                ("mlx_lm_distributed_2", "mlx-lm")]
        for key, short in plan:
            if short in args.skip:
                continue
            print(f"[{key}] starting", file=sys.stderr, flush=True)
            if short == "mlx-lm":
                servers[key], per_server[key] = bench_mlx_lm_distributed(model, args, workdir)
            elif short == "tp2-blas1":
                servers[key], per_server[key] = bench_meshlm(model, 2, args, workdir, leader_blas_threads=blas1)
            else:
                servers[key], per_server[key] = bench_meshlm(model, int(short[2:]), args, workdir)
        if "tp2-blas1" not in args.skip:
            report["config"]["note"] = (f"meshlm_tp2_leader_openblas_threads_1 is meshlm TP=2 with OPENBLAS_NUM_THREADS="
                                        f"{blas1} exported for rank 0 too, as mlx-lm's ranks get here")
        # Control plane, with no server running.
        top_step = per_server.get("meshlm_tp2", {}).get(max(args.levels), {}).get("step_seconds_mean")
        print("[control] micro-benchmark", file=sys.stderr, flush=True)
        compute = min(top_step, 0.05) if top_step else 0.01  # capped: only the socket timing matters
        control = control_benchmark(args.control_steps, compute)
        report["control_plane"] = control
        control["method"] = (
            "control_seconds (TensorExecutor) is not exposed over HTTP, so it is measured outside the server: the "
            "real ControlLeader (this process) against one ControlWorker (a separate process) on loopback TCP, "
            "plans of 16 decode chunks (one token per stream). 'pipelined_as_TensorExecutor' times exactly what "
            "TensorExecutor.execute adds to control_seconds each step (collect the previous step's acks, then "
            "broadcast this plan), with a sleep in between standing for rank 0's forward (the worker acks "
            "meanwhile). fraction = control / (control + step), where step = meshlm_step_seconds sum/count "
            "from the TP=2 server's /metrics over that level (that histogram does not include control time); "
            "the headline is the largest fraction over the levels and both TP=2 runs.")
        if "pipelined_as_TensorExecutor" in control:
            c = control["pipelined_as_TensorExecutor"]["mean_us"] / 1e6
            rt = control["round_trip_broadcast_then_collect_acks"]["mean_us"] / 1e6
            fractions: dict[str, Any] = {}
            for name in ("meshlm_tp2", "meshlm_tp2_leader_openblas_threads_1"):
                for streams, lv in per_server.get(name, {}).items():
                    step = lv.get("step_seconds_mean")
                    if step:
                        fractions[f"{name}@{streams}"] = {
                            "step_seconds_mean": step,
                            "fraction": round(c / (c + step), 5),
                            "fraction_if_full_round_trip": round(rt / (rt + step), 5),
                        }
            control["fraction_of_step"] = fractions
            if fractions:
                worst = max(fractions, key=lambda k: fractions[k]["fraction"])
                control["worst"] = {"where": worst, **fractions[worst]}

    texts = {name: info.pop("_texts", {}) for name, info in servers.items()}
    levels = []
    for streams in args.levels:
        entry: dict[str, Any] = {"streams": streams}
        for name in servers:
            if streams in per_server.get(name, {}):
                entry[name] = per_server[name][streams]
        pairs = [("meshlm_tp1", "meshlm_tp2"), ("meshlm_tp2", "mlx_lm_distributed_2"),
                 ("meshlm_tp2", "meshlm_tp2_leader_openblas_threads_1")]
        for a, b in pairs:
            ta, tb = texts.get(a, {}).get(streams), texts.get(b, {}).get(streams)
            if ta and tb:
                entry[f"same_output_frac_{a}_vs_{b}"] = same_frac(ta, tb)
        contended = [n for n in servers if (entry.get(n) or {}).get("contended")]
        if contended:
            entry["contended"] = contended  # other processes used >10% of the CPUs meanwhile
        levels.append(entry)
    report["levels"] = levels

    def tps(name: str, streams: int) -> float | None:
        return per_server.get(name, {}).get(streams, {}).get("tokens_per_s")

    top = max(args.levels)
    ratios: dict[str, Any] = {
        f"meshlm_tp2_over_mlx_lm_distributed_at_{top}_streams": _peer.ratio(tps("meshlm_tp2", top),
                                                                         tps("mlx_lm_distributed_2", top)),
        "target_vs_mlx_lm_distributed": f">= {TARGET_VS_PEER}",
        f"meshlm_tp2_leader_openblas_threads_1_over_mlx_lm_distributed_at_{top}_streams": _peer.ratio(
            tps("meshlm_tp2_leader_openblas_threads_1", top), tps("mlx_lm_distributed_2", top)),
        f"meshlm_tp2_over_tp1_at_{top}_streams": _peer.ratio(tps("meshlm_tp2", top), tps("meshlm_tp1", top)),
        "control_plane_fraction_worst": report.get("control_plane", {}).get("worst", {}).get("fraction"),
        "target_control_plane_fraction": f"<= {TARGET_CONTROL_FRACTION}",
    }
    if servers.get("mlx_lm_distributed_2", {}).get("error"):
        ratios["note"] = "mlx-lm's distributed server failed or hung; see servers.mlx_lm_distributed_2.error"
    report["ratios"] = ratios
    report["elapsed_s"] = round(time.monotonic() - t_start, 1)
    failed = any("error" in i for i in servers.values())
    return end_report(report, failed, workdir, args.keep_logs, args.out, leftover_mark="bench-tp-")


if __name__ == "__main__":
    sys.exit(main())
