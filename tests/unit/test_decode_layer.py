"""The fused decode layer (model/decode_layer.py, `_cpu_ops.decode_layer`): a step of decode rows run as
one node per layer gives the module path's logits and KV bit for bit, on every family and panel type;
layers it cannot compute are left to the modules; the pools are updated in place."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from meshlm.config import CacheConfig, ModelConfig
from meshlm.engine.plan import LOGITS_ALL, LOGITS_LAST, Chunk, NewSequence, StepPlan, TableUpdate
from meshlm.executor.rank import RankState, build_rank
from meshlm.model import cpu_kernels, decode_layer, demo
from meshlm.model.loader import load_model

NATIVE, NATIVE_STATUS = cpu_kernels.native_ops()
pytestmark = pytest.mark.skipif(NATIVE is None or not NATIVE.packed_gemm, reason=str(NATIVE_STATUS))

BS = 4
BLOCKS_PER_ROW = 6
PROMPTS = [[5, 17, 42, 9, 100, 7, 3, 64, 11], [6, 18, 43], [7, 19], [8, 20, 44, 90, 91]]


def make_rank(path, fused: bool) -> RankState:
    cfg = ModelConfig(str(path), fused_decode=fused)
    return build_rank(load_model(cfg), cfg, CacheConfig(enabled=False, ssd=False, block_size=BS), 2**22)


def plans() -> list[StepPlan]:
    """Prefill of every prompt; decode steps; a step where each row verifies three tokens (split into
    decode rows, two of one sequence attending to the one before); a step mixing a new prompt with
    decode rows (the module path), and decode steps again over what both paths wrote."""
    n = len(PROMPTS)
    lengths = {u: len(p) for u, p in enumerate(PROMPTS)}
    out = [StepPlan(0, new=tuple(NewSequence(u, 0) for u in range(n)),
                    chunks=tuple(Chunk(u, 0, tuple(p), LOGITS_LAST) for u, p in enumerate(PROMPTS)),
                    tables=tuple(TableUpdate(u, tuple(range(u * BLOCKS_PER_ROW, (u + 1) * BLOCKS_PER_ROW)))
                                 for u in range(n)),
                    num_blocks=(n + 1) * BLOCKS_PER_ROW)]

    def step(chunks, **kw) -> None:
        out.append(StepPlan(len(out), chunks=tuple(chunks), num_blocks=(n + 1) * BLOCKS_PER_ROW, **kw))
        for c in chunks:
            lengths[c.uid] = c.start + len(c.token_ids)

    for t in range(3):
        step([Chunk(u, lengths[u], (30 + 7 * u + t,), LOGITS_LAST) for u in range(n)])
    step([Chunk(u, lengths[u], (50 + u, 60 + u, 70 + u), LOGITS_ALL) for u in range(n)])
    newcomer = n
    step([Chunk(u, lengths[u], (80 + u,), LOGITS_LAST) for u in range(n)]
         + [Chunk(newcomer, 0, (9, 8, 7, 6, 5), LOGITS_LAST)],
         new=(NewSequence(newcomer, 0),),
         tables=(TableUpdate(newcomer, tuple(range(n * BLOCKS_PER_ROW, (n + 1) * BLOCKS_PER_ROW))),))
    for t in range(3):
        step([Chunk(u, lengths[u], (90 + u + t,), LOGITS_LAST) for u in range(n + 1)])
    return out


def run(rank: RankState) -> tuple[list[np.ndarray], list[np.ndarray]]:
    logits = []
    for plan in plans():
        result = rank.step(plan)
        mx.eval(result.logits)
        logits.append(np.array(result.logits))
    store = rank.runner.store
    mx.eval(store.keys, store.values)
    return logits, [np.array(a) for a in store.keys + store.values]


@pytest.mark.parametrize("split", [False, True], ids=["one-rank", "split"])
@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fused_decode_steps_equal_the_module_path_bit_for_bit(tmp_path, model_type, stored, split, monkeypatch):
    """`split`: each layer cut at its sums as under tensor parallelism, here over a group of one rank (real
    tensor-parallel ranks: tests/integration/test_tensor_parallel.py)."""
    check_bit_for_bit(demo.make_tiny(tmp_path, model_type=model_type, seed=5, dtype=stored), split, monkeypatch)


@pytest.mark.parametrize("split", [False, True], ids=["one-rank", "split"])
def test_a_biased_o_projection_is_added_where_the_module_adds_it(tmp_path, split, monkeypatch):
    """llama with `attention_bias`: q/k/v and o carry biases; a split layer adds o's after the sum."""
    path = with_attention_bias(demo.make_tiny(tmp_path, seed=6))
    rank = make_rank(path, fused=True)
    assert all(f.o_bias is not None and f.qkv_bias is not None for f in rank.runner.parts.decode_layers)
    check_bit_for_bit(path, split, monkeypatch)


