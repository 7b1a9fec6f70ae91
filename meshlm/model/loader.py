"""Loading a model directory (or the built-in demo) into an mlx-lm model + tokenizer."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from meshlm.config import ModelConfig
from meshlm.model.adapt import check_supported
from meshlm.model.adapters import FILES as ADAPTER_FILES, apply_adapter
from meshlm.model.chat_templates import adopt_tool_parser
from meshlm.model.vocab_parallel import shard_vocab_head
from meshlm.platform import cache_root, default_device_is_gpu, import_mlx_lm, resolve_dtype

log = logging.getLogger(__name__)

HASH_CHUNK = 8 * 2**20
DIGEST_CACHE_FILE = "weight-digests.json"
DIGEST_CACHE_VERSION = 2  # 2: entries name the inode and ctime too
DIGEST_CACHE_MAX_ENTRIES = 512  # old entries (models deleted, test dirs) go first
DIGEST_CACHE_MAX_BYTES = 16 << 20  # ~100x what 512 entries take: a larger file is not ours
# What must match for a cached digest to stand for a file's bytes. Size and mtime alone missed a file
# rewritten in place with its mtime kept (`cp -p`, `rsync -a`, `tar` of a same-shape fine-tune): its old
# digest salted the new weights' prefix cache, which then served the old model's KV. No call sets ctime.
_STAT_FIELDS = ("size", "mtime_ns", "ino", "ctime_ns")


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    path: Path
    name: str
    dtype: str
    context_length: int  # the model's own limit
    eos_token_ids: frozenset[int]
    fingerprint: str  # identifies the weights; salts prefix-cache keys
    vocab_size: int  # rows of the embedding: every token id must be below it
    generation_defaults: dict  # sampling keys of generation_config.json (temperature, top_p, ...), maybe empty


def read_config(path: Path) -> dict:
    """A model directory's config.json; a file that is not a JSON object is a ValueError naming it."""
    return read_json_object(path / "config.json")


def read_json_object(file: Path) -> dict:
    """One of the model's JSON files, which must hold an object: else a ValueError naming it."""
    try:
        content = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # Recursion: nested 200,000 deep
        raise ValueError(f"{file} is not readable JSON: {exc}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{file} is not a JSON object")
    return content


def check_model_json(path: Path, config: dict) -> None:
    """What mlx-lm and transformers would trip on in the model's JSON, checked first: a generation_config.json
    that is not an object ('AttributeError: list object has no attribute get'), an eos_token_id that is
    not an id or a list of ids ('unhashable type: list', blamed on config.json), no layers, no vocabulary,
    a rope_theta of 0 ('math domain error'); each in a sentence naming the file and the field."""
    files = [(path / "config.json", config)]
    gen = path / "generation_config.json"
    if gen.is_file():
        files.append((gen, read_json_object(gen)))
    for file, content in files:
        eos = content.get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos]
        if eos is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {str(eos)[:60]}")
    for key in ("num_hidden_layers", "vocab_size", "max_position_embeddings"):  # the last: 0 was served as 4096
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{path / 'config.json'}: {key} must be a positive integer, got {str(value)[:40]}")
    theta = config.get("rope_theta")
    if theta is not None and (not isinstance(theta, (int, float)) or isinstance(theta, bool)
                              or not 0 < theta < float("inf")):
        raise ValueError(f"{path / 'config.json'}: rope_theta must be a positive number, got {str(theta)[:40]}")


# Quantization methods whose checkpoints mlx-lm repacks from their own tensors (`*.qweight`, `*.scales`).
REPACKED_METHODS = ("awq", "gptq")
SAFETENSORS_HEADER_LIMIT = 100 * 2**20  # bytes of a header's JSON read at most


def check_weight_files(path: Path) -> None:
    """Every *.safetensors a regular file (or a link to one): a directory of that name failed in MLX's reader
    as '[read] Unable to read 8 bytes from file'."""
    for file in sorted(path.glob("*.safetensors")):
        if not file.is_file():
            kind = "a directory" if file.is_dir() else "not a regular file (a broken link?)"
            raise ValueError(f"{file} is {kind}; the weights must be .safetensors files")


