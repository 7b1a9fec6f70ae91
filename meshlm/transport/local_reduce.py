"""The all-reduce of tensor-parallel ranks on one machine, through shared memory.

MLX's ring backend sums over TCP even when every rank is on 127.0.0.1; with one core per rank a
decode step's two sums per layer cost ~230 us each inside the forward, most of it waiting on the
other rank's wakeup (docs/BENCHMARKS.md, issue 17). `_local_reduce` (csrc/local_reduce.cpp) sums
through a file in /dev/shm instead: each rank copies its part in, publishes a sequence number,
spins briefly (then sleeps on a futex) for the others', and adds the parts in rank order, so
every rank holds the same bits. A peer that exits makes the waiting sum raise "peer lost", as a
ring peer does.

Used for tensor parallelism when every rank is on this machine (a loopback ring), the device is
the CPU and the module is built (`--local-all-reduce auto`); `on` insists, `off` keeps MLX's
backend. The file's name is derived from the cluster secret and the control address, which every
rank knows; rank 0 creates it once every rank has passed the handshake, just before welcoming them, and
removes its name as soon as they have all mapped it.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from meshlm.platform import interrupt_deferred

log = logging.getLogger(__name__)

SLOT_BYTES = 1 << 20  # per rank and round: a larger sum goes in rounds of this size
SPIN_US = 50.0  # how long a rank with a core of its own spins before it sleeps on the futex


PEER_LOST = "local all-reduce: peer lost"  # how csrc/local_reduce.cpp's errors begin when a rank is gone


def is_peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a sum's report that another rank is gone. It reaches Python through MLX's eval,
    which turns every C++ exception into a plain RuntimeError, so only its message tells."""
    return isinstance(exc, RuntimeError) and str(exc).startswith(PEER_LOST)


@functools.cache
def native_module() -> tuple[Any, str]:
    """The compiled `_local_reduce` module, or None, and a phrase saying which for the log."""
    try:
        with interrupt_deferred():  # a nanobind module's init
            from meshlm.transport import _local_reduce
    except ImportError as e:
        return None, f"not built ({e}); run `make install` with a C++20 compiler"
    if _local_reduce.mlx_version != mx.__version__:
        return None, f"built for MLX {_local_reduce.mlx_version}, not {mx.__version__}; run `make install`"
    return _local_reduce, "shared memory (_local_reduce)"


def group_path(secret: str, control_addr: str) -> Path:
    """The group's file: the same on every rank of one cluster, another for every other cluster."""
    digest = hashlib.sha256(f"meshlm-local-reduce\0{secret}\0{control_addr}".encode()).hexdigest()[:24]
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"meshlm-reduce-{digest}"


def ring_is_local(ring_file: Path | None) -> bool:
    """Whether every rank of an MLX ring hostfile listens on a loopback address (so shares this machine)."""
    if ring_file is None:
        return False
    try:
        entries = json.loads(Path(ring_file).read_text())
        hosts = [addr.rsplit(":", 1)[0] for rank in entries for addr in rank]
        return bool(hosts) and all(ipaddress.ip_address(h.strip("[]")).is_loopback for h in hosts)
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def spin_us(world: int) -> float:
    """Spin only where each rank has a core of its own: ranks sharing cores would spin on each other's."""
    pinned = len(os.sched_getaffinity(0)) < (os.cpu_count() or 1) if hasattr(os, "sched_getaffinity") else False
    return SPIN_US if pinned or (os.cpu_count() or 1) >= world else 0.0


class SharedMemoryGroup:
    """A tensor-parallel group's sums through one shared file. Built before the model is adapted (its
    layers keep it), joined once the ranks have met: `create` on rank 0 before it welcomes the others, `join`
    on the others once welcomed."""

    def __init__(self, path: Path, rank: int, world: int, native, spin: float) -> None:
        self.path, self.rank, self.world = path, rank, world
        self._native, self._spin = native, spin
        self._group = None
        self._removed = False

    def create(self) -> None:
        self._group = self._open(create=True)

    def join(self) -> None:
        self._group = self._open(create=False)

    def _open(self, create: bool):
        try:
            return self._native.LocalGroup(str(self.path), self.rank, self.world, SLOT_BYTES, self._spin, create)
        except (OSError, RuntimeError, ValueError) as exc:
            raise RuntimeError(f"{exc} (--local-all-reduce needs every rank on this machine; "
                               "`--local-all-reduce off` uses MLX's backend)") from None

    def all_sum(self, x: mx.array) -> mx.array:
        if self._group is None:
            raise RuntimeError("the local all-reduce group was used before the ranks joined it")
        if x.dtype != mx.float32:  # the sums are float32; anything else goes through float32 and back
            return self._native.all_sum(x.astype(mx.float32), self._group).astype(x.dtype)
        return self._native.all_sum(x, self._group)

    def stats(self) -> tuple[int, float, float]:
        """(sums, seconds in them, seconds of which waiting for the other ranks' parts) on this rank."""
        return self._group.stats() if self._group is not None else (0, 0.0, 0.0)

    def abort(self) -> None:
        """Make every rank's waiting sums raise (a failed cluster must not leave a rank asleep in one)."""
        if self._group is not None:
            self._group.abort()

    def remove_file_once_joined(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every rank to map the file (they do within milliseconds of
        being welcomed), then remove its name; True if it could."""
        deadline = time.monotonic() + timeout
        while self._group is not None and self._group.joined < self.world and time.monotonic() < deadline:
            time.sleep(0.001)
        self.remove_file(only_once_joined=True)
        return self._removed

    def remove_file(self, only_once_joined: bool = False) -> None:
        """Remove the file's name (rank 0, which made it; `only_once_joined`: once every rank has it
        mapped). The mappings stay valid, and nothing is left in /dev/shm however the ranks end."""
        if self.rank != 0 or self._removed:
            return
        if only_once_joined and (self._group is None or self._group.joined < self.world):
            return
        self.path.unlink(missing_ok=True)
        self._removed = True
