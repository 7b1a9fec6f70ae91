"""The SSD tier shared by several processes: two SSDTier instances on one directory stand for two servers.

Temp files, the lock-protected re-scan and eviction, files deleted behind a
tier's back. Real multi-process runs are in tests/integration/test_prefix_cache_server.py.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from meshlm.kv import ssd
from meshlm.kv.keys import CacheSalt, block_keys
from meshlm.kv.store import BlockData as Block, KVShape
from meshlm.kv.ssd import LOCK_FILE, SUFFIX, TMP_DIR, SSDConfig, SSDTier, temp_is_stale

BS = 4
SALT = CacheSalt("f" * 24, "float32", "tp1", BS)
SHAPE = KVShape(2, 2, 8, BS, mx.float32)  # the store `fake_block`'s blocks belong to


def fake_block(seed: int) -> Block:
    keys = mx.random.split(mx.random.key(seed), 4)
    arrays = [mx.random.normal((2, BS, 8), key=k) for k in keys]
    mx.eval(arrays)
    return Block(arrays[:2], arrays[2:])


def keys(n: int, seed: int) -> list[bytes]:
    return block_keys([(seed * 1000 + i) % 397 + 3 for i in range(n * BS)], SALT)


def tier(root: Path, capacity: int = 2**30, ttl_days: float = 7.0) -> SSDTier:
    return SSDTier(SSDConfig(root, capacity, ttl_days), SALT, 0, SHAPE)


def write(t: SSDTier, ks: list[bytes], seed: int, mtime: float | None = None) -> None:
    """Save and flush each block; `mtime` (then +1 s per block) pins the LRU order coarse clocks could blur."""
    for i, k in enumerate(ks):
        t.save(k, fake_block(seed + i))
        t.flush()
        if mtime is not None:
            os.utime(t._path(k), (mtime + i, mtime + i))


def on_disk(t: SSDTier) -> dict[bytes, int]:
    return {bytes.fromhex(p.name[: -len(SUFFIX)]): p.stat().st_size for p in t.dir.glob("*" + SUFFIX)}


@pytest.fixture(scope="module")
def block_size(tmp_path_factory) -> int:
    """Bytes of one block file (all fake blocks have the same shapes)."""
    t = tier(tmp_path_factory.mktemp("size"))
    write(t, keys(1, seed=99), seed=0)
    return t.nbytes


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- temp files ---------------------------------------------------------------------


def test_temp_files_are_per_writer_and_live_writers_are_not_stale(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)  # two tiers in one process still differ
    names = {a._temp_path().name, a._temp_path().name, b._temp_path().name}
    assert len(names) == 3
    assert all(n.endswith(SUFFIX) and f"-{os.getpid()}-" in n for n in names)
    assert a._temp_path().parent == a.dir / TMP_DIR
    now = time.time()
    assert not any(temp_is_stale(n, now, now) for n in names)
    assert all(temp_is_stale(n, now - 3601, now) for n in names)  # nothing takes an hour to write


def test_startup_removes_only_temp_files_of_gone_writers(tmp_path):
    t = tier(tmp_path)
    write(t, keys(1, seed=1), seed=1)
    tmp = t.dir / TMP_DIR
    host, old = socket.gethostname(), time.time() - 2 * 3600
    files = {
        "live": f"{host}-{os.getpid()}-aaaa0000-7{SUFFIX}",
        "dead": f"{host}-{dead_pid()}-bbbb0000-0{SUFFIX}",
        "live_but_old": f"{host}-{os.getpid()}-cccc0000-1{SUFFIX}",
        "other_host": f"elsewhere-{dead_pid()}-dddd0000-0{SUFFIX}",  # its pid means nothing here
        "unknown": f"whatever{SUFFIX}",
        "unknown_old": f"ancient{SUFFIX}",
    }
    for kind, name in files.items():
        (tmp / name).write_bytes(b"half a block")
        if kind.endswith("old"):
            os.utime(tmp / name, (old, old))
    again = tier(tmp_path)
    assert sorted(p.name for p in tmp.iterdir()) == sorted(files[k] for k in ("live", "other_host", "unknown"))
    assert again.dropped == 0 and keys(1, seed=1)[0] in again  # temp files are not blocks


@pytest.mark.parametrize("squatter", ["directory_in_tmp", "file_named_tmp"])
def test_what_no_writer_made_in_the_temp_place_never_turns_the_tier_off(tmp_path, squatter):
    """Regression: a directory with a dead writer's temp name (unlink: IsADirectoryError), or a file named
    `tmp` (scandir: NotADirectoryError), switched the whole tier off at every start-up."""
    t = tier(tmp_path)
    write(t, keys(1, seed=1), seed=1)
    if squatter == "directory_in_tmp":
        (t.dir / TMP_DIR / f"{socket.gethostname()}-{dead_pid()}-eeee0000-0{SUFFIX}").mkdir()
    else:
        (t.dir / TMP_DIR).rmdir()
        (t.dir / TMP_DIR).write_bytes(b"")
    again = tier(tmp_path)
    assert again.enabled and keys(1, seed=1)[0] in again
    write(again, keys(1, seed=2), seed=2)  # and writes go on
    assert again.enabled and keys(1, seed=2)[0] in again and (again.dir / TMP_DIR).is_dir()


def test_a_startup_while_another_tier_writes_leaves_its_temp_file_alone(tmp_path, monkeypatch):
    """Regression: start-up globbed *.safetensors, deleted the writer's `<key>.tmp.safetensors`, and the
    writer's rename then failed."""
    writer = tier(tmp_path)
    written, resume = threading.Event(), threading.Event()
    save = ssd.DirectWriter.write

    def paused_save(self, path, arrays, metadata):
        save(self, path, arrays, metadata)
        written.set()
        resume.wait(10)  # the temp file exists, not yet renamed

    monkeypatch.setattr(ssd.DirectWriter, "write", paused_save)
    k = keys(1, seed=2)[0]
    writer.save(k, fake_block(2))
    assert written.wait(10)
    in_flight = list((writer.dir / TMP_DIR).iterdir())
    other = tier(tmp_path)  # another server starting on the same directory
    assert [p.exists() for p in in_flight] == [True] and other.dropped == 0
    resume.set()
    writer.flush()
    assert writer.enabled and writer.writes == 1 and k in writer
    assert list(on_disk(writer)) == [k] and not any((writer.dir / TMP_DIR).iterdir())


