"""Context-parallel benchmark: meshlm with 2 context-parallel ranks against one meshlm process, on
long prompts, one core per rank. Prints JSON.

    python benchmarks/context_parallel.py                   # makes a tiny random long-context llama
    python benchmarks/context_parallel.py --model PATH      # any HF-layout dir with a long enough context
    python benchmarks/context_parallel.py --quick           # smoke run: small sizes, no 128K prompt

Fair scaling on a small machine: every process is pinned to one core (`taskset -c`) with
OPENBLAS_NUM_THREADS=1, so 2 ranks get exactly twice the compute of the baseline:

- meshlm_1core: one `meshlm serve` on core 0;
- meshlm_cp2: `meshlm serve --context-parallel 2` (`--cp-algorithm auto`), both ranks started here by
  hand (hostfile on loopback, `--rank r`) so that each can be pinned: rank 0 (HTTP, scheduler) on
  core 0, rank 1 on core 1;
- meshlm_cp2_pass_kv, meshlm_cp2_pass_q: the same with `--cp-algorithm pass-kv` / `pass-q`
  (pass-KV with `--cp-overlap off`, what `auto` resolves to on a CPU);
- meshlm_cp2_pass_kv_overlap: pass-KV with `--cp-overlap on` (the gather on a second stream, beside
  the attention to the rank's own KV): what the overlap is worth.

Every server gets `--no-ssd-cache`, a fresh `--kv-cache-dir` and one `--max-model-len` covering the
longest prompt any server gets plus the output. Prompts are random token ids in 3..499 sent to
/v1/completions as `"prompt": [ids]`, greedy (temperature 0), streamed, with `ignore_eos`; every
server gets the same prompts, and no two measured prompts share a prefix (each run's `cached_tokens`
from usage is reported: 0 where nothing should be cached).

Measured, after one short warm-up request per server:
1. TTFT of a 32K-token prompt (`--ttft-tokens`): time from sending the request (its JSON body
   encoded beforehand) to the first streamed token, `--ttft-runs` distinct prompts per server; the
   best and every run, and the ratio meshlm_1core / meshlm_cp2 of the bests.
2. Decode right after that prompt: inter-token latency p50/p95 between the streamed tokens of the
   same requests (`--max-tokens` tokens each), per run and pooled.
3. A 128K-token prompt (`--long-tokens`, the model's window minus headroom for the output) on
   meshlm_cp2: whether it completes, TTFT, ITL, per-rank peak RSS during it. The same on
   meshlm_1core only with `--single-128k` (minutes on one core).
4. KV bytes per rank for the 32K prompt, from config.json: one process holds L positions of
   2 * layers * kv_heads * head_dim * 4 bytes (float32 KV); CP rank r holds
   ContextSplit(2, r, block_size).local_count(L) of them; the largest rank's share / one process's.
   Beside it, the leader's `meshlm_kv_cache_bytes` gauge (/metrics) after the first 32K request of
   each server (blocks needed so far, counted by doubling: an upper bound, not the bytes used), and
   per-rank peak RSS.
5. pass-KV against pass-Q at cached fractions (`--fractions`) of a `--crossover-tokens` prompt: per
   fraction f, first the prompt's first f*T tokens (max_tokens 1) so they land in the prefix cache,
   then the whole prompt, whose TTFT is taken (distinct prompts per fraction and run, identical
   across the two servers). Beside it, what `auto` picks (meshlm.model.context_batch.
   choose_algorithm with the model's heads and the server's default min_new_for_kv): for the
   request as one step, and per step of chunked prefill (`--max-tokens-per-step`, 1024 by default),
   where every chunk after the first attends to more cached KV than the one before.

Each request is watched: a rank that exits or a request outliving its timeout ends that server's
measurements, recorded with its log tails. Servers run one after the other, never at the same time;
every process is stopped at the end, also on error or Ctrl-C. Helpers are shared with
pipeline_parallel.py (pinning, ports, Cluster) and tensor_parallel.py (RankRss, scrape, finish).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _peer  # noqa: E402
import pipeline_parallel as pp  # noqa: E402  (pinned, one_core_env, port_run, affinity, Cluster)
import tensor_parallel as tp  # noqa: E402  (RankRss, scrape, cpu_seconds, finish, other_servers)

RANKS = 2
BLOCK_SIZE = 32  # meshlm's default --block-size (each CP rank's share of a logical block of RANKS * 32)
MAX_TOKENS_PER_STEP = 1024  # meshlm's default --max-tokens-per-step
KV_DTYPE_BYTES = 4  # float32 KV on CPU
MAX_POSITION = 131072  # the tiny model's context window
LONG_HEADROOM = 64  # --long-tokens default: the window minus this (room for the output)
TTFT_TOKENS = 32768
CROSSOVER_TOKENS = 16384
FRACTIONS = (0.0, 0.5, 0.75, 0.9, 0.97)
TARGET_TTFT_SPEEDUP = 1.6  # meshlm_1core TTFT / meshlm_cp2 TTFT at 32K
TARGET_KV_FRACTION = 0.55  # largest CP rank's KV bytes / one process's, 32K prompt
SERVERS = ("meshlm_1core", "meshlm_cp2", "meshlm_cp2_pass_kv", "meshlm_cp2_pass_kv_overlap", "meshlm_cp2_pass_q")
CROSSOVER_SERVERS = SERVERS[2:]
ALGORITHM = {"meshlm_cp2": "auto", "meshlm_cp2_pass_kv": "pass-kv", "meshlm_cp2_pass_kv_overlap": "pass-kv",
             "meshlm_cp2_pass_q": "pass-q"}
# pass-KV's gather beside the attention to the rank's own KV (on) or after it (off; what auto picks on a CPU)
EXTRA_FLAGS = {"meshlm_cp2_pass_kv": ["--cp-overlap", "off"], "meshlm_cp2_pass_kv_overlap": ["--cp-overlap", "on"]}
QUICK = {"ttft_tokens": 4096, "crossover_tokens": 4096, "fractions": "0,0.75", "crossover_runs": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF-layout model dir; default: a tiny random long-context llama made here")
    p.add_argument("--ttft-tokens", type=int, help=f"prompt tokens of the TTFT runs (default {TTFT_TOKENS})")
    p.add_argument("--ttft-runs", type=int, default=2, help="TTFT runs per server, each a distinct prompt")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per measured request")
    p.add_argument("--long-tokens", type=int, help="prompt tokens of the long run (default: the model's "
                   f"window minus {LONG_HEADROOM}, {MAX_POSITION - LONG_HEADROOM} for the tiny model)")
    p.add_argument("--skip-long", action="store_true", help="no long-prompt run")
    p.add_argument("--single-128k", action="store_true", help="also the long prompt on meshlm_1core (minutes)")
    p.add_argument("--crossover-tokens", type=int, help=f"whole prompt of the pass-KV/pass-Q runs "
                   f"(default {CROSSOVER_TOKENS})")
    p.add_argument("--fractions", help="cached fractions of the crossover prompt (default "
                   + ",".join(f"{f:g}" for f in FRACTIONS) + ")")
    p.add_argument("--crossover-runs", type=int, help="runs per fraction and server, distinct prompts (default 2)")
    p.add_argument("--skip-crossover", action="store_true", help="no pass-KV/pass-Q servers")
    p.add_argument("--servers", help=f"comma-separated subset of {','.join(SERVERS)} (default: all)")
    p.add_argument("--max-tokens-per-step", type=int, help="passed to every server (meshlm's default: "
                   f"{MAX_TOKENS_PER_STEP}); the prefill chunk the per-step auto choice assumes")
    p.add_argument("--quick", action="store_true", help="smoke run: 4096-token TTFT and crossover prompts, "
                   "fractions 0,0.75, one crossover run, no long run")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds before a request counts as hung")
    p.add_argument("--long-timeout", type=float, default=3600.0, help="the same for the long-prompt requests")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--meshlm-args", default="", help="extra `meshlm serve` options for every meshlm rank, e.g. "
                   "--meshlm-args='--max-batch-size 8' (with '='; not --block-size or --max-model-len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", action="store_true", help="keep server logs even when all went well")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.skip_long = True
        for key, value in QUICK.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    args.ttft_tokens = args.ttft_tokens or TTFT_TOKENS
    args.crossover_tokens = args.crossover_tokens or CROSSOVER_TOKENS
    args.crossover_runs = args.crossover_runs or 2
    try:
        args.fractions = ([float(x) for x in args.fractions.split(",") if x.strip()] if args.fractions
                          else list(FRACTIONS))
    except ValueError:
        p.error(f"--fractions takes comma-separated numbers, got {args.fractions!r}")
    if not args.fractions or not all(0 <= f < 1 for f in args.fractions):
        p.error("--fractions need numbers in [0, 1)")
    if min(args.ttft_tokens, args.crossover_tokens, args.ttft_runs, args.max_tokens, args.crossover_runs) < 1:
        p.error("token counts and runs must be positive")
    if args.long_tokens is not None and args.long_tokens < 1:
        p.error("--long-tokens must be positive")
    if args.max_tokens_per_step is not None and args.max_tokens_per_step < 1:
        p.error("--max-tokens-per-step must be positive")
    args.step_tokens = args.max_tokens_per_step or MAX_TOKENS_PER_STEP
    args.servers = args.servers.split(",") if args.servers else list(SERVERS)
    if unknown := set(args.servers) - set(SERVERS):
        p.error(f"--servers: unknown {sorted(unknown)}")
    if "--block-size" in args.meshlm_args or "--max-model-len" in args.meshlm_args:
        p.error("--meshlm-args: this script sets --max-model-len itself and assumes the default --block-size")
    return args


# -- the model ---------------------------------------------------------------------------------


def prepare_model(args: argparse.Namespace, workdir: Path) -> tuple[Path, dict[str, Any]]:
    return _peer.prepare_model(args.model, workdir / "tiny-llama-long", [
        "--model-type", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
        "--max-position", str(MAX_POSITION), "--seed", str(args.seed)])


def plan_sizes(args: argparse.Namespace, model_info: dict[str, Any]) -> int:
    """Fix --long-tokens from the model's window; returns the --max-model-len every server gets."""
    window = int(model_info.get("max_position_embeddings") or 0) or None
    if args.long_tokens is None:
        args.long_tokens = (window or MAX_POSITION) - LONG_HEADROOM
    longest = max(args.ttft_tokens, 0 if args.skip_crossover else args.crossover_tokens,
                  0 if args.skip_long else args.long_tokens)
    needed = longest + args.max_tokens
    if window is not None and needed > window:
        raise ValueError(f"the longest prompt ({longest} tokens) plus --max-tokens {args.max_tokens} does not fit "
                         f"the model's window ({window}): lower --long-tokens/--ttft-tokens or use --skip-long")
    return needed


