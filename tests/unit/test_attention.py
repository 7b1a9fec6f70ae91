"""The attention seam: backends agree with mlx's fused kernel on paged pools, attention by true
positions, log-sum-exp merging of partial attentions, per-token RoPE."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from meshlm.engine.plan import LOGITS_ALL
from meshlm.model import cpu_kernels
from meshlm.model.adapt import TokenRoPE
from meshlm.model.attention import (CPUBackend, PortableBackend, TokenPositions, attend_batch, attend_exact,
                                    merge_partials)
from meshlm.model.batch import Batch, ExtendGroup, RowSpec

NATIVE, NATIVE_STATUS = cpu_kernels.native_ops()
BACKENDS = [
    pytest.param(lambda: CPUBackend(NATIVE, cores=2), id="native",
                 marks=pytest.mark.skipif(NATIVE is None, reason=str(NATIVE_STATUS))),
    pytest.param(lambda: CPUBackend(None, cores=2), id="mlx-cpu"),
    pytest.param(PortableBackend, id="portable"),
]
H, HK, D, BS = 6, 2, 64, 4


def dense(q, k, v, scale, q_offset):
    """Reference: mlx's fused kernel on one row's contiguous keys (causal, queries at the end)."""
    out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], k[None], v[None], scale=scale,
                                               mask="causal")
    return out[0].transpose(1, 0, 2)


@pytest.mark.parametrize("make", BACKENDS)
@pytest.mark.parametrize("decode_rows", [1, 9])  # nine: the split over two CPU streams
@pytest.mark.parametrize("extend", [[(10, 4), (0, 2)], [(6, 3), (9, 2), (0, 5), (0, 4), (0, 5)]])
@pytest.mark.parametrize("group", [True, False])  # padded groups of extend rows, or each row alone
def test_backends_on_paged_pools_equal_dense_attention(make, decode_rows, extend, group):
    """Decode rows, extend rows alone and in padded groups, fresh (start 0) and continuing ones."""
    mx.random.seed(decode_rows)
    blocks = 96
    pool_k, pool_v = mx.random.normal((blocks * BS, HK, D)), mx.random.normal((blocks * BS, HK, D))
    rng = list(range(blocks))
    rows, used = [], 0
    lengths = [3 + 5 * i for i in range(decode_rows)] + [s for s, _ in extend]
    counts = [1] * decode_rows + [n for _, n in extend]
    for uid, (length, n) in enumerate(zip(lengths, counts)):
        need = -(-(length + n) // BS)
        table = tuple(rng[used : used + need][::-1])  # scattered, out of order
        used += need
        rows.append(RowSpec(uid, length, tuple(range(n)), table, LOGITS_ALL))
    batch = Batch.build(rows, BS, group)
    assert group or not any(isinstance(item, ExtendGroup) for item in batch.extend)
    q = mx.random.normal((batch.num_tokens, H, D))
    new_k, new_v = pool_k[batch.slots], pool_v[batch.slots]  # the step's own keys, as written
    out = attend_batch(q, pool_k, pool_v, batch, make(), D**-0.5, BS, new_k, new_v)
    t = 0
    for spec in batch.rows:
        n = len(spec.token_ids)
        slots = [spec.blocks[p // BS] * BS + p % BS for p in range(spec.start + n)]
        k, v = pool_k[mx.array(slots)].transpose(1, 0, 2), pool_v[mx.array(slots)].transpose(1, 0, 2)
        want = dense(q[t : t + n], k, v, D**-0.5, spec.start)
        assert mx.abs(out[t : t + n] - want).max().item() < 5e-5, spec
        t += n


def test_exact_attention_matches_the_fused_kernel_and_returns_the_log_sum_exp():
    q, k, v = mx.random.normal((5, H, D)), mx.random.normal((HK, 9, D)), mx.random.normal((HK, 9, D))
    mask = mx.arange(9)[None] <= (mx.arange(5)[:, None] + 4)
    out, lse = attend_exact(q, k, v, 0.125, mask)
    assert mx.abs(out - dense(q, k, v, 0.125, 4)).max().item() < 1e-5
    scores = (q.reshape(5, HK, 3, D).transpose(1, 2, 0, 3) * 0.125) @ k.swapaxes(-1, -2)[:, None]
    want = mx.logsumexp(mx.where(mask, scores, -mx.inf), axis=-1).transpose(2, 0, 1).reshape(5, H)
    assert mx.abs(lse - want).max().item() < 1e-4


@pytest.mark.parametrize("spread", [1.0, 300.0])  # 300: scores far beyond exp's range
def test_partials_over_disjoint_keys_merge_into_the_whole(spread):
    mx.random.seed(int(spread))
    q = mx.random.normal((7, H, D)) * spread
    k, v = mx.random.normal((HK, 20, D)), mx.random.normal((HK, 20, D))
    whole = attend_exact(q, k, v, 0.125)
    pick = mx.array([0, 3, 4, 9, 10, 11, 17])  # any split, not only contiguous halves
    rest = mx.array([i for i in range(20) if i not in pick.tolist()])
    parts = [attend_exact(q, k[:, idx], v[:, idx], 0.125) for idx in (pick, rest)]
    out, lse = merge_partials(parts)
    assert mx.abs(out - whole[0]).max().item() < 1e-4 * max(1.0, spread / 30)
    assert mx.abs(lse - whole[1]).max().item() < 1e-3 * spread


def test_a_partial_with_no_keys_contributes_nothing():
    q, k, v = mx.random.normal((3, H, D)), mx.random.normal((HK, 6, D)), mx.random.normal((HK, 6, D))
    whole = attend_exact(q, k, v, 0.125)
    empty = attend_exact(q, k, v, 0.125, mx.zeros((3, 6), dtype=mx.bool_))
    assert mx.isinf(empty[1]).all().item() and mx.abs(empty[0]).max().item() == 0
    out, lse = merge_partials([empty, whole])
    assert mx.abs(out - whole[0]).max().item() < 1e-6 and mx.abs(lse - whole[1]).max().item() < 1e-6


def test_attention_by_true_positions_equals_the_dense_causal_kernel():
    """A row whose KV holds positions in any order: the mask compares true positions."""
    k, v = mx.random.normal((HK, 12, D)), mx.random.normal((HK, 12, D))
    q = mx.random.normal((4, H, D))
    want = dense(q, k, v, 0.125, 8)  # queries at positions 8..11
    order = mx.array([5, 0, 11, 3, 9, 1, 8, 2, 10, 4, 6, 7])  # the same keys, shuffled, with their positions
    mask = order[None] <= mx.arange(8, 12)[:, None]
    out, _ = attend_exact(q, k[:, order], v[:, order], 0.125, mask)
    assert mx.abs(out - want).max().item() < 1e-5


@pytest.mark.parametrize("traditional", [False, True])
def test_token_rope_rotates_each_token_by_its_own_position(traditional):
    rope = TokenRoPE(nn.RoPE(D, traditional=traditional, base=10000))
    x = mx.random.normal((1, H, 6, D))
    contiguous = rope(x, offset=3)  # positions 3..8: the wrapped RoPE, unchanged
    per_token = rope(x, offset=TokenPositions(mx.arange(3, 9)))
    assert mx.abs(per_token - contiguous).max().item() < 1e-6
    scattered = mx.array([0, 7, 7, 100, 2, 50])
    got = rope(x, offset=TokenPositions(scattered))
    for i, p in enumerate(scattered.tolist()):
        one = nn.RoPE(D, traditional=traditional, base=10000)(x[:, :, i : i + 1], offset=p)
        assert mx.abs(got[:, :, i : i + 1] - one).max().item() < 1e-6


def test_the_compiled_backend_attends_row_by_row_and_the_token_order_stays():
    """With the compiled causal attention every extend row is its own call; grouped or not, a batch lays its
    tokens out in one order, so a pipeline's stages agree on their activations whatever their backends."""
    assert PortableBackend.groups_extend_rows and CPUBackend(None).groups_extend_rows
    if NATIVE is not None and NATIVE.packed_gemm:
        assert not CPUBackend(NATIVE).groups_extend_rows
    rows = [RowSpec(u, s, tuple(range(n)), tuple(range(8 * u, 8 * u + 8))) for u, (s, n) in
            enumerate([(0, 5), (0, 4), (6, 3), (0, 5), (9, 2), (2, 1)])]
    grouped, alone = Batch.build(rows, BS), Batch.build(rows, BS, group=False)
    assert any(isinstance(item, ExtendGroup) for item in grouped.extend)
    assert [r.uid for r in grouped.rows] == [r.uid for r in alone.rows]
    assert mx.array_equal(grouped.tokens, alone.tokens) and mx.array_equal(grouped.slots, alone.slots)
