"""Facts about the machine meshlm runs on: which device, which dtype, which BLAS."""

from __future__ import annotations

import contextlib
import glob
import importlib
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

OPENBLAS_GLOBS = (
    "/usr/lib/*/openblas-pthread/libopenblasp-r*.so",
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",
)
_PRELOADED_MARK = "MESHLM_OPENBLAS"
# OpenBLAS worker threads spin for 2**28 cycles after each GEMM before sleeping;
# between GEMMs MLX runs its elementwise ops and Python its host work on the same
# few cores, so the spinning steals them. 2**4 cycles: measured +12 % serving
# throughput and half the TTFT on 2 cores (docs/BENCHMARKS.md).
OPENBLAS_THREAD_TIMEOUT = "4"
# glibc mmaps every buffer above its mmap threshold (at most 32 MiB by default) and unmaps it on free,
# so a long prefill's attention blocks and a KV pool's growth fault fresh pages on every use; and it
# returns freed heap tops to the kernel. Keeping allocations on the heap and never trimming it: a
# 32K-token prefill 19.5 -> 8.2 s, 16K 4.45 -> 2.62 s (docs/BENCHMARKS.md). The cost: a process keeps
# its peak heap. Variables the user set win.
GLIBC_MALLOC_TUNING = {
    "MALLOC_TOP_PAD_": str(1 << 30),
    "MALLOC_MMAP_THRESHOLD_": str(1 << 34),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
}


# What mlx-lm raises the soft open-file limit to when imported (a model with many weight files).
MLX_LM_OPEN_FILES = 2048


