"""Speculative-decoding benchmark: meshlm with speculation off vs on (and,
optionally, mlx_lm.server without vs with a draft model) on two workloads, at
several concurrency levels. Prints one JSON object to stdout.

    python benchmarks/speculative.py                                   # ngram, K=5, streams 1,8
    python benchmarks/speculative.py --spec-flags "--speculative ngram --num-speculative-tokens 3"
    python benchmarks/speculative.py --spec-flags "--speculative draft --num-speculative-tokens 3 --draft-model {draft}"
    python benchmarks/speculative.py --peer mlx-lm --streams 1          # also mlx_lm.server --draft-model
    python benchmarks/speculative.py --spec-flags "" --streams 1 --requests-per-stream 1 --max-tokens 32

Workloads (greedy chat completions, streamed with usage):
- input_grounded: the answer copies long spans of the prompt (repeat a
  paragraph, fix a typo in ~30 lines of code and print it all, replace one
  word throughout a paragraph, summarise quoting sentences verbatim);
- free_form: short open questions ("Write a short story about ...").
Prompts are generated offline from seeded choices over text embedded here;
both sides of a comparison get the same prompts.

Each side is its own server process, run one after the other (never two at
once), on a fresh --kv-cache-dir and warmed up with an unrelated prompt. Per
workload and level: output tok/s (usage completion tokens / wall time), TTFT
p50, the `meshlm_spec_*` metric deltas (mean accepted length =
emitted/verify_steps, acceptance rate = accepted/draft) when /metrics has
them, and `same_output_frac` between off and on (greedy: must be 1.0), with
the first differing pair. `{draft}` in --spec-flags is replaced by the
early-exit draft built by `make_layer_draft` (the first --draft-layers decoder
layers of the model, same embedding, norm and head).

A default run takes ~2-3 minutes on 2 cores. With --peer mlx-lm add
--streams 1: its draft mode serves one request at a time, so 8 streams take
~8x as long there.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _peer  # noqa: E402

WORKLOADS = ("input_grounded", "free_form")
DEFAULT_SPEC_FLAGS = "--speculative ngram --num-speculative-tokens 5"
# (workload, streams or None for every level, minimum on/off tok/s ratio of meshlm)
TARGETS = (("input_grounded", 1, 2.0), ("free_form", None, 0.95))
SPEC_PREFIX = "meshlm_spec_"
PARAGRAPH_SENTENCES = 10
PEER_NOTES = (
    "mlx_lm.server with --draft-model is not batchable: one generation thread serves requests one at a "
    "time (_serve_single), so with N streams the others queue (TTFT grows, tok/s is that of 1 stream)",
    "mlx_lm.server --draft-model: once its prompt cache hits (e.g. the system prompt cached by the "
    "warm-up), greedy text can differ from its plain decoding; see same_output_frac of the mlx-lm pair",
)
OPENBLAS_THREAD_TIMEOUT = "4"  # as meshlm.platform sets for its own re-exec

# -- prompt material (embedded, so nothing is downloaded) -----------------------

SENTENCES = (
    "The river ran quietly past the old mill at the edge of the village.",
    "Every morning the teacher opened the windows before the students arrived.",
    "The market in the city square sold bread, cheese and fresh flowers.",
    "A small train left the station at seven and reached the coast by noon.",
    "The library kept its oldest books in a cool room under the stairs.",
    "In winter the garden was covered in snow, and the birds came to the feeder.",
    "My grandmother wrote a letter to her sister every Sunday afternoon.",
    "The bridge across the river was built of grey stone more than a century ago.",
    "Children played football in the park until the street lights came on.",
    "The baker woke before dawn to light the ovens and knead the dough.",
    "A strong wind blew across the hills and bent the tall grass.",
    "The museum opened a new room for paintings of the sea.",
    "After dinner the family sat by the fire and told stories.",
    "The road to the mountain village was narrow and full of sharp turns.",
    "She carried a basket of apples from the orchard to the kitchen.",
    "The old clock in the hall struck twelve as the guests arrived.",
    "Fishermen mended their nets on the harbour wall in the evening light.",
    "The students asked the teacher a question about the history of the city.",
    "Rain fell all night, and by morning the river had risen over its banks.",
    "The doctor walked to the farm to visit a patient who could not travel.",
    "A quiet path through the forest led to a lake with clear water.",
    "The market closed early because a storm was coming from the west.",
    "He painted the fence white and planted roses along the garden wall.",
    "The musicians played in the square while people danced in the warm evening.",
    "Every summer the village held a fair with games, music and good food.",
    "The letter arrived a week late, but the news in it was still good.",
    "A lighthouse stood on the rocks and guided ships safely into the harbour.",
    "The library card let her borrow five books at a time for three weeks.",
    "Snow closed the mountain road, so the train was the only way to travel.",
    "The teacher drew a map of the river on the board and named every town.",
    "In the morning the city was quiet, and the streets were still wet.",
    "The gardener knew the name of every tree and flower in the park.",
    "They built a small boat from wood and sailed it on the lake.",
    "The bakery on the corner sold the best bread in the whole city.",
    "An old man fed the pigeons in the square every day at noon.",
    "The station master checked his watch and waved the train away.",
    "Her brother repaired bicycles in a small shop near the bridge.",
    "The festival ended with fireworks over the river at midnight.",
)

# Words the replacement task swaps (each occurs in several sentences above).
REPLACEMENTS = (
    ("river", "stream"), ("teacher", "professor"), ("city", "town"), ("train", "bus"),
    ("library", "archive"), ("garden", "yard"), ("market", "bazaar"), ("morning", "dawn"),
    ("village", "hamlet"), ("bread", "cake"), ("letter", "note"), ("bridge", "viaduct"),
)

CODE_FUNCTIONS = (
    '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)''',
    '''def count_words(text):
    counts = {}
    for word in text.split():
        word = word.lower()
        counts[word] = counts.get(word, 0) + 1
    return counts''',
    '''def fizzbuzz(n):
    result = []
    for i in range(1, n + 1):
        if i % 15 == 0:
            result.append("FizzBuzz")
        elif i % 3 == 0:
            result.append("Fizz")
        elif i % 5 == 0:
            result.append("Buzz")
        else:
            result.append(str(i))
    return result''',
    '''def is_prime(n):
    if n < 2:
        return False
    for d in range(2, int(n ** 0.5) + 1):
        if n % d == 0:
            return False
    return True''',
    '''def reverse_words(sentence):
    words = sentence.split()
    words.reverse()
    return " ".join(words)''',
    '''def flatten(items):
    out = []
    for item in items:
        if isinstance(item, list):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out''',
    '''def fibonacci(n):
    a, b = 0, 1
    sequence = []
    for _ in range(n):
        sequence.append(a)
        a, b = b, a + b
    return sequence''',
    '''def find_max(values):
    best = values[0]
    for value in values[1:]:
        if value > best:
            best = value
    return best''',
    '''def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value''',
    '''def merge_dicts(first, second):
    merged = dict(first)
    for key, value in second.items():
        merged[key] = value
    return merged''',
)

TYPOS = (("return", "retrun"), ("range", "rnage"), ("append", "apend"), ("value", "vlaue"), ("len(", "lne("))

FREE_TEMPLATES = (
    ("Write a short story about {}.", (
        "a lighthouse keeper who finds a message in a bottle", "a robot learning to cook",
        "a cat that can talk to birds", "two friends lost in a snowy forest", "a child's first day at school",
        "an old clock that runs backwards", "a dragon afraid of the dark", "a baker who bakes one magic loaf",
        "a sailor who never saw the sea", "a garden that grows overnight",
    )),
    ("Explain why {}.", (
        "the sky is blue", "leaves change colour in autumn", "we have seasons", "ice floats on water",
        "bread rises when it bakes", "the moon has phases", "people need sleep", "rivers flow to the sea",
        "metal feels colder than wood", "rainbows appear after rain",
    )),
    ("Give some advice to someone who wants to {}.", (
        "learn to play the piano", "start running every morning", "grow vegetables at home",
        "become a better writer", "learn a new language", "save money each month", "cook healthy meals",
        "make new friends in a new city", "read more books", "keep a tidy desk",
    )),
    ("Describe {} to a ten-year-old.", (
        "how a train works", "what a volcano is", "how bees make honey", "what electricity is",
        "how a library is organised", "what the internet is", "how a bridge stays up", "what a planet is",
        "how clouds form", "what a computer program is",
    )),
)

WARMUP_PROMPT = (
    "Repeat the following list exactly:\n\nalpha, bravo, charlie, delta, echo, foxtrot, golf, hotel, "
    "india, juliett, kilo, lima, mike, november, oscar, papa, quebec, romeo, sierra, tango."
)


def paragraph(rng: random.Random, sentences: int = PARAGRAPH_SENTENCES) -> str:
    return " ".join(rng.sample(SENTENCES, sentences))


def code_listing(rng: random.Random, min_lines: int = 30) -> tuple[str, str]:
    """(code with one typo, the typo's description); ~`min_lines` lines of simple functions."""
    funcs = rng.sample(CODE_FUNCTIONS, len(CODE_FUNCTIONS))
    chosen: list[str] = []
    while sum(f.count("\n") + 2 for f in chosen) < min_lines:
        chosen.append(funcs[len(chosen)])
    code = "\n\n\n".join(chosen)
    options = [(good, bad) for good, bad in TYPOS if good in code]
    good, bad = rng.choice(options)
    spots = [i for i in range(len(code)) if code.startswith(good, i)]
    at = rng.choice(spots)
    return code[:at] + bad + code[at + len(good):], f"{bad} -> {good}"


def grounded_prompt(rng: random.Random, index: int) -> str:
    """One of four copy-heavy tasks, chosen by `index` so every level mixes them alike."""
    kind = index % 4
    if kind == 0:
        return f"Repeat the following text exactly:\n\n{paragraph(rng)}"
    if kind == 1:
        code, _ = code_listing(rng)
        return f"Fix the typo in this code and output the whole corrected code:\n\n```python\n{code}\n```"
    if kind == 2:
        text = paragraph(rng)
        old, new = rng.choice([(a, b) for a, b in REPLACEMENTS if a in text] or [REPLACEMENTS[0]])
        return (
            "Rewrite this paragraph, keeping every sentence, in the same words but with the word "
            f'"{old}" replaced by "{new}":\n\n{text}'
        )
    return (
        "Summarise the following text in a few sentences, quoting at least three of its sentences "
        f"word for word in double quotes:\n\n{paragraph(rng)}"
    )


def free_prompts(rng: random.Random, n: int) -> list[str]:
    """`n` open questions, distinct while n <= 40 (template x topic pairs shuffled)."""
    pairs = [t.format(topic) for t, topics in FREE_TEMPLATES for topic in topics]
    rng.shuffle(pairs)
    return [pairs[i % len(pairs)] for i in range(n)]


def workload_prompts(workload: str, level_index: int, n: int, seed: int) -> list[str]:
    """Prompts of one workload at one level: deterministic, distinct across levels (string seeds hash stably)."""
    rng = random.Random(f"{seed}-{workload}-{level_index}")
    if workload == "free_form":
        return free_prompts(rng, n)
    return [grounded_prompt(random.Random(f"{seed}-{workload}-{level_index}-{i}"), i) for i in range(n)]


# -- the early-exit draft model ---------------------------------------------------


def make_layer_draft(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, layers: int) -> Path:
    """Write an mlx-lm model dir made of the first `layers` decoder layers of `src_dir`.

    Same embedding, final norm and head (so the same tokenizer), config's
    `num_hidden_layers` (and any per-layer `layer_types` list) cut to `layers`,
    every non-weight file copied. Written to a temp dir beside `dst_dir`, then
    renamed: an existing `dst_dir` is replaced.
    """
    import mlx.core as mx

    src, dst = Path(src_dir), Path(dst_dir)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= layers < total:
        raise ValueError(f"--draft-layers must be in 1..{total - 1}, got {layers}")
    weights: dict[str, Any] = {}
    for shard in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(shard)))
    kept = {k: v for k, v in weights.items() if _layer_index(k) is None or _layer_index(k) < layers}
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(tmp / "model.safetensors"), kept, metadata={"format": "mlx"})
    (tmp / "draft_source.json").write_text(json.dumps({"source": str(src.resolve()), "layers": layers}) + "\n")
    tmp.chmod(0o755)
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    return dst


