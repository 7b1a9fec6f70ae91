"""Prefix-cache benchmark: time to first token of a long (~2,000-token) prompt,
cold, warm from RAM (the same prompt again) and warm from SSD (a new server
process on the same --kv-cache-dir), optionally against mlx_lm.server's own
prompt cache on the same model in the same run. Prints JSON to stdout.

    python benchmarks/prefix_cache.py                       # demo model, float32
    python benchmarks/prefix_cache.py --model PATH --peer mlx-lm

TTFT is measured client-side on a streaming chat completion: request sent ->
first SSE chunk with content. Each server first gets a warm-up request (a
different, shorter prompt sent to /v1/completions, so it shares no cached
block with the chat prompt) so "cold" measures a prefill, not process
start-up. Before the SSD run the block files are evicted from the page cache
(fsync + POSIX_FADV_DONTNEED on those files only), so the restarted server
really reads them from disk.
Servers run one after the other, never at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _peer  # noqa: E402

PEERS = ("mlx-lm",)
TARGET_RAM = 10.0  # cold / warm-from-RAM TTFT
TARGET_SSD = 5.0  # cold / warm-from-SSD TTFT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="model dir, or 'demo' (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", help="meshlm --dtype (and the demo export the peer loads)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="approximate prompt length in tokens")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=3, help="warm requests per tier (median reported)")
    p.add_argument("--warmup-tokens", type=int, default=500, help="length of each server's warm-up prompt")
    p.add_argument("--block-size", type=int, default=32, help="meshlm --block-size (default: the server's)")
    p.add_argument("--kv-cache-dir", help="SSD tier root (default: a temp dir, removed afterwards)")
    p.add_argument("--keep-page-cache", action="store_true",
                   help="don't evict the block files from the page cache before the SSD run")
    p.add_argument("--peer", choices=PEERS, help="also measure this server's prompt cache on the same model")
    p.add_argument("--no-openblas", action="store_true", help="don't LD_PRELOAD OpenBLAS into the peer")
    p.add_argument("--ready-timeout", type=float, default=_peer.READY_TIMEOUT_S)
    p.add_argument("--seed", type=int, default=0, help="prompt text seed")
    p.add_argument("--keep-logs", action="store_true", help="keep server logs even when all went well")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.prompt_tokens < 2 * args.block_size or args.max_tokens < 1 or args.repeats < 1:
        p.error("--prompt-tokens must cover 2 blocks; --max-tokens and --repeats must be >= 1")
    if args.warmup_tokens < 16:
        p.error("--warmup-tokens must be >= 16")
    return args


# -- prompts --------------------------------------------------------------------


def sized_prompt(model_dir: Path, index: int, tokens: int, seed: int) -> tuple[str, int]:
    """A `_peer.make_prompt` text of about `tokens` tokens (counted without the chat template)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    words = tokens * 3 // 4
    for _ in range(6):
        text = _peer.make_prompt(index, words, seed)
        n = len(tok.encode(text, add_special_tokens=False).ids)
        if abs(n - tokens) <= tokens // 100:
            break
        words = max(16, round(words * tokens / n))
    return text, n


# -- a streaming client that keeps the usage details ------------------------------


