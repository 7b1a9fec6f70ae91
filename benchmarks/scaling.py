"""Scaling benchmark (issue 17): N ranks with one core each against one process on one core, same model
and load, in one run. Prints JSON.

    python benchmarks/scaling.py                            # --tensor-parallel 2 on a 72M llama made here
    python benchmarks/scaling.py --pipeline-parallel 2
    python benchmarks/scaling.py --context-parallel 2
    python benchmarks/scaling.py --tensor-parallel 2 --model PATH

Fair on a small machine: every process is pinned to one core (`taskset -c`) with OPENBLAS_NUM_THREADS=1,
so N ranks get exactly N times the baseline's compute:

- one_core: `meshlm serve` on core 0;
- ranks: `meshlm serve --<layout> N`, every rank started here by hand (a hostfile on loopback,
  `--rank r`, as `meshlm launch` would on N hosts) so each can be pinned, rank r on core r.

The load (the issue's): greedy streamed chat completions with `ignore_eos`, 16 concurrent streams,
48 requests, ~64-word prompts (every request differs; each server gets a fresh KV cache directory),
64 output tokens. The headline is output tokens/s of the N ranks / the one core's.

Where the time goes: every meshlm rank counts its seconds by phase (meshlm/step_times.py: build,
device, schedule, sample, emit, control, wait, link); rank 0's /metrics reports all ranks'
(`meshlm_rank_seconds_total`, workers' from their ACKs). The report gives them per engine step over
the load. `device` is the forward with its collectives: to split the two, a probe measures the
all-reduce alone: two processes pinned like the ranks run `mx.distributed.all_sum` on the shapes a
tensor-parallel layer reduces (decode: streams x hidden; prefill: a chunk x hidden), two per layer.
A pipeline's report adds `decode_probe` (benchmarks/stage_probe.py): each stage's decode micro-batch
timed alone and with every stage at once, against the one core's decode step, and the decode ceiling
those leave (a micro-batch holds streams/N rows, so per token the stages read N times the weights).

Servers run one after the other, never at the same time; a server that fails or hangs is recorded
with its log tails instead of ending the run; every process is stopped at the end.

On a shared VM the same run moves by up to ~15 % (docs/BENCHMARKS.md), so the pair is run --repeat
times (default 3), alternating one core and the ranks, each server on a fresh KV cache directory: the
headline `ratio` is the median of the pairs' ratios, `runs` lists every pair, and `servers` details
the first pair.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _peer  # noqa: E402
import pipeline_parallel as pp  # noqa: E402  (pinned, one_core_env, port_run, Cluster, one_level, warm_up)
import stage_probe  # noqa: E402
import tensor_parallel as tp  # noqa: E402  (scrape, finish, end_report, other_servers)

TARGETS = {"tensor": 1.7, "pipeline": 1.7, "context": None}  # N=2 ranks / one core at 16 streams (issues 13, 17)
LAYOUT_FLAGS = {"tensor": "--tensor-parallel", "pipeline": "--pipeline-parallel", "context": "--context-parallel"}
_RANK_SECONDS = re.compile(r'^meshlm_rank_seconds_total\{phase="(\w+)",rank="(\d+)"\}\s+(\S+)$')
_ALL_REDUCE_SECONDS = re.compile(r'^meshlm_all_reduce_seconds_total\{part="(\w+)",rank="(\d+)"\}\s+(\S+)$')
_ALL_REDUCES = re.compile(r'^meshlm_all_reduce_total\{rank="(\d+)"\}\s+(\S+)$')
PROBE_ITERS = 300
DECODE_PROBE_CONTEXT = 256  # tokens per row before decoding: about the load's prompts


TINY_SHAPE = ("layers", "hidden", "heads", "kv_heads", "dtype")  # flags of the tiny model made without --model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    layout = p.add_mutually_exclusive_group()
    for name, flag in LAYOUT_FLAGS.items():
        layout.add_argument(flag, type=int, dest=name, metavar="N", help=f"{name}-parallel ranks")
    p.add_argument("--model", help="HF-layout model dir; default: the issue's 72M llama, made here")
    p.add_argument("--layers", type=int, default=8, help="tiny model layers (without --model)")
    p.add_argument("--hidden", type=int, default=1024, help="tiny model hidden size")
    p.add_argument("--heads", type=int, default=16, help="tiny model attention heads")
    p.add_argument("--kv-heads", type=int, default=8, help="tiny model KV heads")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="how the tiny model's weights are stored (bfloat16 or float16: as most published "
                        "checkpoints; meshlm's packed layers then stream half the bytes)")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams")
    p.add_argument("--requests", type=int, default=48, help="requests in the load")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=64, help="~words per prompt (each request differs)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="rows of the all-reduce probe's prefill shape")
    p.add_argument("--level-timeout", type=float, default=600.0, help="seconds before the load counts as hung")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--meshlm-args", default="", help="extra `meshlm serve` options for every rank, e.g. "
                   "--meshlm-args=--no-ssd-cache (with '=')")
    p.add_argument("--layout-args", default="", help="extra options for the N ranks only, e.g. "
                   "--layout-args=--cp-min-tokens=4096 (with '=')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="pairs of runs (one core, then the ranks); the ratio "
                   "is their median")
    p.add_argument("--keep-logs", action="store_true", help="keep server logs even when all went well")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--probe-rank", type=int, help=argparse.SUPPRESS)  # internal: one all-reduce probe rank
    p.add_argument("--probe-shm", help=argparse.SUPPRESS)  # internal: the probe's shared-memory group file
    args = p.parse_args(argv)
    given = [(name, getattr(args, name)) for name in LAYOUT_FLAGS if getattr(args, name) is not None]
    args.layout, args.ranks = given[0] if given else ("tensor", 2)
    if args.ranks < 2:
        p.error("a layout needs at least 2 ranks")
    if args.ranks > (os.cpu_count() or 1) and args.probe_rank is None:
        print(f"warning: {args.ranks} ranks on {os.cpu_count()} cores: ranks share cores, the measure is not fair",
              file=sys.stderr)
    if min(args.streams, args.requests, args.max_tokens, args.prefill_chunk, args.repeat) < 1:
        p.error("--streams, --requests, --max-tokens, --prefill-chunk and --repeat need positive integers")
    _peer.refuse_tiny_flags(p, args, TINY_SHAPE)
    return args


# -- servers ----------------------------------------------------------------------------------


def flags(model: Path, port: int, args: argparse.Namespace, workdir: Path, tag: str) -> list[str]:
    return ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--kv-cache-dir", str(workdir / f"kv-{tag}"), *shlex.split(args.meshlm_args)]


def start_one_core(model: Path, args: argparse.Namespace, workdir: Path, run: int) -> pp.Cluster:
    port = _peer.free_port()
    cmd = flags(model, port, args, workdir, f"one-core-{run}")
    server = _peer.ServerProcess("meshlm-one-core", pp.pinned(0, [*_peer.meshlm_command(), *cmd]),
                                 f"http://127.0.0.1:{port}", env=pp.one_core_env())
    server.extra["flags"] = ["taskset", "-c", "0", "meshlm", *cmd]
    return pp.Cluster("one_core", [server.start()], metrics=True)


def start_ranks(model: Path, args: argparse.Namespace, workdir: Path, run: int) -> pp.Cluster:
    """Every rank by hand, the last first, rank r on core r (mod the cores there are)."""
    from meshlm.transport.auth import SECRET_ENV, ClusterSecret

    n, cores = args.ranks, os.cpu_count() or 1
    tag = f"{args.layout}{n}-{run}"
    hosts = workdir / f"{tag}-hosts.json"
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * n))
    base = pp.port_run(n)  # ring backend (TP, CP) or stage links (PP): rank r listens on base + r
    taken = set(range(base, base + n))
    control, *http = _peer.free_ports(n + 1, taken)
    env = pp.one_core_env({**os.environ, SECRET_ENV: ClusterSecret.generate().reveal()})
    servers = []
    for rank in reversed(range(n)):
        cmd = [*flags(model, http[rank], args, workdir, tag), *shlex.split(args.layout_args), "--hostfile", str(hosts),
               LAYOUT_FLAGS[args.layout], str(n), "--rank", str(rank), "--control-port", str(control),
               "--stage-port" if args.layout == "pipeline" else "--ring-port", str(base)]
        core = rank % cores
        server = _peer.ServerProcess(f"meshlm-{tag}-rank{rank}", pp.pinned(core, [*_peer.meshlm_command(), *cmd]),
                                     f"http://127.0.0.1:{http[rank]}", env=env)
        server.extra["flags"] = ["taskset", "-c", str(core), "meshlm", *cmd]
        servers.append(server.start())
    return pp.Cluster(tag, servers[::-1], metrics=True)


# -- measuring ----------------------------------------------------------------------------------


def rank_seconds(url: str) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """From /metrics: `meshlm_rank_seconds_total` as {rank: {phase: seconds}}, and every rank's shared-memory
    all-reduces as {rank: {"count", "total", "waiting"}} (empty where the ranks sum with MLX's backend)."""
    out: dict[int, dict[str, float]] = {}
    sums: dict[int, dict[str, float]] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out, sums
    for line in text.splitlines():
        if m := _RANK_SECONDS.match(line.strip()):
            out.setdefault(int(m.group(2)), {})[m.group(1)] = float(m.group(3))
        elif m := _ALL_REDUCE_SECONDS.match(line.strip()):
            sums.setdefault(int(m.group(2)), {})[m.group(1)] = float(m.group(3))
        elif m := _ALL_REDUCES.match(line.strip()):
            sums.setdefault(int(m.group(1)), {})["count"] = float(m.group(2))
    return out, sums


def breakdown(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]], steps: int,
              wall: float) -> dict[str, Any]:
    """Milliseconds per engine step by phase, per rank; `unaccounted`: the step's wall time no phase
    holds (on rank 0, mostly the HTTP thread's share of the core)."""
    per_rank: dict[str, Any] = {}
    for rank, phases in sorted(after.items()):
        ms = {p: round((s - before.get(rank, {}).get(p, 0.0)) / steps * 1e3, 3) for p, s in phases.items()}
        ms = {p: v for p, v in ms.items() if v > 0}
        ms["total"] = round(sum(ms.values()), 3)
        ms["unaccounted"] = round(wall / steps * 1e3 - ms["total"], 3)
        per_rank[str(rank)] = ms
    return per_rank


