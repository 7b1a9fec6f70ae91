"""Serving benchmark: N concurrent streaming chat completions against an
OpenAI-compatible server, optionally compared with mlx_lm.server on the same
model in the same run. Prints JSON to stdout.

    python benchmarks/serve.py --model demo --streams 1,16 --max-tokens 64 --peer mlx-lm
    python benchmarks/serve.py --url http://127.0.0.1:8000 --streams 1,4,16

Per concurrency level: TTFT p50/p95, inter-token latency p50/p95 (between
content chunks), aggregate output tokens/s (completion tokens from the final
usage chunk / wall time of the level), requests ok/failed, and peak RSS of the
server process tree (sampled every 0.2 s; only for servers this script starts
or --server-pid). With --peer both servers are up together and each level runs
against one server at a time, alternating which goes first (so other load on
the machine hits both alike); --sequential runs one server, then the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _peer  # noqa: E402

PEERS = ("mlx-lm",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="an already-running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    src.add_argument("--model", help="model dir (or 'demo') to start `meshlm serve` with")
    p.add_argument("--peer-model", help="model dir for the peer with --url (default: --model's dir)")
    p.add_argument("--streams", default="1,16", help="comma list of concurrency levels, run in turn")
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128, help="~words per prompt (varied per request)")
    p.add_argument("--dtype", default="float32", help="meshlm --dtype (and the demo export the peer loads)")
    p.add_argument("--max-batch-size", type=int, help="meshlm --max-batch-size")
    p.add_argument("--meshlm-args", default="", help="extra `meshlm serve` flags, e.g. '--no-ssd-cache'")
    p.add_argument("--peer", choices=PEERS, help="also benchmark this server on the same model dir")
    p.add_argument("--label", default="meshlm", help="JSON key of the main server")
    p.add_argument("--request-model", help="`model` field for the main server (default: its /v1/models id)")
    p.add_argument("--server-pid", type=int, help="with --url: pid whose process tree RSS to sample")
    p.add_argument("--ready-timeout", type=float, default=_peer.READY_TIMEOUT_S)
    p.add_argument("--no-openblas", action="store_true", help="don't LD_PRELOAD OpenBLAS into the peer")
    p.add_argument(
        "--retries", type=int, default=2,
        help="retries of a request whose connection fails before any response (counted in the JSON)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt variation seed")
    p.add_argument("--long-every", type=int, default=0, help="every Nth prompt is a long one (mixed lengths)")
    p.add_argument("--long-words", type=int, default=1000, help="~words of the long prompts")
    p.add_argument(
        "--sequential", action="store_true",
        help="run one server at a time (default: all up together, levels interleaved)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep server logs even when all went well")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    args.levels = _peer.parse_levels(p, args.streams)
    if args.requests_per_stream < 1 or args.max_tokens < 1:
        p.error("--requests-per-stream and --max-tokens must be >= 1")
    if args.peer and args.url and not (args.peer_model or args.model):
        p.error("--peer with --url needs --peer-model DIR")
    return args


def resolve_model_dir(model: str, dtype: str | None) -> Path:
    """'demo' -> the exported SmolLM2 dir for `dtype` (float32 unless a stored dtype is asked)."""
    if model == "demo":
        from meshlm.model.demo import demo_model_dir

        from_dtype = dtype if dtype in ("float32", "float16", "bfloat16") else "float32"
        return demo_model_dir(from_dtype)
    return Path(model).expanduser().resolve()


def stored_dtype(model_dir: Path) -> str | None:
    try:
        return json.loads((model_dir / "config.json").read_text()).get("torch_dtype")
    except (OSError, ValueError):
        return None


def level_prompts(level_index: int, n: int, words: int, seed: int, long_every: int = 0,
                  long_words: int = 0) -> list[str]:
    # Distinct across levels and requests; identical across servers. With `long_every`, every
    # long_every-th prompt has `long_words` words instead (a mix of lengths, for memory).
    base = (level_index + 1) * 100_000
    return [_peer.make_prompt(base + i, long_words if long_every and i % long_every == 0 else words, seed)
            for i in range(n)]


class Target:
    """One server under test: started here (`server`) or already running (`url`)."""

    def __init__(
        self,
        name: str,
        args: argparse.Namespace,
        *,
        server: _peer.ServerProcess | None = None,
        url: str | None = None,
        request_model: str | None = None,
        pid: int | None = None,
    ):
        self.name = name
        self.args = args
        self.server = server
        self.url = server.url if server else (url or "").rstrip("/")
        self.request_model = request_model
        self.pid = server.pid if server else pid
        self.info: dict[str, Any] = {}
        self.results: dict[int, dict[str, Any]] = {}
        self.texts: dict[int, list[str | None]] = {}
        self.sampler = _peer.RssSampler(self.pid)
        self.failed = False
        self.finished = False
        if server:
            self.info["flags"] = server.extra.get("flags")
            if "env" in server.extra:
                self.info["env"] = server.extra["env"]
        else:
            self.info["url"] = self.url

    def prepare(self) -> bool:
        """Wait until ready, warm up; False (with info['error']) if the server is unusable."""
        try:
            self.sampler.start()
            if self.server:
                self.info["ready_s"] = round(self.server.wait_ready(self.args.ready_timeout), 2)
            if self.pid:
                self.info["openblas_loaded"] = _peer.tree_maps_contain(self.pid, "libopenblas")
            if self.request_model is None:
                self.request_model = _peer.served_model_id(self.url)
            self.info["request_model"] = self.request_model
            self._warmup()
            return True
        except _peer.ServerError as e:
            self.info["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - keep the other server's numbers
            self.info["error"] = _peer.describe_error(e)
        self.failed = True
        return False

    def _warmup(self) -> None:
        args = self.args
        t0 = time.perf_counter()
        prompt = _peer.make_prompt(0, args.prompt_tokens, args.seed)
        warm, _ = asyncio.run(_peer.run_load(self.url, self.request_model, [prompt], 1, args.max_tokens))
        w = warm[0]
        self.info["warmup"] = {"ok": w.ok, "s": round(time.perf_counter() - t0, 3), "completion_tokens": w.tokens}
        if w.text:
            self.info["warmup"]["text_head"] = w.text[:120]
        if not w.ok:
            self.info["warmup"]["error"] = w.error
            raise RuntimeError(f"warm-up request failed: {w.error}")
        if self.pid:
            self.info["idle_rss_mb"] = round(self.sampler.sample(), 1)
            # CPU an idle server burns (matters when servers are up together)
            c0 = _peer.tree_cpu_s(self.pid)
            time.sleep(1.0)
            self.info["idle_cpu_frac"] = round(_peer.tree_cpu_s(self.pid) - c0, 3)

    def run_level(self, li: int, streams: int) -> None:
        if self.failed:
            return
        args = self.args
        if self.server and not self.server.alive():
            self.info["error"] = f"{self.name} died (exit code {self.server.proc.returncode})"
            self.failed = True
            return
        prompts = level_prompts(li, streams * args.requests_per_stream, args.prompt_tokens, args.seed,
                                args.long_every, args.long_words)
        self.sampler.reset()
        with _peer.CpuMeter(self.pid) as cpu:
            results, wall = asyncio.run(
                _peer.run_load(self.url, self.request_model, prompts, streams, args.max_tokens, retries=args.retries)
            )
        summary = _peer.summarize(results, wall)
        summary["cpu"] = cpu.result
        server_cpu = cpu.result.get("server_cpu_s")
        if server_cpu:
            # robust to other load on the machine: output per CPU-second the server got
            summary["tokens_per_cpu_s"] = round(summary["completion_tokens"] / server_cpu, 2)
        if self.pid:
            self.sampler.sample()
            summary["peak_rss_mb"] = round(self.sampler.peak_mb, 1)
        self.results[streams] = summary
        self.texts[streams] = [r.text if r.ok else None for r in results]
        print(
            f"[{self.name}] streams={streams}: {summary['tokens_per_s']} tok/s, "
            f"ttft p50 {summary['ttft_p50']}s, ok {summary['requests_ok']}/{len(results)}"
            + (" (contended)" if cpu.result.get("contended") else ""),
            file=sys.stderr,
            flush=True,
        )

    def finish(self) -> None:
        """Stop sampling and (if started here) the server; safe to call twice."""
        if self.finished:
            return
        self.finished = True
        self.sampler.stop()
        if self.pid:
            self.info["peak_rss_mb"] = round(self.sampler.overall_peak_mb, 1)
        if not self.server:
            return
        self.info["exit_code"] = self.server.stop()
        ok = not self.failed and all(r["requests_failed"] == 0 for r in self.results.values())
        if ok and not self.args.keep_logs:
            self.server.remove_log()
        else:
            self.info["log"] = self.server.log_path
            if not ok:
                self.info["log_tail"] = self.server.log_tail(15)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _peer.install_signal_handlers()
    report: dict[str, Any] = {
        "machine": _peer.machine_info(),
        "config": {
            "streams": args.levels,
            "requests_per_stream": args.requests_per_stream,
            "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_tokens,
            "long_every": args.long_every,
            "long_words": args.long_words,
            "temperature": 0,
            "stream_options": {"include_usage": True},
            "retries": args.retries,
        },
    }
    model_info: dict[str, Any] = {"arg": args.model or args.url}
    report["model"] = model_info
    targets: list[Target] = []

    def finish_targets() -> None:
        for t in targets:
            try:
                t.finish()
            except Exception:  # noqa: BLE001
                pass

    with _peer.recording(report, cleanup=finish_targets):
        peer_dir: Path | None = None
        if args.model:
            if args.peer or args.model == "demo":
                peer_dir = resolve_model_dir(args.model, args.dtype)
        elif args.peer:
            peer_dir = resolve_model_dir(args.peer_model, args.dtype)
        if peer_dir is not None:
            model_info["dir"] = str(peer_dir)
            model_info["stored_dtype"] = stored_dtype(peer_dir)

        def make_main() -> Target:
            if args.url:
                return Target(args.label, args, url=args.url, request_model=args.request_model, pid=args.server_pid)
            server = _peer.start_meshlm(args.model, dtype=args.dtype, max_batch_size=args.max_batch_size,
                                        extra_args=shlex.split(args.meshlm_args))  # on a fresh --kv-cache-dir
            t = Target(args.label, args, server=server, request_model=args.request_model)
            t.info["dtype"] = args.dtype
            return t

        def make_peer() -> Target:
            assert peer_dir is not None
            server = _peer.start_mlx_lm(peer_dir, concurrency=max(args.levels), openblas=not args.no_openblas)
            t = Target("mlx-lm", args, server=server, request_model=server.extra["request_model"])
            t.info["dtype"] = stored_dtype(peer_dir)
            return t

        makers = [make_main] + ([make_peer] if args.peer else [])
        if args.sequential:
            # one server at a time: all its levels, then stop it
            for make in makers:
                t = make()
                targets.append(t)
                try:
                    if t.prepare():
                        for li, streams in enumerate(args.levels):
                            t.run_level(li, streams)
                finally:
                    t.finish()
        else:
            # all servers up (idle but for one), levels interleaved, order alternating
            # per level, so load from elsewhere on the machine hits both alike
            for make in makers:
                t = make()
                targets.append(t)
                t.prepare()
            for li, streams in enumerate(args.levels):
                order = targets if li % 2 == 0 else targets[::-1]
                for t in order:
                    t.run_level(li, streams)

    servers = {t.name: t.info for t in targets}
    report["servers"] = servers
    per_server = {t.name: t.results for t in targets}
    texts = {t.name: t.texts for t in targets}
    report["openblas"] = {
        name: info.get("openblas_loaded") for name, info in servers.items()
    }
    levels = []
    for streams in args.levels:
        entry: dict[str, Any] = {"streams": streams}
        for name in servers:
            if streams in per_server.get(name, {}):
                entry[name] = per_server[name][streams]
        if args.peer and args.label in entry and args.peer in entry:
            a, b = entry[args.label], entry[args.peer]
            entry["ratio"] = {
                "tokens_per_s": _peer.ratio(a["tokens_per_s"], b["tokens_per_s"]),
                "ttft_p50": _peer.ratio(a["ttft_p50"], b["ttft_p50"]),
                "itl_p50": _peer.ratio(a["itl_p50"], b["itl_p50"]),
                "peak_rss_mb": _peer.ratio(a.get("peak_rss_mb"), b.get("peak_rss_mb")),
                "tokens_per_cpu_s": _peer.ratio(a.get("tokens_per_cpu_s"), b.get("tokens_per_cpu_s")),
            }
            # temperature 0 on the same weights: how many completions match exactly
            ta, tb = texts[args.label].get(streams, []), texts[args.peer].get(streams, [])
            pairs = [(x, y) for x, y in zip(ta, tb) if x is not None and y is not None]
            if pairs:
                entry["same_output_frac"] = round(sum(x == y for x, y in pairs) / len(pairs), 3)
                entry["same_output_stripped_frac"] = round(
                    sum(x.strip() == y.strip() for x, y in pairs) / len(pairs), 3
                )
        contended = [n for n in servers if (entry.get(n) or {}).get("cpu", {}).get("contended")]
        if contended:
            entry["contended"] = contended  # other processes used >10% of the CPUs meanwhile
        levels.append(entry)
    report["levels"] = levels

    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    failed = report.get("interrupted") or report.get("error") or any("error" in i for i in servers.values()) or any(
        s.get("requests_failed") for lv in per_server.values() for s in lv.values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
