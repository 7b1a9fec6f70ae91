"""The SSD tier: KV blocks as safetensors files that survive restarts.

Layout: `<cache_dir>/<model_fingerprint>/<layout>-<kv dtype>-b<block size>/rank_<r>/<key hex>.safetensors`.
Writes go through a background thread (off the request path), each as a temp
file renamed into place, so a crash leaves either the old state or a whole
file. Every file carries its format, key, salt and a CRC-32 of its tensor
bytes in the safetensors metadata; at start-up the index is rebuilt from
headers and anything torn, truncated, garbled, foreign or of an older format
is deleted and counted, never loaded. The checksum is verified again on every
load. Only regular files are read, opened without blocking or following a
symlink: a FIFO, device, directory or link under a block's name is a bad file.

Several processes (servers, restarts overlapping) may share one directory:
- Temp files live in `tmp/` as `<host>-<pid>-<nonce>-<n>.safetensors`, unique
  per writer, so two processes writing the same key never collide (the last
  rename wins; both files are valid). Start-up validates only the directory's
  own `*.safetensors` and removes a temp file only when its writer is gone
  (same host, pid not alive) or it is older than an hour.
- Capacity and TTL are enforced under `fcntl.flock` on `.lock`: re-scan the
  directory (sizes, mtimes; no headers) into the index and byte total, delete
  expired files, then evict the oldest mtimes (loads touch their file, so mtime
  is the shared LRU order) down to 95% of capacity. A writer re-scans when
  its own total says over capacity, when it has written 5% of capacity since
  its last scan, or when that scan is RESCAN_SECONDS old (so other writers'
  blocks become hits; a lookup then asks the writer thread for one too, so a
  server that only reads sees them); other writes cost O(1) (one scandir per
  5% written).
  Since every writer re-scans and evicts before it has written 5% unseen by
  the others, N processes writing at once keep the directory within
  capacity x (1 + 0.05 N), plus one temp file each.
- A file another process deleted is a plain miss, not a dropped file.
- A block hot in this server's RAM is never loaded from its file, so the block
  manager has the file touched now and then (`touch`), off the engine's thread:
  else the most used prefix would be the first to expire or be evicted here.

A cache directory that cannot be written (full, read-only) turns the tier off
with one warning; serving continues from RAM.

Capacity is kept per directory (model, layout, rank); the TTL applies to the
whole `--kv-cache-dir`: at start-up a tier also deletes the expired files of
the other directories there (another model, dtype, block size or layout that
no server has used for `--ssd-ttl-days`). Else every model upgrade left up to
its capacity behind for good.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import queue
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from meshlm.kv.blockfile import FILE_MODE, DirectWriter, block_file_bytes, read_block, read_header
from meshlm.kv.keys import KEY_BYTES, CacheSalt
from meshlm.kv.store import BlockData as Block, KVShape
from meshlm.platform import pid_alive

log = logging.getLogger(__name__)

FORMAT = "meshlm-kv-2"  # 2: CRC-32 checksums (1: blake2b)
SUFFIX = ".safetensors"
TMP_DIR = "tmp"  # in-flight writes; never scanned as blocks
LOCK_FILE = ".lock"
STALE_TMP_SECONDS = 3600  # no write takes that long: its writer died (or lives on another host)
RESCAN_SECONDS = 10.0  # how stale this process's view of other writers' files may get
RESCAN_FRACTION = 0.05  # a writer re-scans after writing this fraction of capacity since its last scan
LOW_WATER = 0.95  # eviction frees down to this fraction of capacity
# Prefetched blocks waiting for their plan to run are held in RAM, outside the KV budget: at most this many
# bytes (4,096 blocks, the old cap, were 6 GB of the demo model's and tens of GB of a 70B model's).
MAX_STAGED_BYTES = 1 << 30


@dataclass(frozen=True)
class SSDConfig:
    cache_dir: Path
    capacity_bytes: int
    ttl_days: float


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def key_of(name: str) -> bytes | None:
    """The key a block file name stands for, or None for any other name."""
    stem = name[: -len(SUFFIX)]
    if not name.endswith(SUFFIX) or len(stem) != 2 * KEY_BYTES:
        return None
    try:
        key = bytes.fromhex(stem)
    except ValueError:
        return None
    # Exactly the name `_path` gives it: an upper-case (or spaced) name was indexed and counted, but every
    # delete used the lower-case name, so it was never evicted and the directory stayed over capacity.
    return key if key.hex() == stem else None


def _private_dir(path: Path) -> None:
    """Make `path` a directory only this user may enter (0700; tightened where it is ours and looser), or
    raise OSError naming why it cannot be used: a link, not a directory, another user's."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a directory (a link?)")
    if st.st_uid != os.getuid():
        raise OSError(f"{path} belongs to user {st.st_uid}, not to this one: a directory others may write is one "
                      "they can plant KV blocks in")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


