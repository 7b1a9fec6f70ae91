"""Disaggregated-prefill benchmark: inter-token latency of decoding streams while long prompts keep
arriving, colocated (one server on both cores) against disaggregated (a decode server on core 0, a
prefill server on core 1, `taskset`), same model, same load, one run. Prints one JSON object.

    python benchmarks/disaggregated.py                       # demo model, 8 streams, 4K-token prompts
    python benchmarks/disaggregated.py --out disaggregated.json
    python -m meshlm demo-model --tiny /tmp/tiny && \
    python benchmarks/disaggregated.py --model /tmp/tiny --long-prompts 2 --long-words 600   # smoke

Load, per layout: `--streams` chat streams decode continuously (each a short
prompt, `--decode-tokens` tokens with ignore_eos, then the next); once they
all stream, `--long-prompts` long prompts (about `--long-words` words, each
new, so no prefix cache helps) arrive one after another, each sent when the
previous one's first token arrived (at least `--long-gap` seconds apart).
Measured while the long prompts run (from the first one's arrival to the last
one's first token): the decoding streams' inter-token latencies (p50, p95,
p99) and the long prompts' TTFT. The goal (issue 16): p95 inter-token latency
at least 3x lower disaggregated, long-prompt TTFT at most 1.5x colocated.

The colocated server runs with its default flags on both cores; the decode
server hands off prompts of at least `--min-tokens` uncached tokens. Both
layouts get OPENBLAS_NUM_THREADS set to their cores.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _peer  # noqa: E402

TARGET_ITL_P95_RATIO = 3.0  # colocated / disaggregated
TARGET_TTFT_RATIO = 1.5  # disaggregated / colocated


def _env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), **(extra or {})}
    blas = _peer.openblas_path()
    if blas:
        env.setdefault("LD_PRELOAD", blas)
    return env


def _pinned(server: _peer.ServerProcess, core: int) -> _peer.ServerProcess:
    """Pin a started server's whole tree to one core (taskset -a: every thread)."""
    for pid in _peer.process_tree(server.pid):
        os.system(f"taskset -a -p -c {core} {pid} > /dev/null")
    return server


async def _measure(url: str, args, short: list[str], long: list[str]) -> dict[str, Any]:
    stop = asyncio.Event()
    window: list[float] = []  # [start, end] of the long prompts' run
    decode: list[tuple[float, float]] = []  # (time of a chunk, gap to the previous chunk) of decoding streams
    streaming = [0] * args.streams

    async with _peer.async_client() as client:

        async def stream_forever(i: int) -> None:
            n = 0
            while not stop.is_set():
                payload = _peer.chat_payload(None, short[(i + n * args.streams) % len(short)], args.decode_tokens,
                                             ignore_eos=True)
                n += 1
                last = None
                async with client.request("POST", url + "/v1/chat/completions", json.dumps(payload).encode()) as r:
                    async for line in r.lines():
                        if not line.startswith("data:") or line.strip() == "data: [DONE]":
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            decode.append((now, now - last))
                        last = now
                        streaming[i] = 1
                        if stop.is_set():
                            break

        async def long_prompts() -> list[_peer.StreamResult]:
            while not all(streaming):
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # the streams are in their steady state
            window.append(time.perf_counter())
            results = []
            for prompt in long:
                t0 = time.perf_counter()
                res = _peer.StreamResult(ok=False)
                task = asyncio.create_task(_peer._stream_once(
                    client, url, _peer.chat_payload(None, prompt, args.long_tokens), res, t0))
                while res.ttft is None and not task.done():
                    await asyncio.sleep(0.01)
                results.append((res, task))
                await asyncio.sleep(max(0.0, args.long_gap - (time.perf_counter() - t0)))
            last = results[-1][0]
            window.append(t0 + (last.ttft or 0.0))  # t0: when the last long prompt was sent
            for _, task in results:
                await task
            return [r for r, _ in results]

        streams = [asyncio.create_task(stream_forever(i)) for i in range(args.streams)]
        longs = await long_prompts()
        stop.set()
        await asyncio.gather(*streams, return_exceptions=True)
    gaps = [g for t, g in decode if window[0] <= t <= window[1]]
    ttfts = [r.ttft for r in longs if r.ok and r.ttft is not None]
    return {
        "window_s": _peer.rounded(window[1] - window[0], 2),
        "decode_itl_samples": len(gaps),
        "decode_itl_p50": _peer.rounded(_peer.percentile(gaps, 50), 5),
        "decode_itl_p95": _peer.rounded(_peer.percentile(gaps, 95), 5),
        "decode_itl_p99": _peer.rounded(_peer.percentile(gaps, 99), 5),
        "decode_itl_max": _peer.rounded(max(gaps) if gaps else None, 5),
        "long_ok": sum(r.ok for r in longs),
        "long_errors": sorted({r.error for r in longs if not r.ok and r.error})[:3],
        "long_prompt_tokens": [r.prompt_tokens for r in longs],
        "long_ttft_s": [_peer.rounded(t, 3) for t in ttfts],
        "long_ttft_mean": _peer.rounded(sum(ttfts) / len(ttfts), 3) if ttfts else None,
        "long_ttft_p50": _peer.rounded(_peer.percentile(ttfts, 50), 3),
    }


