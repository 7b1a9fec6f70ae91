"""The KV pools, both ways they get memory: grown by copying (the portable path) and reserved at the whole
budget as zeros made resident only where written (the compiled CPU kernels' `untouched_zeros`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from meshlm.kv.store import KVShape, KVStore
from meshlm.model import cpu_kernels

NATIVE, _ = cpu_kernels.native_ops()
needs_native = pytest.mark.skipif(NATIVE is None, reason="compiled CPU kernels not built")
SHAPE = KVShape(num_layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=mx.float32)


def resident_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def stores() -> list[KVStore]:
    out = [KVStore(SHAPE, max_blocks=40, initial_blocks=2)]
    if NATIVE is not None:
        out.append(KVStore(SHAPE, max_blocks=40, initial_blocks=2, reserve=NATIVE.untouched_zeros))
        out.append(KVStore(SHAPE, max_blocks=40, initial_blocks=2, reserve=NATIVE.untouched_zeros,
                           write_rows=NATIVE.kv_write))
    return out


def head_major(rows: np.ndarray) -> mx.array:
    """(T, kv_heads, head_dim) rows as mlx-lm's attention hands them to a cache: a (1, kv_heads, T, head_dim)
    view of token-major memory."""
    return mx.array(rows).transpose(1, 0, 2)[None]


def test_both_ways_count_and_hold_the_same_blocks():
    rng = np.random.default_rng(0)
    blocks = {b: rng.standard_normal((SHAPE.block_size, 2, 8)).astype(np.float32) for b in (0, 1, 5, 17, 39)}
    seen = []
    for store in stores():
        capacities = []
        for b, kv in sorted(blocks.items()):
            store.ensure(b + 1)
            capacities.append(store.capacity)
            slots = store.block_slots(b)
            for layer in range(SHAPE.num_layers):
                store.write(layer, slots, head_major(kv + layer), head_major(-kv))
        mx.eval(store.keys, store.values)
        assert capacities == [2, 2, 6, 18, 40]  # at least doubling, capped at the budget, either way
        assert store.nbytes == 40 * SHAPE.block_bytes
        for b, kv in blocks.items():
            slots = store.block_slots(b)
            for layer in range(SHAPE.num_layers):
                assert np.array_equal(np.array(store.keys[layer][slots]), kv + layer)
                assert np.array_equal(np.array(store.values[layer][slots]), -kv)
        unwritten = store.block_slots(3)
        assert not np.any(np.array(store.keys[1][unwritten]))  # zeros wherever nothing was written
        seen.append(np.array(store.keys[1][: 40 * SHAPE.block_size]))
        with pytest.raises(ValueError, match="budget holds 40"):
            store.ensure(41)
    assert all(np.array_equal(seen[0], other) for other in seen[1:])


@needs_native
def test_a_reserved_store_never_reallocates():
    store = KVStore(SHAPE, max_blocks=64, initial_blocks=1, reserve=NATIVE.untouched_zeros)
    assert store.capacity == 1 and store.keys[0].shape == (64 * SHAPE.block_size, 2, 8)
    store.ensure(50)
    assert store.capacity == 50 and store.keys[0].shape == (64 * SHAPE.block_size, 2, 8)


@needs_native
def test_untouched_zeros_are_resident_only_where_written():
    before = resident_mb()
    pool = NATIVE.untouched_zeros([1 << 28], mx.float32)  # 1 GiB
    mx.eval(pool)
    assert pool.shape == (1 << 28,) and pool.dtype == mx.float32
    assert resident_mb() - before < 64
    assert mx.max(mx.abs(pool[:: 4099])).item() == 0.0  # reading maps the zero page, costs nothing
    pool[mx.arange(1 << 20)] = mx.ones((1 << 20,))  # 4 MiB written in place: no copy of the gigabyte
    mx.eval(pool)
    assert mx.sum(pool).item() == float(1 << 20)
    assert resident_mb() - before < 128
    del pool


@needs_native
def test_untouched_zeros_take_any_dtype_and_refuse_negative_sizes():
    small = NATIVE.untouched_zeros([3, 5], mx.float16)
    assert small.dtype == mx.float16 and not np.any(np.array(small))
    assert NATIVE.untouched_zeros([0], mx.float32).size == 0
    with pytest.raises(ValueError, match="negative"):
        NATIVE.untouched_zeros([-1], mx.float32)


@needs_native
def test_a_reservation_the_machine_refuses_is_a_clear_error():
    huge = KVShape(num_layers=1, kv_heads=1024, head_dim=1024, block_size=1024, dtype=mx.float32)  # 4 GiB a block
    active = mx.get_active_memory()
    with pytest.raises(ValueError, match="cannot reserve .* MB for the KV pools .* lower --kv-cache-memory"):
        KVStore(huge, max_blocks=1 << 20, reserve=NATIVE.untouched_zeros)  # 4 PiB per pool
    # MLX counts a malloc it could not make as active memory for good; 4 PiB of it once put every later eval
    # of the process over MLX's memory limit, where eval could spin for ever (a hung test run).
    assert mx.get_active_memory() - active < 2**30


def test_a_kv_budget_above_the_machines_ram_is_refused():
    from meshlm.config import SchedulerConfig
    from meshlm.platform import kv_budget_bytes, physical_memory

    with pytest.raises(ValueError, match="more than this machine's RAM"):
        kv_budget_bytes(SchedulerConfig(kv_cache_memory=physical_memory() + 2**30))
    assert kv_budget_bytes(SchedulerConfig(kv_cache_memory=2**30)) == 2**30


def test_a_local_clusters_ranks_share_the_default_budget_and_their_sum_is_checked():
    """Each rank of a local cluster took the whole default (a quarter of RAM): `--context-parallel 4` reserved
    100 % of this machine's RAM in KV pools, and `--kv-cache-memory 20GB` 86 GB, without a word (helper-58)."""
    from meshlm.config import SchedulerConfig
    from meshlm.platform import kv_budget_bytes, physical_memory

    whole = kv_budget_bytes(SchedulerConfig())
    assert kv_budget_bytes(SchedulerConfig(), ranks_here=4) == whole // 4
    per_rank = physical_memory() // 3
    assert kv_budget_bytes(SchedulerConfig(kv_cache_memory=per_rank), ranks_here=3) == per_rank  # a rank's, as given
    with pytest.raises(ValueError, match="a rank, 4 ranks on this machine, is more than this machine's RAM"):
        kv_budget_bytes(SchedulerConfig(kv_cache_memory=per_rank), ranks_here=4)