def test_two_tiers_writing_the_same_key_both_succeed(tmp_path, monkeypatch):
    a, b = tier(tmp_path), tier(tmp_path)
    k = keys(1, seed=3)[0]
    written, resume = threading.Event(), threading.Event()
    save = ssd.DirectWriter.write

    def paused_save(self, path, arrays, metadata):  # only a's writer thread pauses
        save(self, path, arrays, metadata)
        if threading.current_thread() is a._writer:
            written.set()
            resume.wait(10)

    monkeypatch.setattr(ssd.DirectWriter, "write", paused_save)
    a.save(k, fake_block(3))
    assert written.wait(10)
    b.save(k, fake_block(4))  # a's temp file is on disk under another name
    b.flush()
    resume.set()
    a.flush()
    assert a.enabled and b.enabled and a.writes == b.writes == 1
    assert list(on_disk(a)) == [k] and not any((a.dir / TMP_DIR).iterdir())
    fresh = tier(tmp_path)
    assert fresh.dropped == 0
    loaded = fresh.load(k)  # the last rename (a's) wins; either would be valid
    assert loaded is not None and mx.array_equal(loaded.keys[0], fake_block(3).keys[0]).item()


# -- capacity and TTL across tiers ---------------------------------------------------


def test_eviction_sees_every_tiers_files_and_goes_by_mtime(tmp_path, block_size, monkeypatch):
    monkeypatch.setattr(ssd, "RESCAN_FRACTION", 1.0)  # only "over capacity by its own count" triggers a scan
    capacity = int(4.5 * block_size)
    t0 = time.time() - 100
    a_keys, b_keys = keys(5, seed=10), keys(2, seed=20)
    a = tier(tmp_path, capacity)
    write(a, a_keys[:3], seed=10, mtime=t0)  # a0 a1 a2
    b = tier(tmp_path, capacity)
    write(b, b_keys, seed=20, mtime=t0 + 10)  # b0 b1: 5 blocks, b evicts the oldest, a0
    assert b.evictions == 1 and set(on_disk(b)) == {*a_keys[1:3], *b_keys}
    # a's own total does not know b's blocks yet: one more write stays O(1) and leaves the directory over
    write(a, a_keys[3:4], seed=13, mtime=t0 + 20)
    assert a.evictions == 0 and len(on_disk(a)) == 5 and a.nbytes == 4 * block_size
    write(a, a_keys[4:], seed=14, mtime=t0 + 30)  # over by its own count: re-scan, then evict a1 and a2
    assert a.evictions == 2
    assert set(on_disk(a)) == {*b_keys, *a_keys[3:]}
    assert a.nbytes == sum(on_disk(a).values()) <= capacity
    assert all(k in a for k in b_keys) and a_keys[0] not in a  # the re-scan replaced a's stale view


