"""Structured-outputs benchmark: meshlm output tokens/s with a JSON schema
(`response_format` json_schema, grammar-constrained decoding) vs unconstrained,
same prompts, same server, same run. Prints one JSON object to stdout.

    python benchmarks/structured.py                                  # demo model, streams 1 16, 2 rounds
    python benchmarks/structured.py --rounds 4 --out structured.json
    python -m meshlm demo-model --tiny /tmp/tiny && \
    python benchmarks/structured.py --model /tmp/tiny --streams 1 4 --requests 8 --max-tokens 32   # smoke

One `meshlm serve` (the demo model, SmolLM2-135M-Instruct, unless --model),
warmed up in both modes (the first constrained request compiles the schema;
later ones copy the cached matcher). Per concurrency level the same chat
prompts (each asks for a JSON description of a fictional person) run in both
modes, --rounds times, in ABBA order (unconstrained, constrained, then
constrained, unconstrained, ...) so drift from other load on the machine hits
both alike. Each batch is `streams` workers pulling requests from a queue,
streamed with usage. Per mode: output tok/s (sum of usage.completion_tokens /
sum of batch wall times), mean and p50 request latency, TPOT p50, tokens per
server CPU-second, finish reasons, and how many outputs parse as JSON (and
match the schema, when `jsonschema` is importable). Per level: the
constrained/unconstrained ratios, overall and per round; the goal is a
tokens/s ratio of at least 0.85 at 16 streams.

The prefix cache is off by default (--prefix-cache keeps it): the same prompts
run in both modes, so whichever ran second would skip their prefill. The
modes' outputs differ in length (a schema-bound object usually ends before
max_tokens, free text rarely does), so each constrained request spends a larger
share of its time in prefill; `tpot_p50_ratio` (decode only) separates the
cost of the masks from that.

A default run takes roughly 10 minutes on 2 cores (the 1-stream level is most
of it).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _peer  # noqa: E402

MODES = ("unconstrained", "constrained")
TARGET_STREAMS = 16
TARGET_RATIO = 0.85  # constrained / unconstrained output tok/s at TARGET_STREAMS

# A realistic, bounded object: every string has a maxLength and the array a maxItems, so a
# constrained generation ends well within 128 tokens whatever the model prefers to write.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "mood": {"type": "string", "enum": ["happy", "calm", "curious", "tired", "excited", "worried"]},
        "age": {"type": "integer", "minimum": 1, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "country": {"type": "string", "maxLength": 20},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "mood", "age", "hobbies", "home"],
    "additionalProperties": False,
}
SCHEMA_NAME = "person"

PEOPLE = (
    "a lighthouse keeper", "a retired train driver", "a young baker", "a travelling musician",
    "a village teacher", "a ship's cook", "a mountain guide", "a museum painter", "a bicycle mechanic",
    "a night-shift nurse", "a market gardener", "a street photographer", "a librarian", "a fisherman",
    "a clock repairer", "a beekeeper",
)
PLACES = (
    "a harbour town", "a snowy mountain village", "a busy capital city", "an island in the north",
    "a river valley", "a desert oasis", "a small farm", "a seaside resort", "an old university town",
    "a forest cabin",
)
DETAILS = (
    "who loves long walks", "who has just moved house", "who collects old maps", "who never misses a sunrise",
    "who is learning to sing", "who writes letters every week", "who keeps a small garden",
    "who fixes things for the neighbours",
)
WARMUP_PROMPT = "Describe a cheerful postman as a JSON object with his name, mood, age, hobbies and home."


def prompts_for(level_index: int, n: int, seed: int) -> list[str]:
    """`n` chat prompts for one level: deterministic, distinct per request and level, the same in both modes."""
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}-{level_index}-{i}")
        out.append(
            f"Request {level_index}.{i}. Invent {rng.choice(PEOPLE)} from {rng.choice(PLACES)} "
            f"{rng.choice(DETAILS)}. Describe them as a JSON object with their name, mood, age, "
            "a few hobbies and their home (city and country)."
        )
    return out


def response_format(schema: dict[str, Any] = SCHEMA, name: str = SCHEMA_NAME) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def request_extra(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Payload fields beyond `_peer.chat_payload`'s (which sends temperature 0: overridden here)."""
    extra: dict[str, Any] = {"temperature": args.temperature}
    if args.temperature > 0:
        extra["seed"] = args.seed  # same draws in both modes and every round
    if mode == "constrained":
        extra["response_format"] = response_format()
    return extra