def with_attention_bias(path):
    """The tiny llama at `path` with random q/k/v/o biases (`attention_bias`), as some llama checkpoints have."""
    import json

    config = json.loads((path / "config.json").read_text())
    config["attention_bias"] = True
    (path / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(path / "model.safetensors"))
    key = mx.random.key(7)
    for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))]:
        key, sub = mx.random.split(key)
        weights[name.replace(".weight", ".bias")] = 0.1 * mx.random.normal((weights[name].shape[0],), key=sub)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def check_bit_for_bit(path, split: bool, monkeypatch) -> None:
    fused_calls = []
    call = decode_layer.DecodeLayer.__call__
    monkeypatch.setattr(decode_layer.DecodeLayer, "__call__",
                        lambda self, *a: fused_calls.append(1) or call(self, *a))
    want_logits, want_kv = run(make_rank(path, fused=False))
    assert not fused_calls
    rank = make_rank(path, fused=True)
    parts = rank.runner.parts
    assert parts.decode_layers is not None and all(f.group is None for f in parts.decode_layers)
    if split:
        group = mx.distributed.init()
        assert group.size() == 1
        parts.decode_layers = [dataclasses.replace(f, group=group) for f in parts.decode_layers]
    got_logits, got_kv = run(rank)
    layers = len(rank.runner.parts.layers)
    assert len(fused_calls) == 7 * layers  # every decode-only step, not the prefill nor the mixed one
    for got, want in zip(got_logits, want_logits):
        assert np.array_equal(got, want)
    for got, want in zip(got_kv, want_kv):
        assert np.array_equal(got, want)


def test_fused_layers_write_the_pools_in_place(tmp_path):
    """The layer's node holds each pool once (its other outputs drop their copies of its inputs), so MLX
    donates it: a step copies no pool (a copy per layer and pool made a one-row step of the demo model
    ~30x slower)."""
    rank = make_rank(demo.make_tiny(tmp_path, seed=1), fused=True)
    store = rank.runner.store
    steps = plans()

    def address(a: mx.array) -> int:
        return np.asarray(a).__array_interface__["data"][0]  # the view is dropped at once: no reference kept

    rank.step(steps[0])
    rank.step(steps[1])
    mx.eval(store.keys, store.values)
    before = [address(a) for a in store.keys + store.values]
    rank.step(steps[2])  # decode rows only: the fused path
    mx.eval(store.keys, store.values)
    assert [address(a) for a in store.keys + store.values] == before


