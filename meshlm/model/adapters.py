"""`--adapter-path`: an mlx-lm fine-tuned adapter (LoRA, DoRA or full, as `mlx_lm.lora` writes it:
`adapter_config.json` and `adapters.safetensors`), fused into the model's weights at load time.

Fused as `mlx_lm.fuse` does, so the model is plain linear layers again: a step costs what the base model's
does, and tensor-parallel shards and pipeline stages are cut from the fused weights by the same code
(a layer a stage drops is never computed). Quantized layers are re-quantized after fusing, as `mlx_lm.fuse`
without `--dequantize`. The adapter's files are part of the model's fingerprint: the prefix cache of the base
model (or of another adapter) is never read, and every rank must hold the same adapter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

FILES = ("adapter_config.json", "adapters.safetensors")
MAX_RANK = 4096  # lora_parameters.rank: matrices of in_dims x rank are made before any weight is checked
FINE_TUNE_TYPES = ("lora", "dora", "full")
ADAPTER_LEAVES = ("lora_a", "lora_b", "m")  # what a LoRA or DoRA layer holds beside the base weights


def check_adapter(path: Path) -> dict:
    """The adapter's config, checked before anything is built from it. Raises ValueError naming the problem."""
    for name in FILES:
        if not (path / name).is_file():
            raise ValueError(f"--adapter-path {path}: no {name} (mlx_lm.lora writes adapter_config.json and "
                             "adapters.safetensors)")
    try:
        config = json.loads((path / FILES[0]).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"--adapter-path {path}: {FILES[0]} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--adapter-path {path}: {FILES[0]} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in FINE_TUNE_TYPES:
        raise ValueError(f"--adapter-path {path}: fine_tune_type {str(kind)[:40]!r} is not one of "
                         f"{', '.join(FINE_TUNE_TYPES)}")
    if kind != "full":
        layers = config.get("num_layers")
        params = config.get("lora_parameters")
        if not isinstance(layers, int) or isinstance(layers, bool) or not (layers == -1 or layers >= 1):
            raise ValueError(f"--adapter-path {path}: num_layers must be a positive integer or -1")
        if not isinstance(params, dict):
            raise ValueError(f"--adapter-path {path}: lora_parameters must be an object (rank, scale)")
        rank, scale = params.get("rank"), params.get("scale")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
            raise ValueError(f"--adapter-path {path}: lora_parameters.rank must be an integer in 1..{MAX_RANK}")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
            raise ValueError(f"--adapter-path {path}: lora_parameters.scale must be a finite number")
    return config


def apply_adapter(model: nn.Module, path: Path, load_adapters) -> None:
    """Load the adapter into `model` (mlx-lm's `load_adapters`, which checks every tensor's name and shape)
    and fuse it into the weights, lazily: nothing is computed until the model's weights are evaluated."""
    config = check_adapter(path)
    try:
        load_adapters(model, str(path))
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as exc:  # incompatible or unreadable tensors
        raise ValueError(f"--adapter-path {path} does not fit this model: {exc}") from None
    if config.get("fine_tune_type", "lora") != "full":  # a full fine-tune may hold only the layers it trained
        _require_every_adapter_tensor(model, path)
    # An integer lora_a or lora_b fused into float weights of 1e9 and more: every answer garbage, no error
    for name, value in tree_flatten(model.parameters()):
        if name.rsplit(".", 1)[-1] in ADAPTER_LEAVES and not mx.issubdtype(value.dtype, mx.floating):
            raise ValueError(f"--adapter-path {path}: {name} is {str(value.dtype).removeprefix('mlx.core.')}, not "
                             "a floating-point type")
    fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))


def _require_every_adapter_tensor(model: nn.Module, path: Path) -> None:
    """mlx-lm loads what the file holds and leaves the rest of its LoRA layers as made: a missing lora_a kept
    its random start (another answer at every start, and on every rank of a cluster), a missing lora_b
    its zeros (that layer silently not adapted)."""
    with open(path / FILES[1], "rb") as f:  # its header's names: load_adapters has read the file whole
        held = set(json.loads(f.read(int.from_bytes(f.read(8), "little")))) - {"__metadata__"}
    wanted = {name for name, _ in tree_flatten(model.parameters()) if name.rsplit(".", 1)[-1] in ADAPTER_LEAVES}
    missing = sorted(wanted - held)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(f"--adapter-path {path}: {FILES[1]} lacks {shown}, which its adapter_config.json's "
                         "layers need")