def prompt_ids(tag: str, n: int, seed: int) -> list[int]:
    """n random token ids in 3..499; the same for every server, different for every tag."""
    rng = random.Random(f"{seed}/{tag}")
    return [rng.randrange(3, 500) for _ in range(n)]


def kv_bytes(model_info: dict[str, Any], length: int) -> dict[str, Any]:
    """KV bytes of `length` positions in one process and on each CP rank, from config.json."""
    from meshlm.kv.context_split import ContextSplit

    per_position = 2 * model_info["layers"] * model_info["kv_heads"] * model_info["head_dim"] * KV_DTYPE_BYTES
    single = length * per_position
    ranks = []
    for r in range(RANKS):
        held = ContextSplit(RANKS, r, BLOCK_SIZE).local_count(length)
        ranks.append({"rank": r, "positions": held, "bytes": held * per_position,
                      "fraction_of_single": round(held / length, 4)})
    return {
        "prompt_tokens": length,
        "bytes_per_position": per_position,
        "formula": f"positions * 2 (K,V) * {model_info['layers']} layers * {model_info['kv_heads']} kv_heads * "
                   f"{model_info['head_dim']} head_dim * {KV_DTYPE_BYTES} bytes (float32)",
        "rank_positions": f"meshlm.kv.context_split.ContextSplit({RANKS}, r, {BLOCK_SIZE}).local_count(L)",
        "single_bytes": single,
        "per_cp_rank": ranks,
        "max_rank_over_single": round(max(r["bytes"] for r in ranks) / single, 4),
    }