def test_only_layers_the_kernel_computes_fuse(tmp_path):
    path = demo.make_tiny(tmp_path, seed=2)
    assert make_rank(path, fused=False).runner.parts.decode_layers is None
    cfg = ModelConfig(str(path), native_kernels=False)
    assert build_rank(load_model(cfg), cfg, CacheConfig(enabled=False, block_size=BS), 2**22).runner.parts.decode_layers is None
    rank = make_rank(path, fused=True)
    layers = rank.runner.parts.layers
    assert decode_layer.decode_layers(layers, None) is None
    layer = layers[0]
    o_proj = layer.self_attn.o_proj
    layer.self_attn.o_proj = cpu_kernels.TransposedLinear(o_proj)  # not packed: e.g. no panel fits
    assert decode_layer.decode_layer(layer, NATIVE) is None and decode_layer.decode_layers(layers, NATIVE) is None
    layer.self_attn.o_proj = o_proj
    assert decode_layer.decode_layer(layer, NATIVE) is not None


def test_fused_decode_is_on_by_default_and_the_flag_turns_it_off():
    from meshlm import cli

    def fused(*flags: str) -> bool:
        return cli.serve_config(cli.build_parser().parse_args(["serve", *flags])).model.fused_decode

    assert fused() and not fused("--no-fused-decode")


def test_decode_layer_and_mlp_reject_bad_shapes_with_clear_errors():
    E, H, Hk, D, I = 32, 2, 1, 16, 32
    pools = [mx.zeros((8, Hk, D)), mx.zeros((8, Hk, D))]

    def panels(n: int, k: int) -> mx.array:
        return mx.zeros((n // 16, k, 16))

    weights = [mx.ones(E), panels((H + 2 * Hk) * D, E), panels(E, H * D), mx.ones(E), panels(2 * I, E),
               panels(E, I), mx.ones(D // 2)]
    ids = mx.array([1]), mx.array([1]), mx.array([[0]]), mx.array([2])

    def call(h=mx.ones((1, 1, E)), w=weights, heads=H, block_size=BS, **kw):
        return NATIVE.decode_layer(h, w, *pools, *ids, heads, [1e-5, 1e-5, 1.0], D, False, 1.0, block_size, 1.0, **kw)

    mx.eval(call())
    bad = [
        dict(h=mx.ones((1, 1, E + 16))),  # hidden of another width
        dict(w=weights[:6]),  # a weight missing
        dict(w=[weights[0], panels(H * D, E), *weights[2:]]),  # q/k/v without k and v
        dict(heads=3),  # not a multiple of the KV heads
        dict(block_size=3),  # the pools do not hold whole blocks of it
        dict(qkv_bias=mx.ones(7)),
        dict(q_norm=mx.ones(D)),  # q norm without k norm
    ]
    for kw in bad:
        with pytest.raises(ValueError, match="decode_layer: "):
            call(**kw)
    h = mx.ones((1, 1, E))
    mx.eval(NATIVE.decode_mlp(h, h, weights, [1e-5, 1e-5, 1.0]))
    for args in [(mx.ones((1, 1, E + 16)), h, weights),  # h and the attention output of different shapes
                 (h, h, [*weights[:4], panels(2 * I, E + 16), *weights[5:]]),  # gate/up of another width
                 (h, h, [*weights[:5], panels(E, 2 * I), weights[6]])]:  # down not taking gate/up's width
        with pytest.raises(ValueError, match="decode_mlp: "):
            NATIVE.decode_mlp(*args, [1e-5, 1e-5, 1.0])


def test_only_float32_steps_of_decode_rows_run_fused(tmp_path):
    from meshlm.model.batch import Batch, RowSpec

    store = make_rank(demo.make_tiny(tmp_path, seed=3), fused=True).runner.store
    decode = Batch.build([RowSpec(0, 3, (5,), (0,)), RowSpec(1, 7, (6,), (1, 2))], BS)
    mixed = Batch.build([RowSpec(0, 3, (5,), (0,)), RowSpec(1, 0, (6, 7, 8), (1,))], BS)
    h = mx.zeros((1, 2, 64))
    assert decode_layer.runs_fused(decode, store, h)
    assert not decode_layer.runs_fused(decode, store, h.astype(mx.bfloat16))
    assert not decode_layer.runs_fused(mixed, store, mx.zeros((1, 4, 64)))