def _warm(url: str, prompt: str) -> None:
    import httpx

    payload = _peer.chat_payload(None, prompt, 4, stream=False)
    del payload["stream_options"]
    httpx.post(url + "/v1/chat/completions", json=payload, timeout=600).raise_for_status()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="'demo' (SmolLM2-135M-Instruct) or a model directory")
    p.add_argument("--streams", type=int, default=8, help="decoding streams")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens per decoding request (ignore_eos)")
    p.add_argument("--long-prompts", type=int, default=6)
    p.add_argument("--long-words", type=int, default=3000, help="words per long prompt (~4K tokens on the demo)")
    p.add_argument("--long-tokens", type=int, default=16, help="tokens each long prompt generates")
    p.add_argument("--long-gap", type=float, default=1.0, help="seconds at least between long prompts")
    p.add_argument("--min-tokens", type=int, default=1024, help="decode server's --disagg-min-tokens")
    p.add_argument("--max-model-len", type=int, default=8192)
    _peer.add_run_args(p)
    args = p.parse_args()
    _peer.install_signal_handlers()
    model = _peer.resolve_model_dir(args.model, "float32")
    report: dict[str, Any] = {
        "benchmark": "disaggregated",
        "date": datetime.date.today().isoformat(),
        "machine": _peer.machine_info(),
        "model": str(model),
        "load": {k: getattr(args, k) for k in ("streams", "decode_tokens", "long_prompts", "long_words",
                                               "long_tokens", "long_gap", "min_tokens")},
    }
    short = [_peer.make_prompt(i, 64, seed=1) for i in range(4 * args.streams)]
    common = ["--max-model-len", str(args.max_model_len)]
    servers: list[_peer.ServerProcess] = []
    with _peer.recording(report):
        cores = os.cpu_count() or 2
        # Colocated: one server, every core.
        srv = _peer.start_meshlm(str(model), extra_args=common, env=_env(cores))
        servers.append(srv)
        srv.wait_ready(args.ready_timeout)
        _warm(srv.url, _peer.make_prompt(10_000, args.long_words, seed=9))
        long = [_peer.make_prompt(20_000 + i, args.long_words, seed=2) for i in range(args.long_prompts)]
        report["colocated"] = asyncio.run(_measure(srv.url, args, short, long))
        report["colocated"]["flags"] = srv.extra["flags"]
        srv.stop()
        # Disaggregated: prefill server on core 1, decode server on core 0.
        secret = {"MESHLM_CLUSTER_SECRET": secrets.token_hex(32)}
        port = _peer.free_port()
        pre = _peer.start_meshlm(str(model), extra_args=[*common, "--role", "prefill", "--prefill-port", str(port)],
                                 env=_env(1, secret))
        dec = _peer.start_meshlm(str(model), extra_args=[*common, "--prefill-peer", f"127.0.0.1:{port}",
                                                         "--disagg-min-tokens", str(args.min_tokens)],
                                 env=_env(1, secret))
        servers += [pre, dec]
        pre.wait_ready(args.ready_timeout)
        dec.wait_ready(args.ready_timeout)
        _pinned(pre, 1 % cores)
        _pinned(dec, 0)
        _warm(dec.url, _peer.make_prompt(10_001, args.long_words, seed=9))  # one handoff, compiles both sides
        long = [_peer.make_prompt(30_000 + i, args.long_words, seed=2) for i in range(args.long_prompts)]
        report["disaggregated"] = asyncio.run(_measure(dec.url, args, short, long))
        report["disaggregated"]["flags"] = {"prefill": pre.extra["flags"], "decode": dec.extra["flags"]}
        report["disaggregated"]["decode_metrics"] = _disagg_metrics(dec.url)
        c, d = report["colocated"], report["disaggregated"]
        report["itl_p95_ratio"] = _peer.ratio(c["decode_itl_p95"], d["decode_itl_p95"], 2)
        report["itl_p50_ratio"] = _peer.ratio(c["decode_itl_p50"], d["decode_itl_p50"], 2)
        report["ttft_ratio"] = _peer.ratio(d["long_ttft_mean"], c["long_ttft_mean"], 2)
        report["targets"] = {"itl_p95_ratio_at_least": TARGET_ITL_P95_RATIO, "ttft_ratio_at_most": TARGET_TTFT_RATIO,
                             "met": (report["itl_p95_ratio"] or 0) >= TARGET_ITL_P95_RATIO
                             and (report["ttft_ratio"] or 99) <= TARGET_TTFT_RATIO}
    if not args.keep_logs and "error" not in report:
        for s in servers:
            s.remove_log()
    else:
        report["logs"] = [s.log_path for s in servers]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _disagg_metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("meshlm_disagg_") and "_total" in line or line.startswith("meshlm_disagg_transfer_seconds_sum"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


if __name__ == "__main__":
    main()