# -- servers -------------------------------------------------------------------------------------


def meshlm_flags(model: Path, port: int, args: argparse.Namespace, workdir: Path, tag: str) -> list[str]:
    flags = ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--no-ssd-cache",
             "--kv-cache-dir", str(workdir / f"kv-{tag}"), "--max-model-len", str(args.max_model_len)]
    if args.max_tokens_per_step is not None:
        flags += ["--max-tokens-per-step", str(args.max_tokens_per_step)]
    return flags + shlex.split(args.meshlm_args)


def start_1core(model: Path, args: argparse.Namespace, workdir: Path) -> list[_peer.ServerProcess]:
    port = _peer.free_port()
    flags = meshlm_flags(model, port, args, workdir, "1core")
    server = _peer.ServerProcess("meshlm-1core", pp.pinned(0, [*_peer.meshlm_command(), *flags]),
                                 f"http://127.0.0.1:{port}", env=pp.one_core_env())
    server.extra["flags"] = ["taskset", "-c", "0", "meshlm", *flags]
    return [server.start()]


def start_cp2(model: Path, args: argparse.Namespace, workdir: Path, algorithm: str,
              extra: list[str]) -> list[_peer.ServerProcess]:
    """Both ranks by hand (as `meshlm launch` would on two hosts), rank 1 first, rank r on core r."""
    from meshlm.transport.auth import SECRET_ENV, ClusterSecret

    tag = f"cp{RANKS}-{algorithm}" + "".join(extra).replace("--", "-")
    hosts = workdir / f"{tag}-hosts.json"
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * RANKS))
    ring_port = pp.port_run(RANKS)  # the ring backend: rank r listens on ring_port + r
    control, *http = _peer.free_ports(RANKS + 1, set(range(ring_port, ring_port + RANKS)))
    env = pp.one_core_env({**os.environ, SECRET_ENV: ClusterSecret.generate().reveal()})
    servers = []
    for rank in reversed(range(RANKS)):
        flags = [*meshlm_flags(model, http[rank], args, workdir, tag), "--hostfile", str(hosts),
                 "--context-parallel", str(RANKS), "--cp-algorithm", algorithm, "--rank", str(rank),
                 "--control-port", str(control), "--ring-port", str(ring_port), *extra]
        server = _peer.ServerProcess(f"meshlm-{tag}-rank{rank}", pp.pinned(rank, [*_peer.meshlm_command(), *flags]),
                                     f"http://127.0.0.1:{http[rank]}", env=env)
        server.extra["flags"] = ["taskset", "-c", str(rank), "meshlm", *flags]
        servers.append(server.start())
    return servers[::-1]  # [rank 0, rank 1]