def check_quantization(path: Path, config: dict) -> None:
    """A config.json that declares AWQ or GPTQ weights over a checkpoint holding none: mlx-lm then failed
    with 'UnboundLocalError: cannot access local variable model_dtype'."""
    q = config.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    if isinstance(q, dict) and method is None and "quantization" not in config:
        # mlx-lm writes its own quantization as both keys; with only this copy it fails 'KeyError: quant_method'
        raise ValueError(f"{path / 'config.json'}: quantization_config has no quant_method, and there is no "
                         "`quantization` (mlx-lm's own key, with bits and group_size): restore that key, or "
                         "name the method")
    if method not in REPACKED_METHODS:
        return
    for file in sorted(path.glob("*.safetensors")):
        if any(k.endswith(".qweight") for k in safetensors_keys(file)):
            return
    raise ValueError(f"{path / 'config.json'}: quantization_config.quant_method is {method!r}, but no weight in "
                     f"{path} is a packed {method} tensor (*.qweight): the weights and config.json disagree")


def safetensors_keys(file: Path) -> list[str]:
    """The tensor names a .safetensors file's header lists, read without its tensors; [] for a file that is
    not one (MLX's loader then names it)."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= SAFETENSORS_HEADER_LIMIT:
                return []
            header = json.loads(f.read(size))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return []
    return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []


def resolve_path(path: str, dtype: str = "float32") -> Path:
    if path == "demo":
        from meshlm.model.demo import demo_model_dir

        return demo_model_dir()
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is not a model directory (no config.json); pass a HF-layout directory or 'demo'")
    return p


def model_fingerprint(path: Path, digest_cache: Path | None = None) -> str:
    """Digest of config.json and every byte of every *.safetensors file (with its name).

    It salts the prefix cache's keys, so two models differing in any weight
    byte never share KV blocks. The tokenizer is left out: KV depends on token
    ids, which the keys hash. Hashing reads all the weights once; each file's
    digest is then cached by (resolved path, size, mtime, inode, ctime) in `digest_cache`
    (default `<meshlm cache dir>/weight-digests.json`), so restarts skip it.
    """
    files = sorted(path.glob("*.safetensors"))
    digests = weight_digests(files, digest_cache or default_digest_cache())
    config = (path / "config.json").read_bytes()
    h = hashlib.blake2b(digest_size=12)
    h.update(f"config.json:{len(config)}:".encode())  # length-prefixed: no two inputs concatenate alike
    h.update(config)
    for f in files:
        h.update(f"{f.name}:{digests[f]};".encode())
    return h.hexdigest()


def default_digest_cache() -> Path:
    return cache_root() / DIGEST_CACHE_FILE


def hash_file(path: Path, chunk: int = HASH_CHUNK) -> str:
    """blake2b of the whole file, read in chunks (weights do not fit in RAM twice)."""
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while data := f.read(chunk):
            h.update(data)
    return h.hexdigest()


def weight_digests(files: list[Path], cache_path: Path) -> dict[Path, str]:
    """Each file's digest, from `cache_path` when its resolved path and `_STAT_FIELDS` match, else hashed.

    Side effect: newly hashed files are added to `cache_path`; a cache that cannot be
    read or written only costs hashing again, never an error.
    """
    cache = read_digest_cache(cache_path)
    digests: dict[Path, str] = {}
    todo: list[tuple[Path, str, os.stat_result]] = []
    for f in files:
        st, key = f.stat(), str(f.resolve())
        entry = cache.get(key)
        if entry is not None and tuple(entry[k] for k in _STAT_FIELDS) == _stat_key(st):
            digests[f] = entry["digest"]
        else:
            todo.append((f, key, st))
    if todo:
        hashed, entries = _hash_files(todo)
        digests.update(hashed)
        write_digest_cache(cache_path, entries)
    return digests


def _hash_files(todo: list[tuple[Path, str, os.stat_result]]) -> tuple[dict[Path, str], dict[str, dict]]:
    """Hash `todo`: (digest per file, cache entries by resolved path). A file that changed while
    being read gets no entry: its digest may mix old and new bytes."""
    total = sum(st.st_size for _, _, st in todo)
    log.info("hashing %.1f GB of weights in %s for the cache fingerprint (once; cached by size, times, inode)",
             total / 1e9, todo[0][0].parent)
    t0 = time.monotonic()
    digests: dict[Path, str] = {}
    entries: dict[str, dict] = {}
    for f, key, st in todo:
        digests[f] = hash_file(f)
        if _stat_key(f.stat()) == _stat_key(st):
            entries[key] = {**dict(zip(_STAT_FIELDS, _stat_key(st))), "digest": digests[f]}
        else:
            log.warning("%s changed while being hashed; its digest is not cached", f)
    log.info("hashed %.1f GB of weights in %.1f s", total / 1e9, time.monotonic() - t0)
    return digests, entries


def read_digest_cache(path: Path) -> dict[str, dict]:
    """The valid entries of the digest cache; {} when it is missing or corrupt (then it is rewritten)."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > DIGEST_CACHE_MAX_BYTES:  # opening a FIFO waited for ever
            raise ValueError("not a regular file of at most "
                             f"{DIGEST_CACHE_MAX_BYTES >> 20} MiB")
        data = json.loads(path.read_text())
    except FileNotFoundError:
        log.debug("no weight digest cache at %s yet", path)
        return {}
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: "[" nested 200,000 deep
        log.warning("ignoring unreadable weight digest cache %s: %s", path, exc)
        return {}
    files = data.get("files") if isinstance(data, dict) and data.get("version") == DIGEST_CACHE_VERSION else None
    if not isinstance(files, dict):
        log.warning("ignoring weight digest cache %s: not a version-%d cache", path, DIGEST_CACHE_VERSION)
        return {}
    return {k: v for k, v in files.items() if _valid_entry(v)}