def _layer_index(key: str) -> int | None:
    """`model.layers.7.mlp.up_proj.weight` -> 7; None for weights outside the decoder layers."""
    parts = key.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


def draft_is_current(dst: Path, src: Path, layers: int) -> bool:
    try:
        mark = json.loads((dst / "draft_source.json").read_text())
    except (OSError, ValueError):
        return False
    return mark == {"source": str(src.resolve()), "layers": layers} and (dst / "model.safetensors").is_file()


# -- metrics ------------------------------------------------------------------------


def spec_metrics(url: str) -> dict[str, float] | None:
    """`meshlm_spec_*` samples from /metrics (`name{labels}` -> value); None without /metrics."""
    try:
        r = httpx.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith(SPEC_PREFIX) and "_created" not in line.split(" ", 1)[0]:
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def spec_stats(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """Deltas of the spec counters over one level, with the derived rates; None if there are none."""
    if before is None or after is None or not after:
        return None
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}

    def get(name: str) -> float | None:
        return delta.get(SPEC_PREFIX + name)

    draft, accepted = get("draft_tokens_total"), get("accepted_tokens_total")
    emitted, steps = get("emitted_tokens_total"), get("verify_steps_total")
    out: dict[str, Any] = {
        "draft_tokens": draft, "accepted_tokens": accepted, "emitted_tokens": emitted, "verify_steps": steps,
        "mean_accepted_length": _peer.ratio(emitted, steps),
        "acceptance_rate": _peer.ratio(accepted, draft),
    }  # fmt: skip
    seconds, count = get("verify_step_seconds_sum"), get("verify_step_seconds_count")
    if count:
        out["verify_step_s_mean"] = round(seconds / count, 5) if seconds is not None else None
    per_position = _per_position(delta)
    if per_position:
        out["accepted_per_position"] = per_position
        if steps:
            out["accepted_per_position_frac"] = {p: round(n / steps, 3) for p, n in per_position.items()}
    return out