def start(name: str, model: Path, args: argparse.Namespace, workdir: Path) -> pp.Cluster:
    if name == "meshlm_1core":
        return pp.Cluster(name, start_1core(model, args, workdir), metrics=True)
    return pp.Cluster(name, start_cp2(model, args, workdir, ALGORITHM[name], EXTRA_FLAGS.get(name, [])), metrics=True)


# -- requests ------------------------------------------------------------------------------------


async def stream_completion(url: str, body: bytes) -> _peer.StreamResult:
    """POST a streaming text completion (`body` encoded beforehand) and time its SSE chunks until
    `data: [DONE]`; no read timeout: the caller's guard ends a hung request."""
    res = _peer.StreamResult(ok=False)
    async with _peer.async_client(timeout=None) as client:
        await _peer._stream_once(client, url, None, res, time.perf_counter(), path="/v1/completions", body=body)
    return res


def request(cluster: pp.Cluster, ids: list[int], max_tokens: int, timeout: float) -> dict[str, Any]:
    """One streamed greedy completion of `ids`, watched (a rank exiting or the timeout raises
    RuntimeError); returns its timings, usage and the CPU others used meanwhile."""
    payload = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    if cluster.request_model:
        payload["model"] = cluster.request_model
    body = json.dumps(payload).encode()  # encoded before the clock starts
    pids = cluster.pids
    cpu0 = {r: tp.cpu_seconds([p]) for r, p in pids.items()}
    busy0, me0, w0 = _peer.system_busy_cpu_s(), sum(os.times()[:2]), time.monotonic()
    res = asyncio.run(cluster._guarded(stream_completion(cluster.url, body), timeout))  # pp.Cluster's watch
    span = time.monotonic() - w0
    cpu = {r: tp.cpu_seconds([p]) - cpu0[r] for r, p in pids.items()}
    cpu = {r: c if c >= 0 else None for r, c in cpu.items()}  # None: the rank exited meanwhile
    used = sum(c for c in cpu.values() if c is not None)
    other = max(0.0, _peer.system_busy_cpu_s() - busy0 - used - (sum(os.times()[:2]) - me0))
    out: dict[str, Any] = {
        "ok": res.ok, "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
        "completion_tokens": res.completion_tokens, "streamed_chunks": res.content_chunks,
        "finish_reason": res.finish_reason, "output_sha1": hashlib.sha1(res.text.encode()).hexdigest()[:12],
        "ttft_s": _peer.rounded(res.ttft), "latency_s": _peer.rounded(res.latency),
        "itl_p50_s": _peer.rounded(_peer.percentile(res.itls, 50), 6),
        "itl_p95_s": _peer.rounded(_peer.percentile(res.itls, 95), 6),
        "decode_s_per_token": _peer.rounded(res.tpot, 6),
        "cpu_cores_used_per_rank": {str(r): None if c is None else round(c / span, 2) for r, c in cpu.items()} if span > 0 else None,
        "other_processes_cpu_s": round(other, 2),
        # others used over 10% of the machine meanwhile (and more than /proc's tick granularity): noisy numbers
        "contended": other > max(0.1 * span * (os.cpu_count() or 1), 0.05),
    }
    if not res.ok:
        out["error"] = res.error
    out["_itls"] = res.itls
    return out


def public(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if not k.startswith("_")}


def decode_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    itls = [x for r in runs if r["ok"] for x in r["_itls"]]
    return {"itl_p50_s": _peer.rounded(_peer.percentile(itls, 50), 6),
            "itl_p95_s": _peer.rounded(_peer.percentile(itls, 95), 6), "samples": len(itls),
            "per_run": [{"itl_p50_s": r["itl_p50_s"], "itl_p95_s": r["itl_p95_s"]} for r in runs]}


def log(name: str, what: str, run: dict[str, Any]) -> None:
    state = "ok" if run["ok"] else f"FAILED ({run.get('error')})"
    print(f"[{name}] {what}: ttft {run['ttft_s']} s, itl p50 {run['itl_p50_s']} s, cached {run['cached_tokens']}, "
          f"{state}" + (" (CONTENDED)" if run["contended"] else ""), file=sys.stderr, flush=True)


