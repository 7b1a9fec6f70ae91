"""The CPU attention and SwiGLU agree with mlx's own kernels to fp32 rounding."""

import shutil
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.activations import swiglu as mlx_swiglu

from meshlm.model import cpu_kernels

TOL = 5e-6  # outputs are O(1); the kernels differ only in exp vs power(2, .) rounding


def reference(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def ours(q, k, v, mask, split_decode=False, native=None):
    return cpu_kernels.attention(q, k, v, None, 0.125, mask, _fallback=reference, split_decode=split_decode,
                                 native=native)


NATIVE, NATIVE_STATUS = cpu_kernels.native_ops()
# None: the MLX kernels; else the compiled ones (csrc/cpu_ops.cpp), which `make install` builds where there is
# a compiler; without one those cases skip, saying why.
KERNELS = [None, pytest.param(NATIVE, id="native", marks=pytest.mark.skipif(NATIVE is None, reason=NATIVE_STATUS))]


NEEDS_PACKED_GEMM = pytest.mark.skipif(NATIVE is None or not NATIVE.packed_gemm,
                                       reason=f"packed GEMM not built: {NATIVE_STATUS}")


def test_native_kernels_are_built_where_a_compiler_is():
    if sys.platform != "linux" or not shutil.which("g++"):
        pytest.skip("scripts/build_cpu_ops.py builds on Linux with g++")
    assert NATIVE is not None, NATIVE_STATUS
    assert NATIVE.mlx_version == mx.__version__


@pytest.mark.parametrize(
    "B,H,Hk,L,S",
    [
        (1, 9, 3, 300, 300),  # causal prefill split into query blocks
        (1, 9, 3, 200, 650),  # a later prefill chunk against a longer cache, in blocks
        (1, 4, 4, 40, 40),  # no GQA
        (16, 9, 3, 1, 200),  # batched decode
        (3, 8, 2, 17, 60),
    ],
)
@pytest.mark.parametrize("mask_kind", ["causal", "none", "bool", "additive", "one-row"])
@pytest.mark.parametrize("native", KERNELS)
def test_attention_matches_mlx(B, H, Hk, L, S, mask_kind, native):
    mx.random.seed(B * 1000 + L)
    q, k, v = (mx.random.normal(s) for s in ((B, H, L, 64), (B, Hk, S, 64), (B, Hk, S, 64)))
    allowed = mx.random.uniform(shape=(B, 1, L, S)) > 0.3
    mask = {
        "causal": "causal",
        "none": None,
        "bool": allowed,
        "additive": mx.where(allowed, 0.0, -1e9),
        "one-row": allowed[0, 0],  # (L, S): what mlx-lm builds when no row is padded
    }[mask_kind]
    want = reference(q, k, v, scale=0.125, mask=mask)
    got = ours(q, k, v, mask, native=native)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < TOL


@pytest.mark.parametrize("native", KERNELS)
@pytest.mark.parametrize("rows", [8, 15])
def test_decode_split_over_two_streams_matches_mlx(rows, native):
    """With a core to spare, half a decode batch's attention runs on a second CPU stream."""
    q, k, v = mx.random.normal((rows, 9, 1, 64)), mx.random.normal((rows, 3, 90, 64)), mx.random.normal((rows, 3, 90, 64))
    mask = mx.random.uniform(shape=(rows, 1, 1, 90)) > 0.2
    want = reference(q, k, v, scale=0.125, mask=mask)
    assert mx.abs(ours(q, k, v, mask, split_decode=True, native=native) - want).max().item() < TOL


@pytest.mark.skipif(NATIVE is None, reason=str(NATIVE_STATUS))
def test_native_decode_reads_a_kv_cache_slice_in_place():
    """A decode's keys are the first S positions of a longer cache buffer: the kernel walks its strides
    (no copy), and a mask that differs per head falls back to the MLX path, with the same result."""
    cache_k, cache_v = mx.random.normal((4, 2, 256, 32)), mx.random.normal((4, 2, 256, 32))
    k, v = cache_k[:, :, :70], cache_v[:, :, :70]
    q = mx.random.normal((4, 6, 1, 32))
    for mask in (mx.arange(70)[None, None, None] >= mx.array([0, 3, 9, 69])[:, None, None, None],
                 mx.random.uniform(shape=(4, 6, 1, 70)) > 0.5):
        want = reference(q, mx.contiguous(k), mx.contiguous(v), scale=0.125, mask=mask)
        assert mx.abs(ours(q, k, v, mask, native=NATIVE) - want).max().item() < TOL


@pytest.mark.parametrize("native", KERNELS)
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # the native decode kernel's 64-wide passes, and its fallback
def test_decode_head_dims(native, head_dim):
    q = mx.random.normal((3, 8, 1, head_dim))
    k, v = mx.random.normal((3, 2, 45, head_dim)), mx.random.normal((3, 2, 45, head_dim))
    mask = mx.arange(45)[None, None, None] >= mx.array([0, 7, 44])[:, None, None, None]
    want = reference(q, k, v, scale=0.125, mask=mask)
    assert mx.abs(ours(q, k, v, mask, native=native) - want).max().item() < TOL


@pytest.mark.parametrize("native", KERNELS)
def test_fully_masked_rows_stay_finite(native):
    """Left-padded rows of a batched prefill mask every key; NaN there would poison the real rows' values."""
    q, k, v = mx.random.normal((2, 4, 5, 16)), mx.random.normal((2, 2, 5, 16)), mx.random.normal((2, 2, 5, 16))
    mask = mx.ones((2, 1, 5, 5), dtype=mx.bool_)
    mask[0, :, :2] = False
    assert mx.isfinite(ours(q, k, v, mask, native=native)).all().item()
    one = mx.array([[True, False, False, False, False], [False] * 5])[:, None, None]  # a decode row with no key
    got = ours(q[:, :, :1], k, v, one, native=native)
    assert mx.isfinite(got).all().item()


@pytest.mark.parametrize("native", KERNELS)
def test_swiglu_matches_mlx(native, monkeypatch):
    gate = mx.random.normal((4, 300)) * 12  # large |gate| exercises power's overflow to inf
    x = mx.random.normal((4, 300))
    monkeypatch.setattr(cpu_kernels, "_native", native)
    ours_swiglu = cpu_kernels.native_swiglu if native is not None else cpu_kernels.swiglu
    assert mx.abs(ours_swiglu(gate, x) - mlx_swiglu(gate, x)).max().item() < TOL
    assert mx.abs(ours_swiglu(gate[:, :1], x) - mlx_swiglu(gate[:, :1], x)).max().item() < TOL  # broadcast


def test_half_precision_uses_the_fallback():
    calls = []

    def fallback(*args, **kwargs):
        calls.append(1)
        return reference(*args, **kwargs)

    q = mx.random.normal((1, 2, 3, 8)).astype(mx.bfloat16)
    cpu_kernels.attention(q, q, q, None, 0.3, "causal", _fallback=fallback)
    assert calls == [1]


def test_install_patches_the_models_module_and_keeps_its_outputs(monkeypatch):
    from mlx_lm.models import llama

    # Restored at teardown, so other tests in this process see stock mlx-lm.
    monkeypatch.setattr(llama, "scaled_dot_product_attention", llama.scaled_dot_product_attention)
    monkeypatch.setattr(llama, "swiglu", llama.swiglu)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100)
    model = llama.Model(args)
    tokens = mx.array([[1, 5, 9, 2, 7, 3]])
    want = model(tokens)
    assert cpu_kernels.install(model)
    assert llama.swiglu is (cpu_kernels.swiglu if NATIVE is None else cpu_kernels.native_swiglu)
    linear_type = cpu_kernels.PackedLinear if NATIVE is not None and NATIVE.packed_gemm else cpu_kernels.TransposedLinear
    assert isinstance(model.layers[1].mlp.down_proj, linear_type)
    assert cpu_kernels.install(model)  # idempotent: does not wrap itself
    assert mx.abs(model(tokens) - want).max().item() < 1e-4