def stream_chat(url: str, model: str | None, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streaming chat completion: TTFT to the first content chunk, text, usage (with cached tokens)."""
    payload = _peer.chat_payload(model, prompt, max_tokens)
    out: dict[str, Any] = {"ttft_s": None, "text": "", "usage": None}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(f"error event: {chunk['error']}")
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if out["ttft_s"] is None:
                        out["ttft_s"] = now - t0
                    out["text"] += content
    out["latency_s"] = time.perf_counter() - t0
    if out["ttft_s"] is None:
        raise RuntimeError("no content chunk in the stream")
    return out


def cached_tokens(res: dict[str, Any]) -> int | None:
    usage = res.get("usage") or {}
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def warm_up(url: str, model: str | None, prompt: str, max_tokens: int) -> float:
    """A long prompt through /v1/completions: exercises the prefill path without caching a chat block."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if model is not None:
        body["model"] = model
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    if r.status_code != 200:  # a server without /v1/completions: a chat request with another prompt
        stream_chat(url, model, prompt, max_tokens)
    return round(time.perf_counter() - t0, 3)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("meshlm_prefix_cache"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_ssd_settled(url: str, timeout: float = 60.0) -> float:
    """Poll the SSD tier's size until it stops growing (the writes are asynchronous)."""
    key = 'meshlm_prefix_cache_bytes{tier="ssd"}'
    deadline = time.monotonic() + timeout
    last, stable_since = -1.0, time.monotonic()
    while time.monotonic() < deadline:
        now = metrics(url).get(key, 0.0)
        if now != last:
            last, stable_since = now, time.monotonic()
        elif now > 0 and time.monotonic() - stable_since > 1.0:
            break
        time.sleep(0.2)
    return last


def evict_page_cache(files: list[Path]) -> bool:
    """fsync then POSIX_FADV_DONTNEED each file (only these files' pages; nothing system-wide)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in results]
    return {
        "ttft_s": round(statistics.median(ttfts), 4),
        "ttft_all_s": [round(t, 4) for t in ttfts],
        "cached_tokens": [cached_tokens(r) for r in results],
        "prompt_tokens": (results[0].get("usage") or {}).get("prompt_tokens"),
    }


# -- the runs -----------------------------------------------------------------------


def start(server: _peer.ServerProcess, args: argparse.Namespace) -> float:
    t0 = time.perf_counter()
    server.wait_ready(args.ready_timeout)
    return round(time.perf_counter() - t0, 2)


def bench_meshlm(args: argparse.Namespace, model_dir: Path, prompt: str, warm_prompts: list[str],
                 kv_dir: Path, logs: list[_peer.ServerProcess]) -> dict[str, Any]:
    flags = ["--kv-cache-dir", str(kv_dir), "--block-size", str(args.block_size)]
    model = "demo" if args.model == "demo" else str(model_dir)
    out: dict[str, Any] = {"flags": flags}

    # 1. A fresh server on an empty cache directory: cold, then warm from RAM.
    server = _peer.start_meshlm(model, dtype=args.dtype, extra_args=flags)
    logs.append(server)
    try:
        out["startup_s"] = start(server, args)
        out["warmup_s"] = warm_up(server.url, None, warm_prompts[0], args.max_tokens)
        with _peer.CpuMeter(server.pid) as cpu:
            cold = stream_chat(server.url, None, prompt, args.max_tokens)
            ram = [stream_chat(server.url, None, prompt, args.max_tokens) for _ in range(args.repeats)]
        out["cpu_first_server"] = cpu.result
        out["ssd_bytes_written"] = int(wait_ssd_settled(server.url))
        out["metrics_first_server"] = metrics(server.url)
    finally:
        server.stop()
    files = list(kv_dir.rglob("*.safetensors"))
    out["ssd_files"] = len(files)
    # Just written, the blocks are still in the page cache: evict them so "warm from SSD" reads the disk.
    out["page_cache_evicted"] = not args.keep_page_cache and evict_page_cache(files)

    # 2. A new process on the same directory: the prompt's blocks come from SSD.
    server = _peer.start_meshlm(model, dtype=args.dtype, extra_args=flags)
    logs.append(server)
    try:
        out["restart_startup_s"] = start(server, args)
        out["restart_warmup_s"] = warm_up(server.url, None, warm_prompts[1], args.max_tokens)
        with _peer.CpuMeter(server.pid) as cpu:
            ssd = [stream_chat(server.url, None, prompt, args.max_tokens)]
            out["metrics_after_ssd_hit"] = metrics(server.url)
            # Later repeats of the same prompt in this process come from RAM again.
            ssd_then_ram = [stream_chat(server.url, None, prompt, args.max_tokens)
                            for _ in range(args.repeats - 1)]
        out["cpu_second_server"] = cpu.result
    finally:
        server.stop()

    out["cold"] = summarize([cold])
    out["warm_ram"] = summarize(ram)
    out["warm_ssd"] = summarize(ssd)
    if ssd_then_ram:
        out["after_ssd_warm_ram"] = summarize(ssd_then_ram)
    texts = {r["text"] for r in [cold, *ram, *ssd, *ssd_then_ram]}
    out["outputs_identical"] = len(texts) == 1
    out["text_head"] = cold["text"][:80]
    cold_t = out["cold"]["ttft_s"]
    out["ratio_cold_over_warm_ram"] = _peer.ratio(cold_t, out["warm_ram"]["ttft_s"], 2)
    out["ratio_cold_over_warm_ssd"] = _peer.ratio(cold_t, out["warm_ssd"]["ttft_s"], 2)
    out["targets"] = {
        "cold_over_warm_ram": TARGET_RAM,
        "cold_over_warm_ssd": TARGET_SSD,
        "ram_met": (out["ratio_cold_over_warm_ram"] or 0) >= TARGET_RAM,
        "ssd_met": (out["ratio_cold_over_warm_ssd"] or 0) >= TARGET_SSD,
    }
    return out


def bench_mlx_lm(args: argparse.Namespace, model_dir: Path, prompt: str, warm_prompt: str,
                 logs: list[_peer.ServerProcess]) -> dict[str, Any]:
    server = _peer.start_mlx_lm(model_dir, openblas=not args.no_openblas)
    logs.append(server)
    request_model = server.extra.get("request_model", "default_model")
    out: dict[str, Any] = {"flags": server.extra.get("flags"), "env": server.extra.get("env")}
    try:
        out["startup_s"] = start(server, args)
        out["warmup_s"] = warm_up(server.url, request_model, warm_prompt, args.max_tokens)
        with _peer.CpuMeter(server.pid) as cpu:
            cold = stream_chat(server.url, request_model, prompt, args.max_tokens)
            warm = [stream_chat(server.url, request_model, prompt, args.max_tokens) for _ in range(args.repeats)]
        out["cpu"] = cpu.result
    finally:
        server.stop()
    out["cold"] = summarize([cold])
    out["warm"] = summarize(warm)
    out["outputs_identical"] = len({r["text"] for r in [cold, *warm]}) == 1
    out["text_head"] = cold["text"][:80]
    out["ratio_cold_over_warm"] = _peer.ratio(out["cold"]["ttft_s"], out["warm"]["ttft_s"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _peer.install_signal_handlers()
    model_dir = _peer.resolve_model_dir(args.model, args.dtype)
    prompt, n = sized_prompt(model_dir, 0, args.prompt_tokens, args.seed)
    warm_prompts = [sized_prompt(model_dir, i, args.warmup_tokens, args.seed)[0] for i in (1, 2)]
    own_dir = args.kv_cache_dir is None
    kv_dir = Path(tempfile.mkdtemp(prefix="bench-kv-")) if own_dir else Path(args.kv_cache_dir).expanduser()
    result: dict[str, Any] = {
        "benchmark": "prefix_cache",
        "model": args.model,
        "model_dir": str(model_dir),
        "dtype": args.dtype,
        "prompt_text_tokens": n,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "warmup_text_tokens": args.warmup_tokens,
        "block_size": args.block_size,
        "machine": _peer.machine_info(),
        "loadavg_before": round(os.getloadavg()[0], 2),
    }
    logs: list[_peer.ServerProcess] = []
    failed = False
    t0 = time.perf_counter()
    try:
        result["meshlm"] = bench_meshlm(args, model_dir, prompt, warm_prompts, kv_dir, logs)
        if args.peer == "mlx-lm":
            result["mlx-lm"] = bench_mlx_lm(args, model_dir, prompt, warm_prompts[0], logs)
            m, p = result["meshlm"], result["mlx-lm"]
            result["comparison"] = {
                "cold_ttft_s": {"meshlm": m["cold"]["ttft_s"], "mlx-lm": p["cold"]["ttft_s"]},
                "warm_ttft_s": {"meshlm_ram": m["warm_ram"]["ttft_s"], "meshlm_ssd": m["warm_ssd"]["ttft_s"],
                                "mlx-lm": p["warm"]["ttft_s"]},
                "same_greedy_text": m["text_head"] == p["text_head"],
            }
    except (Exception, KeyboardInterrupt) as exc:  # report what we have, with the logs
        failed = True
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["logs"] = [s.log_path for s in logs]
    finally:
        _peer.stop_all()
        if own_dir:
            shutil.rmtree(kv_dir, ignore_errors=True)
        if not failed and not args.keep_logs:
            for s in logs:
                s.remove_log()
        elif logs:
            result["logs"] = [s.log_path for s in logs]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    # CPU used by anything else during a measurement: well above 0 makes those TTFTs less trustworthy.
    result["other_cpu_s"] = {
        f"{name}.{key}": section[key].get("other_cpu_s")
        for name in ("meshlm", "mlx-lm") for section in [result.get(name) or {}]
        for key in ("cpu_first_server", "cpu_second_server", "cpu") if section.get(key)
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