def run_load(cluster: pp.Cluster, args: argparse.Namespace, info: dict[str, Any]) -> None:
    info["command_per_rank"] = {str(r): s.extra["flags"] for r, s in enumerate(cluster.servers)}
    ok = False
    try:
        info["ready_s"] = round(cluster.servers[0].wait_ready(args.ready_timeout), 2)
        if dead := cluster.dead():
            raise _peer.ServerError(f"rank(s) {dead} exited before rank 0 was ready")
        info["cpu_affinity_per_rank"] = {str(r): pp.affinity(p) for r, p in cluster.pids.items()}
        info["openblas_loaded"] = all(_peer.tree_maps_contain(p, "libopenblas") for p in cluster.pids.values())
        cluster.request_model = _peer.served_model_id(cluster.url)
        pp.warm_up(cluster, args, info)
        prompts = tp.level_prompts(0, args.requests, args.prompt_words, args.seed)
        before, (times0, sums0) = tp.scrape(cluster.url), rank_seconds(cluster.url)
        summary, results = pp.one_level(cluster, prompts, args.streams, args)
        after, (times1, sums1) = tp.scrape(cluster.url), rank_seconds(cluster.url)
        steps = int(after.get("meshlm_step_seconds_count", 0) - before.get("meshlm_step_seconds_count", 0))
        if steps > 0:
            summary["ms_per_step_by_rank"] = breakdown(times0, times1, steps, summary["wall_s"])
            if sums1:
                summary["all_reduce_by_rank"] = {str(rank): {
                    "sums_per_step": round((parts.get("count", 0) - sums0.get(rank, {}).get("count", 0)) / steps, 2),
                    **{f"{part}_ms_per_step": round((s - sums0.get(rank, {}).get(part, 0.0)) / steps * 1e3, 3)
                       for part, s in parts.items() if part != "count"}} for rank, parts in sorted(sums1.items())}
        info["load"] = summary
        info["_texts"] = [r.text if r.ok else None for r in results]
        ok = not summary.get("requests_failed")
        print(f"[{cluster.name}] {summary['tokens_per_s']} tok/s, {steps} steps, itl p50 {summary['itl_p50']}",
              file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - a failed or hung server is a result, not a crash
        info["error"] = _peer.describe_error(e)
    finally:
        tp.finish(cluster.servers, info, ok, args.keep_logs)


# -- the all-reduce probe ---------------------------------------------------------------------------


def probe_rank(args: argparse.Namespace) -> int:
    """One rank of the probe (run pinned, with MLX_HOSTFILE/MLX_RANK): all_sum latency per shape, as meshlm
    sends it over the ring (transport/collectives.py: large sums in pieces), as one mx.distributed.all_sum,
    and through shared memory (transport/local_reduce.py, where built), as JSON."""
    import mlx.core as mx

    from meshlm.transport.collectives import all_sum
    from meshlm.transport.local_reduce import SharedMemoryGroup, native_module, spin_us

    group = mx.distributed.init(backend="ring")
    sums = {"meshlm": lambda x: all_sum(x, group), "one_piece": lambda x: mx.distributed.all_sum(x, group=group)}
    native, _ = native_module()
    if native is not None and args.probe_shm:
        shm = SharedMemoryGroup(Path(args.probe_shm), group.rank(), group.size(), native, spin_us(group.size()))
        if group.rank() == 0:
            shm.create()
        mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=group))  # rank 0 has created it
        if group.rank() != 0:
            shm.join()
        sums["shared_memory"] = shm.all_sum
    out: dict[str, dict[str, float]] = {}
    for how, fn in sums.items():
        for name, rows in (("decode", args.streams), ("prefill", args.prefill_chunk)):
            x = mx.ones((1, rows, args.hidden), dtype=mx.float32)
            for _ in range(10):
                mx.eval(fn(x))
            iters = PROBE_ITERS if rows <= 64 else PROBE_ITERS // 10
            t0 = time.perf_counter()
            for _ in range(iters):
                mx.eval(fn(x))
            out.setdefault(how, {})[name] = (time.perf_counter() - t0) / iters * 1e6
    print(json.dumps(out))
    return 0


