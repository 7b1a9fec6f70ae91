"""Pipeline-parallel benchmark (issue 13): meshlm with 2 stages against one meshlm process, and
mlx-lm's own `--pipeline` server against one mlx-lm process, on the same model, one core per rank.
Prints JSON.

    python benchmarks/pipeline_parallel.py                  # makes a tiny random qwen2 (~72M params)
    python benchmarks/pipeline_parallel.py --model PATH     # any HF-layout dir (qwen2/llama for mlx-lm's pipeline)

Fair scaling on a small machine: every process is pinned to one core (`taskset -c`) with
OPENBLAS_NUM_THREADS=1, so a 2-stage pipeline gets exactly twice the compute of the baseline:

- meshlm_1core: one `meshlm serve` on core 0;
- meshlm_pp2: `meshlm serve --pipeline-parallel 2`, both ranks started here by hand (hostfile on
  loopback, `--rank r`) so that each can be pinned: rank 0 (HTTP, scheduler, the last stage) on
  core 0, rank 1 (stage 0) on core 1;
- mlx_lm_1core: `python -m mlx_lm.server` on core 0;
- mlx_lm_pp2: `python -m mlx_lm.server --pipeline` as 2 ranks of the ring backend (MLX_HOSTFILE /
  MLX_RANK per process, not mlx.launch), rank 0 on core 0 and rank 1 on core 1.

Per server and concurrency level (1 and 16 streams by default): greedy streamed chat completions
with `ignore_eos` (mlx-lm ignores that field), aggregate output tokens/s (usage completion tokens
/ wall time of the level), TTFT and inter-token latency p50/p95, per-rank peak RSS and CPU, the
same-output fraction against meshlm_1core's texts (greedy parity: reported, not asserted), and
for meshlm the mean engine step time from /metrics (`meshlm_step_seconds` sum/count).

Bytes per stage are measured in this process before any server starts: each stage's slice is
loaded with `load_model(..., stage=StageSlice(...))`, as a rank loads it, and its parameters'
nbytes summed, against the whole model's. KV bytes per block and stage are computed from
config.json (2 * layers * kv_heads * head_dim * block_size * 4 bytes, float32 KV).

mlx-lm answers /v1/models before it has loaded the model, so its load time shows in the warm-up.
mlx-lm's pipeline loader needs model.safetensors.index.json; a model without one (the tiny model,
most single-file models) is given to mlx_lm_pp2 as a mirror dir of symlinks plus a generated index.

Servers run one after the other, never at the same time; a server that fails or hangs is recorded
with its log tails instead of ending the run; every process is stopped at the end, also on error
or Ctrl-C. Helpers shared with tensor_parallel.py (RankRss, scrape, finish, ...) are imported
from it rather than copied.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _peer  # noqa: E402
import tensor_parallel as tp  # noqa: E402  (RankRss, scrape, cpu_seconds, finish, same_frac, ...)

STAGES = 2
BLOCK_SIZE = 32  # meshlm's default --block-size
KV_DTYPE_BYTES = 4  # float32 KV on CPU
TARGET_THROUGHPUT = 1.7  # meshlm PP2 / 1-core tokens/s at 16 streams
TARGET_ITL = 1.15  # meshlm PP2 / 1-core inter-token latency at 1 stream
TARGET_STAGE_FRACTION = 0.55  # weight bytes of each stage / whole model, S=2
SERVERS = ("meshlm_1core", "meshlm_pp2", "mlx_lm_1core", "mlx_lm_pp2")
BASELINE = "meshlm_1core"  # greedy parity is measured against its texts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF-layout model dir; default: a tiny random qwen2 made here")
    p.add_argument("--model-type", default="qwen2", help="tiny model type (without --model)")
    p.add_argument("--layers", type=int, default=8, help="tiny model layers")
    p.add_argument("--hidden", type=int, default=1024, help="tiny model hidden size")
    p.add_argument("--heads", type=int, default=16, help="tiny model attention heads")
    p.add_argument("--kv-heads", type=int, default=8, help="tiny model KV heads")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="how the tiny model's weights are stored (16-bit: meshlm's packed layers stream half the "
                        "bytes; mlx-lm then computes in 16 bits, very slowly on a CPU: compare meshlm with meshlm)")
    p.add_argument("--levels", default="1,16", help="comma list of concurrency levels (streams)")
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=64, help="~words per prompt (each request differs)")
    p.add_argument("--pp-split", help="layers per stage in pipeline order, e.g. 3,5 (default: even)")
    p.add_argument("--level-timeout", type=float, default=300.0, help="seconds before a level counts as hung")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--skip", default="", help="comma list of servers to skip: " + ",".join(SERVERS))
    p.add_argument("--meshlm-args", default="", help="extra `meshlm serve` options for every meshlm rank, e.g. "
                   "--meshlm-args=--no-ssd-cache (with '=')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", action="store_true", help="keep server logs even when all went well")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    args.levels = _peer.parse_levels(p, args.levels)
    if args.requests_per_stream < 1 or args.max_tokens < 1:
        p.error("--requests-per-stream and --max-tokens need positive integers")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if unknown := args.skip - set(SERVERS):
        p.error(f"--skip: unknown servers {sorted(unknown)}")
    args.split = parse_split(p, args.pp_split)
    _peer.refuse_tiny_flags(p, args, ("model_type", "layers", "hidden", "heads", "kv_heads", "dtype"))
    return args


def parse_split(parser: argparse.ArgumentParser, text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        split = tuple(int(x) for x in text.split(","))
    except ValueError:
        parser.error(f"--pp-split takes comma-separated integers, got {text!r}")
    if len(split) != STAGES:
        parser.error(f"--pp-split needs {STAGES} entries")
    return split


# -- the model and its stages ---------------------------------------------------------


def prepare_model(args: argparse.Namespace, workdir: Path) -> tuple[Path, dict[str, Any]]:
    return _peer.prepare_model(
        args.model,
        workdir / f"tiny-{args.model_type}-l{args.layers}-h{args.hidden}-a{args.heads}-kv{args.kv_heads}-{args.dtype}",
        ["--model-type", args.model_type, "--layers", str(args.layers), "--hidden", str(args.hidden),
         "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--seed", str(args.seed),
         "--dtype", args.dtype])


def stage_layout(model_info: dict[str, Any], split: tuple[int, ...] | None):
    from meshlm.cluster.stages import StageLayout

    return StageLayout.create(int(model_info["layers"]), STAGES, split)


def parameter_bytes(model_dir: Path, stage=None) -> tuple[int, int]:
    """(bytes, count) of the parameters a rank holds: the whole model, or one StageSlice of it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from meshlm.config import ModelConfig
    from meshlm.model.loader import load_model

    loaded = load_model(ModelConfig(str(model_dir)), stage=stage)
    params = [v for _, v in tree_flatten(loaded.model.parameters())]
    out = sum(v.nbytes for v in params), sum(v.size for v in params)
    del loaded, params
    gc.collect()
    mx.clear_cache()
    return out