def test_eviction_frees_down_to_the_low_water_mark(tmp_path, block_size):
    capacity = 20 * block_size  # 95%: 19 blocks
    t = tier(tmp_path, capacity)
    write(t, keys(21, seed=30), seed=30, mtime=time.time() - 100)
    assert t.evictions == 2 and len(on_disk(t)) == 19
    write(t, keys(1, seed=31), seed=31)  # room again: no eviction
    assert t.evictions == 2 and len(on_disk(t)) == 20


def test_a_writer_rescans_after_writing_a_twentieth_of_capacity(tmp_path, block_size, monkeypatch):
    capacity = 100 * block_size
    a, b = tier(tmp_path, capacity), tier(tmp_path, capacity)
    write(a, keys(1, seed=44), seed=44)
    write(b, keys(4, seed=45), seed=45)
    scans = []
    real_scan = SSDTier._scan
    monkeypatch.setattr(SSDTier, "_scan", lambda self: scans.append(self) or real_scan(self))
    write(a, keys(3, seed=46), seed=46)
    assert scans == [] and a.nbytes == 4 * block_size  # 4 blocks written, b's 4 unseen
    write(a, keys(1, seed=47), seed=47)  # the fifth: 5% of capacity
    assert scans == [a] and a.nbytes == 9 * block_size == sum(on_disk(a).values())


def test_two_writers_overshoot_by_at_most_a_twentieth_of_capacity_each(tmp_path, block_size):
    capacity = 40 * block_size
    tiers = tier(tmp_path, capacity), tier(tmp_path, capacity)
    sizes, written = [], 0
    for run in range(60):  # runs of 1-3 blocks, taking turns: each writes some blocks the other has not seen
        t = tiers[run % 2]
        for _ in range(1 + run % 3):
            write(t, keys(1, seed=100 + written), seed=written)
            written += 1
            sizes.append(sum(on_disk(t).values()))
    left = len(on_disk(tiers[0]))
    assert sum(t.evictions for t in tiers) == written - left  # every block written once, the rest evicted
    assert capacity * 0.9 < max(sizes) <= capacity * (1 + 2 * ssd.RESCAN_FRACTION), max(sizes) / capacity