def _per_position(delta: dict[str, float]) -> dict[str, float]:
    """`meshlm_spec_accepted_per_position_total{position="i"}` deltas -> {i: count}."""
    out: dict[str, float] = {}
    for key, value in delta.items():
        if not key.startswith(SPEC_PREFIX + "accepted_per_position_total{") or 'position="' not in key:
            continue
        position = key.split('position="', 1)[1].split('"', 1)[0]
        out[position] = out.get(position, 0.0) + value
    return dict(sorted(out.items(), key=lambda kv: (len(kv[0]), kv[0])))


# -- one side: a server and its measurements -------------------------------------------


@dataclass
class Side:
    """One server configuration: `pair` groups an off side with its on side."""

    name: str
    pair: str
    role: str  # "off" or "on"
    start: Callable[[], _peer.ServerProcess]
    info: dict[str, Any] = field(default_factory=dict)
    results: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    texts: dict[tuple[str, int], list[str | None]] = field(default_factory=dict)
    failed: bool = False


def run_side(side: Side, args: argparse.Namespace, prompts: dict[tuple[str, int], list[str]]) -> None:
    """Start the side's server, warm it up, measure every level and workload, stop it."""
    server = side.start()
    side.info["flags"] = server.extra.get("flags")
    ok = False
    try:
        side.info["ready_s"] = round(server.wait_ready(args.ready_timeout), 2)
        side.info["openblas_loaded"] = _peer.tree_maps_contain(server.pid, "libopenblas")
        model = server.extra.get("request_model") or _peer.served_model_id(server.url)
        side.info["request_model"] = model
        warm_up(side, server.url, model, args)
        for li, streams in enumerate(args.levels):
            for workload in WORKLOADS:
                measure(side, server, model, workload, streams, prompts[(workload, li)], args)
        ok = not any(r["requests_failed"] for r in side.results.values())
    except Exception as e:  # noqa: BLE001 - keep the other sides' numbers
        side.info["error"] = _peer.describe_error(e)
        side.failed = True
    finally:
        side.info["exit_code"] = server.stop()
        if ok and not args.keep_logs:
            server.remove_log()
        else:
            side.info["log"] = server.log_path
            if not ok:
                side.info["log_tail"] = server.log_tail(15)