def rss_mb(values: dict[int, float]) -> dict[str, float]:
    return {str(r): round(mb, 1) for r, mb in values.items()}


# -- the phases ----------------------------------------------------------------------------------


def ttft_phase(cluster: pp.Cluster, args: argparse.Namespace, info: dict[str, Any], rss: tp.RankRss) -> None:
    rss.reset_level()
    runs: list[dict[str, Any]] = []
    info["ttft"] = {"prompt_tokens": args.ttft_tokens, "runs": runs}
    try:
        for i in range(args.ttft_runs):
            run = request(cluster, prompt_ids(f"ttft-{i}", args.ttft_tokens, args.seed), args.max_tokens,
                          args.request_timeout)
            runs.append(run)
            log(cluster.name, f"{args.ttft_tokens}-token prompt, run {i}", run)
            if i == 0:  # allocated KV after one prompt (a later one adds its own cached blocks)
                info["kv_cache_bytes_metric_after_first"] = tp.scrape(cluster.url).get("meshlm_kv_cache_bytes")
    finally:  # also when a rank died or a request hung: what was measured stays
        ok = [r["ttft_s"] for r in runs if r["ok"] and r["ttft_s"] is not None]
        info["ttft"]["best_s"] = min(ok) if ok else None
        info["ttft"]["decode"] = decode_summary(runs)
        info["ttft"]["peak_rss_mb_per_rank"] = rss_mb(rss.level_peak)
        info["ttft"]["runs"] = [public(r) for r in runs]


def long_phase(cluster: pp.Cluster, args: argparse.Namespace, info: dict[str, Any], rss: tp.RankRss) -> None:
    rss.reset_level()
    entry: dict[str, Any] = {"prompt_tokens": args.long_tokens}
    info["long"] = entry
    try:
        run = request(cluster, prompt_ids("long", args.long_tokens, args.seed), args.max_tokens, args.long_timeout)
    except RuntimeError as e:
        entry.update({"completed": False, "error": str(e), "peak_rss_mb_per_rank": rss_mb(rss.level_peak)})
        raise
    log(cluster.name, f"{args.long_tokens}-token prompt", run)
    entry["completed"] = run["ok"] and run["completion_tokens"] == args.max_tokens
    entry.update(public(run))
    entry["peak_rss_mb_per_rank"] = rss_mb(rss.level_peak)
    entry["metric_kv_cache_bytes"] = tp.scrape(cluster.url).get("meshlm_kv_cache_bytes")


def crossover_phase(cluster: pp.Cluster, args: argparse.Namespace, info: dict[str, Any], rss: tp.RankRss) -> None:
    out: list[dict[str, Any]] = []
    info["crossover"] = out
    total = args.crossover_tokens
    for fi, f in enumerate(args.fractions):
        entry: dict[str, Any] = {"fraction": f, "prefix_tokens": int(f * total), "runs": []}
        out.append(entry)
        for run_i in range(args.crossover_runs):
            ids = prompt_ids(f"crossover-{fi}-{run_i}", total, args.seed)
            prefix = int(f * total)
            if prefix:
                warm = request(cluster, ids[:prefix], 1, args.request_timeout)
                if not warm["ok"]:
                    entry["runs"].append({"prefix_error": warm.get("error")})
                    continue
            run = request(cluster, ids, args.max_tokens, args.request_timeout)
            log(cluster.name, f"crossover f={f:g} run {run_i}", run)
            entry["runs"].append({k: run[k] for k in ("ok", "ttft_s", "cached_tokens", "prompt_tokens", "output_sha1",
                                                      "cpu_cores_used_per_rank", "contended", "error") if k in run})
        ok = [r["ttft_s"] for r in entry["runs"] if r.get("ok") and r.get("ttft_s") is not None]
        entry["best_ttft_s"] = min(ok) if ok else None
    info["peak_rss_mb_per_rank_crossover"] = rss_mb(rss.level_peak)


# -- one server ----------------------------------------------------------------------------------


