"""The CPU kernels (attention, paged decode, SwiGLU, packed linears) agree with mlx's own to fp32 rounding."""

import random
import shutil
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.activations import swiglu as mlx_swiglu

from meshlm.model import cpu_kernels
from meshlm.model.attention import CPUBackend, PortableBackend
from meshlm.model.cpu_kernels import LOG2E

TOL = 5e-6  # outputs are O(1); the kernels differ only in exp vs power(2, .) rounding


def reference(queries, keys, values, scale=1.0, mask=None):
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def ours(q, k, v, mask, native=None):
    return cpu_kernels.attention(q, k, v, 0.125, native, mask)


NATIVE, NATIVE_STATUS = cpu_kernels.native_ops()
# None: the MLX kernels; else the compiled ones (csrc/cpu_ops.cpp), which `make install` builds where there is
# a compiler; without one those cases skip, saying why.
KERNELS = [None, pytest.param(NATIVE, id="native", marks=pytest.mark.skipif(NATIVE is None, reason=NATIVE_STATUS))]


NEEDS_PACKED_GEMM = pytest.mark.skipif(NATIVE is None or not NATIVE.packed_gemm,
                                       reason=f"packed GEMM not built: {NATIVE_STATUS}")


def test_native_kernels_are_built_where_a_compiler_is():
    if sys.platform != "linux" or not shutil.which("g++"):
        pytest.skip("scripts/build_native.py builds on Linux with g++")
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


# The compiled kernels' vector widths (the packed GEMM, the paged decode scores): 256-bit, and 512-bit where
# the build has it (the default there).
WIDTHS = ["256-bit"] + (["512-bit"] if NATIVE is not None and NATIVE.wide_kernels_built else [])


@pytest.fixture(params=WIDTHS)
def kernel_width(request):
    NATIVE.set_wide_kernels(request.param == "512-bit")
    yield request.param
    NATIVE.set_wide_kernels(True)


