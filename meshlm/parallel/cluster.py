"""Running a tensor-parallel cluster: rank 0 serves HTTP and leads; ranks 1..N-1 follow.

Three ways in, one code path:
- `meshlm serve --tensor-parallel N` alone: rank 0 writes a loopback ring
  hostfile, starts ranks 1..N-1 itself (as `meshlm serve ... --rank r`), and leads;
- `meshlm serve --hostfile H --rank r` on each host (what `meshlm launch` runs);
- a spawned child, which gets the ring hostfile and control address directly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from meshlm.config import ParallelConfig, ServeConfig
from meshlm.parallel.bootstrap import (ClusterError, LocalCluster, check_backend, check_shardable, init_group,
                                       read_hostfile, ring_hostfile, spawn_local_workers)

log = logging.getLogger(__name__)

HANDSHAKE_SECONDS = 180.0  # workers load their shards before saying HELLO


@dataclass(frozen=True)
class ClusterPorts:
    control_port: int = 52100
    ring_port: int = 52000
    ring_hostfile: str | None = None  # given to spawned children


@dataclass(frozen=True)
class Topology:
    parallel: ParallelConfig  # with control_addr resolved
    ring_file: Path | None
    control_bind: str


def resolve_topology(p: ParallelConfig, ports: ClusterPorts) -> tuple[Topology, LocalCluster | None]:
    if ports.ring_hostfile is not None or (p.backend != "ring" and p.control_addr):
        ring = Path(ports.ring_hostfile) if ports.ring_hostfile else None
        return Topology(p, ring, p.control_addr.rsplit(":", 1)[0]), None
    if p.hostfile is None:
        if p.rank != 0:
            raise ClusterError("a rank other than 0 needs --hostfile (or is started by rank 0 itself)")
        local = LocalCluster.create(p.tensor_parallel)
        return Topology(dataclasses.replace(p, control_addr=local.control_addr), local.hostfile, "127.0.0.1"), local
    hosts = read_hostfile(p.hostfile)
    if len(hosts) != p.tensor_parallel:
        raise ClusterError(f"hostfile lists {len(hosts)} ranks but --tensor-parallel is {p.tensor_parallel}")
    ring = Path(tempfile.mkdtemp(prefix="meshlm-ring-")) / "ring.json"
    ring.write_text(json.dumps(ring_hostfile(hosts, ports.ring_port)))
    control = p.control_addr or f"{hosts[0].ips[0]}:{ports.control_port}"
    return Topology(dataclasses.replace(p, control_addr=control), ring, control.rsplit(":", 1)[0]), None


def serve_tensor_parallel(config: ServeConfig, argv: list[str], ports: ClusterPorts) -> None:
    from meshlm.model.loader import resolve_path

    p = config.parallel
    check_backend(p)
    check_shardable(resolve_path(config.model.path), p.tensor_parallel)
    topo, local = resolve_topology(p, ports)
    children = spawn_local_workers(argv, local, p.tensor_parallel) if local else []
    try:
        if p.rank == 0:
            _lead(config, topo)
        else:
            sys.exit(_follow(config, topo))
    finally:
        _reap(children)


def _load(config: ServeConfig, topo: Topology):
    from meshlm.app import build_prefix_cache
    from meshlm.model.loader import load_model

    group = init_group(topo.parallel, topo.ring_file)
    loaded = load_model(config.model, tensor_group=group)
    prefix = build_prefix_cache(config, loaded, layout=topo.parallel.layout, rank=topo.parallel.rank)
    return loaded, prefix


def _follow(config: ServeConfig, topo: Topology) -> int:
    from meshlm.app import kv_budget_bytes
    from meshlm.parallel.worker import run_worker

    loaded, prefix = _load(config, topo)
    return run_worker(topo.parallel, loaded.model, loaded.fingerprint, prefix, kv_budget_bytes(config))


def _lead(config: ServeConfig, topo: Topology) -> None:
    from meshlm.app import build_engine, kv_budget_bytes, run_http
    from meshlm.parallel.control import ControlLeader
    from meshlm.parallel.tensor import TensorExecutor
    from meshlm.parallel.watchdog import Watchdog

    p = topo.parallel
    port = int(p.control_addr.rsplit(":", 1)[1])
    control = ControlLeader(topo.control_bind, port, p.tensor_parallel, timeout=p.step_timeout,
                            heartbeat_interval=p.heartbeat_interval)
    loaded, prefix = _load(config, topo)
    control.fingerprint = loaded.fingerprint
    control.wait_for_workers(timeout=HANDSHAKE_SECONDS)
    log.info("all %d ranks joined; model fingerprint %s", p.tensor_parallel, loaded.fingerprint)
    executor = TensorExecutor(loaded.model, control, prefix, kv_budget_bytes(config), p.step_timeout)
    holder: dict = {}  # the watchdog must exist before the engine it guards

    def on_failure(message: str) -> None:
        if "engine" in holder:
            holder["engine"].fail(f"cluster failed: {message}")

    # The probe notices a dead worker even while the engine thread is blocked in a collective.
    watchdog = Watchdog(p.step_timeout, on_failure, probe=control.check_workers)
    engine = build_engine(config, loaded, executor=executor, prefix=prefix, watchdog=watchdog)
    holder["engine"] = engine
    try:
        run_http(config, loaded, engine)
    finally:
        watchdog.close()


def _reap(children: list[subprocess.Popen], grace: float = 2.0) -> None:
    deadline = time.monotonic() + grace
    for proc in children:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