def all_reduce_probe(args: argparse.Namespace, hidden: int, layers: int, workdir: Path) -> dict[str, Any]:
    n, cores = args.ranks, os.cpu_count() or 1
    base = pp.port_run(n)
    ring = workdir / "probe-ring.json"
    ring.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(n)]))
    procs = []
    for rank in reversed(range(n)):
        env = {**pp.one_core_env(), "MLX_HOSTFILE": str(ring), "MLX_RANK": str(rank)}
        cmd = pp.pinned(rank % cores, [sys.executable, __file__, "--probe-rank", str(rank), "--streams",
                                       str(args.streams), "--prefill-chunk", str(args.prefill_chunk),
                                       "--probe-shm", str(workdir / "probe-sums")])
        procs.append(subprocess.Popen([*cmd, "--hidden", str(hidden)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return {"error": "the all-reduce probe hung"}
    if any(p.returncode for p in procs):
        return {"error": "the all-reduce probe failed", "stderr": [e[-500:] for _, e in outs]}
    rank0 = json.loads(outs[-1][0].strip().splitlines()[-1])
    per_layer = 2  # attention's output projection and the MLP's down projection each reduce
    return {
        "what": f"all-reduce of float32 (rows, {hidden}), {n} processes pinned like the ranks, back to back; a "
                "tensor-parallel layer reduces twice; meshlm: over the ring backend as ranks that are not all local "
                "send it (pieces of at most 512 KiB), one_piece: a single mx.distributed.all_sum, shared_memory: "
                "what local ranks use by default (--local-all-reduce; transport/local_reduce.py)",
        "decode_rows": args.streams, "prefill_rows": args.prefill_chunk,
        **{how: {"all_sum_us": {k: round(v, 1) for k, v in times.items()},
                 "per_layer_us": {k: round(v * per_layer, 1) for k, v in times.items()},
                 "per_step_ms": {k: round(v * per_layer * layers / 1e3, 3) for k, v in times.items()}}
           for how, times in rank0.items()},
    }


# -- the report ---------------------------------------------------------------------------------------


def pair_summary(pair: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One pair of runs: both sides' output tokens/s, their ratio and how much of the greedy text matched.
    Reads (does not remove) the servers' texts."""
    rates = {name: info.get("load", {}).get("tokens_per_s") for name, info in pair.items()}
    texts = {name: info.get("_texts") for name, info in pair.items()}
    same = tp.same_frac(texts["one_core"], texts["ranks"]) if texts.get("one_core") and texts.get("ranks") else None
    return {"one_core_tokens_per_s": rates.get("one_core"), "ranks_tokens_per_s": rates.get("ranks"),
            "ratio": _peer.ratio(rates.get("ranks"), rates.get("one_core")), "same_output_frac": same}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe_rank is not None:
        return probe_rank(args)
    _peer.install_signal_handlers()
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _peer.machine_info(),
        "config": {"layout": args.layout, "ranks": args.ranks, "streams": args.streams, "requests": args.requests,
                   "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "temperature": 0,
                   "meshlm_args": args.meshlm_args, "layout_args": args.layout_args,
                   "ignore_eos": True, "stream": True,
                   "pinning": "every process on one core (taskset -c), OPENBLAS_NUM_THREADS=1; rank r on core r"},
        "notes": {
            "ms_per_step_by_rank": "meshlm_rank_seconds_total over the load / engine steps; device = the forward and "
                                   "its collectives (see all_reduce for the collectives alone); unaccounted = wall "
                                   "per step minus every phase (rank 0: its HTTP thread's share of the core)",
            "all_reduce_by_rank": "each rank's shared-memory sums inside the forwards (meshlm_all_reduce_*) per "
                                  "engine step: total, and waiting for the other ranks to reach the same sum "
                                  "(their skew)",
        },
    }
    if others := tp.other_servers():
        report["warning_other_servers_running"] = others
    pairs: list[dict[str, dict[str, Any]]] = [{} for _ in range(args.repeat)]
    report["servers"] = pairs[0]  # the first pair in detail (and what a failure leaves recorded)
    with _peer.recording(report):
        model, report["model"] = _peer.prepare_model(
            args.model, workdir / "tiny",
            ["--model-type", "llama", "--layers", str(args.layers), "--hidden", str(args.hidden),
             "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--seed", str(args.seed),
             "--dtype", args.dtype])
        for run in range(args.repeat):
            for name, start in (("one_core", start_one_core), ("ranks", start_ranks)):
                print(f"[{name}] starting (pair {run + 1} of {args.repeat})", file=sys.stderr, flush=True)
                pairs[run][name] = {}
                run_load(start(model, args, workdir, run), args, pairs[run][name])
        if args.layout == "tensor":
            print("[all_reduce] probing", file=sys.stderr, flush=True)
            report["all_reduce"] = all_reduce_probe(args, int(report["model"]["hidden"]), report["model"]["layers"],
                                                    workdir)
        if args.layout == "pipeline":
            print("[decode_probe] probing", file=sys.stderr, flush=True)
            try:
                report["decode_probe"] = stage_probe.probe(model, args.ranks, args.streams, DECODE_PROBE_CONTEXT,
                                                           workdir)
            except RuntimeError as exc:
                report["decode_probe"] = {"error": str(exc)}
    report["runs"] = [pair_summary(pair) for pair in pairs]
    for pair in pairs:  # the texts were only for comparing
        for info in pair.values():
            info.pop("_texts", None)
    ratios = [r["ratio"] for r in report["runs"] if r["ratio"] is not None]
    report["ratio"] = round(statistics.median(ratios), 3) if len(ratios) == len(pairs) and ratios else None
    fracs = [r["same_output_frac"] for r in report["runs"]]
    report["same_output_frac"] = None if None in fracs or not fracs else min(fracs)
    target = TARGETS.get(args.layout) if args.ranks == 2 else None
    report["target"] = {"ranks_over_one_core": target,
                        "met": None if target is None or report["ratio"] is None else report["ratio"] >= target}
    if failed := [f"{n} (pair {i + 1})" for i, pair in enumerate(pairs) for n, info in pair.items()
                  if info.get("error") or not info.get("exit_codes")]:
        report["failed_servers"] = failed
    report["elapsed_s"] = round(time.monotonic() - t_start, 1)
    return tp.end_report(report, bool(failed), workdir, args.keep_logs, args.out)


if __name__ == "__main__":
    sys.exit(main())