# -- checking outputs -----------------------------------------------------------


def _validator():
    try:
        import jsonschema
    except ImportError:
        return None
    return jsonschema.Draft202012Validator(SCHEMA)


VALIDATOR = _validator()


def check_json(text: str) -> tuple[bool, bool | None]:
    """(parses as JSON, matches SCHEMA: None without jsonschema or when it does not parse)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False, None
    if VALIDATOR is None:
        return True, None
    return True, VALIDATOR.is_valid(value)


# -- measuring ------------------------------------------------------------------


def run_batch(url: str, model: str | None, prompts: list[str], streams: int, mode: str,
              args: argparse.Namespace, server_pid: int | None) -> tuple[list[_peer.StreamResult], dict[str, Any]]:
    """One mode's load at one level: every prompt once, `streams` at a time."""
    with _peer.CpuMeter(server_pid) as cpu:
        results, wall = asyncio.run(_peer.run_load(url, model, prompts, streams, args.max_tokens,
                                                   retries=args.retries, **request_extra(mode, args)))
    ok = [r for r in results if r.ok]
    checks = [check_json(r.text) for r in ok]
    latencies = [r.latency for r in ok if r.latency is not None]
    tokens = sum(r.tokens for r in ok)
    batch = {
        "wall_s": round(wall, 3),
        "completion_tokens": tokens,
        "tokens_per_s": _peer.rounded(tokens / wall if wall > 0 else None, 2),
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "mean_latency_s": _peer.rounded(statistics.fmean(latencies) if latencies else None, 3),
        "json_parse_ok": sum(p for p, _ in checks),
        "server_cpu_s": cpu.result.get("server_cpu_s"),
        "contended": bool(cpu.result.get("contended")),
        "cpu": cpu.result,
    }
    return results, batch


def summarize_mode(results: list[_peer.StreamResult], batches: list[dict[str, Any]]) -> dict[str, Any]:
    """All rounds of one mode at one level: `_peer.summarize` over every request and the summed wall time."""
    wall = sum(b["wall_s"] for b in batches)
    out = _peer.summarize(results, wall)
    ok = [r for r in results if r.ok]
    latencies = [r.latency for r in ok if r.latency is not None]
    out["mean_latency_s"] = _peer.rounded(statistics.fmean(latencies) if latencies else None, 3)
    server_cpu = sum(b["server_cpu_s"] or 0.0 for b in batches)
    out["server_cpu_s"] = round(server_cpu, 2) if server_cpu else None
    # robust to other load on the machine: output per CPU-second the server got
    out["tokens_per_cpu_s"] = round(out["completion_tokens"] / server_cpu, 2) if server_cpu else None
    checks = [check_json(r.text) for r in ok]
    out["json_parse_ok"] = sum(p for p, _ in checks)
    out["schema_valid"] = sum(bool(v) for _, v in checks) if VALIDATOR is not None else None
    out["outputs_checked"] = len(checks)
    stopped = [r for r in ok if r.finish_reason == "stop"]
    out["mean_completion_tokens_when_stopped"] = (
        round(sum(r.tokens for r in stopped) / len(stopped), 1) if stopped else None)
    bad = next((r for r, (p, _) in zip(ok, checks) if not p), None)
    if bad is not None:
        out["first_unparsed"] = {"finish_reason": bad.finish_reason, "tokens": bad.tokens, "text": bad.text[:300]}
    if ok:
        out["sample_output"] = ok[0].text[:300]
    out["rounds"] = [{k: b[k] for k in ("wall_s", "completion_tokens", "tokens_per_s", "mean_latency_s",
                                        "requests_failed", "json_parse_ok", "contended")} for b in batches]
    return out


