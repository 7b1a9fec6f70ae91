"""Does preloading Debian's OpenBLAS speed up MLX on Linux CPU? Prints JSON.

Runs the same measurement in two child processes, with and without
LD_PRELOAD: fp32 GEMM throughput, and greedy decode tokens/s of the demo model
at batch 1 and 8 through meshlm's own runner (one step = one forward + sample).

    python benchmarks/blas.py [--model demo|PATH] [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import mlx.core as mx
from meshlm.config import CacheConfig, ModelConfig
from meshlm.engine.plan import LOGITS_LAST, Chunk, NewSequence, StepPlan, TableUpdate
from meshlm.executor.rank import build_rank
from meshlm.model.loader import load_model

def gemm_gflops(n=1024, reps=10):
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a @ b)
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9

def decode_tps(rank, batch, steps, first_uid):
    # Tokens/s of `steps` batched decode steps after an 8-token prefill per row (blocks of 32 tokens).
    uids = range(first_uid, first_uid + batch)
    blocks = lambda u: tuple(range((u - first_uid) * 2, (u - first_uid) * 2 + 2))  # 64 positions each
    plan = StepPlan(0, new=tuple(NewSequence(u, 0) for u in uids),
                    chunks=tuple(Chunk(u, 0, (1, 2, 3, 4, 5, 6, 7, 8), LOGITS_LAST) for u in uids),
                    tables=tuple(TableUpdate(u, blocks(u)) for u in uids), num_blocks=2 * batch)
    tokens = mx.argmax(rank.step(plan).logits, axis=-1).tolist()
    t = time.perf_counter()
    for s in range(1, steps + 1):
        plan = StepPlan(s, chunks=tuple(Chunk(u, 7 + s, (tokens[i],), LOGITS_LAST) for i, u in enumerate(uids)),
                        num_blocks=2 * batch)
        tokens = mx.argmax(rank.step(plan).logits, axis=-1).tolist()
    elapsed = time.perf_counter() - t
    rank.step(StepPlan(steps + 1, removed=tuple(uids), num_blocks=2 * batch))
    return batch * steps / elapsed

cfg = ModelConfig(sys.argv[1], "float32")
rank = build_rank(load_model(cfg), cfg, CacheConfig(enabled=False), 2**28)
steps = int(sys.argv[2])
print(json.dumps({"gemm_1024_fp32_gflops": round(gemm_gflops(), 1),
                  "decode_tokens_per_s_batch1": round(decode_tps(rank, 1, steps, 0), 1),
                  "decode_tokens_per_s_batch8": round(decode_tps(rank, 8, steps, 100), 1)}))
"""


def run(model: str, steps: int, preload: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(steps)], env=env, capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    from meshlm.platform import find_openblas

    lib = find_openblas()
    result = {"machine": {"cpus": os.cpu_count(), "openblas": lib}, "model": args.model,
              "reference_blas": run(args.model, args.steps, None)}
    if lib:
        result["openblas"] = run(args.model, args.steps, lib)
        ref, ob = result["reference_blas"], result["openblas"]
        result["speedup"] = {k: round(ob[k] / ref[k], 2) for k in ref if k in ob and ref[k]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