def temp_is_stale(name: str, mtime: float, now: float) -> bool:
    """A temp file nobody will rename any more: older than an hour, or written by a dead process on this host."""
    if now - mtime > STALE_TMP_SECONDS:
        return True
    parts = name[: -len(SUFFIX)].rsplit("-", 3)  # host names may contain "-"
    if len(parts) != 4 or not parts[1].isdigit():
        return False  # not our naming: only age removes it
    return parts[0] == socket.gethostname() and not pid_alive(int(parts[1]))


class SSDTier:
    def __init__(self, config: SSDConfig, salt: CacheSalt, rank: int, shape: KVShape) -> None:
        """`shape`: the KV store's on this rank; a file is read only as a block of it."""
        self.config = config
        self.salt = salt
        self.rank = rank
        self.shape = shape
        self.dir = config.cache_dir / salt.model_fingerprint / salt.directory / f"rank_{rank}"
        self.enabled = True
        self.dropped = 0  # files rejected at start-up or on load
        self.writes = 0
        self.evictions = 0
        # key -> file size; insertion order = LRU order. Other processes' files join it at each re-scan.
        self._index: dict[bytes, int] = {}
        self._bytes = 0  # sum of self._index's sizes, kept as it changes (the writer checks it per block)
        self._last_scan = time.monotonic()
        self._written = 0  # bytes this process wrote since its last scan: what the others may not have seen
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=1024)
        self._writer: threading.Thread | None = None
        self._files = DirectWriter()  # used by the writer thread alone (it owns an aligned buffer)
        self._temp_names = itertools.count()
        self._nonce = uuid.uuid4().hex[:8]  # two tiers in one process never share a temp name
        self._staged: dict[bytes, Block] = {}  # read and verified by `prefetch`, taken by the next `load`
        self._scan_queued = False  # a lookup asked the writer thread for a re-scan (`_rescan_when_due`)
        self._queued: set[bytes] = set()  # keys queued to be written: a second save of one is dropped
        if config.capacity_bytes < block_file_bytes(shape):  # every block written would be evicted at once
            self._disable(f"--ssd-cache-gb {config.capacity_bytes / 2**30:.3g} holds no KV block of this store "
                          f"(up to {block_file_bytes(shape)} bytes each, with its header)")
            return
        try:
            self._make_private_dirs()
            self._rebuild_index()
        except OSError as exc:
            self._disable(f"cannot use {self.dir}: {exc}")
            return
        try:
            self._expire_others()
        except OSError as exc:  # another process's directory: never a reason to turn this tier off
            log.warning("SSD KV tier: could not expire other directories under %s: %s", config.cache_dir, exc)

    def _make_private_dirs(self) -> None:
        """The cache root and each level down to this rank's directory: real directories of this user, no
        one else's to read or write. Blocks hold prompts' KV (their text can be read back from it), and a
        directory another user may write is one they can plant blocks in (answers changed) or links in."""
        self.config.cache_dir.parent.mkdir(parents=True, exist_ok=True)
        level = self.config.cache_dir
        for part in (None, *self.dir.relative_to(self.config.cache_dir).parts):
            if part is not None:
                level = level / part
            _private_dir(level)

    def _expire_others(self) -> None:
        """Delete the expired block files of the other model/layout/rank directories under the cache root:
        nobody else looks there until a server of that kind starts. Directories are left (a server of that
        kind may be starting in one)."""
        root = self.config.cache_dir
        expiry = time.time() - self.config.ttl_days * 86400
        removed = 0
        for rank_dir in root.glob("*/*/rank_*"):
            if rank_dir == self.dir or rank_dir.is_symlink() or not rank_dir.is_dir():
                continue
            with os.scandir(rank_dir) as entries:
                for e in entries:
                    if key_of(e.name) is None or not e.is_file(follow_symlinks=False):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        if e.stat(follow_symlinks=False).st_mtime < expiry:
                            os.unlink(e.path)
                            removed += 1
        if removed:
            log.info("SSD KV tier: %d expired files of other models or layouts removed under %s", removed, root)

    # -- start-up ---------------------------------------------------------
    def _rebuild_index(self) -> None:
        """Validate every block file's header (dropping bad ones) and clear dead writers' temp files.

        Creates nothing, so an unused tier leaves its directory empty."""
        expiry = time.time() - self.config.ttl_days * 86400
        with os.scandir(self.dir) as entries:
            files = [Path(e.path) for e in entries if e.name.endswith(SUFFIX) and e.is_file()]
        dated = [(mtime, p) for p in files if (mtime := _mtime(p)) is not None]  # oldest first: LRU order
        expired = 0
        for mtime, path in sorted(dated):
            if mtime < expiry:  # its time is up, as at a re-scan: evicted, not a bad file
                path.unlink(missing_ok=True)
                expired += 1
                continue
            try:
                key = self._validate(path)
                size = path.stat().st_size
            except FileNotFoundError:  # evicted by another process meanwhile: not a bad file
                continue
            except OSError as exc:  # this process cannot read it now (EMFILE, EIO, EACCES): left as it is
                log.warning("SSD KV tier: leaving %s, not readable now: %s", path.name, exc)
                continue
            if key is None:
                self._drop(path)
            else:
                self._put(key, size)
        self.evictions += expired
        stale = self._remove_stale_temps()
        log.info("SSD KV tier %s: %d blocks, %d expired, %d dropped", self.dir, len(self._index), expired,
                 self.dropped)
        if self._bytes > self.config.capacity_bytes:  # a restart with a smaller --ssd-cache-gb
            # enforced now: else only at the first write or lookup, which a worker rank may not make for long
            self._enforce_capacity()
        if stale:
            log.info("SSD KV tier %s: removed %d temp files of writers that are gone", self.dir, stale)

    def _validate(self, path: Path) -> bytes | None:
        """The file's key if it is a whole block of this salt and rank, else None.

        Raises OSError (FileNotFoundError: another process deleted it meanwhile) when it cannot be read
        now: the file may be good, so it is not dropped."""
        try:
            header, size = read_header(path, self.shape)
            meta = header.get("__metadata__") or {}
            key = key_of(path.name)
            # Keys are the same on every rank, so the rank is checked too: another rank's shard is foreign.
            ok = (key is not None and meta.get("format") == FORMAT and meta.get("salt") == self.salt.root().hex()
                  and meta.get("key") == key.hex() and meta.get("rank") == str(self.rank)
                  and size == path.stat().st_size)
            return key if ok else None
        except OSError:
            raise
        except Exception:  # whatever is wrong with a file, it is dropped, never fatal
            return None

    def _remove_stale_temps(self) -> int:
        """Delete temp files whose writer is gone; another live process's in-flight write is left alone."""
        removed, now = 0, time.time()
        try:
            entries = list(os.scandir(self.dir / TMP_DIR))
        except (FileNotFoundError, NotADirectoryError):  # none yet, or a file in its place (`_temp_dir`)
            return 0
        for e in entries:
            try:
                if temp_is_stale(e.name, e.stat(follow_symlinks=False).st_mtime, now):
                    os.unlink(e.path)
                    removed += 1
            except FileNotFoundError:  # renamed into place or removed meanwhile
                pass
            except OSError as exc:  # a directory, or what else no writer of ours made: left, and never fatal
                log.warning("SSD KV tier: leaving %s in %s: %s", e.name, self.dir / TMP_DIR, exc)
        return removed

    def _drop(self, path: Path) -> None:
        self.dropped += 1
        try:
            path.unlink()
        except OSError:
            pass

    # -- lookups ----------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        if not self.enabled:
            return False
        self._rescan_when_due()
        return key in self._index

    def _rescan_when_due(self) -> None:
        """A server that only reads (its prompts all cached already) must see other writers' blocks too:
        a lookup past RESCAN_SECONDS asks the writer thread for a re-scan (never on this, the engine's,
        thread: a scandir of thousands of files would stall a step)."""
        if self._scan_queued or time.monotonic() - self._last_scan < RESCAN_SECONDS:
            return
        self._scan_queued = True
        self._start_writer()
        try:
            self._queue.put_nowait(None)
        except queue.Full:  # writes pending: the writer re-scans after them anyway
            self._scan_queued = False

    def prefetch(self, key: bytes) -> bool:
        """Read and verify a block now, so a plan loads only blocks known to be good; the next `load`
        of `key` takes it from memory. False (a miss) for a missing, bad or expired file."""
        if key in self._staged:
            return True
        if key not in self:
            return False
        if (len(self._staged) + 1) * self.shape.block_bytes > MAX_STAGED_BYTES:
            # plans that never ran (a failed step, an admission that waits), or one loading more than this:
            # forget the reads (a load reads a block again when it is not staged)
            self._staged.clear()
        block = self._read(key)
        if block is not None:
            self._staged[key] = block
        return block is not None

    def forget(self, key: bytes) -> None:
        """Never list `key` again, and delete its file: another rank of the cluster could not load its own
        copy, so this one is of no use (a miss from now on; the prefix is recomputed and saved anew)."""
        self._staged.pop(key, None)
        self._forget(key)
        try:
            self._path(key).unlink()
        except OSError:  # gone already, or a directory squatting the name: no longer listed either way
            pass

    def load(self, key: bytes) -> Block | None:
        """The block `key`: prefetched, else read and verified now; None if missing or bad."""
        block = self._staged.pop(key, None)
        return block if block is not None else self._read(key)

    def _read(self, key: bytes) -> Block | None:
        """Read and verify a block; a bad file is deleted and counted as dropped, an expired one as evicted
        (as a re-scan counts it), and None returned.

        A file another process deleted (evicted) is a plain miss: forgotten, not counted."""
        path = self._path(key)
        try:
            # lstat: a symlink's target (a device's mtime) is nothing of ours; the read refuses the link
            if path.lstat().st_mtime < time.time() - self.config.ttl_days * 86400:
                with self._lock:  # the writer thread counts its evictions under it too
                    self._pop(key)
                    self.evictions += 1
                path.unlink(missing_ok=True)
                return None
            block, meta = read_block(path, self.shape)
            if meta.get("key") != key.hex() or meta.get("rank") != str(self.rank):
                raise ValueError("a block of another key or rank")
        except Exception as exc:  # any unreadable file is a miss, never a crash
            self._forget(key)
            if isinstance(exc, FileNotFoundError) or not os.path.lexists(path):
                return None
            if isinstance(exc, OSError):  # this process's trouble (EMFILE, EIO, EACCES), not the file's:
                # kept for the processes sharing it (the next re-scan lists it again)
                log.warning("KV block %s not read: %s", path.name, exc)
                return None
            log.warning("dropping KV block %s: %s", path.name, exc)
            self._drop(path)
            return None
        with self._lock:  # refresh LRU position
            size = self._index.pop(key, None)
            if size is not None:
                self._index[key] = size
        try:  # and on disk: mtime is the LRU order other processes and restarts see; the TTL counts from it
            os.utime(path)
        except FileNotFoundError:  # evicted right after we read it
            self._forget(key)
        except OSError:
            pass
        return block

    @property
    def nbytes(self) -> int:
        """Bytes of findable blocks: none once the tier is off."""
        return self._bytes if self.enabled else 0

    def _put(self, key: bytes, size: int) -> None:
        self._pop(key)
        self._index[key] = size
        self._bytes += size

    def _pop(self, key: bytes) -> None:
        self._bytes -= self._index.pop(key, 0)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._pop(key)

    # -- writes -----------------------------------------------------------
    def save(self, key: bytes, block: Block) -> None:
        """Queue a block for writing (its arrays must already be evaluated)."""
        if not self.enabled or key in self._index or key in self._queued:
            return
        self._start_writer()
        try:
            self._queue.put_nowait(("write", key, block))
            self._queued.add(key)
        except queue.Full:  # the disk is behind; the block stays RAM-only
            pass

    def touch(self, key: bytes) -> None:
        """The block is in use (from RAM): it becomes the most recently used here, and its file's mtime,
        the LRU order and TTL clock every process sharing the directory sees, is refreshed by the writer."""
        if not self.enabled:
            return
        with self._lock:
            size = self._index.pop(key, None)
            if size is None:  # not listed here (another rank's view, or evicted meanwhile): nothing to refresh
                return
            self._index[key] = size
        self._start_writer()
        try:
            self._queue.put_nowait(("touch", key))
        except queue.Full:  # the disk is behind: a refresh can wait for the next hit
            pass

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued writes are on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="meshlm-ssd", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:  # a lookup found the last scan stale
                    self._scan_queued = False
                    if self.enabled:
                        self._enforce_capacity()
                elif item[0] == "touch":
                    if self.enabled:
                        self._touch_file(item[1])
                else:
                    self._queued.discard(item[1])
                    if self.enabled:
                        self._write(item[1], item[2])
            except Exception as exc:  # OSError on ENOSPC/EROFS; the tier turns itself off, the server goes on
                self._disable(f"writing {self.dir} failed: {exc}")
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, block: Block) -> None:
        arrays = {f"k.{i}": a for i, a in enumerate(block.keys)}
        arrays.update({f"v.{i}": a for i, a in enumerate(block.values)})
        meta = {"format": FORMAT, "key": key.hex(), "salt": self.salt.root().hex(), "rank": str(self.rank)}
        path = self._path(key)
        tmp = self._temp_path()
        self._temp_dir()
        try:
            self._files.write(tmp, arrays, meta)
            os.replace(tmp, path)
            size = path.stat().st_size
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            # Our temp file was removed (a start-up that took us for dead), the new file was evicted at
            # once, or something not ours (a directory) holds this block's name: this block stays RAM-only,
            # the tier is fine (a directory in one block's place switched the whole tier off).
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            log.warning("KV block %s not kept on disk: %s", path.name, exc)
            return
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._put(key, size)
            self.writes += 1
            self._written += size
        if self._scan_due():
            self._enforce_capacity()

    def _touch_file(self, key: bytes) -> None:
        try:
            os.utime(self._path(key), follow_symlinks=False)
        except FileNotFoundError:  # evicted by another process: a miss from now on
            self._forget(key)
        except OSError:  # a file we cannot touch stays as it is; its loads still verify it
            pass

    def _temp_dir(self) -> None:
        """Where writes start; a file squatting its name (nothing a writer of ours makes) is replaced, where
        it switched the whole tier off."""
        where = self.dir / TMP_DIR
        try:
            where.mkdir(mode=0o700, exist_ok=True)
        except FileExistsError:
            log.warning("SSD KV tier: replacing the file %s by the directory writes need", where)
            where.unlink()
            where.mkdir(mode=0o700, exist_ok=True)
        _private_dir(where)

    def _scan_due(self) -> bool:
        capacity = self.config.capacity_bytes
        return (self._bytes > capacity or self._written >= capacity * RESCAN_FRACTION
                or time.monotonic() - self._last_scan >= RESCAN_SECONDS)

    def _temp_path(self) -> Path:
        """A name no other writer uses; start-up reads the pid back to tell live writers from dead ones."""
        name = f"{socket.gethostname()}-{os.getpid()}-{self._nonce}-{next(self._temp_names)}{SUFFIX}"
        return self.dir / TMP_DIR / name

    def _enforce_capacity(self) -> None:
        """Under the directory lock: re-scan, then evict least recently used files down to LOW_WATER.

        The lock makes the processes sharing the directory evict in turn, each
        from a fresh view, so they neither over-evict nor miss each other's bytes."""
        with self._dir_lock():
            self._rescan()
            if self._bytes <= self.config.capacity_bytes:
                return
            target = int(self.config.capacity_bytes * LOW_WATER)
            while True:
                with self._lock:
                    if self._bytes <= target or not self._index:
                        return
                    oldest = next(iter(self._index))
                    self._pop(oldest)
                    self.evictions += 1
                self._path(oldest).unlink(missing_ok=True)

    @contextlib.contextmanager
    def _dir_lock(self) -> Iterator[None]:
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _rescan(self) -> None:
        """Rebuild the index and byte total from the directory (every process's files); delete expired ones.

        Headers are not read (a load checks them); sizes and mtimes come from one scandir."""
        expiry_ns = (time.time() - self.config.ttl_days * 86400) * 1e9
        found = self._scan()
        # mtimes are coarse (a clock tick of a few ms): equal ones keep this process's own LRU order,
        # files it has not seen yet counting as newer.
        with self._lock:
            known = {key: i for i, key in enumerate(self._index)}
        found.sort(key=lambda f: (f[0], known.get(f[1], len(known))))
        index = {key: size for mtime, key, size in found if mtime >= expiry_ns}
        with self._lock:
            self._index, self._bytes = index, sum(index.values())
            self._last_scan, self._written = time.monotonic(), 0
        for mtime, key, _ in found:
            if mtime < expiry_ns and self._still_expired(key, expiry_ns):
                self._path(key).unlink(missing_ok=True)
                self.evictions += 1

    def _still_expired(self, key: bytes, expiry_ns: float) -> bool:
        """Whether `key`'s file is still past its TTL now: another process that loaded it since the scan
        refreshed its mtime (the LRU and TTL clock), and deleting it by the scan's view lost a live block."""
        try:
            return self._path(key).stat().st_mtime_ns < expiry_ns
        except OSError:
            return False

    def _scan(self) -> list[tuple[int, bytes, int]]:
        """(mtime_ns, key, size) of every block file in the directory, whoever wrote it."""
        found = []
        with os.scandir(self.dir) as entries:
            for e in entries:
                key = key_of(e.name)
                if key is None or not e.is_file(follow_symlinks=False):  # the tier writes regular files only
                    continue
                with contextlib.suppress(FileNotFoundError):  # deleted since listed
                    st = e.stat()
                    found.append((st.st_mtime_ns, key, st.st_size))
        return found

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def _disable(self, reason: str) -> None:
        if self.enabled:
            log.warning("SSD KV cache off, continuing RAM-only: %s", reason)
        self.enabled = False
        self._staged = {}  # prefetched blocks (up to MAX_STAGED_BYTES) no load will take now
