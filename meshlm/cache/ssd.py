"""The SSD tier: KV blocks as safetensors files that survive restarts.

Layout: `<cache_dir>/<model_fingerprint>/<layout>-<kv dtype>-b<block size>/rank_<r>/<key hex>.safetensors`.
Writes go through a background thread (off the request path), each as a temp
file renamed into place, so a crash leaves either the old state or a whole
file. Every file carries its key, salt and a checksum of its tensor bytes in
the safetensors metadata; at start-up the index is rebuilt from headers and
anything torn, truncated, garbled or foreign is deleted and counted, never
loaded. The checksum is verified again on every load.

A cache directory that cannot be written (full, read-only) turns the tier off
with one warning; serving continues from RAM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from meshlm.cache.keys import CacheSalt
from meshlm.cache.pool import Block

log = logging.getLogger(__name__)

FORMAT = "meshlm-kv-1"
SUFFIX = ".safetensors"


@dataclass(frozen=True)
class SSDConfig:
    cache_dir: Path
    capacity_bytes: int
    ttl_days: float


def checksum(arrays: dict[str, mx.array]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        a = arrays[name]
        h.update(name.encode())
        h.update(memoryview(a.view(mx.uint8) if a.dtype.size != 1 else a))
    return h.hexdigest()


def _read_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header; return (header, expected file size). Raises ValueError."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("truncated before header")
        (n,) = struct.unpack("<Q", raw)
        if n > 16 * 2**20:
            raise ValueError("implausible header length")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    return header, 8 + n + end


class SSDTier:
    def __init__(self, config: SSDConfig, salt: CacheSalt, rank: int) -> None:
        self.config = config
        self.salt = salt
        self.rank = rank
        self.dir = config.cache_dir / salt.model_fingerprint / salt.directory / f"rank_{rank}"
        self.enabled = True
        self.dropped = 0  # files rejected at start-up or on load
        self.writes = 0
        self.evictions = 0
        self._index: dict[bytes, int] = {}  # key -> file size; insertion order = LRU order
        self._bytes = 0  # sum of self._index's sizes, kept as it changes (the writer checks it per block)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=1024)
        self._writer: threading.Thread | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._rebuild_index()
        except OSError as exc:
            self._disable(f"cannot use {self.dir}: {exc}")

    # -- start-up ---------------------------------------------------------
    def _rebuild_index(self) -> None:
        expiry = time.time() - self.config.ttl_days * 86400
        files = sorted(self.dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
        for path in files:
            key = self._validate(path, expiry)
            if key is None:
                self._drop(path)
            else:
                self._put(key, path.stat().st_size)
        log.info("SSD KV tier %s: %d blocks, %d dropped", self.dir, len(self._index), self.dropped)

    def _validate(self, path: Path, expiry: float) -> bytes | None:
        try:
            if path.stat().st_mtime < expiry:
                return None
            header, size = _read_header(path)
            meta = header.get("__metadata__") or {}
            key = bytes.fromhex(path.name[: -len(SUFFIX)])
            # Keys are the same on every rank, so the rank is checked too: another rank's shard is foreign.
            ok = (meta.get("format") == FORMAT and meta.get("salt") == self.salt.root().hex()
                  and meta.get("key") == key.hex() and meta.get("rank") == str(self.rank)
                  and size == path.stat().st_size)
            return key if ok else None
        except Exception:  # whatever is wrong with a file, it is dropped, never fatal
            return None

    def _drop(self, path: Path) -> None:
        self.dropped += 1
        try:
            path.unlink()
        except OSError:
            pass

    # -- lookups ----------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return self.enabled and key in self._index

    def load(self, key: bytes) -> Block | None:
        """Read and verify a block; a bad or expired file is deleted and counted, and None returned."""
        path = self._path(key)
        try:
            if path.stat().st_mtime < time.time() - self.config.ttl_days * 86400:
                raise ValueError("older than the TTL")
            arrays, meta = mx.load(str(path), return_metadata=True)
            if (meta.get("checksum") != checksum(arrays) or meta.get("key") != key.hex()
                    or meta.get("rank") != str(self.rank)):
                raise ValueError("checksum mismatch")
            n = len(arrays) // 2
            block = Block([arrays[f"k.{i}"] for i in range(n)], [arrays[f"v.{i}"] for i in range(n)])
        except Exception as exc:  # any unreadable file is a miss, never a crash
            log.warning("dropping KV block %s: %s", path.name, exc)
            with self._lock:
                self._pop(key)
            self._drop(path)
            return None
        with self._lock:  # refresh LRU position
            self._index[key] = self._index.pop(key, 0)
        try:  # and on disk: start-up orders by mtime, and the TTL counts from the last use
            os.utime(path)
        except OSError:
            pass
        return block

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _put(self, key: bytes, size: int) -> None:
        self._pop(key)
        self._index[key] = size
        self._bytes += size

    def _pop(self, key: bytes) -> None:
        self._bytes -= self._index.pop(key, 0)

    # -- writes -----------------------------------------------------------
    def save(self, key: bytes, block: Block) -> None:
        """Queue a block for writing (its arrays must already be evaluated)."""
        if not self.enabled or key in self._index:
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="meshlm-ssd", daemon=True)
            self._writer.start()
        try:
            self._queue.put_nowait((key, block))
        except queue.Full:  # the disk is behind; the block stays RAM-only
            pass

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued writes are on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_loop(self) -> None:
        while True:
            key, block = self._queue.get()
            try:
                if self.enabled:
                    self._write(key, block)
            except Exception as exc:  # mx.save_safetensors raises RuntimeError on ENOSPC/EROFS
                self._disable(f"writing {self.dir} failed: {exc}")
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, block: Block) -> None:
        arrays = {f"k.{i}": a for i, a in enumerate(block.keys)}
        arrays.update({f"v.{i}": a for i, a in enumerate(block.values)})
        meta = {"format": FORMAT, "key": key.hex(), "salt": self.salt.root().hex(), "rank": str(self.rank),
                "checksum": checksum(arrays)}
        path = self._path(key)
        # mx.save_safetensors insists on the .safetensors suffix; a torn temp
        # file fails validation at the next start-up and is dropped.
        tmp = self.dir / f"{key.hex()}.tmp{SUFFIX}"
        mx.save_safetensors(str(tmp), arrays, metadata=meta)
        os.replace(tmp, path)
        with self._lock:
            self._put(key, path.stat().st_size)
            self.writes += 1
        self._enforce_capacity()

    def _enforce_capacity(self) -> None:
        while True:
            with self._lock:
                if self._bytes <= self.config.capacity_bytes or not self._index:
                    return
                oldest = next(iter(self._index))
                self._pop(oldest)
                self.evictions += 1
            self._path(oldest).unlink(missing_ok=True)

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def _disable(self, reason: str) -> None:
        if self.enabled:
            log.warning("SSD KV cache off, continuing RAM-only: %s", reason)
        self.enabled = False