def compare(u: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """Constrained / unconstrained ratios (tokens/s: higher is better; latencies: lower is better)."""
    per_round = [_peer.ratio(b["tokens_per_s"], a["tokens_per_s"]) for a, b in zip(u["rounds"], c["rounds"])]
    return {
        "tokens_per_s_ratio": _peer.ratio(c["tokens_per_s"], u["tokens_per_s"]),
        "tokens_per_s_ratio_per_round": per_round,
        "tokens_per_cpu_s_ratio": _peer.ratio(c.get("tokens_per_cpu_s"), u.get("tokens_per_cpu_s")),
        "tpot_p50_ratio": _peer.ratio(c["tpot_p50"], u["tpot_p50"]),
        "ttft_p50_ratio": _peer.ratio(c["ttft_p50"], u["ttft_p50"]),
        "mean_latency_ratio": _peer.ratio(c["mean_latency_s"], u["mean_latency_s"]),
        "completion_tokens": {"unconstrained": u["completion_tokens"], "constrained": c["completion_tokens"]},
    }


def warm_up(url: str, model: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """One request per mode (the constrained one compiles the schema into the server's cache)."""
    out: dict[str, Any] = {}
    for mode in MODES:
        t0 = time.perf_counter()
        results, _ = asyncio.run(_peer.run_load(url, model, [WARMUP_PROMPT], 1, args.max_tokens,
                                                **request_extra(mode, args)))
        w = results[0]
        out[mode] = {"ok": w.ok, "s": round(time.perf_counter() - t0, 3), "completion_tokens": w.tokens,
                     "finish_reason": w.finish_reason, "text_head": w.text[:160]}
        if not w.ok:
            out[mode]["error"] = w.error
            raise RuntimeError(f"{mode} warm-up request failed: {w.error}")
    return out


def measure_level(li: int, streams: int, url: str, model: str | None, server: _peer.ServerProcess,
                  args: argparse.Namespace) -> dict[str, Any]:
    n = args.requests or max(8, 2 * streams)
    prompts = prompts_for(li, n, args.seed)
    results: dict[str, list[_peer.StreamResult]] = {m: [] for m in MODES}
    batches: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    order = []
    for rnd in range(args.rounds):
        for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):  # ABBA: linear drift cancels over 2 rounds
            if not server.alive():
                raise RuntimeError(f"meshlm died (exit code {server.proc.returncode if server.proc else None})")
            res, batch = run_batch(url, model, prompts, streams, mode, args, server.pid)
            results[mode] += res
            batches[mode].append(batch)
            order.append(mode)
            print(f"[structured] streams={streams} round {rnd + 1}/{args.rounds} {mode}: "
                  f"{batch['tokens_per_s']} tok/s, {batch['completion_tokens']} tokens, "
                  f"mean latency {batch['mean_latency_s']}s, ok {batch['requests_ok']}/{len(res)}, "
                  f"json {batch['json_parse_ok']}" + (" (contended)" if batch["contended"] else ""),
                  file=sys.stderr, flush=True)
    entry: dict[str, Any] = {"streams": streams, "requests_per_batch": n, "order": order}
    for mode in MODES:
        entry[mode] = summarize_mode(results[mode], batches[mode])
    entry["compare"] = compare(entry["unconstrained"], entry["constrained"])
    contended = sum(b["contended"] for m in MODES for b in batches[m])
    if contended:
        entry["contended_batches"] = contended  # other processes used >10% of the CPUs meanwhile
    return entry


def target(levels: list[dict[str, Any]], streams: int = TARGET_STREAMS, minimum: float = TARGET_RATIO) -> dict:
    entry = next((lv for lv in levels if lv["streams"] == streams), None)
    ratio = entry["compare"]["tokens_per_s_ratio"] if entry else None
    out: dict[str, Any] = {"streams": streams, "min_ratio": minimum, "ratio": ratio,
                           "met": None if ratio is None else ratio >= minimum}
    if entry is None:
        out["note"] = f"streams={streams} was not measured"
    return out


# -- setup ----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="model dir, or 'demo' (SmolLM2-135M-Instruct, the default)")
    p.add_argument("--dtype", help="meshlm --dtype (default: the server's own, auto)")
    p.add_argument("--streams", nargs="+", default=["1", f"{TARGET_STREAMS}"],
                   help="concurrency levels, e.g. '1 16' or '1,16' (default 1 16)")
    p.add_argument("--requests", type=int,
                   help="requests per level, mode and round (default: max(8, 2 x streams))")
    p.add_argument("--rounds", type=int, default=2,
                   help="batches per mode and level, alternating ABBA (default 2; even is fairest)")
    p.add_argument("--max-tokens", type=int, default=128, help="per request (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 sends a fixed seed")
    p.add_argument("--max-batch-size", type=int, help="meshlm --max-batch-size")
    p.add_argument("--prefix-cache", action="store_true",
                   help="keep meshlm's prefix cache (default: --no-prefix-cache, as the modes share prompts)")
    p.add_argument("--meshlm-args", default="", help="extra `meshlm serve` flags, e.g. '--speculative ngram'")
    _peer.add_run_args(p)
    p.add_argument("--seed", type=int, default=0, help="prompt seed (and sampling seed when temperature > 0)")
    args = p.parse_args(argv)
    args.levels = _peer.parse_levels(p, ",".join(args.streams))
    if args.rounds < 1 or args.max_tokens < 1 or (args.requests is not None and args.requests < 1):
        p.error("--rounds, --max-tokens and --requests must be >= 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _peer.install_signal_handlers()
    t0 = time.perf_counter()
    model_dir = _peer.resolve_model_dir(args.model, args.dtype or "float32")
    flags = shlex.split(args.meshlm_args)
    if not args.prefix_cache and "--no-prefix-cache" not in flags:
        flags.append("--no-prefix-cache")
    report: dict[str, Any] = {
        "benchmark": "structured",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _peer.machine_info(),
        "loadavg_before": round(os.getloadavg()[0], 2),
        "model": {"arg": args.model, "dir": str(model_dir), "dtype": args.dtype or "auto"},
        "config": {
            "streams": args.levels, "requests": args.requests or "max(8, 2 x streams)", "rounds": args.rounds,
            "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
            "meshlm_args": args.meshlm_args, "prefix_cache": args.prefix_cache,
            "stream_options": {"include_usage": True}, "retries": args.retries,
            "response_format": response_format(),
            "schema_validation": "jsonschema" if VALIDATOR is not None else None,
        },  # fmt: skip
    }
    server_info: dict[str, Any] = {}
    report["server"] = server_info
    levels: list[dict[str, Any]] = []
    server: _peer.ServerProcess | None = None
    ok = False

    def stop_server() -> None:
        if server is None:
            return
        server_info["exit_code"] = server.stop()
        if ok and not args.keep_logs:
            server.remove_log()
        else:
            server_info["log"] = server.log_path
            if not ok:
                server_info["log_tail"] = server.log_tail(15)

    with _peer.recording(report, cleanup=stop_server):
        server = _peer.start_meshlm(args.model, dtype=args.dtype, max_batch_size=args.max_batch_size,
                                    extra_args=flags)  # on a fresh --kv-cache-dir
        server_info["flags"] = server.extra.get("flags")
        server_info["ready_s"] = round(server.wait_ready(args.ready_timeout), 2)
        server_info["openblas_loaded"] = _peer.tree_maps_contain(server.pid, "libopenblas")
        model = _peer.served_model_id(server.url)
        server_info["request_model"] = model
        server_info["warmup"] = warm_up(server.url, model, args)
        for li, streams in enumerate(args.levels):
            levels.append(measure_level(li, streams, server.url, model, server, args))
        ok = not any(lv[m]["requests_failed"] for lv in levels for m in MODES)

    report["levels"] = levels
    report["comparisons"] = {str(lv["streams"]): lv["compare"]["tokens_per_s_ratio"] for lv in levels}
    report["target"] = target(levels)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    failed = report.get("interrupted") or report.get("error") or any(
        lv[m]["requests_failed"] for lv in levels for m in MODES)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