@needs_native
def test_kv_write_updates_in_place_and_never_changes_a_pool_someone_holds():
    rng = np.random.default_rng(1)
    pool = mx.array(rng.standard_normal((16, 2, 8)).astype(np.float32))
    before = np.array(pool)
    rows = rng.standard_normal((3, 2, 8)).astype(np.float32)
    slots = mx.array([4, 15, 99])  # 99 is outside the pool: skipped, never a stray write
    written = NATIVE.kv_write(pool, slots, head_major(rows))
    want = before.copy()
    want[[4, 15]] = rows[:2]
    assert np.array_equal(np.array(written), want)
    assert np.array_equal(np.array(pool), before)  # still held here: the write went to a copy
    strided = mx.array(rng.standard_normal((2, 8, 5)).astype(np.float32)).transpose(0, 2, 1)[None, :, :3]
    again = NATIVE.kv_write(written, mx.array([0, 1, 2]), strided)  # (1, 2, 3, 8), D not contiguous
    want[[0, 1, 2]] = np.array(strided[0]).transpose(1, 0, 2)
    assert np.array_equal(np.array(again), want)
    with pytest.raises(ValueError, match="one per row"):
        NATIVE.kv_write(pool, mx.array([1, 2]), head_major(rows))
    with pytest.raises(ValueError, match="rows \\(1, Hk, T, D\\)"):
        NATIVE.kv_write(pool, slots, mx.array(rows))