def stage_bytes(model_dir: Path, model_info: dict[str, Any], layout) -> dict[str, Any]:
    """Weight bytes each stage loads (as its rank does) against the whole model, and KV bytes per block."""
    from meshlm.model.loader import StageSlice

    whole, count = parameter_bytes(model_dir)
    per_layer_block = 2 * model_info["kv_heads"] * model_info["head_dim"] * BLOCK_SIZE * KV_DTYPE_BYTES
    stages = []
    for s in range(layout.stages):
        first, end = layout.layers(s)
        nbytes, _ = parameter_bytes(model_dir, StageSlice(first, end, s == 0, s == layout.stages - 1))
        stages.append({
            "stage": s, "rank": layout.rank_of(s), "layers": [first, end],
            "holds": ["embedding"] * (s == 0) + ["norm", "head"] * (s == layout.stages - 1),
            "weight_bytes": nbytes, "weight_mb": round(nbytes / 2**20, 2),
            "fraction_of_whole": round(nbytes / whole, 4),
            "kv_bytes_per_block": per_layer_block * (end - first),
        })
    return {
        "split": list(layout.split),
        "whole_model_weight_bytes": whole, "whole_model_weight_mb": round(whole / 2**20, 2),
        "whole_model_params": count,
        "whole_model_kv_bytes_per_block": per_layer_block * layout.num_layers,
        "kv_block": f"2 (K,V) * layers * {model_info['kv_heads']} kv_heads * {model_info['head_dim']} head_dim * "
                    f"{BLOCK_SIZE} tokens * {KV_DTYPE_BYTES} bytes (float32)",
        "method": "parameters' nbytes (mlx.utils.tree_flatten) after load_model(ModelConfig(dir), "
                  "stage=StageSlice(first, end, embeds, logits)) in the benchmark process, as each rank loads it",
        "stages": stages,
    }