def cache_root() -> Path:
    """Where meshlm keeps what it can make again: the demo model's export, weight digests, transformers'
    module index (MESHLM_CACHE_DIR, else ~/.cache/meshlm)."""
    env = os.environ.get("MESHLM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshlm"


def import_mlx_lm(name: str = "mlx_lm.utils") -> ModuleType:
    """Import an mlx-lm module without letting mlx-lm set this process's open-file limit.

    mlx_lm.utils calls setrlimit(RLIMIT_NOFILE, (2048, 4096)) when it is first imported. Where the hard
    limit is below 4096 that raises, and the server could not start ("not allowed to raise maximum
    limit"); where the limits are higher it lowers both, the hard one for good, and the server then
    holds ~2,000 client connections at most. So its import runs with that call ignored, and the soft
    limit is raised to MLX_LM_OPEN_FILES only where the hard limit allows, never lowered."""
    set_limit = resource.setrlimit

    def keep_open_file_limit(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            set_limit(which, limits)

    resource.setrlimit = keep_open_file_limit
    try:
        module = importlib.import_module(name)
    finally:
        resource.setrlimit = set_limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MLX_LM_OPEN_FILES if hard == resource.RLIM_INFINITY else min(MLX_LM_OPEN_FILES, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return module


def find_openblas() -> str | None:
    for pattern in OPENBLAS_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


# `python -m` puts the working directory first on sys.path: a `dis.py` or `json.py` there would be imported
# by every meshlm process started from it. -P (3.11+) leaves it out; 3.10 drops it before running meshlm.
_WITHOUT_CWD = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; import runpy; "
                "runpy.run_module('meshlm', run_name='__main__', alter_sys=True)")


def meshlm_command() -> list[str]:
    """How meshlm starts meshlm (its re-exec, its local ranks, `meshlm launch`'s): `python -m meshlm`,
    without the working directory's files on the import path."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", "meshlm"]
    return [sys.executable, "-c", _WITHOUT_CWD]


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has `pid` (someone else's included)."""
    if pid <= 0:  # kill(0, ...) would address our own process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except (OverflowError, OSError):
        return False
    return True


@contextlib.contextmanager
def interrupt_deferred() -> Iterator[None]:
    """Ctrl-C while the native modules (MLX's, meshlm's) initialise takes effect once they have: raised
    inside a nanobind module's init, the KeyboardInterrupt was printed by nanobind itself as a "Critical
    nanobind error" with its traceback, before meshlm's one-line "interrupted". Off the main thread, where
    Python delivers no signals, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def sigterm_as_interrupt() -> None:
    """Until serving begins, SIGTERM (a service manager's stop, `kill`) does what Ctrl-C does at that moment:
    whatever handles SIGINT then (interrupt_deferred's, the join watcher's, or Python's KeyboardInterrupt,
    which the CLI reports as 'interrupted', status 130, after a local cluster's ranks and directory are
    gone). Its default ended the process on the spot: silent, the cluster's directory left in the temporary
    directory and its other ranks left to find rank 0 gone. Serving installs its own handler (a drain)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def as_interrupt(signum, frame) -> None:
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):  # SIGINT ignored (a shell's background job): SIGTERM still stops
            raise KeyboardInterrupt
        handler(signal.SIGINT, frame)

    signal.signal(signal.SIGTERM, as_interrupt)


def maybe_reexec_with_openblas(argv: list[str]) -> None:
    """Restart this process with Debian's OpenBLAS preloaded, if present on Linux.

    MLX's Linux CPU wheel links a reference BLAS; preloading OpenBLAS makes fp32
    GEMM 17x faster here (docs/BENCHMARKS.md). LD_PRELOAD only works at exec time,
    hence the re-exec; glibc reads its malloc tuning then too, so the same exec
    sets GLIBC_MALLOC_TUNING. Set MESHLM_OPENBLAS=0 to opt out of both.
    """
    if sys.platform != "linux" or os.environ.get(_PRELOADED_MARK) in ("0", "1"):
        if os.environ.get(_PRELOADED_MARK) == "1":
            log.info("using OpenBLAS for CPU matmuls (%s, OPENBLAS_THREAD_TIMEOUT=%s); malloc: %s",
                     os.environ.get("LD_PRELOAD"), os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
                     " ".join(f"{k}={os.environ.get(k)}" for k in GLIBC_MALLOC_TUNING))
        return
    env = openblas_env(os.environ)
    if env is None:
        log.info("OpenBLAS not found; CPU matmuls use MLX's reference BLAS (apt-get install libopenblas0-pthread)")
        return
    os.execve(sys.executable, [*meshlm_command(), *argv], env)


def openblas_env(base: dict[str, str]) -> dict[str, str] | None:
    """`base` with Debian's OpenBLAS preloaded and glibc's malloc tuned, as meshlm re-executes itself (also
    for other programs that must run MLX as a meshlm rank does, e.g. benchmarks' probes); None when
    OpenBLAS is not installed."""
    lib = find_openblas()
    if lib is None:
        return None
    env = dict(base)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[_PRELOADED_MARK] = "1"
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)
    for name, value in GLIBC_MALLOC_TUNING.items():
        env.setdefault(name, value)
    return env


def cores_for_this_process() -> int:
    """The CPU cores this rank may use: the CLI gives local tensor-parallel ranks cpus/N through
    OPENBLAS_NUM_THREADS (the one place that share is decided); otherwise every core."""
    share = os.environ.get("OPENBLAS_NUM_THREADS", "")
    return int(share) if share.isdigit() and int(share) > 0 else (os.cpu_count() or 1)


def default_device_is_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.gpu


def resolve_dtype(requested: str, model_dtype: str) -> str:
    """`auto`: float32 on CPU (half-precision matmuls are very slow there), else the model's own."""
    if requested != "auto":
        return requested
    return model_dtype if default_device_is_gpu() else "float32"


DEFAULT_KV_FRACTION = 0.25  # of physical RAM, when --kv-cache-memory is not given
DEFAULT_KV_CAP = 8 * 2**30


def physical_memory() -> int:
    """This machine's RAM, or less when this process's cgroup is limited to less (a container's
    `--memory`, a systemd unit's MemoryMax): a budget taken from the host's RAM is an OOM kill there."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit()
    return min(ram, limit) if limit else ram


# cgroup v1 reports "no limit" as the largest page-aligned int64; v2 as "max"
_NO_LIMIT = 1 << 60


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> int | None:
    """The smallest memory limit on this process's cgroup and its ancestors (v2 `memory.max`, v1
    `memory.limit_in_bytes`, a hybrid layout's v2 under `unified/`), None when there is none or it cannot be
    read. A container sees its own cgroup as the root of the mount: the walk up from the path
    /proc/self/cgroup names reaches it whether or not the path exists inside the container."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            places = [(root, "memory.max"), (root / "unified", "memory.max")]
        elif "memory" in controllers.split(","):
            places = [(root / "memory", "memory.limit_in_bytes")]
        else:
            continue
        here = Path(path.strip() or "/")
        for base, name in places:
            for directory in (here, *here.parents):
                try:
                    text = (base / str(directory).lstrip("/") / name).read_text().strip()
                except OSError:
                    continue
                if text.isdigit() and 0 < int(text) < _NO_LIMIT:
                    limits.append(int(text))
    return min(limits) if limits else None


def kv_budget_bytes(scheduler, ranks_here: int = 1) -> int:
    """One rank's KV budget: --kv-cache-memory (SchedulerConfig.kv_cache_memory, a rank's), else a quarter
    of RAM up to 8 GiB shared by the `ranks_here` ranks of a cluster on this machine (a local cluster's: each
    took the whole default, 4 ranks 100 % of RAM here). Budgets above this machine's RAM together are
    refused: they could never be honoured, only fail later (the pools fill as blocks are written)."""
    ram = physical_memory()
    if scheduler.kv_cache_memory and scheduler.kv_cache_memory * ranks_here > ram:
        each = f" a rank, {ranks_here} ranks on this machine," if ranks_here > 1 else ""
        raise ValueError(f"--kv-cache-memory {scheduler.kv_cache_memory / 2**30:.1f} GiB{each} is more than "
                         f"this machine's RAM ({ram / 2**30:.1f} GiB{', its cgroup limit' if cgroup_memory_limit() == ram else ''})")
    return scheduler.kv_cache_memory or min(int(ram * DEFAULT_KV_FRACTION), DEFAULT_KV_CAP) // ranks_here
