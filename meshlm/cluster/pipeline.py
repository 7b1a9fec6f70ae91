"""Forming a pipeline-parallel cluster: the control channel's roll call, then each rank loads its stage's
layers and the cluster starts as for tensor parallelism, then each stage links to its neighbours
(transport/stage_link.py).

Link order avoids waiting in a circle: every stage first connects to the next
stage (whose socket has been listening since before the control channel
formed), then accepts the previous one; the leader runs the last stage, so it
only accepts.
"""

from __future__ import annotations

import logging
import subprocess

from meshlm.api.listener import listen_failure
from meshlm.cluster.bootstrap import ClusterError, start_watch, watch_launch
from meshlm.cluster.ranks import Leader, Topology, control_leader, smallest_kv_blocks
from meshlm.cluster.stages import StageLayout
from meshlm.cluster.watchdog import Watchdog
from meshlm.config import ServeConfig, split_addr
from meshlm.executor.rank import RankSpec, build_rank
from meshlm.executor.stage_io import StageIO
from meshlm.platform import kv_budget_bytes
from meshlm.transport import stage_link
from meshlm.transport.stage_link import ActivationSpec

log = logging.getLogger(__name__)


def _load_stage(config: ServeConfig, topo: Topology, layout: StageLayout):
    import mlx.core as mx

    from meshlm.model.loader import StageSlice, load_model

    p = topo.parallel
    stage = layout.stage_of(p.rank)
    first, end = layout.layers(stage)
    loaded = load_model(config.model, stage=StageSlice(first, end, stage == 0, stage == layout.stages - 1))
    rank = build_rank(loaded, config.model, config.cache, kv_budget_bytes(config.scheduler, topo.ranks_here),
                      RankSpec(layout=layout.name, rank=p.rank, ranks_here=topo.ranks_here))
    log.info("stage %d of %d (rank %d): layers %d..%d of %d", stage, layout.stages, p.rank, first, end - 1,
             layout.num_layers)
    spec = ActivationSpec(int(loaded.model.args.hidden_size), getattr(mx, loaded.dtype))
    return loaded, rank, spec


def _listen(topo: Topology, rank: int):
    host, port = split_addr(topo.parallel.stage_addrs[rank])
    try:
        return stage_link.listen(host, int(port))
    except OSError as exc:
        raise ClusterError(f"rank {rank} cannot listen for its stage link on {host}:{port}: "
                           f"{listen_failure(exc, '--stage-port', 'cluster')}") from None


def _join(topo: Topology, layout: StageLayout, server, spec: ActivationSpec) -> StageIO:
    p = topo.parallel
    stage = layout.stage_of(p.rank)
    liveness = p.worker_timeout
    nxt = prev = None
    try:
        if stage < layout.stages - 1:
            addr = p.stage_addrs[layout.rank_of(stage + 1)]
            nxt = stage_link.connect(addr, topo.secret, stage, stage + 1, p.start_timeout, liveness)
        if stage > 0:
            prev = stage_link.accept(server, topo.secret, stage, stage - 1, p.start_timeout, liveness)
    finally:
        if server is not None:
            server.close()
    log.info("stage %d linked to its neighbours", stage)
    return StageIO(stage, prev, nxt, spec, p.step_timeout)


def follow_stage(config: ServeConfig, topo: Topology, layout: StageLayout) -> int:
    from meshlm.executor.worker import answer_roll_call, run_worker

    p = topo.parallel
    server = _listen(topo, p.rank) if layout.stage_of(p.rank) > 0 else None
    control = answer_roll_call(p, topo.secret, p.start_timeout, topo.leader_gone)
    loaded, rank, spec = _load_stage(config, topo, layout)
    return run_worker(p, control, rank, loaded.fingerprint, lambda: _join(topo, layout, server, spec),
                      local=topo.leader_gone is not None)


def lead_pipeline(config: ServeConfig, topo: Topology, layout: StageLayout,
                  children: list[subprocess.Popen]) -> Leader:
    from meshlm.executor.pipeline import PipelineExecutor
    from meshlm.transport.control import ControlError

    p = topo.parallel
    control = control_leader(topo)
    server = _listen(topo, 0)
    gone = start_watch(children, p.launch_fd)
    log.info("pipeline %s: waiting up to %.0f s for ranks 1..%d on control port %s", layout.name,
             p.start_timeout, p.world_size - 1, p.control_addr)
    try:
        control.wait_for_workers(timeout=p.start_timeout, gone=gone)
        loaded, rank, spec = _load_stage(config, topo, layout)
        control.fingerprint = loaded.fingerprint
        log.info("stage %d has loaded its layers: waiting up to %.0f s for the other stages to load theirs",
                 layout.stage_of(0), p.start_timeout)
        ready = control.start(timeout=p.start_timeout, gone=gone)
        io = _join(topo, layout, server, spec)
    except ControlError as exc:  # HandshakeError among them: the message names the rank
        raise ClusterError(str(exc)) from None
    log.info("all %d stages joined; model fingerprint %s", p.world_size, loaded.fingerprint)
    stages = {layout.rank_of(s): f"stage {s}, layers {a}..{b - 1}"
              for s, (a, b) in ((s, layout.layers(s)) for s in range(layout.stages))}
    executor = PipelineExecutor(rank, control, p.step_timeout, io, depth=layout.stages, stages=stages)
    leader = Leader(loaded, rank, executor, children=children,
                    kv_blocks=smallest_kv_blocks(rank, ready))
    if p.launch_fd is not None:
        watch_launch(p.launch_fd)
    leader.watchdog = Watchdog(p.step_timeout, leader._on_failure, probe=control.check_workers)
    return leader