# -- pinned processes --------------------------------------------------------------------


def pinned(core: int, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(core), *cmd]


def one_core_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["OPENBLAS_NUM_THREADS"] = "1"
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # meshlm's own default (meshlm/platform.py)
    return env


def port_run(n: int) -> int:
    """The first of n consecutive free ports (rank r's stage link listens on base + r)."""
    import socket
    from contextlib import ExitStack

    while True:
        base = _peer.free_port()
        try:
            with ExitStack() as stack:
                for port in range(base + 1, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


def affinity(pid: int | None) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(pid)) if pid else None
    except OSError:
        return None


def meshlm_flags(model: Path, port: int, args: argparse.Namespace, workdir: Path, tag: str) -> list[str]:
    return ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--kv-cache-dir", str(workdir / f"kv-{tag}"), *shlex.split(args.meshlm_args)]


def start_meshlm_1core(model: Path, args: argparse.Namespace, workdir: Path) -> list[_peer.ServerProcess]:
    port = _peer.free_port()
    flags = meshlm_flags(model, port, args, workdir, "1core")
    server = _peer.ServerProcess("meshlm-1core", pinned(0, [*_peer.meshlm_command(), *flags]),
                                 f"http://127.0.0.1:{port}", env=one_core_env())
    server.extra["flags"] = ["taskset", "-c", "0", "meshlm", *flags]
    return [server.start()]


def start_meshlm_pp2(model: Path, args: argparse.Namespace, workdir: Path) -> list[_peer.ServerProcess]:
    """Both ranks by hand (as `meshlm launch` would on two hosts), rank 1 first, each on its own core."""
    from meshlm.transport.auth import SECRET_ENV, ClusterSecret

    hosts = workdir / "pp-hosts.json"
    hosts.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * STAGES))
    stage_port = port_run(STAGES)
    avoid = range(stage_port, stage_port + STAGES)
    control = _peer.free_port()
    while control in avoid:
        control = _peer.free_port()
    http = [_peer.free_port() for _ in range(STAGES)]
    env = one_core_env({**os.environ, SECRET_ENV: ClusterSecret.generate().reveal()})
    servers = []
    for rank in reversed(range(STAGES)):
        flags = [*meshlm_flags(model, http[rank], args, workdir, "pp2"), "--hostfile", str(hosts),
                 "--pipeline-parallel", str(STAGES), "--rank", str(rank), "--control-port", str(control),
                 "--stage-port", str(stage_port)]
        if args.pp_split:
            flags += ["--pp-split", args.pp_split]
        server = _peer.ServerProcess(f"meshlm-pp2-rank{rank}", pinned(rank, [*_peer.meshlm_command(), *flags]),
                                     f"http://127.0.0.1:{http[rank]}", env=env)
        server.extra["flags"] = ["taskset", "-c", str(rank), "meshlm", *flags]
        servers.append(server.start())
    return servers[::-1]  # [rank 0, rank 1]


def mlx_lm_env(hf_cache: Path, ring: Path | None = None, rank: int | None = None) -> dict[str, str]:
    env = one_core_env()
    env.pop("MESHLM_OPENBLAS", None)
    env.update({"HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"})
    if ring is not None:
        env.update({"MLX_HOSTFILE": str(ring), "MLX_RANK": str(rank)})
    if blas := _peer.openblas_path():
        env["LD_PRELOAD"] = ":".join(p for p in (blas, env.get("LD_PRELOAD", "")) if p)
    return env


def mlx_lm_flags(model: Path, port: int, args: argparse.Namespace) -> list[str]:
    decode = max(_peer.MLX_LM_DEFAULT_DECODE_CONCURRENCY, max(args.levels))
    prompt = max(_peer.MLX_LM_DEFAULT_PROMPT_CONCURRENCY, max(args.levels))
    return ["--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--decode-concurrency", str(decode), "--prompt-concurrency", str(prompt)]