def test_copy_extract_and_load_agree_on_every_kind_of_store():
    """Copy-on-write of a partial block, and a save/restore round trip (what the prefix cache and the SSD
    tier do), give the same positions whichever way the store writes."""
    rng = np.random.default_rng(2)
    seen = []
    for store in stores():
        rows = rng.standard_normal((SHAPE.block_size, 2, 8)).astype(np.float32)
        rng = np.random.default_rng(2)  # the same rows for every store
        store.ensure(6)
        for layer in range(SHAPE.num_layers):
            store.write(layer, store.block_slots(0), head_major(rows + layer), head_major(-rows))
        store.copy(0, 1, tokens=3)
        saved = store.extract([0, 1])
        mx.eval([a for d in saved for a in (*d.keys, *d.values)])
        store.load([4, 5], saved)
        mx.eval(store.keys, store.values)
        for layer in range(SHAPE.num_layers):
            keys = np.array(store.keys[layer])
            assert np.array_equal(keys[store.block_slots(1, 3)], rows[:3] + layer)
            assert not np.any(keys[store.block_slots(1)][3:])  # only the copied positions
            assert np.array_equal(keys[store.block_slots(4)], rows + layer)
            assert np.array_equal(keys[store.block_slots(5)], keys[store.block_slots(1)])
            assert np.array_equal(np.array(store.values[layer])[store.block_slots(4)], -rows)
        seen.append(np.array(store.keys[1][: 6 * SHAPE.block_size]))
    assert all(np.array_equal(seen[0], other) for other in seen[1:])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_host_copies_hold_what_mlx_copies_hold_and_never_pin_the_pools(dtype):
    """`extract(host=True)` (the SSD writer's copies) gathers numpy arrays straight from the pools where
    numpy can view the dtype, and MLX arrays otherwise (bfloat16); either way the same values, copies
    that later writes do not change, and a pool the native write still updates in place."""
    rng = np.random.default_rng(3)
    shape = KVShape(num_layers=2, kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    kinds = [KVStore(shape, max_blocks=40, initial_blocks=8)]
    if NATIVE is not None and dtype == mx.float32:
        kinds.append(KVStore(shape, max_blocks=40, initial_blocks=8, reserve=NATIVE.untouched_zeros,
                             write_rows=NATIVE.kv_write))
    for store in kinds:
        for b in (1, 2, 6):
            for layer in range(shape.num_layers):
                rows = rng.standard_normal((shape.block_size, 2, 8)).astype(np.float32)
                store.write(layer, store.block_slots(b), head_major(rows).astype(dtype), head_major(-rows).astype(dtype))
        want = store.extract([6, 1])
        mx.eval([a for d in want for a in (*d.keys, *d.values)])
        got = store.extract([6, 1], host=True)
        on_host = dtype != mx.bfloat16
        for w, g in zip(want, got):
            for a, b in zip((*w.keys, *w.values), (*g.keys, *g.values)):
                assert isinstance(b, np.ndarray) == on_host and b.shape == (2, 4, 8)
                assert np.array_equal(np.array(a.astype(mx.float32)), np.array(mx.array(b).astype(mx.float32)))
        before = np.array(got[0].keys[0]).copy() if on_host else None
        address = np.asarray(store.keys[0]).ctypes.data if on_host else None
        store.write(0, store.block_slots(6), head_major(np.ones((4, 2, 8), np.float32)).astype(dtype),
                    head_major(np.ones((4, 2, 8), np.float32)).astype(dtype))
        mx.eval(store.keys, store.values)
        if on_host:
            assert np.array_equal(got[0].keys[0], before)  # a copy, not a view of the pool
            if store.reserved:  # the native write updated the pool in place: nothing held on to it
                assert np.asarray(store.keys[0]).ctypes.data == address