def test_transposed_linears_keep_outputs_and_skip_what_they_cannot_hold():
    import mlx.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.plain = nn.Linear(64, 48, bias=False)
            self.biased = nn.Linear(64, 48)
            self.layers = [nn.Linear(64, 64), nn.Linear(64, 64, bias=False)]
            self.half = nn.Linear(64, 64).to_quantized(group_size=32, bits=4)
            self.bf16 = nn.Linear(64, 8)
            self.bf16.set_dtype(mx.bfloat16)

        def __call__(self, x):
            h = self.layers[1](self.layers[0](x)) + self.half(x)
            return self.plain(x), self.biased(x), h, self.bf16(x.astype(mx.bfloat16))

    block = Block()
    x = mx.random.normal((3, 5, 64))
    want = block(x)
    assert cpu_kernels.transpose_linears(block) == 4  # plain, biased, both list entries
    assert type(block.half) is nn.QuantizedLinear and type(block.bf16) is nn.Linear
    assert block.layers[0].weight_t.shape == (64, 64) and "bias" in block.layers[0]
    for got, ref in zip(block(x), want):
        assert mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item() < 1e-5
    assert cpu_kernels.transpose_linears(block) == 0  # nothing left to swap


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_every_tiny_architecture_keeps_its_logits(tmp_path, monkeypatch, model_type):
    """Each architecture `meshlm demo-model --tiny` writes: prefill and cached decode logits with the CPU
    kernels (and a decode batch split over two streams) match stock mlx-lm's."""
    import sys

    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from meshlm.model import demo

    model, _ = mlx_lm.load(str(demo.make_tiny(tmp_path, model_type=model_type, seed=3)))
    prompts = mx.array([[5, 17, 42, 9, 100, 7, 3, 64]] * 3) + mx.arange(3)[:, None]

    def logits() -> list[mx.array]:
        cache = make_prompt_cache(model)
        out = [model(prompts, cache=cache)]
        for _ in range(3):
            out.append(model(mx.argmax(out[-1][:, -1:], axis=-1), cache=cache))
        return out

    want = logits()
    module = sys.modules[type(model).__module__]
    for name in ("scaled_dot_product_attention", "swiglu"):
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(cpu_kernels, "SPLIT_DECODE_ROWS", 2)
    assert cpu_kernels.install(model, cores=2)
    got = logits()
    assert max(mx.abs(g - w).max().item() for g, w in zip(got, want)) < 1e-4