def warm_up(side: Side, url: str, model: str | None, args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    results, _ = asyncio.run(_peer.run_load(url, model, [WARMUP_PROMPT], 1, min(args.max_tokens, 32)))
    w = results[0]
    side.info["warmup"] = {"ok": w.ok, "s": round(time.perf_counter() - t0, 2), "completion_tokens": w.tokens}
    if not w.ok:
        raise RuntimeError(f"warm-up request failed: {w.error}")


def measure(side: Side, server: _peer.ServerProcess, model: str | None, workload: str, streams: int,
            prompts: list[str], args: argparse.Namespace) -> None:
    if not server.alive():
        raise RuntimeError(f"{side.name} died (exit code {server.proc.returncode if server.proc else None})")
    before = spec_metrics(server.url)
    with _peer.CpuMeter(server.pid) as cpu:
        results, wall = asyncio.run(
            _peer.run_load(server.url, model, prompts, streams, args.max_tokens, retries=args.retries)
        )
    summary = _peer.summarize(results, wall)
    summary["cpu"] = cpu.result
    if cpu.result.get("server_cpu_s"):  # robust to other load on the machine
        summary["tokens_per_cpu_s"] = round(summary["completion_tokens"] / cpu.result["server_cpu_s"], 2)
    summary["spec"] = spec_stats(before, spec_metrics(server.url))
    if summary["spec"] and summary["spec"]["emitted_tokens"] and summary["completion_tokens"]:
        # the rest were decoded plainly (no draft proposed, speculation off for the row or the step)
        summary["spec"]["output_frac_from_verify"] = round(
            summary["spec"]["emitted_tokens"] / summary["completion_tokens"], 3)
    side.results[(workload, streams)] = summary
    side.texts[(workload, streams)] = [r.text if r.ok else None for r in results]
    spec = summary["spec"] or {}
    print(
        f"[{side.name}] {workload} streams={streams}: {summary['tokens_per_s']} tok/s, "
        f"ttft p50 {summary['ttft_p50']}s, ok {summary['requests_ok']}/{len(results)}"
        + (f", accepted len {spec['mean_accepted_length']}" if spec.get("verify_steps") else "")
        + (" (contended)" if cpu.result.get("contended") else ""),
        file=sys.stderr,
        flush=True,
    )


# -- comparing off with on ------------------------------------------------------------


def compare(off: Side, on: Side, key: tuple[str, int], prompts: list[str]) -> dict[str, Any] | None:
    a, b = off.results.get(key), on.results.get(key)
    if a is None or b is None:
        return None
    out: dict[str, Any] = {
        "off_tokens_per_s": a["tokens_per_s"],
        "on_tokens_per_s": b["tokens_per_s"],
        "tokens_per_s_ratio": _peer.ratio(b["tokens_per_s"], a["tokens_per_s"]),
        "ttft_p50_ratio": _peer.ratio(b["ttft_p50"], a["ttft_p50"]),
        "tpot_p50_ratio": _peer.ratio(b["tpot_p50"], a["tpot_p50"]),
        "tokens_per_cpu_s_ratio": _peer.ratio(b.get("tokens_per_cpu_s"), a.get("tokens_per_cpu_s")),
        "contended": bool(a["cpu"].get("contended") or b["cpu"].get("contended")),
    }
    spec = b.get("spec") or {}
    out["mean_accepted_length"] = spec.get("mean_accepted_length")
    out["acceptance_rate"] = spec.get("acceptance_rate")
    out.update(same_output(off.texts.get(key, []), on.texts.get(key, []), prompts))
    return out


def same_output(off: list[str | None], on: list[str | None], prompts: list[str]) -> dict[str, Any]:
    """Fraction of requests with identical greedy text, and the first pair that differs (truncated)."""
    pairs = [(i, x, y) for i, (x, y) in enumerate(zip(off, on)) if x is not None and y is not None]
    if not pairs:
        return {"same_output_frac": None}
    out: dict[str, Any] = {"same_output_frac": round(sum(x == y for _, x, y in pairs) / len(pairs), 3)}
    for i, x, y in pairs:
        if x != y:
            at = next((k for k, (c, d) in enumerate(zip(x, y)) if c != d), min(len(x), len(y)))
            lo = max(0, at - 40)
            out["first_difference"] = {
                "request": i, "prompt_head": prompts[i][:80], "diverges_at_char": at,
                "off": x[lo:at + 120], "on": y[lo:at + 120],
            }  # fmt: skip
            break
    return out


def targets(comparisons: dict[str, Any], spec_flags: str) -> list[dict[str, Any]]:
    """The meshlm on/off goals (the input-grounded one is stated for ngram speculation)."""
    out = []
    for workload, streams, minimum in TARGETS:
        for key, c in comparisons.get("meshlm", {}).items():
            w, s = key.rsplit("@", 1)
            if w != workload or (streams is not None and int(s) != streams):
                continue
            ratio = c.get("tokens_per_s_ratio")
            out.append({"workload": w, "streams": int(s), "min_ratio": minimum, "ratio": ratio,
                        "met": ratio is not None and ratio >= minimum})
    return [{"spec_flags": spec_flags, "note": "input_grounded goal is for --speculative ngram"}, *out]


# -- setup ----------------------------------------------------------------------------


def needs_draft(args: argparse.Namespace) -> bool:
    return args.peer == "mlx-lm" or "{draft}" in args.spec_flags or _draft_without_path(args.spec_flags)


def _draft_without_path(spec_flags: str) -> bool:
    words = shlex.split(spec_flags)
    drafted = any(w == "draft" and i > 0 and words[i - 1] == "--speculative" for i, w in enumerate(words))
    return (drafted or "--speculative=draft" in words) and not any(w.startswith("--draft-model") for w in words)


def spec_args(spec_flags: str, draft_dir: Path | None) -> list[str]:
    """--spec-flags as argv: `{draft}` -> the built draft; `--speculative draft` alone gets `--draft-model`."""
    words = [w.replace("{draft}", str(draft_dir)) for w in shlex.split(spec_flags)]
    if draft_dir is not None and _draft_without_path(spec_flags):
        words += ["--draft-model", str(draft_dir)]
    return words


def prepare_draft(args: argparse.Namespace, model_dir: Path, report: dict[str, Any]) -> Path:
    """Build (or reuse an up-to-date --draft-dir) the early-exit draft; records how in `report`."""
    dst = Path(args.draft_dir).expanduser() if args.draft_dir else Path(tempfile.mkdtemp(prefix="bench-draft-")) / "m"
    t0 = time.perf_counter()
    reused = draft_is_current(dst, model_dir, args.draft_layers)
    if not reused:
        make_layer_draft(model_dir, dst, args.draft_layers)
    report["draft_model"] = {
        "dir": str(dst), "kept": bool(args.draft_dir), "layers": args.draft_layers,
        "of_layers": json.loads((model_dir / "config.json").read_text()).get("num_hidden_layers"),
        "reused": reused, "build_s": round(time.perf_counter() - t0, 2),
        "bytes": (dst / "model.safetensors").stat().st_size,
        "how": "first N decoder layers of the model, same embedding, final norm and head (early exit)",
    }  # fmt: skip
    return dst


def make_sides(args: argparse.Namespace, model_dir: Path, draft_dir: Path | None) -> list[Side]:
    base = shlex.split(args.meshlm_args)
    on_flags = spec_args(args.spec_flags, draft_dir)
    model = "demo" if args.model == "demo" else str(model_dir)

    def meshlm(flags: list[str]) -> Callable[[], _peer.ServerProcess]:
        return lambda: _peer.start_meshlm(model, dtype=args.dtype, max_batch_size=args.max_batch_size,
                                          extra_args=[*base, *flags])  # fresh --kv-cache-dir each

    def mlx_lm(flags: list[str]) -> Callable[[], _peer.ServerProcess]:
        return lambda: _peer.start_mlx_lm(model_dir, concurrency=max(args.levels), extra_args=flags,
                                          openblas=not args.no_openblas)

    sides = [Side("meshlm-off", "meshlm", "off", meshlm([])), Side("meshlm-on", "meshlm", "on", meshlm(on_flags))]
    if args.peer == "mlx-lm":
        draft = ["--draft-model", str(draft_dir), "--num-draft-tokens", str(args.num_draft_tokens)]
        sides += [Side("mlx-lm-off", "mlx-lm", "off", mlx_lm([])), Side("mlx-lm-draft", "mlx-lm", "on", mlx_lm(draft))]
    return sides


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="model dir, or 'demo' (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", help="meshlm --dtype (and the demo export the peer loads)")
    p.add_argument("--spec-flags", default=DEFAULT_SPEC_FLAGS,
                   help="meshlm flags of the 'on' side ('' = plain); {draft} -> the built draft dir")
    p.add_argument("--meshlm-args", default="", help="extra flags for both meshlm sides, e.g. '--no-prefix-cache'")
    p.add_argument("--max-batch-size", type=int, help="meshlm --max-batch-size (both sides)")
    p.add_argument("--streams", default="1,8", help="comma list of concurrency levels")
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--peer", choices=("mlx-lm",), help="also mlx_lm.server plain vs --draft-model")
    p.add_argument("--draft-layers", type=int, default=8, help="decoder layers of the early-exit draft")
    p.add_argument("--draft-dir", help="where to build (and keep, and reuse) the draft; default: temp dir")
    p.add_argument("--num-draft-tokens", type=int, default=3, help="mlx_lm.server --num-draft-tokens")
    p.add_argument("--no-openblas", action="store_true", help="don't LD_PRELOAD OpenBLAS into the peer")
    _peer.add_run_args(p)
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    args = p.parse_args(argv)
    args.levels = _peer.parse_levels(p, args.streams)
    if args.requests_per_stream < 1 or args.max_tokens < 1 or args.draft_layers < 1:
        p.error("--requests-per-stream, --max-tokens and --draft-layers must be >= 1")
    return args


