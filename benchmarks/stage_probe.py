"""Decode forwards of a pipeline's stages, alone and side by side (run by `scaling.py --pipeline-parallel N`).

A pipeline of S stages keeps S micro-batches in flight, so at 16 streams each micro-batch holds 16/S
decode rows, and every stage reads its layers' weights once per micro-batch: per token, the stages
together read S times the weight bytes one process reads in its 16-row step. Prefill is not affected
(its GEMMs are compute-bound). On one machine the stages also share its memory bandwidth. This probe
measures what that leaves of the decode phase, on meshlm's own runner and KV store (no HTTP, no
scheduling, no transport), each process pinned to one core with OPENBLAS_NUM_THREADS=1 and OpenBLAS
preloaded as meshlm preloads it:

- `one_core`: one process, every layer, `streams` decode rows (the baseline's decode step);
- `alone`: each stage's layers, streams/S rows, one stage at a time on its core;
- `side_by_side`: every stage at once, each on its core, the median of its steps taken while every
  stage was stepping;

and `decode_ceiling` = one_core / (S x the slowest stage side by side): the most a pipeline of these
stages can serve over one core in the decode phase before any host work.

    python benchmarks/stage_probe.py --model DIR --stages 2 [--streams 16] [--context 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pipeline_parallel as pp  # noqa: E402  (pinned, one_core_env)

from meshlm.platform import openblas_env  # noqa: E402

TIMED_STEPS = 64  # the scaling load's output tokens per request
BARRIER_TIMEOUT_S = 120.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF-layout model dir (float32)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--streams", type=int, default=16, help="decode rows of the one-core step")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per row before decoding")
    p.add_argument("--out", help="also write the JSON here")
    # internal: one measuring process
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layers", help=argparse.SUPPRESS)  # first,end,embeds,logits
    p.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    p.add_argument("--barrier", help=argparse.SUPPRESS)  # a directory the side-by-side processes meet in
    p.add_argument("--name", help=argparse.SUPPRESS)
    p.add_argument("--peers", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.stages - 1, args.streams, args.context) < 1:
        p.error("--stages needs at least 2, --streams and --context positive integers")
    return args


# -- one measuring process ----------------------------------------------------------------------------


def _meet(barrier: Path, tag: str, name: str, peers: int) -> None:
    """Wait until all `peers` processes have reached `tag` (a file each in `barrier`)."""
    (barrier / f"{tag}-{name}").touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while len(list(barrier.glob(f"{tag}-*"))) < peers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other probe processes never reached {tag}")
        time.sleep(0.001)


def worker(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from meshlm.config import CacheConfig, ModelConfig, SchedulerConfig
    from meshlm.engine.request import SamplingParams, Sequence
    from meshlm.engine.scheduler import Scheduler
    from meshlm.executor.rank import build_rank
    from meshlm.kv.blocks import BlockManager
    from meshlm.model.loader import StageSlice, load_model

    cfg = ModelConfig(args.model)
    stage = None
    if args.layers != "all":
        first, end, embeds, logits = map(int, args.layers.split(","))
        stage = StageSlice(first, end, bool(embeds), bool(logits))
    loaded = load_model(cfg, stage=stage)
    rank = build_rank(loaded, cfg, CacheConfig(enabled=False, ssd=False, block_size=16), 2**30)
    hidden = int(json.loads((Path(args.model) / "config.json").read_text())["hidden_size"])
    blocks = BlockManager(rank.max_blocks, rank.block_size)
    longest = min(rank.max_blocks * rank.block_size, 4096)
    sched = Scheduler(SchedulerConfig(max_batch_size=args.rows, max_tokens_per_step=max(1024, args.rows)),
                      blocks, longest)
    for uid in range(args.rows):  # distinct prompts: no row's KV is another's
        prompt = [3 + (uid * 7919 + i * 104729) % (loaded.vocab_size - 3) for i in range(args.context)]
        sched.add(Sequence(uid, prompt, SamplingParams(max_tokens=longest - args.context - 1, temperature=0,
                                                        ignore_eos=True)))

    def step() -> tuple[float, bool]:
        plan, _ = sched.schedule()
        h = None
        if stage is not None and not stage.embeds:
            h = mx.random.normal((1, plan.num_tokens, hidden))
            mx.eval(h)
        t0 = time.perf_counter()
        result = rank.step(plan, h)
        out = result.logits if result.logits is not None else result.hidden
        if out is not None:
            mx.eval(out)  # its KV writes too: the attention reads the pools they write
        seconds = time.perf_counter() - t0
        if result.logits is not None:
            sampled = {u: [t] for u, t in zip(result.uids, mx.argmax(result.logits, axis=-1).tolist())}
        else:  # a stage without the head: any id keeps the rows decoding
            sampled = {c.uid: [5] for c in plan.chunks if c.sample}
        sched.update(plan, sampled)
        return seconds, plan.num_tokens == len(plan.chunks) == args.rows

    while not step()[1]:  # prefill, and the first decode step
        pass
    for _ in range(8):  # warm
        step()
    barrier = Path(args.barrier) if args.barrier else None
    if barrier is not None:
        _meet(barrier, "start", args.name, args.peers)
    spans: list[tuple[float, float]] = []  # (start, seconds) of every step from here on, on the shared clock

    def timed() -> float:
        start = time.monotonic()
        seconds = step()[0]
        spans.append((start, seconds))
        return seconds

    window = [time.monotonic()]
    times = [timed() for _ in range(TIMED_STEPS)]
    window.append(time.monotonic())
    if barrier is not None:  # keep decoding until every peer's timed steps are done: they all overlap
        (barrier / f"done-{args.name}").touch()
        deadline = time.monotonic() + BARRIER_TIMEOUT_S
        while len(list(barrier.glob("done-*"))) < args.peers and time.monotonic() < deadline:
            timed()
    print(json.dumps({"median_ms": round(statistics.median(times) * 1e3, 3),
                      "mean_ms": round(statistics.mean(times) * 1e3, 3), "steps": len(times),
                      "window": window, "spans": spans if barrier is not None else []}))
    return 0


# -- the probe ----------------------------------------------------------------------------------------


def _spawn(args: argparse.Namespace, core: int, layers: str, rows: int, barrier: Path | None = None,
           name: str = "", peers: int = 1) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", str(args.model), "--layers", layers,
           "--rows", str(rows), "--context", str(args.context)]
    if barrier is not None:
        cmd += ["--barrier", str(barrier), "--name", name, "--peers", str(peers)]
    env = pp.one_core_env()
    return subprocess.Popen(pp.pinned(core, cmd), env=openblas_env(env) or env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _results(procs: list[subprocess.Popen]) -> list[dict[str, Any]]:
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError("a probe process hung") from None
    failed = [err[-800:] for p, (_, err) in zip(procs, outs) if p.returncode]
    if failed:
        raise RuntimeError(f"a probe process failed: {failed[0]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def probe(model: Path, stages: int, streams: int, context: int, workdir: Path) -> dict[str, Any]:
    """The measurement, as the report's `decode_probe` (scaling.py) or this script's output."""
    from meshlm.cluster.stages import StageLayout

    args = argparse.Namespace(model=model, context=context)
    config = json.loads((Path(model) / "config.json").read_text())
    layout = StageLayout.create(int(config["num_hidden_layers"]), stages)
    rows = -(-streams // stages)
    cores = os.cpu_count() or 1
    spans = []
    for s in range(stages):
        first, end = layout.layers(s)
        spans.append(f"{first},{end},{int(s == 0)},{int(s == stages - 1)}")
    one_core = _results([_spawn(args, 0, "all", streams)])[0]
    alone = [_results([_spawn(args, s % cores, span, rows)])[0] for s, span in enumerate(spans)]
    barrier = workdir / "stage-probe-barrier"
    barrier.mkdir(parents=True, exist_ok=True)
    side = _results([_spawn(args, s % cores, span, rows, barrier, f"stage{s}", stages)
                     for s, span in enumerate(spans)])
    # Side by side means while every process steps: from the last one's first step to the first one's last
    # (each keeps stepping until all have timed theirs). A process the VM stalled after the start barrier
    # would otherwise have some of its peers' timed steps run alone. Each stage's figure is the median of
    # its steps inside that interval.
    common = (max(r["spans"][0][0] for r in side), min(sum(r["spans"][-1]) for r in side))
    inside = [[seconds for start, seconds in r["spans"] if start >= common[0] and start + seconds <= common[1]]
              for r in side]
    if min(map(len, inside)) < TIMED_STEPS // 4:
        raise RuntimeError(f"the stages stepped side by side for {min(map(len, inside))} steps only")
    side_ms = [round(statistics.median(steps) * 1e3, 3) for steps in inside]
    slowest = max(side_ms)
    shortest = min(r["window"][1] - r["window"][0] for r in side)
    overlap = min(common[1] - common[0], shortest)
    return {
        "what": f"decode forwards on meshlm's runner, each process pinned to one core, OPENBLAS_NUM_THREADS=1, "
                f"{context}-token prompts, median of {TIMED_STEPS} steps; one_core: every layer, {streams} rows; "
                f"stages: layers per stage as --pipeline-parallel {stages} splits them, {rows} rows (a micro-batch), "
                "alone and all at once",
        "split": list(layout.split),
        "one_core_ms": one_core["median_ms"],
        "stage_alone_ms": [r["median_ms"] for r in alone],
        "stage_side_by_side_ms": side_ms,
        "side_by_side_steps": [len(steps) for steps in inside],  # each stage's steps while all stepped
        "side_by_side_slowdown": [round(b / a["median_ms"], 3) for a, b in zip(alone, side_ms)],
        "side_by_side_overlap": round(overlap / shortest, 3),  # all stepping, of the shortest timed window
        "decode_ceiling": round(one_core["median_ms"] / (stages * slowest), 3),
        "decode_ceiling_alone": round(one_core["median_ms"] / (stages * max(r["median_ms"] for r in alone)), 3),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-stage-probe-") as tmp:
        report = probe(Path(args.model), args.stages, args.streams, args.context, Path(tmp))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
