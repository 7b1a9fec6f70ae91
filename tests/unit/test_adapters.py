"""--adapter-path: an mlx-lm adapter fused into the weights gives mlx-lm's own (unfused) outputs, changes the
fingerprint, and a bad adapter is refused at start-up naming the flag."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from meshlm.config import ModelConfig
from meshlm.model.demo import make_tiny, make_tiny_adapter
from meshlm.model.loader import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    model = make_tiny(root / "tiny", "qwen3", layers=2, hidden=64)
    return model, make_tiny_adapter(model, root / "lora"), make_tiny_adapter(model, root / "dora", seed=2,
                                                                              fine_tune_type="dora")


@pytest.mark.parametrize("which", [1, 2])  # LoRA, DoRA
def test_a_fused_adapter_computes_what_mlx_lm_computes_unfused(tiny, which):
    from mlx_lm import load

    model, adapter = tiny[0], tiny[which]
    ids = mx.array([[5, 17, 99, 3, 250, 42, 7, 8]])
    want = load(str(model), adapter_path=str(adapter))[0](ids)
    base = load(str(model))[0](ids)
    loaded = load_model(ModelConfig(str(model), adapter_path=str(adapter)))
    got = loaded.model(ids)
    assert float(mx.abs(want - base).max()) > 0.1  # the adapter changes the model
    # W + scale * B^T A^T rounds otherwise than x W + scale * (x A) B: logits of magnitude ~6 within 5e-4
    np.testing.assert_allclose(np.array(got), np.array(want), atol=5e-4)
    assert not any("lora" in name for name, _ in loaded.model.named_modules())  # plain layers again


def test_the_adapter_is_part_of_the_fingerprint(tiny):
    model, lora, dora = tiny
    prints = {load_model(ModelConfig(str(model), adapter_path=a)).fingerprint for a in (None, str(lora), str(dora))}
    assert len(prints) == 3


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "adapters.safetensors").unlink(), "no adapters.safetensors"),
    (lambda d: (d / "adapter_config.json").write_text("{"), "not readable JSON"),
    (lambda d: (d / "adapter_config.json").write_text("[]"), "not a JSON object"),
    (lambda d: _config(d, fine_tune_type="qlora"), "fine_tune_type 'qlora'"),
    (lambda d: _config(d, num_layers=0), "num_layers"),
    (lambda d: _config(d, lora_parameters={"rank": 10**9, "scale": 1.0}), "rank must be an integer"),
    (lambda d: _config(d, lora_parameters={"rank": 4, "scale": float("nan")}), "scale must be a finite"),
    (lambda d: _config(d, lora_parameters={"rank": 8, "scale": 1.0, "keys": ["self_attn.q_proj"]}),
     "does not fit this model"),  # shapes of another rank
    (lambda d: mx.save_safetensors(str(d / "adapters.safetensors"), {"model.norm.weight": mx.zeros((64,))}),
     "does not fit this model"),  # not an adapter's tensor
    # served with that layer's random start (another answer at every start) or silently unadapted
    (lambda d: _without(d, "model.layers.1.self_attn.q_proj.lora_a"), "lacks model.layers.1.self_attn.q_proj.lora_a"),
    (lambda d: _without(d, "model.layers.0.self_attn.v_proj.lora_b"), "lacks model.layers.0.self_attn.v_proj.lora_b"),
    # fused into weights of 1e9 and more: served, every answer garbage
    (lambda d: _as_int(d, "model.layers.0.self_attn.q_proj.lora_a"), "lora_a is int32, not a floating-point type"),
])
def test_a_bad_adapter_is_refused_naming_the_flag(tiny, tmp_path, damage, words):
    bad = shutil.copytree(tiny[1], tmp_path / "bad")
    damage(bad)
    with pytest.raises(ValueError, match="--adapter-path") as info:
        load_model(ModelConfig(str(tiny[0]), adapter_path=str(bad)))
    assert words in str(info.value)


def _config(d, **changes):
    path = d / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _without(d, name):
    path = d / "adapters.safetensors"
    weights = mx.load(str(path))
    assert name in weights, sorted(weights)
    del weights[name]
    mx.save_safetensors(str(path), weights)


def _as_int(d, name):
    path = d / "adapters.safetensors"
    weights = mx.load(str(path))
    weights[name] = (weights[name] * 1000).astype(mx.int32)
    mx.save_safetensors(str(path), weights)
