"""Loading a model directory (or the built-in demo) into an mlx-lm model + tokenizer."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import sharded_load

from meshlm.config import ModelConfig
from meshlm.model import cpu_kernels
from meshlm.platform import cores_for_this_process, resolve_dtype

log = logging.getLogger(__name__)


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


def resolve_path(path: str, dtype: str = "float32") -> Path:
    if path == "demo":
        from meshlm.model.demo import demo_model_dir

        return demo_model_dir()
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is not a model directory (no config.json); pass a HF-layout directory or 'demo'")
    return p


def model_fingerprint(path: Path) -> str:
    """Digest of config.json and each weight file's name, size and safetensors header."""
    h = hashlib.blake2b(digest_size=12)
    h.update((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            h.update(f"{f.name}:{f.stat().st_size}".encode())
            h.update(fh.read(65536))
    return h.hexdigest()


def load_model(cfg: ModelConfig, tensor_group=None) -> LoadedModel:
    """Load the whole model, or with `tensor_group` only this rank's shard (mlx-lm's sharded_load)."""
    path = resolve_path(cfg.path)
    if tensor_group is None:
        model, tokenizer = mlx_lm_load(str(path))
    else:
        model, tokenizer = sharded_load(str(path), tensor_group=tensor_group)
    config = json.loads((path / "config.json").read_text())
    native = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    dtype = resolve_dtype(cfg.dtype, native if native in ("float16", "bfloat16", "float32") else "float32")
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    if cfg.cpu_kernels:
        cpu_kernels.install(model, cores_for_this_process(), cfg.native_kernels)
    context = int(config.get("max_position_embeddings") or 4096)
    eos = frozenset(int(t) for t in (tokenizer.eos_token_ids or ()))
    name = cfg.served_name or ("demo" if cfg.path == "demo" else path.name)
    log.info("loaded %s (%s, dtype %s, context %d)", path, name, dtype, context)
    return LoadedModel(model, tokenizer, path, name, dtype, context, eos, model_fingerprint(path))