def with_weight_index(model: Path, workdir: Path) -> tuple[Path, str | None]:
    """mlx-lm's pipeline loader reads model.safetensors.index.json to pick each rank's files and fails
    without one (single-file models): give it a mirror of `model` (symlinks) plus a generated index."""
    if (model / "model.safetensors.index.json").exists():
        return model, None
    mirror = workdir / f"{model.name}-with-index"
    if not mirror.exists():
        mirror.mkdir()
        weight_map = {}
        for f in sorted(model.iterdir()):
            (mirror / f.name).symlink_to(f)
            if f.suffix == ".safetensors":
                weight_map.update({name: f.name for name in safetensors_names(f)})
        index = {"metadata": {}, "weight_map": weight_map}
        (mirror / "model.safetensors.index.json").write_text(json.dumps(index))
    return mirror, ("the model has no model.safetensors.index.json, which mlx-lm's pipeline loader needs: it "
                    "ran on a mirror dir (symlinks to the same files) with a generated index")


def safetensors_names(path: Path) -> list[str]:
    """Tensor names from a .safetensors header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return [k for k in header if k != "__metadata__"]


def start_mlx_lm(model: Path, args: argparse.Namespace, workdir: Path, ranks: int) -> list[_peer.ServerProcess]:
    """mlx_lm.server on core 0, or with ranks=2 `--pipeline` over a loopback ring, rank r on core r."""
    note = None
    if ranks > 1:
        model, note = with_weight_index(model, workdir)
    hf_cache = Path(tempfile.mkdtemp(prefix="bench-hf-cache-", dir=workdir))
    port = _peer.free_port()
    flags = mlx_lm_flags(model, port, args) + (["--pipeline"] if ranks > 1 else [])
    ring = None
    if ranks > 1:
        ring = workdir / "mlx-lm-ring.json"
        ring.write_text(json.dumps([[f"127.0.0.1:{_peer.free_port()}"] for _ in range(ranks)]))
    servers = []
    for rank in reversed(range(ranks)):  # rank 0 last: its HTTP readiness is what we wait for
        env = mlx_lm_env(hf_cache, ring, rank if ring else None)
        cmd = pinned(rank, [sys.executable, "-m", "mlx_lm.server", *flags])
        server = _peer.ServerProcess(f"mlx-lm-rank{rank}" if ring else "mlx-lm-1core", cmd,
                                     f"http://127.0.0.1:{port}", env=env, ready_path="/v1/models")
        server.extra["flags"] = ["taskset", "-c", str(rank), "python", "-m", "mlx_lm.server", *flags]
        server.extra["note"] = note
        servers.append(server.start())
    return servers[::-1]


# -- measuring -------------------------------------------------------------------------------


@dataclass
class Cluster:
    """The running ranks of one server under test; rank 0 serves HTTP."""

    name: str
    servers: list[_peer.ServerProcess]
    request_model: str | None = None
    metrics: bool = False  # meshlm: /metrics has meshlm_step_seconds

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def pids(self) -> dict[int, int]:
        return {r: s.pid for r, s in enumerate(self.servers)}

    def dead(self) -> list[int]:
        return [r for r, s in enumerate(self.servers) if not s.alive()]

    def load(self, prompts: list[str], streams: int, args: argparse.Namespace) -> tuple[list, float]:
        """`_peer.run_load`, ended early (RuntimeError) when a rank dies or the level outlives --level-timeout."""
        return asyncio.run(self._guarded(_peer.run_load(self.url, self.request_model, prompts, streams,
                                                        args.max_tokens, ignore_eos=True), args.level_timeout))

    async def _guarded(self, coro, timeout: float):
        task = asyncio.ensure_future(coro)
        deadline = time.monotonic() + timeout
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            why = (f"rank(s) {self.dead()} exited" if self.dead() else
                   f"not finished within {timeout:g} s (hung?)" if time.monotonic() > deadline else None)
            if why and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise RuntimeError(f"{self.name}: {why}")
        return task.result()


def warm_up(cluster: Cluster, args: argparse.Namespace, info: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    warm = cluster.load([_peer.make_prompt(0, args.prompt_words, args.seed)], 1, args)[0][0]
    info["warmup"] = {"ok": warm.ok, "s": round(time.perf_counter() - t0, 2), "tokens": warm.tokens,
                      "text_head": warm.text[:80]}
    if not warm.ok:
        raise RuntimeError(f"warm-up request failed: {warm.error}")


def one_level(cluster: Cluster, prompts: list[str], streams: int,
              args: argparse.Namespace) -> tuple[dict[str, Any], list]:
    """One concurrency level: the summary (throughput, latencies, CPU per rank, step time) and the results."""
    pids = cluster.pids
    before = tp.scrape(cluster.url) if cluster.metrics else {}
    cpu0 = {r: tp.cpu_seconds([p]) for r, p in pids.items()}
    busy0, w0, me0 = _peer.system_busy_cpu_s(), time.monotonic(), sum(os.times()[:2])
    results, wall = cluster.load(prompts, streams, args)
    span = time.monotonic() - w0
    cpu = {r: tp.cpu_seconds([p]) - cpu0[r] for r, p in pids.items()}
    busy, client = _peer.system_busy_cpu_s() - busy0, sum(os.times()[:2]) - me0
    summary = _peer.summarize(results, wall)
    for key in ("mean_content_chunks", "tokens_from_usage"):
        summary.pop(key, None)
    cores = os.cpu_count() or 1
    summary["cpu_cores_used_per_rank"] = {str(r): round(c / span, 2) for r, c in cpu.items()} if span else None
    other = max(0.0, busy - sum(cpu.values()) - client)
    summary["other_processes_cpu_s"] = round(other, 2)  # CPU used by neither the servers nor this client
    summary["client_cpu_s"] = round(client, 2)  # this process: the load's HTTP clients
    summary["contended"] = other > 0.1 * span * cores
    if cluster.metrics:
        summary.update(step_time(before, tp.scrape(cluster.url), wall))
    return summary, results


def step_time(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, Any]:
    steps = after.get("meshlm_step_seconds_count", 0) - before.get("meshlm_step_seconds_count", 0)
    total = after.get("meshlm_step_seconds_sum", 0) - before.get("meshlm_step_seconds_sum", 0)
    if steps <= 0:
        return {}
    return {"engine_steps": int(steps), "step_seconds_mean": round(total / steps, 6),
            "wall_seconds_per_step": round(wall / steps, 6)}


def run_levels(cluster: Cluster, args: argparse.Namespace, info: dict[str, Any],
               levels: dict[int, dict[str, Any]]) -> None:
    """Warm up, then every level, filling `levels` {streams: summary} as it goes (a hang keeps the rest)."""
    texts: dict[int, list[str | None]] = {}
    info["_texts"] = texts
    with tp.RankRss(cluster.pids) as rss:
        warm_up(cluster, args, info)
        info["idle_rss_mb_per_rank"] = {str(r): round(mb, 1) for r, mb in rss.sample().items()}
        for li, streams in enumerate(args.levels):
            prompts = tp.level_prompts(li, streams * args.requests_per_stream, args.prompt_words, args.seed)
            rss.reset_level()
            try:
                summary, results = one_level(cluster, prompts, streams, args)
            except RuntimeError as e:
                levels[streams] = {"error": str(e)}
                raise
            rss.sample()
            summary["peak_rss_mb_per_rank"] = {str(r): round(mb, 1) for r, mb in rss.level_peak.items()}
            texts[streams] = [r.text if r.ok else None for r in results]
            levels[streams] = summary
            print(f"[{cluster.name}] streams={streams}: {summary['tokens_per_s']} tok/s, itl p50 "
                  f"{summary['itl_p50']}, ok {summary['requests_ok']}/{len(results)}, cpu "
                  f"{summary['cpu_cores_used_per_rank']}"
                  + (" (CONTENDED: other processes used the CPU)" if summary["contended"] else ""),
                  file=sys.stderr, flush=True)
        info["peak_rss_mb_per_rank"] = {str(r): round(mb, 1) for r, mb in rss.peak.items()}


def bench(cluster: Cluster, args: argparse.Namespace, info: dict[str, Any], levels: dict[int, dict[str, Any]]) -> None:
    """Wait for rank 0, check every rank lives and sits on its core, run the levels; always stop them.
    Fills `info` and `levels` as it goes, so a failure or Ctrl-C keeps what was measured."""
    servers = cluster.servers
    info["command_per_rank"] = {str(r): s.extra["flags"] for r, s in enumerate(servers)}
    info["env"] = {"OPENBLAS_NUM_THREADS": "1", "pinning": "taskset -c <rank>"}
    if note := servers[0].extra.get("note"):
        info["note"] = note
    ok = False
    try:
        info["ready_s"] = round(servers[0].wait_ready(args.ready_timeout), 2)
        if dead := cluster.dead():
            raise _peer.ServerError(f"rank(s) {dead} exited before rank 0 was ready")
        info["cpu_affinity_per_rank"] = {str(r): affinity(p) for r, p in cluster.pids.items()}
        info["openblas_loaded"] = all(_peer.tree_maps_contain(p, "libopenblas") for p in cluster.pids.values())
        if cluster.metrics:
            cluster.request_model = _peer.served_model_id(cluster.url)
        run_levels(cluster, args, info, levels)
        ok = all(not lv.get("requests_failed") and "error" not in lv for lv in levels.values())
        if dead := cluster.dead():
            ok = False
            info["error"] = f"rank(s) {dead} exited during the run"
    except Exception as e:  # noqa: BLE001 - a failed or hung server is a result, not a crash
        info["error"] = _peer.describe_error(e)
    finally:
        tp.finish(servers, info, ok, args.keep_logs)


def start(name: str, model: Path, args: argparse.Namespace, workdir: Path) -> Cluster:
    if name == "meshlm_1core":
        return Cluster(name, start_meshlm_1core(model, args, workdir), metrics=True)
    if name == "meshlm_pp2":
        return Cluster(name, start_meshlm_pp2(model, args, workdir), metrics=True)
    ranks = STAGES if name == "mlx_lm_pp2" else 1
    return Cluster(name, start_mlx_lm(model, args, workdir, ranks), request_model="default_model")


# -- the report ----------------------------------------------------------------------------------


def level_entries(args: argparse.Namespace, servers: dict[str, dict], per_server: dict[str, dict]) -> list[dict]:
    texts = {name: info.pop("_texts", {}) for name, info in servers.items()}
    entries = []
    for streams in args.levels:
        entry: dict[str, Any] = {"streams": streams}
        for name in servers:
            if streams in per_server.get(name, {}):
                entry[name] = per_server[name][streams]
        for a, b in ((BASELINE, "meshlm_pp2"), (BASELINE, "mlx_lm_1core"), (BASELINE, "mlx_lm_pp2"),
                     ("mlx_lm_1core", "mlx_lm_pp2")):
            ta, tb = texts.get(a, {}).get(streams), texts.get(b, {}).get(streams)
            if ta and tb:
                entry[f"same_output_frac_{b}_vs_{a}"] = tp.same_frac(ta, tb)
        if contended := [n for n in servers if (entry.get(n) or {}).get("contended")]:
            entry["contended"] = contended  # other processes used >10% of the CPUs meanwhile
        entries.append(entry)
    return entries


def ratios(args: argparse.Namespace, per_server: dict[str, dict]) -> dict[str, Any]:
    def get(name: str, streams: int, key: str) -> float | None:
        return per_server.get(name, {}).get(streams, {}).get(key)

    out: dict[str, Any] = {}
    pairs = (("meshlm_pp2", "meshlm_1core"), ("mlx_lm_pp2", "mlx_lm_1core"), ("meshlm_pp2", "mlx_lm_pp2"))
    for a, b in pairs:
        for streams in args.levels:
            out[f"{a}_over_{b}_at_{streams}_streams"] = {
                key: _peer.ratio(get(a, streams, key), get(b, streams, key))
                for key in ("tokens_per_s", "itl_p50", "itl_p95", "tpot_p50", "ttft_p50")}
    return out


def targets(args: argparse.Namespace, per_server: dict[str, dict], stages: dict[str, Any] | None) -> list[dict]:
    def get(name: str, streams: int, key: str) -> float | None:
        return per_server.get(name, {}).get(streams, {}).get(key)

    top = 16 if 16 in args.levels else max(args.levels)
    low = 1 if 1 in args.levels else min(args.levels)
    speedup = _peer.ratio(get("meshlm_pp2", top, "tokens_per_s"), get("meshlm_1core", top, "tokens_per_s"))
    itl = _peer.ratio(get("meshlm_pp2", low, "itl_p50"), get("meshlm_1core", low, "itl_p50"))
    fractions = [s["fraction_of_whole"] for s in (stages or {}).get("stages", [])]
    worst = max(fractions) if fractions else None

    def met(value: float | None, ok: bool) -> bool | None:
        return None if value is None else ok

    return [
        {"target": f"meshlm PP2 / meshlm 1-core output tokens/s at {top} streams", "want": f">= {TARGET_THROUGHPUT}",
         "measured": speedup, "met": met(speedup, (speedup or 0) >= TARGET_THROUGHPUT)},
        {"target": f"meshlm PP2 / meshlm 1-core inter-token latency p50 at {low} stream(s)",
         "want": f"<= {TARGET_ITL}", "measured": itl, "met": met(itl, (itl or 0) <= TARGET_ITL)},
        {"target": "largest stage's weight bytes / whole model's, 2 stages", "want": f"<= {TARGET_STAGE_FRACTION}",
         "measured": worst, "met": met(worst, (worst or 0) <= TARGET_STAGE_FRACTION)},
    ]


def attach_rss(stages: dict[str, Any] | None, servers: dict[str, dict]) -> None:
    """Each stage's peak RSS in both pipelines, beside its weight bytes."""
    for s in (stages or {}).get("stages", []):
        for name in ("meshlm_pp2", "mlx_lm_pp2"):
            peak = servers.get(name, {}).get("peak_rss_mb_per_rank", {}).get(str(s["rank"]))
            if peak is not None:
                s[f"{name}_peak_rss_mb"] = peak


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _peer.install_signal_handlers()
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="bench-pp-"))
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _peer.machine_info(),
        "config": {"levels": args.levels, "requests_per_stream": args.requests_per_stream,
                   "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "temperature": 0,
                   "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                   "pinning": "every process on one core (taskset -c), OPENBLAS_NUM_THREADS=1; pipelines: rank r "
                              "on core r", "stages": STAGES},
        "notes": {
            "step_seconds_mean": "meshlm's /metrics meshlm_step_seconds sum/count over the level: host time to "
                                 "build and launch a step plus sampling and the scheduler update, not the forward "
                                 "it overlaps with; wall_seconds_per_step is the level's wall time / engine steps",
            "ready_s": "mlx-lm answers /v1/models before it loads the model, so its load time is in warmup.s",
            "same_output_frac": "greedy parity against meshlm_1core's texts, request by request (reported, not "
                                "asserted); mlx-lm ignores ignore_eos, so a stop token ends its text early",
        },
    }
    if args.dtype != "float32" and not args.model:
        report["notes"]["dtype"] = (f"the tiny model is stored in {args.dtype}: meshlm holds its layers as {args.dtype} "
                                    f"panels and computes in float32, mlx-lm computes in {args.dtype} (slow on a CPU), "
                                    "so only meshlm's two servers compare")
    if others := tp.other_servers():
        report["warning_other_servers_running"] = others
    servers: dict[str, dict[str, Any]] = {}
    per_server: dict[str, dict[int, dict[str, Any]]] = {}
    report["servers"] = servers
    with _peer.recording(report):
        model, report["model"] = prepare_model(args, workdir)
        layout = stage_layout(report["model"], args.split)
        print("[bytes] loading each stage's slice", file=sys.stderr, flush=True)
        report["bytes_per_stage"] = stage_bytes(model, report["model"], layout)
        for name in SERVERS:
            if name in args.skip:
                continue
            print(f"[{name}] starting", file=sys.stderr, flush=True)
            servers[name], per_server[name] = {}, {}
            bench(start(name, model, args, workdir), args, servers[name], per_server[name])
    report["levels"] = level_entries(args, servers, per_server)
    report["ratios"] = ratios(args, per_server)
    report["targets"] = targets(args, per_server, report.get("bytes_per_stage"))
    attach_rss(report.get("bytes_per_stage"), servers)
    if failed := [n for n, i in servers.items() if i.get("error") or not i.get("exit_codes")]:
        report["failed_servers"] = failed  # see servers.<name>.error and log_tails
    report["elapsed_s"] = round(time.monotonic() - t_start, 1)
    return tp.end_report(report, bool(failed), workdir, args.keep_logs, args.out)


if __name__ == "__main__":
    sys.exit(main())