def bench(cluster: pp.Cluster, args: argparse.Namespace, info: dict[str, Any],
          phases: list[Callable[[pp.Cluster, argparse.Namespace, dict[str, Any], tp.RankRss], None]]) -> None:
    """Wait for rank 0, check every rank lives and sits on its core, warm up, run the phases; always
    stop the ranks. Fills `info` as it goes, so a failure or Ctrl-C keeps what was measured."""
    servers = cluster.servers
    info["command_per_rank"] = {str(r): s.extra["flags"] for r, s in enumerate(servers)}
    info["env"] = {"OPENBLAS_NUM_THREADS": "1", "pinning": "taskset -c <rank>"}
    ok = False
    try:
        info["ready_s"] = round(wait_ready(cluster, args.ready_timeout), 2)
        info["cpu_affinity_per_rank"] = {str(r): pp.affinity(p) for r, p in cluster.pids.items()}
        info["openblas_loaded"] = all(_peer.tree_maps_contain(p, "libopenblas") for p in cluster.pids.values())
        cluster.request_model = _peer.served_model_id(cluster.url)
        with tp.RankRss(cluster.pids) as rss:
            warm = request(cluster, prompt_ids("warmup", 512, args.seed), 4, args.request_timeout)
            info["warmup"] = public(warm)
            if not warm["ok"]:
                raise RuntimeError(f"warm-up request failed: {warm.get('error')}")
            info["idle_rss_mb_per_rank"] = rss_mb(rss.sample())
            for phase in phases:
                phase(cluster, args, info, rss)
            info["peak_rss_mb_per_rank"] = rss_mb(rss.peak)
        ok = not failed_requests(info)
        if dead := cluster.dead():
            ok = False
            info["error"] = f"rank(s) {dead} exited during the run"
    except KeyboardInterrupt:
        info["error"] = "interrupted"
        raise
    except Exception as e:  # noqa: BLE001 - a failed or hung server is a result, not a crash
        info["error"] = _peer.describe_error(e)
    finally:
        tp.finish(servers, info, ok, args.keep_logs)


def wait_ready(cluster: pp.Cluster, timeout: float) -> float:
    """Rank 0's readiness, giving up at once when any rank exits (a rank that dies during the
    handshake would otherwise leave rank 0 waiting for it)."""
    t0 = time.monotonic()
    leader = cluster.servers[0]
    while True:
        try:
            leader.wait_ready(min(2.0, max(0.1, timeout - (time.monotonic() - t0))))
            ready = True
        except _peer.ServerError:
            if not leader.alive():
                raise
            ready = False
        if dead := cluster.dead():
            raise _peer.ServerError(f"rank(s) {dead} exited before rank 0 was ready; rank {dead[0]}'s log:\n"
                                    + cluster.servers[dead[0]].log_tail())
        if ready:
            return time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            raise _peer.ServerError(f"{leader.name} not ready after {timeout:.0f}s; log {leader.log_path}:\n"
                                    + leader.log_tail(), leader.log_path)


def failed_requests(info: dict[str, Any]) -> int:
    runs = list(info.get("ttft", {}).get("runs", []))
    runs += [info["long"]] if "long" in info else []
    runs += [r for e in info.get("crossover", []) for r in e["runs"]]
    return sum(1 for r in runs if not r.get("ok"))


def phases_of(name: str, args: argparse.Namespace) -> list:
    if name in CROSSOVER_SERVERS:
        return [crossover_phase]
    long = not args.skip_long and (name == "meshlm_cp2" or args.single_128k)
    return [ttft_phase, *([long_phase] if long else [])]


# -- the report ----------------------------------------------------------------------------------


def auto_choices(model_info: dict[str, Any], total: int, cached: int, step_tokens: int) -> dict[str, Any]:
    """What `--cp-algorithm auto` picks for a prompt of `total` tokens with `cached` of them in the prefix
    cache: as one step, and per prefill chunk of at most `step_tokens` tokens."""
    from meshlm.model.batch import RowSpec
    from meshlm.model.context_batch import choose_algorithm
    from meshlm.model.ring_attention import RingContext

    min_new = RingContext.__dataclass_fields__["min_new_for_kv"].default  # what the server runs with

    def pick(start: int, new: int) -> str:
        row = RowSpec(uid=1, start=start, token_ids=tuple(range(new)), blocks=(0,))
        return choose_algorithm("auto", [row], model_info["kv_heads"], model_info["heads"], min_new)

    chunks = [(s, min(step_tokens, total - s)) for s in range(cached, total, step_tokens)]
    picks = [pick(s, n) for s, n in chunks]
    return {
        "whole_request_as_one_step": pick(cached, total - cached),
        "first_chunk": picks[0] if picks else None,
        "last_chunk": picks[-1] if picks else None,
        "chunks": len(picks),
        "pass_kv_chunks": picks.count("pass-kv"),
        "pass_kv_new_tokens": sum(n for (_, n), p in zip(chunks, picks) if p == "pass-kv"),
        "min_new_for_kv": min_new,
    }