@pytest.mark.skipif(NATIVE is None, reason=str(NATIVE_STATUS))
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # the native kernel's 64-wide passes, and its generic loop
@pytest.mark.parametrize("flat", [False, True])  # q pre-scaled as (R, Hk, r, D), or (R, H, D) scaled by the kernel
def test_paged_decode_reads_each_rows_blocks_in_place(head_dim, flat, kernel_width):
    bs, blocks = 8, 12
    pool_k, pool_v = mx.random.normal((blocks * bs, 2, head_dim)), mx.random.normal((blocks * bs, 2, head_dim))
    tables = mx.array([[5, 2, 9, 0], [11, 0, 0, 0], [1, 3, 4, 7]])
    lengths = [19, 3, 32]
    q = mx.random.normal((3, 2, 4, head_dim))  # two KV heads, four query heads each
    if flat:
        got = NATIVE.paged_decode_attention(q.reshape(3, 8, head_dim), pool_k, pool_v, tables, mx.array(lengths), bs,
                                            0.125 * cpu_kernels.LOG2E)
        assert got.shape == (3, 8, head_dim)
    else:
        got = NATIVE.paged_decode_attention(q * (0.125 * cpu_kernels.LOG2E), pool_k, pool_v, tables,
                                            mx.array(lengths), bs)
    for b, n in enumerate(lengths):
        slots = mx.array([tables[b, p // bs].item() * bs + p % bs for p in range(n)])
        keys, values = pool_k[slots].transpose(1, 0, 2)[None], pool_v[slots].transpose(1, 0, 2)[None]
        want = reference(q[b].reshape(1, 8, 1, head_dim), keys, values, scale=0.125)
        assert mx.abs(got[b].reshape(8, head_dim) - want.reshape(8, head_dim)).max().item() < TOL


@NEEDS_PACKED_GEMM
@pytest.mark.parametrize(
    "T,S,H,Hk,D",
    [
        (1, 1, 2, 1, 64),  # one token
        (300, 300, 9, 3, 64),  # a fresh chunk: every query block sees a different number of keys
        (37, 650, 9, 3, 64),  # a later chunk against a longer cache
        (5, 40, 32, 1, 64),  # 32 query heads a KV head: blocks of heads, one query each
        (20, 70, 16, 8, 128),  # wide heads
        (13, 50, 6, 2, 48),  # a head dim of one 16-wide panel and a half, padded
        (64, 200, 4, 4, 80),  # no GQA, a head dim of five panels
    ],
)
def test_causal_attention_of_a_chunk_matches_mlx(T, S, H, Hk, D, kernel_width):
    """The compiled prefill attention (queries the last T of S positions) against MLX's fused kernel, with
    the keys and values handed over as the transposed views the backend passes."""
    mx.random.seed(T * 7 + S)
    q = mx.random.normal((T, H, D))
    k, v = mx.random.normal((Hk, S, D)), mx.random.normal((Hk, S, D))  # head-major, read through views
    want = reference(q.transpose(1, 0, 2)[None], k[None], v[None], scale=D**-0.5, mask="causal")[0].transpose(1, 0, 2)
    got = NATIVE.causal_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), D**-0.5 * LOG2E)
    assert got.shape == (T, H, D)
    assert mx.abs(got - want).max().item() < TOL


@NEEDS_PACKED_GEMM
@pytest.mark.parametrize("T,S,H,Hk,D", [(1, 1, 2, 1, 64), (37, 650, 9, 3, 64), (300, 300, 9, 3, 64),
                                       (20, 70, 16, 8, 128), (13, 50, 6, 2, 48)])
def test_causal_attention_paged_reads_the_pools_in_place_as_the_gathered_keys(T, S, H, Hk, D, kernel_width):
    """A prompt's next chunk against its context where the block tables put it (scattered blocks, the
    pools larger): the same bits as gathering those rows first."""
    mx.random.seed(S + D)
    pool_k, pool_v = mx.random.normal((4 * S + 64, Hk, D)), mx.random.normal((4 * S + 64, Hk, D))
    blocks = random.Random(S).sample(range((4 * S + 64) // 16), (S + 15) // 16)
    slots = mx.array([blocks[p // 16] * 16 + p % 16 for p in range(S)])
    q = mx.random.normal((T, H, D))
    got = NATIVE.causal_attention_paged(q, pool_k, pool_v, slots, D**-0.5 * LOG2E)
    want = NATIVE.causal_attention(q, pool_k[slots], pool_v[slots], D**-0.5 * LOG2E)
    assert got.shape == (T, H, D) and mx.array_equal(got, want).item()
    counts = mx.array(random.Random(T).choices(range(S + 1), k=T))  # as a ring step's rows see them
    got_partial = NATIVE.causal_partial_paged(q, pool_k, pool_v, slots, counts, D**-0.5 * LOG2E)
    want_partial = NATIVE.causal_partial(q, pool_k[slots], pool_v[slots], counts, D**-0.5 * LOG2E)
    assert all(mx.array_equal(a, b, equal_nan=True).item() for a, b in zip(got_partial, want_partial))
    # and the backends' paged calls are the portable path's attention
    ref = PortableBackend().extend_paged(q, pool_k, pool_v, slots, D**-0.5)
    assert mx.abs(CPUBackend(NATIVE).extend_paged(q, pool_k, pool_v, slots, D**-0.5) - ref).max().item() < TOL
    if T > 1:
        ref_o, ref_lse = PortableBackend().partial_paged(q, pool_k, pool_v, slots, D**-0.5, counts)
        o, lse = CPUBackend(NATIVE).partial_paged(q, pool_k, pool_v, slots, D**-0.5, counts)
        assert mx.abs(o - ref_o).max().item() < TOL
        assert mx.allclose(lse, ref_lse, atol=1e-5, equal_nan=True).item()


@NEEDS_PACKED_GEMM
def test_causal_attention_paged_reads_nothing_outside_the_pools():
    pool = mx.random.normal((64, 1, 16))
    q = mx.random.normal((2, 1, 16))
    good = NATIVE.causal_attention_paged(q, pool, pool, mx.array([0, 1, 2]), 0.25)
    assert mx.abs(good).max().item() > 0
    for bad in ([0, 64, 2], [0, -1, 2]):
        assert mx.abs(NATIVE.causal_attention_paged(q, pool, pool, mx.array(bad), 0.25)).max().item() == 0
        out, lse = NATIVE.causal_partial_paged(q, pool, pool, mx.array(bad), mx.array([3, 3]), 0.25)
        assert mx.abs(out).max().item() == 0 and (lse == -mx.inf).all().item()
    with pytest.raises(ValueError, match="0 < T <= S"):
        NATIVE.causal_attention_paged(mx.zeros((4, 1, 16)), pool, pool, mx.array([0, 1, 2]))
    with pytest.raises(ValueError, match="integers"):
        NATIVE.causal_attention_paged(q, pool, pool, mx.array([0.0, 1.0]))


@pytest.mark.skipif(NATIVE is None, reason=str(NATIVE_STATUS))
def test_paged_decode_reads_nothing_outside_the_pool():
    """A block id past the pool (which the runner refuses first) gives zeros for that row, never a stray read."""
    pool = mx.random.normal((4 * 8, 1, 16))
    q = mx.random.normal((2, 1, 1, 16))
    got = NATIVE.paged_decode_attention(q, pool, pool, mx.array([[0, 99], [1, 2]]), mx.array([12, 10]), 8)
    assert mx.abs(got[0]).max().item() == 0 and mx.abs(got[1]).max().item() > 0


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


@pytest.mark.skipif(NATIVE is None, reason=str(NATIVE_STATUS))
def test_softmax_weights_are_zero_or_normal_never_subnormal():
    """A masked or far-below-the-max score weighs exactly 0: a subnormal weight (the old floor of 2^-126,
    normalised) costs Intel cores a microcode assist per multiply, which made masked prefill attention
    20x slower on a Xeon. Weights under 2^-64 of the largest change no float32 sum."""
    tiny = 1.1754944e-38  # the smallest normal float32
    scores = mx.array([[0.0, -1e30, -63.0, -65.0, -126.0, -130.0, -1.0, -20.0]])
    for weights in (NATIVE.softmax2(scores), NATIVE.softmax2_lse(scores)[0]):
        w = weights[0].tolist()
        assert all(x == 0.0 or x >= tiny for x in w)
        assert w[1] == w[3] == w[4] == w[5] == 0.0 and w[2] > 0.0
        assert abs(sum(w) - 1.0) < 1e-6

@pytest.mark.parametrize("native", KERNELS)
def test_swiglu_matches_mlx(native):
    gate = mx.random.normal((4, 300)) * 12  # large |gate| exercises power's overflow to inf
    x = mx.random.normal((4, 300))
    ours_swiglu = cpu_kernels.swiglu_for(native)
    assert mx.abs(ours_swiglu(gate, x) - mlx_swiglu(gate, x)).max().item() < TOL
    assert mx.abs(ours_swiglu(gate[:, :1], x) - mlx_swiglu(gate[:, :1], x)).max().item() < TOL  # broadcast


def test_adapting_a_model_keeps_stock_mlx_lm_calls_working():
    """model/adapt.py changes this model's instances only: its module's attention function routes
    meshlm's caches to meshlm and leaves every other call to mlx-lm (a second, stock model is unaffected)."""
    from mlx_lm.models import llama

    from meshlm.model.adapt import GatedMLP, TokenRoPE, adapt

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100)
    model, stock = llama.Model(args), llama.Model(args)
    stock.update(model.parameters())
    tokens = mx.array([[1, 5, 9, 2, 7, 3]])
    want = model(tokens)
    adapt(model, cpu_kernels_on=True, native=NATIVE)
    seam = llama.scaled_dot_product_attention
    assert seam.meshlm_seam
    assert isinstance(model.layers[0].self_attn.rope, TokenRoPE) and isinstance(model.layers[1].mlp, GatedMLP)
    linear_type = cpu_kernels.PackedLinear if NATIVE is not None and NATIVE.packed_gemm else cpu_kernels.TransposedLinear
    assert isinstance(model.layers[1].mlp.down_proj, linear_type)
    adapt(model, cpu_kernels_on=True, native=NATIVE)  # idempotent: nothing wraps itself
    assert llama.scaled_dot_product_attention is seam and isinstance(model.layers[0].self_attn.rope.inner, nn.RoPE)
    assert mx.abs(model(tokens) - want).max().item() < 1e-4  # mlx-lm's own call path still works
    assert mx.abs(stock(tokens) - want).max().item() < 1e-5


def test_the_parts_a_forward_walks_hold_the_swapped_head():
    """An untied LM head is swapped like every linear layer, and the forward's parts call the new module,
    not the nn.Linear it replaced (they once kept it: MLX's slower GEMM on every step's logits)."""
    from mlx_lm.models import llama

    from meshlm.model.adapt import adapt

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=112,
                           tie_word_embeddings=False)
    model = llama.Model(args)
    h = mx.random.normal((1, 3, 64))
    want = model.lm_head(model.model.norm(h))
    parts = adapt(model, cpu_kernels_on=True, native=NATIVE)
    linear_type = cpu_kernels.PackedLinear if NATIVE is not None and NATIVE.packed_gemm else cpu_kernels.TransposedLinear
    assert isinstance(model.lm_head, linear_type) and parts.lm_head is model.lm_head
    assert parts.norm is model.model.norm and parts.layers[1] is model.model.layers[1]
    assert mx.abs(parts.head(h) - want).max().item() < 1e-5


def test_transposed_linears_keep_outputs_and_skip_what_they_cannot_hold():
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
@pytest.mark.parametrize("backend", ["native", "mlx-cpu", "portable"])
def test_every_tiny_architecture_keeps_its_logits(tmp_path, model_type, backend):
    """Each architecture `meshlm demo-model --tiny` writes, run by meshlm's runner over its KV store with
    each attention backend: prefill, then batched decode of two rows; logits equal stock mlx-lm's."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from meshlm.config import CacheConfig, ModelConfig
    from meshlm.engine.plan import LOGITS_LAST, Chunk, NewSequence, StepPlan, TableUpdate
    from meshlm.executor.rank import build_rank
    from meshlm.model import demo
    from meshlm.model.loader import load_model

    if backend == "native" and NATIVE is None:
        pytest.skip(NATIVE_STATUS)
    path = demo.make_tiny(tmp_path, model_type=model_type, seed=3)
    stock, _ = mlx_lm.load(str(path))
    prompts = [[5, 17, 42, 9, 100, 7, 3, 64], [6, 18, 43]]
    want = []
    for p in prompts:
        cache = make_prompt_cache(stock)
        rows = [stock(mx.array([p]), cache=cache)[0, -1]]
        for _ in range(3):
            rows.append(stock(mx.argmax(rows[-1])[None, None], cache=cache)[0, -1])
        want.append(rows)
    cfg = ModelConfig(str(path), cpu_kernels=backend != "portable", native_kernels=backend == "native")
    rank = build_rank(load_model(cfg), cfg, CacheConfig(enabled=False, block_size=4), 2**22)
    got: list[list[mx.array]] = [[], []]
    plan = StepPlan(0, new=(NewSequence(0, 0), NewSequence(1, 0)),
                    chunks=tuple(Chunk(u, 0, tuple(p), LOGITS_LAST) for u, p in enumerate(prompts)),
                    tables=(TableUpdate(0, (0, 1, 2)), TableUpdate(1, (3, 4))), num_blocks=5)
    for step in range(4):
        result = rank.step(plan)
        for i, uid in enumerate(result.uids):
            got[uid].append(result.logits[i])
        nxt = {uid: mx.argmax(result.logits[i]).item() for i, uid in enumerate(result.uids)}
        plan = StepPlan(step + 1, num_blocks=5, chunks=tuple(
            Chunk(u, len(prompts[u]) + step, (nxt[u],), LOGITS_LAST) for u in (0, 1)))
    for uid in (0, 1):
        assert max(mx.abs(g - w).max().item() for g, w in zip(got[uid], want[uid])) < 1e-4




@NEEDS_PACKED_GEMM
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 9, 12, 13, 16, 17, 64, 65, 300])  # 6- and 12-row passes and their tails
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out", [160, 176])  # panels in pairs, and an odd one left for the 256-bit kernel
def test_packed_linear_matches_nn_linear(rows, bias, out, kernel_width):
    linear = nn.Linear(96, out, bias=bias)
    x = mx.random.normal((rows, 96))
    packed = cpu_kernels.PackedLinear(linear, NATIVE)
    assert packed["weight_p"].shape == (out // 16, 96, 16)
    assert mx.array_equal(packed.weight, linear.weight).item()
    assert mx.abs(packed(x) - linear(x)).max().item() < 1e-5
    assert packed(x.reshape(1, rows, 96)).shape == (1, rows, out)
    xh = x.astype(mx.bfloat16)  # other dtypes take MLX's matmul on the unpacked weight, as nn.Linear would
    assert packed(xh).dtype == linear(xh).dtype and mx.abs(packed(xh) - linear(xh)).max().item() < 1e-5


def half_valued(linear: nn.Linear, dtype: mx.Dtype = mx.bfloat16) -> nn.Linear:
    """`linear` with float32 weights that are all `dtype` values, as a 16-bit checkpoint loads on the CPU."""
    linear.weight = linear.weight.astype(dtype).astype(mx.float32)
    return linear


HALF = pytest.mark.parametrize("half", [mx.bfloat16, mx.float16], ids=["bfloat16", "float16"])


@NEEDS_PACKED_GEMM
@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_a_16_bit_checkpoint_keeps_16_bit_layers_and_the_same_logits(tmp_path, stored):
    """A checkpoint stored in bfloat16 or float16 loads as float32 on the CPU; its packed layers go back to
    16 bits (half the bytes) and every logit stays what --no-half-weights computes."""
    from meshlm.config import CacheConfig, ModelConfig
    from meshlm.engine.plan import LOGITS_LAST, Chunk, NewSequence, StepPlan, TableUpdate
    from meshlm.executor.rank import build_rank
    from meshlm.model import demo
    from meshlm.model.loader import load_model
    from mlx.utils import tree_flatten

    path = demo.make_tiny(tmp_path, hidden=128, heads=4, kv_heads=2, seed=5, dtype=stored)
    half = getattr(mx, stored)
    logits, held = {}, {}
    for flag in (True, False):
        cfg = ModelConfig(str(path), half_weights=flag)
        loaded = load_model(cfg)
        assert loaded.dtype == "float32"
        rank = build_rank(loaded, cfg, CacheConfig(enabled=False, block_size=4), 2**22)
        held[flag] = {dtype: sum(a.nbytes for _, a in tree_flatten(loaded.model.parameters()) if a.dtype == dtype)
                      for dtype in (mx.float32, half)}
        plan = StepPlan(0, new=(NewSequence(0, 0),), chunks=(Chunk(0, 0, (5, 17, 42, 9, 100), LOGITS_LAST),),
                        tables=(TableUpdate(0, (0, 1)),), num_blocks=2)
        logits[flag] = rank.step(plan).logits
    # Every linear layer and the head: all but the embedding table and the norms.
    assert held[False][half] == 0 and held[True][mx.float32] < held[True][half]
    assert sum(held[True].values()) < 0.65 * sum(held[False].values())
    assert mx.array_equal(logits[True], logits[False]).item()


@NEEDS_PACKED_GEMM
def test_a_16_bit_dtype_on_the_cpu_rounds_the_weights_and_computes_in_float32(tmp_path):
    """`--dtype bfloat16` or `float16` on the CPU: the float32 checkpoint's weights rounded once, held as
    16-bit panels, activations and KV in float32 (MLX's half-precision GEMMs are slow there); its prefix
    cache is keyed apart from the float32 model's, whose KV differs."""
    from meshlm.config import CacheConfig, ModelConfig
    from meshlm.engine.plan import LOGITS_LAST, Chunk, NewSequence, StepPlan, TableUpdate
    from meshlm.executor.rank import build_rank
    from meshlm.model import demo
    from meshlm.model.loader import load_model

    path = demo.make_tiny(tmp_path, hidden=128, heads=4, kv_heads=2, seed=5)
    plan = StepPlan(0, new=(NewSequence(0, 0),), chunks=(Chunk(0, 0, (5, 17, 42, 9, 100), LOGITS_LAST),),
                    tables=(TableUpdate(0, (0, 1)),), num_blocks=2)
    loaded, logits = {}, {}
    for dtype in ("float32", "bfloat16", "float16"):
        cfg = ModelConfig(str(path), dtype=dtype)
        loaded[dtype] = load_model(cfg)
        rank = build_rank(loaded[dtype], cfg, CacheConfig(enabled=False, block_size=4), 2**22)
        logits[dtype] = rank.step(plan).logits
        assert rank.store.shape.dtype == mx.float32 and logits[dtype].dtype == mx.float32
        assert loaded[dtype].dtype == "float32"
    assert cpu_kernels.half_layers(loaded["float32"].model) == {}
    assert len({loaded[d].fingerprint for d in loaded}) == 3
    for dtype, within in (("bfloat16", 0.05), ("float16", 0.005)):  # float16 keeps 3 more mantissa bits
        layers = cpu_kernels.half_layers(loaded[dtype].model)
        assert list(layers) == [dtype] and layers[dtype] > 0
        close = mx.abs(logits[dtype] - logits["float32"]).max().item()
        assert 0 < close < within * mx.abs(logits["float32"]).max().item()  # rounded, not another model


@NEEDS_PACKED_GEMM
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 16, 65])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out", [160, 176])
@HALF
def test_16_bit_panels_compute_what_float32_panels_do_bit_for_bit(rows, bias, out, kernel_width, half):
    """Widening a bfloat16 or a float16 is exact and the multiply-adds run in the same order: held in half
    the bytes, a layer of such values gives identical outputs (the parity suites' single process holds them
    the same way)."""
    linear = half_valued(nn.Linear(96, out, bias=bias), half)
    x = mx.random.normal((rows, 96))
    f32, b16 = cpu_kernels.PackedLinear(linear, NATIVE), cpu_kernels.PackedLinear(linear, NATIVE, half)
    assert b16["weight_p"].dtype == half and b16["weight_p"].nbytes * 2 == f32["weight_p"].nbytes
    assert mx.array_equal(b16(x), f32(x)).item()
    assert mx.abs(b16(x) - linear(x)).max().item() < 1e-5
    xh = x.astype(mx.bfloat16)  # another input dtype: MLX's matmul on the unpacked weight
    assert mx.abs(b16(xh).astype(mx.float32) - linear(xh).astype(mx.float32)).max().item() < 1e-2
    sizes = [out - 64, 32, 32]  # the split GEMM and the fused SwiGLU read 16-bit panels too
    split_f32 = NATIVE.packed_linear_split(x, f32["weight_p"], sizes)
    split_b16 = NATIVE.packed_linear_split(x, b16["weight_p"], sizes)
    assert all(mx.array_equal(a, b).item() for a, b in zip(split_f32, split_b16))
    gate_up = mx.concatenate([f32["weight_p"], f32["weight_p"]])
    assert mx.array_equal(NATIVE.packed_swiglu(x, gate_up), NATIVE.packed_swiglu(x, gate_up.astype(half))).item()


@NEEDS_PACKED_GEMM
def test_only_exact_16_bit_weights_are_held_in_16_bits():
    # bfloat16 values, float16 values (most are not bfloat16 ones), and any float32
    block = nn.Sequential(half_valued(nn.Linear(64, 48)), half_valued(nn.Linear(48, 48), mx.float16),
                          nn.Linear(48, 32, bias=False))
    x = mx.random.normal((3, 64))
    want = block(x)
    weights = [layer.weight for layer in block.layers]
    assert [cpu_kernels.compact_dtype(w) for w in weights] == [mx.bfloat16, mx.float16, mx.float32]
    assert not cpu_kernels.exact_in(weights[1], mx.bfloat16) and not cpu_kernels.exact_in(weights[2], mx.float16)
    assert not cpu_kernels.exact_in(mx.array([70000.0]), mx.float16)  # beyond float16's range: inf, not exact
    assert cpu_kernels.transpose_linears(block, NATIVE) == 3
    assert [layer["weight_p"].dtype for layer in block.layers] == [mx.bfloat16, mx.float16, mx.float32]
    assert cpu_kernels.half_layers(block) == {"bfloat16": 1, "float16": 1}
    assert mx.abs(block(x) - want).max().item() < 1e-5
    kept = nn.Sequential(half_valued(nn.Linear(64, 48)), half_valued(nn.Linear(48, 48), mx.float16))
    cpu_kernels.transpose_linears(kept, NATIVE, half=False)  # --no-half-weights
    assert all(layer["weight_p"].dtype == mx.float32 for layer in kept.layers) and cpu_kernels.half_layers(kept) == {}
    f16 = cpu_kernels.PackedLinear(half_valued(nn.Linear(64, 32), mx.float16), NATIVE, mx.float16)
    for other in (cpu_kernels.PackedLinear(nn.Linear(64, 32), NATIVE), f16):
        # a bf16 layer fused with a float32 or a float16 one: float32 panels, every value kept
        mixed = cpu_kernels.fuse_linears([block.layers[0], other], NATIVE)
        assert mixed[0]["weight_p"].dtype == mx.float32
        assert mx.abs(mixed[0](x) - block.layers[0](x)).max().item() < 1e-5
        assert mx.abs(mixed[1](x) - other(x)).max().item() < 1e-5


@NEEDS_PACKED_GEMM
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_a_split_gemm_pairs_panels_across_its_outputs(rows, kernel_width):
    """Outputs of 3, 2 and 1 panels: the 512-bit kernel's panel pairs straddle two outputs."""
    w = mx.random.normal((96, 96))
    b = mx.random.normal((96,))
    x = mx.random.normal((rows, 64))[:, :48]  # a strided view, gathered by the kernel
    packed = w[:48].reshape(48, 6, 16).transpose(1, 0, 2)  # x @ W for W (48, 96) as 6 panels
    outs = NATIVE.packed_linear_split(x, mx.contiguous(packed), [48, 32, 16], b)
    want = x @ w[:48] + b
    assert [o.shape for o in outs] == [(rows, 48), (rows, 32), (rows, 16)]
    assert mx.abs(mx.concatenate(outs, axis=1) - want).max().item() < 1e-4


@NEEDS_PACKED_GEMM
@pytest.mark.parametrize("panels", [mx.float32, mx.bfloat16, mx.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
def test_a_row_alone_gets_the_same_bits_as_in_a_batch(panels, threads, prefetch, kernel_width):
    """GEMMs of up to eight rows (decode steps of a few sequences) have their own kernels on 512-bit builds,
    eight, four or three panels at once, with or without their software prefetch (on by default on Intel
    cores); each column still sums in the same order, so a row's outputs do not depend on its batch: every
    size from 1 to 9 rows gives the bits of a 13-row GEMM's rows. 22 panels: groups of eight, four or
    three, then pairs or one left over; the split puts output boundaries inside the groups."""
    NATIVE.set_gemm_threads(threads)
    default = NATIVE.set_software_prefetch(prefetch)
    try:
        w = mx.random.normal((96, 22 * 16)).astype(panels).astype(mx.float32)
        packed = mx.contiguous(w.reshape(96, 22, 16).transpose(1, 0, 2).astype(panels))
        b = mx.random.normal((22 * 16,))
        x = mx.random.normal((13, 96))
        batch = NATIVE.packed_linear(x, packed, b)
        assert mx.abs(batch - (x @ w + b)).max().item() < 1e-4
        sizes = [48, 176, 128]  # 3, 11 and 8 panels
        split_batch = NATIVE.packed_linear_split(x, packed, sizes, b)
        for rows in range(1, 10):
            assert mx.array_equal(NATIVE.packed_linear(x[:rows], packed, b), batch[:rows]).item(), rows
            split = NATIVE.packed_linear_split(x[:rows], packed, sizes, b)
            assert all(mx.array_equal(a, s[:rows]).item() for a, s in zip(split, split_batch)), rows
    finally:
        NATIVE.set_gemm_threads(2)
        NATIVE.set_software_prefetch(default)


@NEEDS_PACKED_GEMM
def test_packed_gemm_threads_and_streams(kernel_width):
    """Two threads share a GEMM's panels; a GEMM from a second stream meanwhile runs alone. Many calls in
    a row, so the helper thread's sleep/wake hand-off is exercised as well."""
    NATIVE.set_gemm_threads(2)
    layers = [cpu_kernels.PackedLinear(nn.Linear(128, 256), NATIVE) for _ in range(3)]
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
def test_paged_decode_items_shared_with_the_gemm_thread_match_one_thread():
    """The paged decode hands its items (rows, or some KV heads of a row) to the GEMM pool, whose helper then alternates
    between GEMM panels and attention items with no pause in between: hundreds of such hand-offs give
    bit-identical outputs to one thread."""
    bs, blocks, D = 8, 64, 64
    pool_k, pool_v = mx.random.normal((blocks * bs, 3, D)), mx.random.normal((blocks * bs, 3, D))
    layer = cpu_kernels.PackedLinear(nn.Linear(D * 9, D * 9), NATIVE)
    rows = 6
    tables = mx.array([[(r * 7 + j) % blocks for j in range(8)] for r in range(rows)])
    lengths = mx.array([40 + 3 * r for r in range(rows)])

    def chain(x):
        for _ in range(60):
            q = layer(x).reshape(rows, 9, D)
            x = NATIVE.paged_decode_attention(q, pool_k, pool_v, tables, lengths, bs, 0.1).reshape(rows, 9 * D)
        return x

    x = mx.random.normal((rows, 9 * D))
    outs = {}
    for threads in (1, 2, 1, 2):
        NATIVE.set_gemm_threads(threads)
        got = chain(x)
        mx.eval(got)
        outs.setdefault(threads, []).append(got)
    NATIVE.set_gemm_threads(2)
    assert all(mx.array_equal(o, outs[1][0]).item() for os_ in outs.values() for o in os_)


@NEEDS_PACKED_GEMM
def test_any_number_of_gemm_threads_gives_one_threads_outputs_bit_for_bit():
    """Each thread walks its own part of a GEMM's panels and then takes chunks of the others': every output
    column is still one thread's, summed in the same order, however many threads there are (a many-core
    Linux box runs as many as it has cores; here more threads than cores, and the count changing between
    calls, which starts helpers and leaves some out of a job)."""
    shapes = [(576, 576, mx.float32), (3072, 576, mx.float16), (960, 576, mx.bfloat16), (64, 128, mx.float32)]
    weights = [mx.contiguous((mx.random.normal((o // 16, i, 16)) * 0.05).astype(dt)) for o, i, dt in shapes]
    xs = [mx.random.normal((rows, 576)) for rows in (1, 3, 16, 33)]
    bs, blocks, Hk, D = 16, 96, 8, 64
    pool_k, pool_v = mx.random.normal((blocks * bs, Hk, D)), mx.random.normal((blocks * bs, Hk, D))
    tables = mx.array([[(r * 11 + 5 * j) % blocks for j in range(6)] for r in range(5)])
    lengths = mx.array([1 + (37 * r + 50) % 96 for r in range(5)])
    q = mx.random.normal((5, Hk * 2, D))

    def outputs():
        got = [NATIVE.packed_linear(x[:, : w.shape[1]], w, None) for x in xs for w in weights]
        got.append(NATIVE.paged_decode_attention(q, pool_k, pool_v, tables, lengths, bs, 0.18))
        if NATIVE.packed_gemm:
            got.append(NATIVE.causal_attention(mx.concatenate([q] * 8), pool_k[:300], pool_v[:300], 0.18))
        mx.eval(got)
        return got

    try:
        NATIVE.set_gemm_threads(1)
        want = outputs()
        for threads in (2, 3, 4, 7, 2, 5, 1, 3):
            NATIVE.set_gemm_threads(threads)
            for _ in range(5):
                assert all(mx.array_equal(a, b).item() for a, b in zip(outputs(), want)), threads
    finally:
        NATIVE.set_gemm_threads(2)


@pytest.mark.skipif(NATIVE is None, reason=str(NATIVE_STATUS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_paged_decode_items_of_whole_rows_or_some_heads_agree(rows):
    """An item is a whole row (every KV head, each block read once) or, with two threads and few rows, some
    of a row's KV heads: 1, 2, 4 or 8 heads an item here. Each head's arithmetic is the same either way."""
    bs, blocks, Hk, D = 16, 96, 8, 64
    pool_k, pool_v = mx.random.normal((blocks * bs, Hk, D)), mx.random.normal((blocks * bs, Hk, D))
    tables = mx.array([[(r * 11 + 5 * j) % blocks for j in range(6)] for r in range(rows)])
    lengths = mx.array([1 + (37 * r + 50) % 96 for r in range(rows)])
    q = mx.random.normal((rows, Hk * 2, D))
    outs = []
    for threads in (1, 2):
        NATIVE.set_gemm_threads(threads)
        outs.append(NATIVE.paged_decode_attention(q, pool_k, pool_v, tables, lengths, bs, 0.18))
        mx.eval(outs[-1])
    NATIVE.set_gemm_threads(2)
    assert mx.array_equal(outs[0], outs[1]).item()
    for b in range(rows):
        n = lengths[b].item()
        slots = mx.array([tables[b, p // bs].item() * bs + p % bs for p in range(n)])
        keys, values = pool_k[slots].transpose(1, 0, 2)[None], pool_v[slots].transpose(1, 0, 2)[None]
        want = reference(q[b].reshape(1, Hk * 2, 1, D), keys, values, scale=0.18 / cpu_kernels.LOG2E)
        assert mx.abs(outs[0][b] - want.reshape(Hk * 2, D)).max().item() < TOL


@pytest.mark.skipif(NATIVE is None, reason=str(NATIVE_STATUS))
def test_long_decode_rows_go_in_chunks_that_merge_into_the_whole_in_any_batch(kernel_width):
    """A row longer than 512 keys is computed as equal chunks of whole blocks, merged after (its few KV heads
    no longer leave a thread idle). Where it is cut depends on its length alone: alone or in a batch, on one
    thread or two, a row's output is the same bits, and it is the attention over all its keys."""
    bs, blocks, Hk, r, D = 16, 320, 3, 3, 64
    pool_k, pool_v = mx.random.normal((blocks * bs, Hk, D)), mx.random.normal((blocks * bs, Hk, D))
    lengths = [513, 700, 2047, 40, 1200]
    mb = max(-(-n // bs) for n in lengths)
    tables = mx.array([[(b * 97 + 7 * j) % blocks for j in range(mb)] for b in range(len(lengths))])
    q = mx.random.normal((len(lengths), Hk * r, D))
    batch = {}
    for threads in (1, 2):
        NATIVE.set_gemm_threads(threads)
        batch[threads] = NATIVE.paged_decode_attention(q, pool_k, pool_v, tables, mx.array(lengths), bs, 0.18)
        mx.eval(batch[threads])
    NATIVE.set_gemm_threads(2)
    assert mx.array_equal(batch[1], batch[2]).item()
    default = NATIVE.set_software_prefetch(False)  # the rows read next, prefetched or not: the same bits
    try:
        for prefetch in (False, True):
            NATIVE.set_software_prefetch(prefetch)
            again = NATIVE.paged_decode_attention(q, pool_k, pool_v, tables, mx.array(lengths), bs, 0.18)
            assert mx.array_equal(again, batch[2]).item(), prefetch
    finally:
        NATIVE.set_software_prefetch(default)
    for b, n in enumerate(lengths):
        alone = NATIVE.paged_decode_attention(q[b : b + 1], pool_k, pool_v, tables[b : b + 1], mx.array([n]), bs, 0.18)
        assert mx.array_equal(alone[0], batch[2][b]).item(), n
        slots = mx.array([tables[b, p // bs].item() * bs + p % bs for p in range(n)])
        keys, values = pool_k[slots].transpose(1, 0, 2)[None], pool_v[slots].transpose(1, 0, 2)[None]
        want = reference(q[b].reshape(1, Hk * r, 1, D), keys, values, scale=0.18 / LOG2E)
        assert mx.abs(batch[2][b] - want.reshape(Hk * r, D)).max().item() < TOL, n


@NEEDS_PACKED_GEMM
def test_transpose_linears_packs_where_the_panel_fits():
    block = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40, bias=False))  # 40 outputs: not a multiple of 16
    x = mx.random.normal((3, 64))
    want = block(x)
    assert cpu_kernels.transpose_linears(block, NATIVE) == 2
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
    pool = mx.zeros((16, 1, 8))
    with pytest.raises(ValueError, match="tables"):
        NATIVE.paged_decode_attention(mx.zeros((2, 1, 3, 8)), pool, pool, mx.zeros((3, 2)), mx.zeros((2,)), 8)
    with pytest.raises(ValueError, match="whole blocks"):
        NATIVE.paged_decode_attention(mx.zeros((2, 1, 3, 8)), pool, pool, mx.zeros((2, 2)), mx.zeros((2,)), 5)
    with pytest.raises(ValueError, match="pools"):
        NATIVE.paged_decode_attention(mx.zeros((2, 2, 3, 8)), pool, pool, mx.zeros((2, 2)), mx.zeros((2,)), 8)
    for paged in (NATIVE.paged_decode_attention, NATIVE.paged_decode_partial):  # was a SIGFPE, not an error
        with pytest.raises(ValueError, match="no rows"):
            paged(mx.zeros((0, 1, 8)), pool, pool, mx.zeros((0, 2)), mx.zeros((0,)), 8)
    with pytest.raises(ValueError, match="pools"):
        empty = mx.zeros((16, 1, 0))
        NATIVE.paged_decode_partial(mx.zeros((2, 1, 0)), empty, empty, mx.zeros((2, 2)), mx.zeros((2,)), 8)
    with pytest.raises(ValueError, match="0 < T <= S"):
        NATIVE.causal_attention(mx.zeros((17, 2, 8)), pool, pool)  # more queries than positions
    with pytest.raises(ValueError, match="multiple of Hk"):
        NATIVE.causal_attention(mx.zeros((4, 3, 8)), mx.zeros((16, 2, 8)), mx.zeros((16, 2, 8)))
    with pytest.raises(ValueError, match="float32"):
        NATIVE.causal_attention(mx.zeros((4, 1, 8), dtype=mx.float16), pool, pool)


@pytest.mark.parametrize("native", KERNELS)
def test_transpose_linears_swaps_tensor_parallel_shards(native):
    """Sharded linears get the CPU kernels too, with their collective and their bias kept (one rank here:
    the group's all_sum is the identity, so the outputs are the unsharded layer's)."""
    group = mx.distributed.init()
    up, down = nn.Linear(64, 48), nn.Linear(48, 32)
    block = nn.Sequential(nn.AllToShardedLinear.from_linear(up, group=group),
                          nn.ShardedToAllLinear.from_linear(down, group=group))
    x = mx.random.normal((5, 64))
    want = down(up(x))
    assert cpu_kernels.transpose_linears(block, native) == 2
    assert all(type(layer) is cpu_kernels.ShardedLinear for layer in block.layers)
    assert "bias" in block.layers[1] and "bias" not in block.layers[1].local  # added once, after the sum
    assert block.layers[1].weight.shape == (32, 48)
    assert mx.abs(block(x) - want).max().item() < 1e-5


@NEEDS_PACKED_GEMM
def test_packed_embedding_looks_up_exactly_and_projects_like_the_table():
    table = nn.Embedding(64, 24)
    ids = mx.array([[0, 5, 63, 17], [16, 15, 1, 48]])
    packed = cpu_kernels.PackedEmbedding(table, NATIVE)
    assert mx.array_equal(packed(ids), table(ids)).item()  # a gather: bit for bit
    assert mx.array_equal(packed.weight, table.weight).item()
    x = mx.random.normal((1, 3, 24))
    assert mx.abs(packed.as_linear(x) - table.as_linear(x)).max().item() < 1e-5
    for half in (mx.bfloat16, mx.float16):
        table.weight = table.weight.astype(half).astype(mx.float32)  # a 16-bit checkpoint's table
        f32, b16 = cpu_kernels.PackedEmbedding(table, NATIVE), cpu_kernels.PackedEmbedding(table, NATIVE, half)
        assert b16["weight_p"].dtype == half and b16(ids).dtype == mx.float32
        assert mx.array_equal(b16(ids), table(ids)).item()
        assert mx.array_equal(b16.as_linear(x), f32.as_linear(x)).item()


@NEEDS_PACKED_GEMM
def test_only_a_tied_float32_table_that_fills_whole_panels_is_packed():
    from mlx_lm.models import llama

    def model(vocab: int, tied: bool) -> nn.Module:
        return llama.Model(llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1,
                                           intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                                           vocab_size=vocab, num_key_value_heads=2, tie_word_embeddings=tied))

    m = model(64, tied=True)
    ids = mx.array([[3, 9, 60]])
    want = m(ids)
    assert cpu_kernels.pack_tied_embedding(m, NATIVE)
    assert type(m.model.embed_tokens) is cpu_kernels.PackedEmbedding
    assert mx.abs(m(ids) - want).max().item() < 1e-4  # mlx-lm's own forward runs on the packed table
    assert not cpu_kernels.pack_tied_embedding(model(64, tied=False), NATIVE)  # the lm_head is its own layer
    assert not cpu_kernels.pack_tied_embedding(model(60, tied=True), NATIVE)  # 60 rows: not whole panels
    assert not cpu_kernels.pack_tied_embedding(model(64, tied=True), None)


NEEDS_NATIVE = pytest.mark.skipif(NATIVE is None, reason=NATIVE_STATUS)


@NEEDS_NATIVE
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])  # the whole head, and a partial rotation that leaves the rest
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_native_rope_matches_mlx_per_token(traditional, dims, scale):
    """One position per token, far positions included: equal to mx.fast.rope on the (T, H, 1, D) layout
    meshlm used before, to fp32 rounding of cos/sin, whatever the input's strides."""
    rope = nn.RoPE(dims, traditional=traditional, base=10000, scale=scale)
    table = cpu_kernels.rope_table(rope)
    positions = mx.array([0, 7, 100, 4095, 131071])
    token_major = mx.random.normal((1, 5, 3, 64))  # (1, T, H, D), as a projection produces it
    inputs = [token_major.transpose(0, 2, 1, 3),  # mlx-lm's head-major view of it: read in place
              mx.contiguous(token_major.transpose(0, 2, 1, 3)),  # head-major memory
              mx.random.normal((1, 3, 64, 5)).transpose(0, 1, 3, 2)]  # D not contiguous: gathered first
    for x in inputs:
        want = mx.fast.rope(x.transpose(2, 1, 0, 3), dims, traditional=traditional, base=10000, scale=scale,
                            offset=positions).transpose(2, 1, 0, 3)
        got = NATIVE.rope(x, positions, table.inv_freq, table.dims, table.traditional, table.scale)
        assert got.shape == x.shape and mx.abs(got - want).max().item() < 1e-5
        # stored token-major: a transpose back to (1, T, H, D) is the layout a KV write copies rows from
        assert mx.abs(got.transpose(0, 2, 1, 3) - want.transpose(0, 2, 1, 3)).max().item() < 1e-5


@NEEDS_NATIVE
def test_rope_table_knows_llama3_scaling_and_leaves_other_ropes_alone():
    from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE

    rope = Llama3RoPE(64, base=500000.0, scaling_config={"factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192})
    table = cpu_kernels.rope_table(rope)
    x = mx.random.normal((1, 2, 4, 64))  # (1, H, T, D)
    positions = mx.array([3, 9000, 20000, 65000])
    want = rope(x.transpose(2, 1, 0, 3), offset=positions).transpose(2, 1, 0, 3)
    got = NATIVE.rope(x, positions, table.inv_freq, table.dims, table.traditional, table.scale)
    assert mx.abs(got - want).max().item() < 1e-5
    su = SuScaledRoPE(64, max_position_embeddings=4096, original_max_position_embeddings=4096,
                      short_factor=[1.0] * 32, long_factor=[1.0] * 32)
    assert cpu_kernels.rope_table(su) is None  # it scales x too: it keeps running as mlx-lm's


@NEEDS_NATIVE
def test_native_rms_norm_matches_mlx_and_reads_strided_inputs():
    w = mx.random.normal((96,))
    x = mx.random.normal((2, 3, 96)) * 3
    assert mx.abs(NATIVE.rms_norm(x, w, 1e-5) - mx.fast.rms_norm(x, w, 1e-5)).max().item() < TOL * 4
    lazy_view = (mx.random.normal((96, 7)) * 2).T  # a strided input the kernel gathers itself
    want = mx.fast.rms_norm(lazy_view, w, 1e-6)
    assert mx.abs(NATIVE.rms_norm(lazy_view, w, 1e-6) - want).max().item() < TOL * 4
    norm = nn.RMSNorm(96, eps=1e-6)
    norm.weight = w

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = [norm, nn.RMSNorm(96)]
            self.half = nn.RMSNorm(96)
            self.half.set_dtype(mx.float16)

    holder = Holder()
    assert cpu_kernels.swap_norms(holder, NATIVE) == 2  # float32 only
    assert type(holder.half) is nn.RMSNorm and isinstance(holder.norms[0], cpu_kernels.NativeRMSNorm)
    assert mx.abs(holder.norms[0](x) - mx.fast.rms_norm(x, w, 1e-6)).max().item() < TOL * 4
    assert set(holder.norms[0].parameters()) == {"weight"}  # the same checkpoint keys


@NEEDS_PACKED_GEMM
def test_native_ops_gather_strided_inputs_themselves():
    """No Contiguous node is built for a lazy input: a strided view is gathered inside the kernel."""
    linear = nn.Linear(32, 48)
    packed = cpu_kernels.PackedLinear(linear, NATIVE)
    x = (mx.random.normal((32, 5)) + 0).T  # lazy, transposed
    assert mx.abs(packed(x) - linear(x)).max().item() < 1e-5
    gate, up = (mx.random.normal((40, 3)) + 0).T, (mx.random.normal((40, 3)) + 0).T
    assert mx.abs(NATIVE.swiglu(gate, up) - mlx_swiglu(gate, up)).max().item() < TOL


@NEEDS_NATIVE
def test_native_rope_and_norm_reject_bad_shapes():
    inv = mx.ones((16,))
    x = mx.zeros((1, 3, 2, 32))  # (1, H, T, D)
    with pytest.raises(ValueError, match="even dims"):
        NATIVE.rope(x, mx.array([0, 1]), inv, 31, False, 1.0)
    with pytest.raises(ValueError, match="even dims"):
        NATIVE.rope(mx.zeros((2, 3, 2, 32)), mx.array([0, 1]), inv, 32, False, 1.0)
    with pytest.raises(ValueError, match="inv_freq"):
        NATIVE.rope(x, mx.array([0, 1]), inv, 16, False, 1.0)
    with pytest.raises(ValueError, match="one per token"):
        NATIVE.rope(x, mx.array([0, 1, 2]), inv, 32, False, 1.0)
    with pytest.raises(ValueError, match="one per token"):
        NATIVE.rope(x, mx.array([0.0, 1.0]), inv, 32, False, 1.0)
    with pytest.raises(ValueError, match="weight \\(D,\\)"):
        NATIVE.rms_norm(mx.zeros((2, 8)), mx.zeros((7,)), 1e-5)


@NEEDS_PACKED_GEMM
@pytest.mark.parametrize("bias", [False, True])  # qwen2 biases its q/k/v projections
def test_fused_projections_match_separate_linears(bias):
    linears = [nn.Linear(64, n, bias=bias) for n in (64, 32, 32)]
    x = mx.random.normal((3, 64))
    want = [lin(x) for lin in linears]
    parts = cpu_kernels.fuse_linears([cpu_kernels.PackedLinear(lin, NATIVE) for lin in linears], NATIVE)
    got = [part(x) for part in parts]  # the way mlx-lm calls q, k, v: one GEMM
    assert all(mx.abs(g - w).max().item() < 1e-5 for g, w in zip(got, want))
    other = mx.random.normal((2, 64))
    assert mx.abs(parts[2](other) - linears[2](other)).max().item() < 1e-5  # alone, another input
    assert mx.abs(parts[1].weight - linears[1].weight).max().item() == 0
    owner = dict(parts[0].parameters())
    assert set(owner) == ({"weight_p", "bias"} if bias else {"weight_p"}) and not parts[1].parameters()


@NEEDS_PACKED_GEMM
def test_only_packed_local_linears_fuse():
    packed = cpu_kernels.PackedLinear(nn.Linear(64, 32), NATIVE)
    unbiased = cpu_kernels.PackedLinear(nn.Linear(64, 32, bias=False), NATIVE)
    assert cpu_kernels.fuse_linears([packed, cpu_kernels.TransposedLinear(nn.Linear(64, 32))], NATIVE) is None
    assert cpu_kernels.fuse_linears([packed, unbiased], NATIVE) is None  # mixed biases
    assert cpu_kernels.fuse_linears([packed, packed], None) is None
    reduced = cpu_kernels.ShardedLinear(packed, None, reduce=True)  # a row shard: a sum follows it
    assert cpu_kernels.packed_local(reduced) is None
    assert cpu_kernels.packed_local(cpu_kernels.ShardedLinear(packed, None, reduce=False)) is packed


@NEEDS_PACKED_GEMM
def test_fused_gate_up_swiglu_matches_the_mlp():
    from mlx_lm.models import llama

    from meshlm.model.adapt import GatedMLP

    mlp = llama.MLP(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=96,
                                    num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=100))
    x = mx.random.normal((5, 64))
    want = mlp(x)
    gated = GatedMLP(mlp, cpu_kernels.swiglu_for(NATIVE))
    cpu_kernels.transpose_linears(gated, NATIVE)
    assert gated.fuse(NATIVE) and "gate_proj" not in gated and gated.fuse(NATIVE)
    assert mx.abs(gated(x) - want).max().item() < 1e-4
    assert set(dict(tree_flatten_names(gated))) == {"gate_up_p", "down_proj.weight_p"}


def tree_flatten_names(module: nn.Module) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


@NEEDS_PACKED_GEMM
def test_split_gemm_rejects_bad_sizes():
    w = mx.zeros((4, 8, 16))
    with pytest.raises(ValueError, match="adding up"):
        NATIVE.packed_linear_split(mx.zeros((2, 8)), w, [32, 16])
    with pytest.raises(ValueError, match="multiples of 16"):
        NATIVE.packed_linear_split(mx.zeros((2, 8)), w, [40, 24])
    with pytest.raises(ValueError, match="gate panels then up"):
        NATIVE.packed_swiglu(mx.zeros((2, 8)), mx.zeros((3, 8, 16)))


@NEEDS_NATIVE
def test_paged_decode_refuses_pools_without_heads():
    """A zero-head pool would divide by zero when the kernel groups query heads: refused at graph build."""
    empty = mx.zeros((16, 0, 8))
    with pytest.raises(ValueError, match="pools"):
        NATIVE.paged_decode_attention(mx.zeros((2, 4, 8)), empty, empty, mx.zeros((2, 2)), mx.zeros((2,)), 8)


@NEEDS_NATIVE
def test_a_build_missing_part_of_the_api_is_not_used(monkeypatch):
    """Every function the Python side calls is checked once, at load: a module built from an older
    csrc/cpu_ops.cpp is not used at all, and the log line says what it lacks."""
    assert all(hasattr(NATIVE, name) for name in cpu_kernels.NATIVE_API)
    monkeypatch.delattr(NATIVE, "kv_write")
    native, status = cpu_kernels.native_ops.__wrapped__()  # uncached: the check as at load
    assert native is None and "no kv_write" in status and "make install" in status


def test_no_half_weights_and_its_old_spelling_hold_every_layer_in_float32():
    from meshlm import cli

    def held_half(*flags: str) -> bool:
        return cli.serve_config(cli.build_parser().parse_args(["serve", *flags])).model.half_weights

    assert held_half() and not held_half("--no-half-weights") and not held_half("--no-bf16-weights")


def _collapse_expected() -> bool:
    """MADV_COLLAPSE: Linux 6.1 and later, transparent huge pages not 'never'."""
    import platform
    from pathlib import Path

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return sys.platform == "linux" and (major, minor) >= (6, 1) and thp.exists() and "[never]" not in thp.read_text()


@NEEDS_PACKED_GEMM
def test_weights_moved_into_huge_pages_keep_their_values_and_products():
    """csrc's huge_pages moves an evaluated array's whole 2 MiB pages (a decode step streams every weight:
    fewer TLB misses); the values, and so every product, stay the same. An unevaluated array is skipped."""
    layer = cpu_kernels.PackedLinear(nn.Linear(1024, 4096, bias=False), NATIVE)
    x = mx.random.normal((8, 1024))
    before, values = layer(x), layer["weight_p"] * 1  # a copy
    mx.eval(before, values)
    model = nn.Sequential(layer)
    moved = cpu_kernels.in_huge_pages(model, NATIVE)
    assert moved % (2 << 20) == 0 and moved <= layer["weight_p"].nbytes
    assert (moved > 0) == _collapse_expected()
    assert mx.array_equal(layer["weight_p"], values) and mx.array_equal(layer(x), before)
    assert NATIVE.huge_pages([mx.zeros((4 << 20,)) + 1]) == 0  # lazy: no memory yet, nothing moved


@NEEDS_PACKED_GEMM
def test_neighbouring_small_weights_move_together():
    """A small model's layers are mostly under 4 MiB, and alone hold no whole 2 MiB page (the demo model
    moved 94 of its 257 MiB): memory of arrays that lie next to each other moves as one span."""
    big = mx.arange(6 * 2**20 // 4, dtype=mx.float32)
    mx.eval(big)
    n = big.size // 4
    quarters = [big[i * n:(i + 1) * n] for i in range(4)]  # 1.5 MiB views, one after another
    mx.eval(quarters)
    assert [NATIVE.huge_pages([q]) for q in quarters] == [0] * 4
    assert NATIVE.huge_pages(quarters) >= (4 << 20 if _collapse_expected() else 0)
    assert mx.array_equal(mx.concatenate(quarters), mx.arange(6 * 2**20 // 4, dtype=mx.float32))


def test_huge_pages_are_on_by_default_and_the_flag_turns_them_off():
    from meshlm import cli

    def huge(*flags: str) -> bool:
        return cli.serve_config(cli.build_parser().parse_args(["serve", *flags])).model.huge_pages

    assert huge() and not huge("--no-huge-pages")