def _valid_entry(entry: object) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("digest"), str)
            and all(type(entry.get(k)) is int for k in _STAT_FIELDS))


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def write_digest_cache(path: Path, new: dict[str, dict]) -> None:
    """Merge `new` into the cache file atomically (temp file + os.replace); failures are logged, not raised.

    The file is re-read first so entries another process added meanwhile are kept;
    entries of files that no longer exist are pruned, and the oldest past the cap.
    """
    if not new:
        return
    entries = {k: v for k, v in read_digest_cache(path).items() if k not in new and os.path.exists(k)}
    entries.update(new)  # newest last: the cap keeps the tail
    entries = dict(list(entries.items())[-DIGEST_CACHE_MAX_ENTRIES:])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The serving user's alone (it lists the model files served): no other user's to read or replace
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w") as f:
            f.write(json.dumps({"version": DIGEST_CACHE_VERSION, "files": entries}, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot cache weight digests in %s (the next start hashes again): %s", path, exc)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


@dataclass(frozen=True)
class StageSlice:
    """The part of a model one pipeline stage holds: layers [first, end), the embedding on the stage that
    embeds, the final norm and head on the stage that computes logits (with tied embeddings, the
    embedding table there too: it is the head)."""

    first: int
    end: int
    embeds: bool
    logits: bool


def check_tokenizer(tokenizer, path: Path) -> None:
    """A model directory without its tokenizer files still loads: transformers builds a tokenizer of the
    special tokens alone, which turns every prompt into nothing (each request then a 400). Refused here."""
    if not tokenizer.encode("hello world", add_special_tokens=False):
        size = len(getattr(tokenizer, "_tokenizer", tokenizer))  # mlx-lm's wrapper holds the HF tokenizer
        raise ValueError(f"the tokenizer in {path} turns text into no tokens ({size} in its vocabulary): are "
                         "its tokenizer files (tokenizer.json, tokenizer.model) missing?")


def load_model(cfg: ModelConfig, tensor_group=None, stage: StageSlice | None = None) -> LoadedModel:
    """Load the whole model; with `tensor_group` only this rank's shard; with `stage` only that stage's
    weights (loaded lazily, the rest never read).

    A shard is loaded as mlx-lm's sharded_load does (lazily, then the model's own `shard`), but without
    its closing all_sum: that barrier waited for ever for a rank stopped or stalled while loading (its
    kernel still answers the keepalives). The control plane's LOADED handshake is the barrier instead,
    with a deadline and the late rank's name (cluster/ranks.py)."""
    # Imported here: mlx-lm imports transformers (~0.9 s), which reading a config.json before a cluster's
    # ranks start (cluster/ranks.py) does not need.
    mlx_lm_utils = import_mlx_lm("mlx_lm.utils")

    path = resolve_path(cfg.path)
    config = read_config(path)
    check_supported(config)
    check_model_json(path, config)
    check_weight_files(path)
    check_quantization(path, config)
    # mlx-lm's `load`, in its two parts, so that an error names the part at fault: a tokenizer.json of {}
    # raised KeyError 'added_tokens', reported as config.json's.
    try:  # lazily for a shard or a stage: only their weights are then read
        model, model_json = mlx_lm_utils.load_model(path, lazy=tensor_group is not None or stage is not None)
    except RuntimeError as exc:  # MLX's loaders: a truncated or corrupt weights file, which it names
        raise ValueError(f"cannot load the weights in {path}: {_in_a_line(str(exc))}") from None
    # mlx-lm's ModelArgs: a config.json without a field the model needs, or a size MLX cannot hold (int32)
    except (TypeError, KeyError, OverflowError) as exc:
        raise ValueError(f"cannot build the model of {path / 'config.json'}: {type(exc).__name__}: "
                         f"{_in_a_line(str(exc))}") from None
    except Exception as exc:  # transformers' and mlx-lm's own checks of the JSON files (a field of the wrong
        # type in config.json, a generation_config.json that is not an object): the model's files, not a bug
        raise ValueError(f"cannot load the model in {path}: {type(exc).__name__}: {_in_a_line(str(exc))}"
                         f"{_missing_shards(path)}") from None
    try:
        tokenizer = mlx_lm_utils.load_tokenizer(path, eos_token_ids=model_json.get("eos_token_id"))
    except Exception as exc:  # transformers' and tokenizers' readers of the tokenizer files
        raise ValueError(f"cannot load the tokenizer in {path} (transformers reads tokenizer.json, tokenizer_config.json "
                         f"and config.json): {type(exc).__name__}: {_in_a_line(str(exc))}") from None
    check_tokenizer(tokenizer, path)
    parser = adopt_tool_parser(tokenizer)
    if parser is not None:
        log.info("tool calls: the %s syntax of the model's tool_use chat template", parser)
    check_weight_types(model, path)
    # Beside the tokenizer's other check, before a shard's or a stage's (lazy) weights are read.
    eos = frozenset(int(t) for t in (tokenizer.eos_token_ids or ()))
    outside = sorted(t for t in eos if not 0 <= t < int(config["vocab_size"]))
    if outside:  # never sampled: every answer would run to max_tokens, and grammars cannot be built
        raise ValueError(f"{path}: end-of-sequence token id(s) {outside} are outside the model's vocabulary of "
                         f"{config['vocab_size']} (config.json / generation_config.json)")
    adapter = None
    if cfg.adapter_path is not None:  # fused before any shard or stage is cut: they are cut from its weights
        apply_adapter(model, Path(cfg.adapter_path), import_mlx_lm("mlx_lm.tuner.utils").load_adapters)
        check_weight_types(model, Path(cfg.adapter_path))  # a full fine-tune's own weights
        adapter = "".join(hash_file(Path(cfg.adapter_path) / name)[:8] for name in ADAPTER_FILES)
    if tensor_group is not None:
        if not hasattr(model, "shard"):
            raise ValueError(f"{path}: mlx-lm's {type(model).__module__} has no tensor-parallel `shard`")
        try:
            model.shard(tensor_group)
        except (ValueError, RuntimeError) as exc:  # MLX's own words name neither the flag nor the cause
            raise ValueError(f"{path}: cannot split the model over --tensor-parallel {tensor_group.size()}: "
                             f"{_in_a_line(str(exc))} (a quantized layer's inputs split over the ranks must "
                             "stay a multiple of its group size: fewer ranks, or --pipeline-parallel)") from None
        if shard_vocab_head(model, tensor_group):
            log.info("tensor parallelism: the LM head is split by vocabulary over %d ranks", tensor_group.size())
    if stage is not None:
        keep_stage(model, stage)
    native = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    dtype = resolve_dtype(cfg.dtype, native if native in ("float16", "bfloat16", "float32") else "float32")
    fingerprint, what = model_fingerprint(path), f"dtype {dtype}"
    if adapter is not None:  # another model: neither the base model's KV nor another adapter's applies
        fingerprint, what = f"{fingerprint}+adapter-{adapter}", f"{what}, adapter {cfg.adapter_path} fused"
    if dtype in ("bfloat16", "float16") and not default_device_is_gpu():
        # MLX's half-precision GEMMs are slow on the CPU: the weights are rounded to `dtype` once and the
        # model computes in float32 (KV too). The packed kernels then hold the rounded layers in 16 bits.
        # Rounding changed the weights where any is stored otherwise: their KV is not the float32 model's.
        # By the tensors, not config.json's torch_dtype: older mlx-lm conversions store float16 scales under
        # "bfloat16", and such a model's bf16 run reused the float32 run's cached KV (another answer).
        stored = {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
        model.set_dtype(getattr(mx, dtype))
        if stored - {getattr(mx, dtype)}:
            fingerprint += {"bfloat16": "+bf16-weights", "float16": "+fp16-weights"}[dtype]
        dtype, what = "float32", f"{dtype} weights, float32 compute"
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters(), _held_arrays(model))
    context = int(config.get("max_position_embeddings") or 4096)
    # The directory's own name, also for `--model .` (whose Path name is "")
    name = cfg.served_name or ("demo" if cfg.path == "demo" else path.resolve().name or str(path))
    log.info("loaded %s (%s, %s, context %d)", path, name, what, context)
    return LoadedModel(model, tokenizer, path, name, dtype, context, eos, fingerprint,
                       int(config["vocab_size"]), generation_defaults(path))


def check_weight_types(model: nn.Module, path: Path) -> None:
    """Every weight floating-point, but a quantized layer's packed integers. MLX loads integer tensors as
    they are, and the model then failed every request at its first norm ('[rms_norm] Received unsupported
    type int32'), a 500 for each, after a start that said nothing."""
    for name, module in model.named_modules():
        for key, value in module.items():
            if key.startswith("_") or not isinstance(value, mx.array) or mx.issubdtype(value.dtype, mx.floating):
                continue
            if key == "weight" and hasattr(module, "bits"):  # QuantizedLinear / QuantizedEmbedding's packing
                continue
            # mxfp4, nvfp4, mxfp8: their scales are 8-bit exponents (mlx-lm loads and runs them)
            if key == "scales" and hasattr(module, "bits") and getattr(module, "mode", "affine") != "affine":
                continue
            raise ValueError(f"{path}: the weight {name}.{key} is {str(value.dtype).removeprefix('mlx.core.')}, "
                             "not a floating-point type (nor a quantized layer's packed weights)")


def _held_arrays(model: nn.Module) -> list[mx.array]:
    """Arrays modules hold beside their parameters: mlx-lm's llama3, yarn, longrope and proportional RoPEs
    keep their frequencies as `_freqs`, built lazily on this thread. Left unevaluated, the engine thread's
    first forward evaluated a graph of this thread's stream, and every request failed ('There is no
    Stream(cpu, 0) in current thread')."""
    return [v for m in model.modules() for k, v in m.items() if k.startswith("_") and isinstance(v, mx.array)]


def _in_a_line(text: str, limit: int = 400) -> str:
    """An error's text on one line, cut at `limit`: mlx-lm names the missing or extra tensors on the lines
    after its first ('Missing 1 parameters: \\nmodel.layers.3.mlp.down_proj.weight.'), which were cut off."""
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return line if len(line) <= limit else line[:limit] + " ..."


def _missing_shards(path: Path) -> str:
    """Where an index names weight files the directory lacks (a cut download), say which."""
    try:
        files = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return ""
    missing = sorted(str(f) for f in files if not (path / str(f)).is_file())
    return f" (model.safetensors.index.json names {', '.join(missing[:3])}, not in the directory)" if missing else ""


def keep_stage(model: nn.Module, stage: StageSlice) -> None:
    """Drop every module `stage` does not hold, before any weight is evaluated (so never read)."""
    inner = model.model
    total = len(inner.layers)
    if not 0 <= stage.first < stage.end <= total:
        raise ValueError(f"stage layers {stage.first}..{stage.end} outside the model's {total}")
    tied = getattr(model.args, "tie_word_embeddings", False) or "lm_head" not in model
    inner.layers = inner.layers[stage.first:stage.end]
    model.meshlm_stage = (stage, total, tied)  # model_parts reads it
    if not stage.embeds and not (stage.logits and tied):
        del inner["embed_tokens"]
    if not stage.logits:
        del inner["norm"]
        if "lm_head" in model:
            del model["lm_head"]


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(path: Path) -> dict:
    """The sampling defaults a model ships in generation_config.json (as vLLM reads them); {} without one."""
    try:
        config = json.loads((path / "generation_config.json").read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path / 'generation_config.json'} is not readable JSON: {exc}") from None
    defaults = {k: config[k] for k in SAMPLING_KEYS if isinstance(config, dict) and config.get(k) is not None}
    if defaults.get("top_k") == -1:  # off, as vLLM and the request API read it (many exports write -1)
        defaults["top_k"] = 0
    return defaults