def test_writes_rescan_every_few_seconds_even_under_capacity(tmp_path, monkeypatch):
    a, b = tier(tmp_path), tier(tmp_path)
    write(a, keys(1, seed=40), seed=40)
    write(b, keys(2, seed=41), seed=41)
    scans = []
    real_scan = SSDTier._scan
    monkeypatch.setattr(SSDTier, "_scan", lambda self: scans.append(self) or real_scan(self))
    write(a, keys(1, seed=42), seed=42)
    assert scans == [] and a.nbytes < sum(on_disk(a).values())  # per-write cost stays O(1)
    monkeypatch.setattr(ssd, "RESCAN_SECONDS", 0.0)
    write(a, keys(1, seed=43), seed=43)
    assert scans == [a] and a.nbytes == sum(on_disk(a).values())
    assert all(k in a for k in keys(2, seed=41))  # b's blocks are hits for a now, and never rewritten


def test_a_tier_that_only_reads_sees_other_writers_blocks(tmp_path, monkeypatch):
    """Regression: only a write re-scanned, so a server whose own prompts were all cached never saw the
    blocks another server sharing the directory wrote (until it restarted). A lookup past RESCAN_SECONDS
    asks the writer thread for a re-scan."""
    reader, writer = tier(tmp_path), tier(tmp_path)
    ks = keys(2, seed=45)
    write(writer, ks, seed=45)
    assert ks[0] not in reader  # not due yet
    monkeypatch.setattr(ssd, "RESCAN_SECONDS", 0.0)
    deadline = time.monotonic() + 5
    while ks[0] not in reader:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ks[1] in reader and reader.prefetch(ks[1]) and reader.writes == 0


def test_rescan_deletes_expired_files_of_any_tier(tmp_path, monkeypatch):
    a, b = tier(tmp_path, ttl_days=1), tier(tmp_path, ttl_days=1)
    old = keys(1, seed=50)
    write(b, old, seed=50, mtime=time.time() - 2 * 86400)
    monkeypatch.setattr(ssd, "RESCAN_SECONDS", 0.0)
    write(a, keys(1, seed=51), seed=51)
    assert old[0] not in a and old[0] not in on_disk(a) and a.evictions == 1


def test_a_file_loaded_since_the_scan_is_not_deleted_as_expired(tmp_path, monkeypatch):
    """A re-scan deleted the files its scan saw past the TTL; one another process loaded meanwhile (its
    mtime, the TTL clock, refreshed) was deleted by that stale view. Its mtime is read again first."""
    t = tier(tmp_path, ttl_days=1)
    k = keys(1, seed=52)
    write(t, k, seed=52)
    stale = [(int((time.time() - 2 * 86400) * 1e9), k[0], t._path(k[0]).stat().st_size)]
    monkeypatch.setattr(t, "_scan", lambda: stale)  # the scan saw it old; the file itself is fresh
    t._rescan()
    assert t._path(k[0]).exists() and t.evictions == 0


def test_a_rescan_indexes_regular_files_only(tmp_path):
    """Regression: a FIFO under a block's name joined the index at a re-scan, and reading it hung the engine."""
    t = tier(tmp_path)
    good, odd = keys(1, seed=60), keys(3, seed=61)
    write(t, good, seed=60)
    os.mkfifo(t._path(odd[0]))
    t._path(odd[1]).symlink_to(t._path(good[0]))
    t._path(odd[2]).mkdir()
    t._rescan()
    assert good[0] in t and not any(k in t for k in odd)
    assert t.nbytes == t._path(good[0]).stat().st_size