def build_report(args: argparse.Namespace, sides: list[Side],
                 prompts: dict[tuple[str, int], list[str]]) -> dict[str, Any]:
    """Per-level results, off/on comparisons per pair, targets and contention flags."""
    levels, comparisons = [], {}
    for li, streams in enumerate(args.levels):
        for workload in WORKLOADS:
            key = (workload, streams)
            entry: dict[str, Any] = {"workload": workload, "streams": streams}
            entry.update({s.name: s.results[key] for s in sides if key in s.results})
            for pair in dict.fromkeys(s.pair for s in sides):
                off, on = (next(s for s in sides if s.pair == pair and s.role == r) for r in ("off", "on"))
                c = compare(off, on, key, prompts[(workload, li)])
                if c is not None:
                    entry.setdefault("compare", {})[pair] = c
                    comparisons.setdefault(pair, {})[f"{workload}@{streams}"] = c
            contended = [s.name for s in sides if ((s.results.get(key) or {}).get("cpu") or {}).get("contended")]
            if contended:
                entry["contended"] = contended  # other processes used >10% of the CPUs meanwhile
            levels.append(entry)
    return {"levels": levels, "comparisons": comparisons, "targets": targets(comparisons, args.spec_flags)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _peer.install_signal_handlers()
    # Inherited by the mlx_lm.server peer (start_mlx_lm copies os.environ and preloads OpenBLAS);
    # meshlm sets the same itself when it re-execs with OpenBLAS.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)
    t0 = time.perf_counter()
    model_dir = _peer.resolve_model_dir(args.model, args.dtype)
    prompts = {(w, li): workload_prompts(w, li, streams * args.requests_per_stream, args.seed)
               for li, streams in enumerate(args.levels) for w in WORKLOADS}
    report: dict[str, Any] = {
        "benchmark": "speculative",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _peer.machine_info(),
        "loadavg_before": round(os.getloadavg()[0], 2),
        "model": {"arg": args.model, "dir": str(model_dir), "dtype": args.dtype},
        "config": {
            "spec_flags": args.spec_flags, "meshlm_args": args.meshlm_args, "streams": args.levels,
            "requests_per_stream": args.requests_per_stream, "max_tokens": args.max_tokens, "temperature": 0,
            "workloads": list(WORKLOADS), "seed": args.seed, "peer": args.peer,
            "num_draft_tokens": args.num_draft_tokens if args.peer else None,
            "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
        },  # fmt: skip
    }
    sides: list[Side] = []
    draft_dir: Path | None = None
    try:
        with _peer.recording(report):
            if needs_draft(args):
                draft_dir = prepare_draft(args, model_dir, report)
            sides = make_sides(args, model_dir, draft_dir)
            for side in sides:  # one server at a time
                run_side(side, args, prompts)
    finally:  # after the servers have stopped
        if draft_dir is not None and not args.draft_dir:
            shutil.rmtree(draft_dir.parent, ignore_errors=True)
    report["servers"] = {s.name: s.info for s in sides}
    if args.peer == "mlx-lm":
        report["peer_notes"] = list(PEER_NOTES)
    report.update(build_report(args, sides, prompts))
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    failed = report.get("interrupted") or report.get("error") or any(s.failed for s in sides) or any(
        r["requests_failed"] for s in sides for r in s.results.values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