@NEEDS_PACKED_GEMM
@pytest.mark.parametrize("rows", [1, 5, 6, 16, 17, 64, 65, 300])  # the 6-row kernel and its tails
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear(rows, bias, monkeypatch):
    import mlx.nn as nn

    monkeypatch.setattr(cpu_kernels, "_native", NATIVE)
    linear = nn.Linear(96, 160, bias=bias)
    x = mx.random.normal((rows, 96))
    packed = cpu_kernels.PackedLinear(linear)
    assert packed["weight_p"].shape == (10, 96, 16)
    assert mx.array_equal(packed.weight, linear.weight).item()
    assert mx.abs(packed(x) - linear(x)).max().item() < 1e-5
    assert packed(x.reshape(1, rows, 96)).shape == (1, rows, 160)
    xh = x.astype(mx.bfloat16)  # other dtypes take MLX's matmul on the unpacked weight, as nn.Linear would
    assert packed(xh).dtype == linear(xh).dtype and mx.abs(packed(xh) - linear(xh)).max().item() < 1e-5


@NEEDS_PACKED_GEMM
def test_packed_gemm_threads_and_streams(monkeypatch):
    """Two threads share a GEMM's panels; a GEMM from a second stream meanwhile runs alone. Many calls in
    a row, so the helper thread's sleep/wake hand-off is exercised as well."""
    import mlx.nn as nn

    monkeypatch.setattr(cpu_kernels, "_native", NATIVE)
    NATIVE.set_gemm_threads(2)
    layers = [cpu_kernels.PackedLinear(nn.Linear(128, 256)) for _ in range(3)]
    refs = [nn.Linear(128, 256) for _ in range(3)]
    for ref, layer in zip(refs, layers):
        ref.update({"weight": layer.weight, "bias": layer.bias})
    second = mx.new_stream(mx.cpu)
    for rows in (1, 16, 33, 16, 1):
        x = mx.random.normal((rows, 128))
        outs, want = [], []
        for ref, layer in zip(refs, layers):
            outs.append(layer(x))
            with mx.stream(second):
                outs.append(layer(x * 2))
            want += [ref(x), ref(x * 2)]
        mx.eval(outs)
        assert max(mx.abs(o - w).max().item() for o, w in zip(outs, want)) < 1e-4


@NEEDS_PACKED_GEMM
def test_transpose_linears_packs_where_the_panel_fits(monkeypatch):
    import mlx.nn as nn

    monkeypatch.setattr(cpu_kernels, "_native", NATIVE)
    block = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40, bias=False))  # 40 outputs: not a multiple of 16
    x = mx.random.normal((3, 64))
    want = block(x)
    assert cpu_kernels.transpose_linears(block, packed=True) == 2
    assert type(block.layers[0]) is cpu_kernels.PackedLinear
    assert type(block.layers[1]) is cpu_kernels.TransposedLinear
    assert mx.abs(block(x) - want).max().item() < 1e-5


@NEEDS_PACKED_GEMM
def test_native_ops_reject_bad_shapes_with_clear_errors():
    """The kernels index raw buffers: a wrong shape must be an error at graph build, never a bad read."""
    w = mx.zeros((2, 8, 16))
    with pytest.raises(ValueError, match="bias must be"):
        NATIVE.packed_linear(mx.zeros((3, 8)), w, mx.zeros((31,)))
    with pytest.raises(ValueError, match="x \\(..., K\\)"):
        NATIVE.packed_linear(mx.zeros((3, 9)), w)
    with pytest.raises(ValueError, match="last axis"):
        NATIVE.softmax2(mx.array(1.0))
    with pytest.raises(ValueError, match="float32"):
        NATIVE.swiglu(mx.zeros((2,), dtype=mx.float16), mx.zeros((2,), dtype=mx.float16))
    with pytest.raises(ValueError, match="mask must be"):
        NATIVE.decode_attention(mx.zeros((2, 1, 3, 8)), mx.zeros((2, 1, 5, 8)), mx.zeros((2, 1, 5, 8)),
                                mx.ones((3, 5), dtype=mx.bool_))