def test_enforcement_waits_for_the_directory_lock(tmp_path, block_size):
    t = tier(tmp_path, capacity=int(1.5 * block_size))
    write(t, keys(1, seed=60), seed=60)
    fd = os.open(t.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process is evicting
        t.save(keys(1, seed=61)[0], fake_block(61))
        t.flush(timeout=0.5)
        assert t.writes == 2 and len(on_disk(t)) == 2 and t.evictions == 0  # written, waiting to evict
    finally:
        os.close(fd)
    t.flush()
    assert t.evictions == 1 and len(on_disk(t)) == 1


# -- files another process deleted -----------------------------------------------------


def test_a_block_evicted_by_another_tier_is_a_plain_miss(tmp_path, caplog):
    a = tier(tmp_path)
    ks = keys(2, seed=70)
    write(a, ks, seed=70)
    b = tier(tmp_path)
    assert all(k in b for k in ks)
    a._path(ks[0]).unlink()  # a evicted it
    with caplog.at_level(logging.WARNING, logger="meshlm.kv.ssd"):
        assert b.load(ks[0]) is None
    assert b.dropped == 0 and ks[0] not in b and "dropping" not in caplog.text
    assert b.nbytes == a._path(ks[1]).stat().st_size
    assert b.load(ks[1]) is not None


def test_a_file_deleted_during_startup_validation_is_not_counted(tmp_path, monkeypatch):
    a = tier(tmp_path)
    ks = keys(2, seed=80)
    write(a, ks, seed=80)
    read_header = ssd.read_header

    def evicted_meanwhile(path: Path, shape):
        if path.name.startswith(ks[0].hex()):
            path.unlink()
        return read_header(path, shape)

    monkeypatch.setattr(ssd, "read_header", evicted_meanwhile)
    b = tier(tmp_path)
    assert b.enabled and b.dropped == 0
    assert ks[0] not in b and ks[1] in b


def test_only_the_names_the_tier_gives_are_its_blocks():
    """An upper-case (or spaced) hex name was indexed and counted toward capacity, but every delete used the
    lower-case name: such a file was never evicted, and the tier evicted its real blocks instead."""
    k = keys(1, seed=3)[0]
    assert ssd.key_of(k.hex() + SUFFIX) == k
    for name in (k.hex().upper() + SUFFIX, " " + k.hex()[1:] + SUFFIX, k.hex()[:-2] + " 0" + SUFFIX):
        assert ssd.key_of(name) is None, name


def test_a_block_this_process_cannot_read_now_stays_for_the_others(tmp_path, monkeypatch, caplog):
    """Too many open files, an I/O error or a permission refused are this process's trouble, not the
    file's: the block is a miss here and stays on disk for every process sharing the directory (it was
    deleted as a bad file). A bad file is still dropped."""
    t = tier(tmp_path)
    good, bad = keys(2, seed=4)
    write(t, [good, bad], seed=4)

    def busy(*_):
        raise OSError(24, "Too many open files")

    real = ssd.read_block
    monkeypatch.setattr(ssd, "read_block", busy)
    assert t.load(good) is None and t._path(good).exists() and t.dropped == 0
    assert "not read" in caplog.text
    monkeypatch.setattr(ssd, "read_block", real)
    assert tier(tmp_path).load(good) is not None  # the next process (or re-scan) finds it whole
    with open(t._path(bad), "r+b") as f:  # a bad file: dropped as before
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    assert t.load(bad) is None and not t._path(bad).exists() and t.dropped == 1
    monkeypatch.setattr(ssd, "read_header", busy)  # at start-up, too: left, neither indexed nor dropped
    assert good not in tier(tmp_path)._index and t._path(good).exists()


def test_prefetched_blocks_held_in_ram_are_capped_in_bytes(tmp_path, monkeypatch):
    """Prefetched blocks wait in RAM, outside the KV budget, for their plan's load: capped at 4,096 blocks
    they could hold tens of GB of a large model's. The cap is in bytes now; a load whose block was
    dropped from the stage reads it again, the same block."""
    t = tier(tmp_path)
    ks = keys(6, seed=8)
    write(t, ks, seed=8)
    monkeypatch.setattr(ssd, "MAX_STAGED_BYTES", 4 * SHAPE.block_bytes)
    for k in ks:
        assert t.prefetch(k)
        assert len(t._staged) * SHAPE.block_bytes <= ssd.MAX_STAGED_BYTES
    for i, k in enumerate(ks):
        got = t.load(k)
        want = fake_block(8 + i)
        assert all(mx.array_equal(a, b) for a, b in zip(got.keys + got.values, want.keys + want.values))