def crossover_table(args: argparse.Namespace, servers: dict[str, dict], model_info: dict[str, Any]) -> dict:
    kv = servers.get("meshlm_cp2_pass_kv", {}).get("crossover", [])
    overlapped = servers.get("meshlm_cp2_pass_kv_overlap", {}).get("crossover", [])
    q = servers.get("meshlm_cp2_pass_q", {}).get("crossover", [])
    rows = []
    for i, f in enumerate(args.fractions):
        a = kv[i] if i < len(kv) else {}
        b = q[i] if i < len(q) else {}
        c = overlapped[i] if i < len(overlapped) else {}
        cached = [r.get("cached_tokens") for e in (a, b) for r in e.get("runs", []) if r.get("cached_tokens") is not None]
        # the prefix cache's hit (whole blocks, less the last prompt token), else the nominal prefix
        hit = min(cached) if cached else int(f * args.crossover_tokens)
        t_kv, t_q = a.get("best_ttft_s"), b.get("best_ttft_s")
        row: dict[str, Any] = {
            "fraction": f, "prefix_tokens_sent": int(f * args.crossover_tokens), "cached_tokens": hit,
            "new_tokens": args.crossover_tokens - hit,
            "ttft_s": {"pass-kv": t_kv, "pass-q": t_q, "pass-kv_overlapped": c.get("best_ttft_s")},
            "runs": {"pass-kv": a.get("runs"), "pass-q": b.get("runs"), "pass-kv_overlapped": c.get("runs")},
            "overlap_speedup_pass_kv": _peer.ratio(t_kv, c.get("best_ttft_s")),  # > 1: overlapping paid
            "faster": None if t_kv is None or t_q is None else ("pass-kv" if t_kv <= t_q else "pass-q"),
            "pass_q_over_pass_kv": _peer.ratio(t_q, t_kv),
            "same_output_pass_kv_vs_pass_q": same_outputs(a.get("runs", []), b.get("runs", [])),
            "same_output_pass_kv_overlap_vs_not": same_outputs(a.get("runs", []), c.get("runs", [])),
            "auto": auto_choices(model_info, args.crossover_tokens, hit, args.step_tokens),
        }
        auto = row["auto"]
        majority = "pass-kv" if auto["pass_kv_new_tokens"] * 2 >= row["new_tokens"] else "pass-q"
        row["auto"]["majority_by_new_tokens"] = majority
        row["auto_agrees_with_faster"] = None if row["faster"] is None else majority == row["faster"]
        rows.append(row)
    return {"total_tokens": args.crossover_tokens, "max_tokens_per_step": args.step_tokens,
            "runs_per_fraction": args.crossover_runs,
            "threshold": f"auto: pass-kv when new / (new + cached) >= 2 * kv_heads / q_heads = "
                         f"{2 * model_info['kv_heads'] / model_info['heads']:g} (or new >= min_new_for_kv), per step",
            "fractions": rows}


def summary(args: argparse.Namespace, servers: dict[str, dict], model_info: dict[str, Any]) -> dict[str, Any]:
    one, cp = servers.get("meshlm_1core", {}), servers.get("meshlm_cp2", {})
    out: dict[str, Any] = {}
    t1, t2 = one.get("ttft", {}).get("best_s"), cp.get("ttft", {}).get("best_s")
    out["ttft"] = {
        "prompt_tokens": args.ttft_tokens,
        "meshlm_1core": {"best_s": t1, "runs_s": [r["ttft_s"] for r in one.get("ttft", {}).get("runs", [])]},
        "meshlm_cp2": {"best_s": t2, "runs_s": [r["ttft_s"] for r in cp.get("ttft", {}).get("runs", [])]},
        "speedup_1core_over_cp2": _peer.ratio(t1, t2),
        # greedy parity, prompt by prompt (reported, not asserted)
        "same_output_cp2_vs_1core": same_outputs(one.get("ttft", {}).get("runs", []), cp.get("ttft", {}).get("runs", [])),
    }
    out["decode_after_ttft_prompt"] = {name: servers.get(name, {}).get("ttft", {}).get("decode")
                                       for name in ("meshlm_1core", "meshlm_cp2")}
    d1, d2 = (out["decode_after_ttft_prompt"][n] or {} for n in ("meshlm_1core", "meshlm_cp2"))
    out["decode_after_ttft_prompt"]["itl_p50_cp2_over_1core"] = _peer.ratio(d2.get("itl_p50_s"), d1.get("itl_p50_s"))
    if args.skip_long:
        out["long"] = {"skipped": "--skip-long" + (" (--quick)" if args.quick else "")}
    else:
        out["long"] = {"prompt_tokens": args.long_tokens,
                       "meshlm_cp2": _long_entry(cp),
                       "meshlm_1core": _long_entry(one) if args.single_128k else {"skipped": "no --single-128k"}}
    kv = kv_bytes(model_info, args.ttft_tokens)
    m1, m2 = one.get("kv_cache_bytes_metric_after_first"), cp.get("kv_cache_bytes_metric_after_first")
    kv["metric_meshlm_kv_cache_bytes_after_first_prompt"] = {"meshlm_1core": m1, "meshlm_cp2_leader": m2,
                                                             "cp2_leader_over_1core": _peer.ratio(m2, m1)}
    kv["peak_rss_mb_per_rank_during_ttft_runs"] = {
        name: servers.get(name, {}).get("ttft", {}).get("peak_rss_mb_per_rank") for name in ("meshlm_1core", "meshlm_cp2")}
    out["kv_bytes"] = kv
    if not args.skip_crossover:
        out["crossover"] = crossover_table(args, servers, model_info)
    return out


