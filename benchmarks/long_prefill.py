"""Long-prompt benchmark: a prompt of tens of thousands of tokens read while another request streams, on
meshlm with its default `--long-prefill-context` (prompt chunks past it shortened to a bounded step's
work) against the same server with `--long-prefill-context 0` (chunks of the token budget at any
context), alternating, in one run. Prints JSON.

    python benchmarks/long_prefill.py                       # makes the issue's 72M llama
    python benchmarks/long_prefill.py --prompt-tokens 65536 --runs 2
    python benchmarks/long_prefill.py --model PATH          # any HF-layout dir

For each server and run: one request streams (`--stream-tokens`, greedy, `ignore_eos`); two seconds
later the long prompt (random token ids 3..499 to /v1/completions, one output token, no prefix shared
with any other run) is sent. Reported: the long prompt's time to its answer (its prefill, beside the
stream), and the stream's inter-token gaps while it was read (max, p99, p50): the stall a long prompt
puts on every running stream, bounded by the longest step. Both servers run unpinned on every core,
one after the other, each with `--no-ssd-cache --no-prefix-cache` and a `--max-model-len` covering the
prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _peer  # noqa: E402

TINY = ["--model-type", "llama", "--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "8"]
LAYOUTS = {"meshlm": [], "meshlm_no_limit": ["--long-prefill-context", "0"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model dir or 'demo' (default: a tiny random 72M llama made here)")
    p.add_argument("--prompt-tokens", type=int, default=32_000, help="the long prompt's length in tokens")
    p.add_argument("--stream-tokens", type=int, default=6_000, help="max_tokens of the streaming request")
    p.add_argument("--runs", type=int, default=1, help="runs per server, alternating")
    p.add_argument("--meshlm-args", default="", help="more `meshlm serve` flags for both servers")
    _peer.add_run_args(p)
    args = p.parse_args(argv)
    if args.prompt_tokens < 2 or args.runs < 1 or args.stream_tokens < 1:
        p.error("--prompt-tokens must be >= 2, --runs and --stream-tokens >= 1")
    return args


def one_run(server: _peer.ServerProcess, model_id: str, prompt: list[int], stream_tokens: int,
            timeout: float) -> dict[str, Any]:
    gaps: list[float] = []
    stop = threading.Event()
    failure: list[str] = []

    def stream() -> None:
        body = {"model": model_id, "prompt": [5, 6, 7], "max_tokens": stream_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}
        last = None
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=timeout) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if last is not None and not stop.is_set():
                        gaps.append(now - last)
                    last = now
                    if stop.is_set():
                        break
        except httpx.HTTPError as e:
            failure.append(_peer.describe_error(e))

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    time.sleep(2.0)  # the stream is decoding before the prompt arrives
    sent = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", timeout=timeout,
                   json={"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    answered = time.perf_counter() - sent
    stop.set()
    thread.join(timeout)
    if r.status_code != 200:
        return {"error": f"long prompt: HTTP {r.status_code}: {r.text[:300]}"}
    gaps.sort()
    return {
        "long_prompt_s": round(answered, 2),
        "stream_gaps": len(gaps),
        "stream_gap_max_s": _peer.rounded(gaps[-1] if gaps else None, 3),
        "stream_gap_p99_s": _peer.rounded(_peer.percentile(gaps, 99), 3),
        "stream_gap_p50_ms": _peer.rounded(1000 * _peer.percentile(gaps, 50), 1) if gaps else None,
        "stream_error": failure[0] if failure else None,
        "answer": r.json()["choices"][0]["text"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _peer.install_signal_handlers()
    report: dict[str, Any] = {"benchmark": "long_prefill", "machine": _peer.machine_info(),
                              "prompt_tokens": args.prompt_tokens, "runs": {name: [] for name in LAYOUTS}}
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp, _peer.recording(report):
        path, report["model"] = _peer.prepare_model(args.model, Path(tmp) / "tiny", TINY)
        rng = random.Random(0)
        common = ["--no-ssd-cache", "--no-prefix-cache", "--max-model-len",
                  str(args.prompt_tokens + args.stream_tokens + 64), *args.meshlm_args.split()]
        for run in range(args.runs):
            prompt = [rng.randrange(3, 500) for _ in range(args.prompt_tokens)]  # each run's own, both servers'
            for name, flags in LAYOUTS.items():
                server = _peer.start_meshlm(str(path), extra_args=[*common, *flags])
                try:
                    server.wait_ready(args.ready_timeout)
                    model_id = _peer.served_model_id(server.url)
                    result = one_run(server, model_id, prompt, args.stream_tokens, timeout=3600)
                    result["utc"] = time.strftime("%H:%M:%S", time.gmtime())
                    report["runs"][name].append(result)
                finally:
                    server.stop()
        done = [(a, b) for a, b in zip(report["runs"]["meshlm"], report["runs"]["meshlm_no_limit"])
                if "error" not in a and "error" not in b]
        report["same_answer"] = all(a["answer"] == b["answer"] for a, b in done)
        report["ratios"] = [{"long_prompt_s": round(a["long_prompt_s"] / b["long_prompt_s"], 3),
                             "stream_gap_max": round(a["stream_gap_max_s"] / b["stream_gap_max_s"], 3)}
                            for a, b in done if a["stream_gap_max_s"] and b["stream_gap_max_s"]]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
