"""Starting a tensor-parallel cluster: checks, hostfiles, rank processes, the MLX group.

Everything that can be wrong is checked before any weights load: the model
must have `shard()`, the rank count must divide its attention and KV heads,
the backend must exist and have its settings.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from meshlm.config import ParallelConfig

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """A cluster that cannot start; the message says what to fix."""


def check_shardable(model_path: Path, n: int) -> None:
    from mlx_lm.utils import _get_classes, load_config

    config = load_config(model_path)
    model_class, _ = _get_classes(config)
    if not callable(getattr(model_class, "shard", None)):
        raise ClusterError(f"model type {config.get('model_type')!r} has no shard(): mlx-lm cannot split it for TP")
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if heads % n or kv_heads % n:
        raise ClusterError(f"--tensor-parallel {n} must divide the attention heads ({heads}) and KV heads "
                           f"({kv_heads}) of {model_path.name}")


def check_backend(cfg: ParallelConfig) -> None:
    import mlx.core as mx

    if not mx.distributed.is_available(cfg.backend):
        raise ClusterError(f"the {cfg.backend} backend is not available in this MLX build")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Host:
    ssh: str
    ips: tuple[str, ...]


def read_hostfile(path: str | Path) -> list[Host]:
    """mlx.launch's format: [{"ssh": "host", "ips": ["10.0.0.1"]}, ...], one entry per rank."""
    try:
        data = json.loads(Path(path).read_text())
        hosts = [Host(str(h["ssh"]), tuple(h.get("ips") or [h["ssh"]])) for h in data]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ClusterError(f"cannot read hostfile {path}: {exc} (expected [{{\"ssh\": ..., \"ips\": [...]}}])")
    if not hosts:
        raise ClusterError(f"hostfile {path} lists no hosts")
    return hosts


def ring_hostfile(hosts: list[Host], base_port: int) -> list[list[str]]:
    """The ring backend's own format: per rank, the ip:port it listens on."""
    return [[f"{h.ips[0]}:{base_port + r}"] for r, h in enumerate(hosts)]


@dataclass(frozen=True)
class LocalCluster:
    """N ranks on this machine: a ring hostfile on free loopback ports and a control port."""

    hostfile: Path
    control_addr: str

    @classmethod
    def create(cls, n: int) -> "LocalCluster":
        tmp = Path(tempfile.mkdtemp(prefix="meshlm-tp-"))
        hostfile = tmp / "ring.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(n)]))
        return cls(hostfile, f"127.0.0.1:{free_port()}")


def init_group(cfg: ParallelConfig, ring_file: Path | None):
    """Join the MLX group as `cfg.rank` (env set here so a child sees the same)."""
    import mlx.core as mx

    os.environ["MLX_RANK"] = str(cfg.rank)
    if cfg.backend == "ring" and ring_file is not None:
        os.environ["MLX_HOSTFILE"] = str(ring_file)
    if cfg.backend == "jaccl":
        os.environ["MLX_IBV_DEVICES"] = str(cfg.ibv_devices)
        os.environ["MLX_JACCL_COORDINATOR"] = str(cfg.jaccl_coordinator)
    group = mx.distributed.init(strict=True, backend=cfg.backend)
    if group.size() != cfg.tensor_parallel or group.rank() != cfg.rank:
        raise ClusterError(f"group is rank {group.rank()} of {group.size()}, expected {cfg.rank} of "
                           f"{cfg.tensor_parallel}: check the hostfile")
    return group


def spawn_local_workers(argv: list[str], cluster: LocalCluster, n: int, log_dir: Path | None = None):
    """Start ranks 1..n-1 of a local cluster as `meshlm serve ... --rank r` children."""
    procs = []
    threads = str(max(1, (os.cpu_count() or 1) // n))
    for rank in range(1, n):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(cluster.hostfile),
               "OPENBLAS_NUM_THREADS": threads}
        cmd = [sys.executable, "-m", "meshlm", *argv, "--rank", str(rank),
               "--ring-hostfile", str(cluster.hostfile), "--control-addr", cluster.control_addr]
        out = open(log_dir / f"rank{rank}.log", "wb") if log_dir else None
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                      start_new_session=False))
    return procs