def same_outputs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[bool] | None:
    """Per prompt, whether two servers' greedy outputs were identical (by hash); None without both."""
    pairs = [(x, y) for x, y in zip(a, b) if x.get("ok") and y.get("ok")]
    return [x["output_sha1"] == y["output_sha1"] for x, y in pairs] or None


def _long_entry(info: dict[str, Any]) -> dict[str, Any]:
    if "long" not in info:
        return {"completed": False, "error": info.get("error", "not run")}
    keys = ("completed", "ttft_s", "itl_p50_s", "itl_p95_s", "completion_tokens", "cached_tokens",
            "peak_rss_mb_per_rank", "metric_kv_cache_bytes", "contended", "error")
    return {k: info["long"][k] for k in keys if k in info["long"]}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    speedup = results["ttft"]["speedup_1core_over_cp2"]
    kv = results["kv_bytes"]["max_rank_over_single"]
    out = [
        {"target": f"TTFT of a {results['ttft']['prompt_tokens']}-token prompt, meshlm 1-core / meshlm CP2 (best runs)",
         "want": f">= {TARGET_TTFT_SPEEDUP}", "measured": speedup,
         "met": None if speedup is None else speedup >= TARGET_TTFT_SPEEDUP},
        {"target": "largest CP rank's KV bytes / one process's, same prompt", "want": f"<= {TARGET_KV_FRACTION}",
         "measured": kv, "met": kv <= TARGET_KV_FRACTION},
    ]
    if "meshlm_cp2" in results["long"]:
        done = results["long"]["meshlm_cp2"].get("completed")
        out.append({"target": f"a {results['long']['prompt_tokens']}-token prompt completes on meshlm CP2",
                    "want": True, "measured": done, "met": bool(done)})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _peer.install_signal_handlers()
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="bench-cp-"))
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _peer.machine_info(),
    }
    if others := tp.other_servers():
        report["warning_other_servers_running"] = others
    servers: dict[str, dict[str, Any]] = {}
    with _peer.recording(report):
        model, report["model"] = prepare_model(args, workdir)
        args.max_model_len = plan_sizes(args, report["model"])
        report["config"] = {
            "ranks": RANKS, "ttft_tokens": args.ttft_tokens, "ttft_runs": args.ttft_runs,
            "max_tokens": args.max_tokens, "long_tokens": None if args.skip_long else args.long_tokens,
            "single_128k": args.single_128k and not args.skip_long,
            "crossover_tokens": None if args.skip_crossover else args.crossover_tokens,
            "fractions": None if args.skip_crossover else args.fractions,
            "crossover_runs": args.crossover_runs, "max_model_len": args.max_model_len,
            "max_tokens_per_step": args.step_tokens, "block_size": BLOCK_SIZE, "quick": args.quick,
            "request": {"endpoint": "/v1/completions", "prompt": "[token ids, random in 3..499]", "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
            "pinning": "every process on one core (taskset -c), OPENBLAS_NUM_THREADS=1; CP: rank r on core r",
            "every_server": "--no-ssd-cache, a fresh --kv-cache-dir, --max-model-len above",
        }
        report["servers"] = servers
        names = [n for n in SERVERS if n in args.servers and not (args.skip_crossover and n in CROSSOVER_SERVERS)]
        for name in names:
            print(f"[{name}] starting", file=sys.stderr, flush=True)
            servers[name] = {}
            bench(start(name, model, args, workdir), args, servers[name], phases_of(name, args))
    if "config" in report:
        report["results"] = summary(args, servers, report["model"])
        report["targets"] = targets(report["results"])
    report["notes"] = {
        "ttft": "request sent (body encoded beforehand) -> first streamed token; best of the runs",
        "itl": "gaps between streamed chunks of the same request; streamed_chunks beside completion_tokens "
               "shows whether every token came in its own chunk",
        "kv_cache_bytes_metric": "meshlm_kv_cache_bytes on the leader: its pools' allocated bytes (they grow by "
                                 "doubling), after the first TTFT prompt (the warm-up's cached blocks included)",
        "contended": "other processes used over 10% of the machine during that request",
        "crossover_cached_tokens": "from usage.prompt_tokens_details: whole prefix-cache blocks of the prefix",
    }
    if failed := [n for n, i in servers.items() if i.get("error") or not i.get("exit_codes")]:
        report["failed_servers"] = failed  # see servers.<name>.error and log_tails
    report["elapsed_s"] = round(time.monotonic() - t_start, 1)
    return tp.end_report(report, bool(failed), workdir, args.keep_logs, args.out)


if __name__ == "__main__":
    sys.exit(main())
