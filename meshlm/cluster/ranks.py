"""Running a tensor-parallel cluster: rank 0 serves HTTP and leads; ranks 1..N-1 follow.

Three ways in, one code path:
- `meshlm serve --tensor-parallel N` alone: rank 0 writes a loopback ring
  hostfile, starts ranks 1..N-1 itself (as `meshlm serve ... --rank r`), and leads;
- `meshlm serve --hostfile H --rank r` on each host (what `meshlm launch` runs);
- a spawned child, which gets the ring hostfile and control address directly.

Every rank needs the cluster secret before it loads anything: rank 0 generates
one for the children it spawns (passed in their environment); ranks started
from a hostfile read MESHLM_CLUSTER_SECRET, else the hostfile's "secret".
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from meshlm.api.listener import listen_failure
from meshlm.cluster.bootstrap import (ClusterError, LocalCluster, check_backend, check_shardable, cluster_secret,
                                      init_group, load_hostfile, local_cluster_dir, local_leader_gone, ring_hostfile,
                                      spawn_local_workers, start_watch, watch_launch)
from meshlm.cluster.join_watch import JoinWatch
from meshlm.cluster.stages import StageLayout
from meshlm.cluster.watchdog import Watchdog
from meshlm.config import CONTROL_PORT, RING_PORT, ParallelConfig, ServeConfig, check_port, split_addr
from meshlm.executor.rank import RankSpec, RankState, build_rank
from meshlm.executor.tensor import TensorExecutor
from meshlm.platform import import_mlx_lm, interrupt_deferred, kv_budget_bytes
from meshlm.process_exit import end_process
from meshlm.transport.auth import ClusterSecret

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ClusterPorts:
    control_port: int = CONTROL_PORT
    ring_port: int = RING_PORT
    ring_hostfile: str | None = None  # given to spawned children

    def __post_init__(self) -> None:
        check_port("--control-port", self.control_port)
        check_port("--ring-port", self.ring_port)  # its span, rank r's ring_port + r: resolve_topology


@dataclass(frozen=True)
class Topology:
    parallel: ParallelConfig  # with control_addr resolved
    ring_file: Path | None
    control_bind: str
    secret: ClusterSecret  # redacted in any repr
    memory_gb: tuple[float, ...] | None = None  # per rank, when the hostfile declares it (pipeline split)
    # A hostfile rank's MLX ring entries, written to a private file only around its join (`_load`):
    # written any earlier, every start that failed before the join left a directory in /tmp.
    ring_hosts: list[list[str]] | None = None
    leader_gone: Callable[[], str | None] | None = None  # a local worker's watch on rank 0, its parent
    ranks_here: int = 1  # this cluster's ranks on this machine, which share its default KV budget and SSD tier


def resolve_topology(p: ParallelConfig, ports: ClusterPorts) -> tuple[Topology, LocalCluster | None]:
    if ports.ring_hostfile is not None or (p.backend != "ring" and p.control_addr):
        ring = Path(ports.ring_hostfile) if ports.ring_hostfile else None
        hostfile = load_hostfile(p.hostfile) if p.hostfile else None
        if p.pipeline and not p.stage_addrs:  # a local cluster's ranks get theirs; launched ones derive them
            if hostfile is None or len(hostfile.hosts) != p.world_size:
                raise ClusterError("--pipeline-parallel with --control-addr needs --stage-addrs, or a --hostfile "
                                   "listing every stage, to know where each stage listens")
            p = dataclasses.replace(p, stage_addrs=_stage_addrs(hostfile.hosts, p.stage_port))
        # A ring file given on the command line is a local cluster's: rank 0 started this process.
        watch = local_leader_gone(ring) if ring is not None else None
        return Topology(p, ring, split_addr(p.control_addr)[0], cluster_secret(os.environ, hostfile),
                        leader_gone=watch, ranks_here=p.world_size if ring is not None else 1), None
    if p.hostfile is None:
        if p.rank != 0:
            raise ClusterError("a rank other than 0 needs --hostfile (or is started by rank 0 itself)")
        local = LocalCluster.create(p.world_size)
        replaced = dataclasses.replace(p, control_addr=local.control_addr, stage_addrs=local.stage_addrs)
        return Topology(replaced, local.hostfile, "127.0.0.1", ClusterSecret.generate(), ranks_here=p.world_size), local
    hostfile = load_hostfile(p.hostfile)
    secret = cluster_secret(os.environ, hostfile)
    hosts = hostfile.hosts
    if len(hosts) != p.world_size:
        flag = "--pipeline-parallel" if p.pipeline else "--context-parallel" if p.context else "--tensor-parallel"
        raise ClusterError(f"hostfile lists {len(hosts)} ranks but {flag} is {p.world_size}")
    ring = None
    if not p.pipeline:  # stages use their own links
        check_port("--ring-port", ports.ring_port, p.world_size)  # rank r's is --ring-port + r
        if p.backend == "ring":  # before any rank waits on the others: it failed only at the group's join
            six = [f"{h.ssh} ({h.ips[0]})" for h in hosts if _ipv6(h.ips[0])]
            if six:
                raise ClusterError(f"the ring backend takes IPv4 addresses (MLX reads ip:port): {', '.join(six)} "
                                   "in the hostfile's first \"ips\" entry")
        ring = ring_hostfile(list(hosts), ports.ring_port)
    control = p.control_addr or f"{hosts[0].ips[0]}:{ports.control_port}"
    stages = p.stage_addrs or _stage_addrs(hosts, p.stage_port)
    memory = tuple(h.memory_gb for h in hosts) if all(h.memory_gb for h in hosts) else None
    if memory is None and any(h.memory_gb for h in hosts):  # said, or it looked applied
        log.warning("the hostfile declares memory_gb for some hosts only: stages split evenly (declare it for "
                    "every host, or pass --pp-split)")
    replaced = dataclasses.replace(p, control_addr=control, stage_addrs=stages)
    return Topology(replaced, None, split_addr(control)[0], secret, memory, ring_hosts=ring), None


def _ipv6(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).version == 6
    except ValueError:  # a host name (an entry without "ips")
        return False


def _stage_addrs(hosts, stage_port: int) -> tuple[str, ...]:
    """Where each rank's stage link listens: its host's first address, at --stage-port + rank."""
    return tuple(f"{h.ips[0]}:{stage_port + r}" for r, h in enumerate(hosts))


@dataclass
class Leader:
    """Rank 0 of a formed cluster: its model and share, the executor that drives every rank, and the
    watchdog whose failures go to `fail` (the engine's, once it exists)."""

    loaded: object  # LoadedModel
    rank: RankState
    executor: TensorExecutor
    watchdog: Watchdog | None = None
    children: list[subprocess.Popen] = field(default_factory=list)
    kv_blocks: int = 0  # the smallest rank's KV budget, in blocks: what the block manager may hand out
    fail: Callable[[str], None] | None = None

    def _on_failure(self, message: str) -> None:
        if self.fail is not None:
            self.fail(f"cluster failed: {message}")
        self.executor.abort_sums()  # the engine's thread may be asleep in one: it fails its step instead

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        _reap(self.children)


@dataclass
class ClusterStart:
    """A cluster as far as it goes before this rank imports the serving stack: its topology, and on rank 0 of
    a local cluster the other ranks it started, which import theirs meanwhile on their own cores."""

    topo: Topology
    local: LocalCluster | None = None
    children: list[subprocess.Popen] = field(default_factory=list)

    def abandon(self) -> None:
        """This rank failed before `start_cluster` took the start over: end the ranks it started."""
        _reap(self.children, grace=0.0)
        self.remove_directory()

    def remove_directory(self) -> None:
        """A local cluster's directory (its ring file, rank 0's pid): done with once every rank has joined."""
        if self.local is not None:
            shutil.rmtree(self.local.hostfile.parent, ignore_errors=True)


@contextlib.contextmanager
def begin_cluster(config: ServeConfig, argv: list[str], ports: ClusterPorts) -> Iterator[ClusterStart | None]:
    """Check what can be checked before any rank starts, resolve the topology and start a local cluster's
    other ranks; None when `config` is one process. Rank 0 used to start them only once it had imported
    mlx-lm, transformers and the HTTP stack itself (~1.3 s), which they then imported in turn: a local
    cluster took ~3.1 s to serve a tiny model against ~1.7 s for one process."""
    p = config.parallel
    if not p.distributed:
        yield None
        return
    from meshlm.model.loader import resolve_path

    if p.pipeline:
        stage_layout(config, None)  # a split that does not fit the model fails here, before any rank starts
    else:
        check_backend(p)
        if not p.context:  # context-parallel ranks hold the whole model
            check_shardable(resolve_path(config.model.path), p.tensor_parallel)
    topo, local = resolve_topology(p, ports)
    start = ClusterStart(topo, local, spawn_local_workers(argv, local, p.world_size, topo.secret) if local else [])
    try:
        yield start
    except BaseException:
        start.abandon()
        raise


def start_cluster(config: ServeConfig, start: ClusterStart) -> Leader:
    """Form the cluster `begin_cluster` began. Rank 0 gets its Leader back; every other rank serves plans here
    until the cluster ends, then exits the process with its worker status."""
    p = config.parallel
    topo, children = start.topo, start.children
    if p.rank != 0:
        # Loading needs mlx-lm (with transformers, ~0.9 s): imported now, while rank 0 imports its serving
        # stack, not after the roll call, when every rank would wait for this one.
        with interrupt_deferred():  # native extensions' inits (tokenizers, safetensors) can swallow a Ctrl-C
            import_mlx_lm()
    try:
        if p.pipeline:
            from meshlm.cluster.pipeline import follow_stage, lead_pipeline

            if p.rank != 0:
                _end_worker(follow_stage(config, topo, stage_layout(config, topo)), children)
            return lead_pipeline(config, topo, stage_layout(config, topo), children)
        if p.rank != 0:
            _end_worker(_follow(config, topo), children)
        return _lead(config, topo, children)
    except BaseException:
        _reap(children)
        raise
    finally:
        start.remove_directory()  # every local rank has joined (or the cluster failed): its ring file is read


def _end_worker(code: int, children: list) -> None:
    _reap(children)
    end_process(code)


def stage_layout(config: ServeConfig, topo: Topology | None) -> StageLayout:
    """Layers per stage: --pp-split, else in proportion to the hostfile's memory_gb, else even."""
    from meshlm.model.loader import read_config, resolve_path

    p = config.parallel
    num_layers = read_config(resolve_path(config.model.path)).get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{config.model.path}: config.json's num_hidden_layers is {num_layers!r}, not a layer count")
    weights = None
    if topo is not None and topo.memory_gb is not None:
        layout = StageLayout.create(num_layers, p.pipeline_parallel)  # only its rank <-> stage map is used
        weights = tuple(topo.memory_gb[layout.rank_of(s)] for s in range(p.pipeline_parallel))
    return StageLayout.create(num_layers, p.pipeline_parallel, p.pp_split, weights)


def local_sum_group(config: ServeConfig, topo: Topology, ring_file: Path | None):
    """The SharedMemoryGroup tensor-parallel layers sum over (--local-all-reduce), or None for the MLX
    group's own all-reduce. Read before the group forms: the ring file is removed then."""
    import mlx.core as mx

    from meshlm.transport.local_reduce import SharedMemoryGroup, group_path, native_module, ring_is_local, spin_us

    p = topo.parallel
    if p.local_all_reduce == "off" or p.tensor_parallel < 2:
        return None
    native, status = native_module()
    why_not = (f"the {p.backend} backend" if p.backend != "ring"
               else "not every rank is on this machine (a ring on loopback)" if not ring_is_local(ring_file)
               else "the GPU sums with MLX's backend" if mx.default_device() != mx.cpu
               else "--no-cpu-kernels" if not config.model.cpu_kernels
               else f"the module is {status}" if native is None else None)
    if why_not is not None:
        if p.local_all_reduce == "on":
            raise ClusterError(f"--local-all-reduce on cannot apply: {why_not}")
        log.info("tensor-parallel sums: the %s backend (%s)", p.backend, why_not)
        return None
    path = group_path(topo.secret.reveal(), p.control_addr)
    log.info("tensor-parallel sums: %s, %s", status, path)
    return SharedMemoryGroup(path, p.rank, p.world_size, native, spin_us(p.world_size))


def _load(config: ServeConfig, topo: Topology, peers: dict[int, socket.socket]):
    """Join the group (every rank has answered the roll call, so all join together) and load this rank's
    share. `peers`: the other ranks' control connections; one that closes or fails meanwhile ends this
    rank at once (join_watch.py), as the join cannot be interrupted. (The load has no collective: a rank
    that never loads is named at the LOADED handshake's deadline, --start-timeout.)"""
    p = topo.parallel
    ring_file, own = topo.ring_file, []
    # A local cluster's directory, which rank 0 removes when the start fails: not when rank 0 died meanwhile
    # (a kill, its join's deadline), so whichever rank's watcher sees that removes it.
    local = local_cluster_dir(ring_file) if ring_file is not None else None
    try:
        if topo.ring_hosts is not None:
            own = [Path(tempfile.mkdtemp(prefix="meshlm-ring-"))]
            ring_file = own[0] / "ring.json"
            ring_file.write_text(json.dumps(topo.ring_hosts))
        sums = local_sum_group(config, topo, ring_file)
        with JoinWatch(p.rank, peers, "the ranks joined the MLX group and loaded their shares",
                       own + ([local] if local is not None else [])):
            try:
                group = init_group(p, ring_file, p.start_timeout)
            except ClusterError:  # a local rank 0 that died meanwhile is the cause (its ring file went with it)
                why = topo.leader_gone() if topo.leader_gone is not None else None
                if why is None:
                    raise
                raise ClusterError(f"{why} (rank {p.rank} was joining the MLX group)") from None
            _remove(own)  # MLX has read it
            loaded, rank = _load_share(config, topo, group, sums)
    finally:
        _remove(own)
    return loaded, rank, sums


def _remove(directories: list[Path]) -> None:
    for d in directories:
        shutil.rmtree(d, ignore_errors=True)


def _load_share(config: ServeConfig, topo: Topology, group, sums):
    from meshlm.model.loader import load_model

    p = topo.parallel
    spec = RankSpec(layout=p.layout, rank=p.rank, ranks_here=topo.ranks_here)
    budget = kv_budget_bytes(config.scheduler, topo.ranks_here)
    if p.context:
        from meshlm.kv.context_split import ContextSplit
        from meshlm.model.ring_attention import RingContext

        loaded = load_model(config.model)
        ring = RingContext(ContextSplit(p.context_parallel, p.rank, config.cache.block_size), group, p.cp_algorithm,
                           overlap=overlap_transfers(p))
        return loaded, build_rank(loaded, config.model, config.cache, budget, spec, ring)
    loaded = load_model(config.model, tensor_group=group)  # no collective: the LOADED handshake is the barrier
    return loaded, build_rank(loaded, config.model, config.cache, budget, spec, sum_group=sums)


def overlap_transfers(p: ParallelConfig) -> bool:
    """--cp-overlap resolved: auto overlaps where the transfer does not take the computing cores' time
    (the forward on a GPU, or jaccl's RDMA); on a CPU over the TCP ring it measured no gain."""
    import mlx.core as mx

    return p.cp_overlap == "on" or (p.cp_overlap == "auto" and (mx.default_device() == mx.gpu or p.backend == "jaccl"))


def _handshake_fingerprint(loaded, topo: Topology) -> str:
    """The model and the layout: a rank started with another layout (tp2 vs cp2) is refused at the
    handshake, not found out by mismatched collectives."""
    return f"{loaded.fingerprint}/{topo.parallel.layout}"


def _follow(config: ServeConfig, topo: Topology) -> int:
    from meshlm.executor.worker import answer_roll_call, run_worker

    control = answer_roll_call(topo.parallel, topo.secret, topo.parallel.start_timeout, topo.leader_gone)
    loaded, rank, sums = _load(config, topo, control.sockets())
    # Rank 0 creates the sums' file before it starts the cluster.
    return run_worker(topo.parallel, control, rank, _handshake_fingerprint(loaded, topo),
                      on_joined=sums.join if sums is not None else None, local=topo.leader_gone is not None,
                      sums=sums)


def control_leader(topo: Topology):
    """Rank 0's end of the control channel, bound now; a port that is taken (or an address that is not this
    host's) is a ClusterError saying so, as for the HTTP port (api/listener.py), not a traceback."""
    from meshlm.transport.control import ControlLeader

    p = topo.parallel
    port = split_addr(p.control_addr)[1]
    try:
        return ControlLeader(topo.control_bind, port, p.world_size, timeout=p.step_timeout,
                             heartbeat_interval=p.heartbeat_interval, secret=topo.secret,
                             silence_timeout=p.worker_timeout)
    except OSError as exc:
        raise ClusterError(f"cannot listen on {topo.control_bind}:{port} for the control channel: "
                           f"{listen_failure(exc, '--control-port', 'cluster')}") from None


def _lead(config: ServeConfig, topo: Topology, children: list[subprocess.Popen]) -> Leader:
    from meshlm.transport.control import ControlError

    p = topo.parallel
    control = control_leader(topo)
    gone = start_watch(children, p.launch_fd)
    log.info("waiting up to %.0f s for ranks 1..%d on control port %s", p.start_timeout, p.world_size - 1,
             p.control_addr)
    try:
        control.wait_for_workers(timeout=p.start_timeout, gone=gone)
    except ControlError as exc:  # the message says what to fix; a traceback would bury it
        raise ClusterError(str(exc)) from None
    loaded, rank, sums = _load(config, topo, control.sockets())
    control.fingerprint = _handshake_fingerprint(loaded, topo)
    log.info("rank 0 has loaded its share: waiting up to %.0f s for the other ranks to load theirs", p.start_timeout)
    try:
        # The sums' file exists from just before the workers are started (and join it) until they all have.
        ready = control.start(timeout=p.start_timeout, before_start=sums.create if sums else None, gone=gone)
    except ControlError as exc:  # a rank that died, refused or garbled its LOADED: named in the message
        if sums is not None:
            sums.remove_file()
        raise ClusterError(str(exc)) from None
    log.info("all %d ranks joined; model fingerprint %s", p.world_size, loaded.fingerprint)
    if sums is not None:  # else the executor removes it once they have (its idle polls)
        sums.remove_file_once_joined(timeout=2.0)
    leader = Leader(loaded, rank, TensorExecutor(rank, control, p.step_timeout, sums), children=children,
                    kv_blocks=smallest_kv_blocks(rank, ready))
    if p.launch_fd is not None:
        watch_launch(p.launch_fd)
    # The probe notices a dead worker even while the engine thread is blocked in a collective.
    leader.watchdog = Watchdog(p.step_timeout, leader._on_failure, probe=control.check_workers)
    return leader


def smallest_kv_blocks(rank: RankState, ready: dict) -> int:
    """Every rank must hold every block the leader hands out: the least of the ranks' budgets (`ready`:
    each worker's LOADED; 0 blocks there means it did not say)."""
    kv_blocks = min([rank.max_blocks] + [r.kv_blocks for r in ready.values() if r.kv_blocks > 0])
    if kv_blocks < rank.max_blocks:
        log.info("KV blocks limited to %d by the smallest rank's --kv-cache-memory", kv_blocks)
    return kv_blocks


def _reap(children: list[subprocess.Popen], grace: float = 2.0) -> None:
    deadline = time.monotonic() + grace
    for proc in children:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
