"""A worker rank: apply every StepPlan the leader sends, in lockstep, and acknowledge it.

Workers decide nothing. They exit when the leader says SHUTDOWN (0), when the
leader goes silent past --worker-timeout (3), when a plan cannot be applied
(4, after telling the leader why), or when a forward outlives --step-timeout
(the watchdog ends the process: a collective with a dead peer cannot be
interrupted from Python).
"""

from __future__ import annotations

import logging
import os
import time

import mlx.core as mx

from meshlm.cache.prefix import PrefixCache
from meshlm.config import ParallelConfig
from meshlm.engine.plan import batch_fingerprint
from meshlm.model.runner import Runner
from meshlm.parallel.control import ControlWorker, LeaderLost
from meshlm.parallel.watchdog import Watchdog

log = logging.getLogger(__name__)

EXIT_SHUTDOWN, EXIT_LEADER_LOST, EXIT_STEP_FAILED, EXIT_DEADLINE = 0, 3, 4, 5


def _hard_exit(message: str) -> None:
    log.error("rank exiting: %s", message)
    os._exit(EXIT_DEADLINE)


def run_worker(cfg: ParallelConfig, model, fingerprint: str, prefix: PrefixCache | None, kv_budget: int) -> int:
    host, port = cfg.control_addr.rsplit(":", 1)
    control = ControlWorker(host, int(port), cfg.rank, fingerprint, timeout=cfg.worker_timeout,
                            world_size=cfg.tensor_parallel, connect_timeout=max(60.0, cfg.worker_timeout))
    control.connect()
    log.info("rank %d joined the leader at %s", cfg.rank, cfg.control_addr)
    runner = Runner(model, prefix)
    runner.kv_bytes_per_token()  # the leader's engine runs the same warm-up forward after the handshake
    watchdog = Watchdog(cfg.step_timeout, _hard_exit, name=f"meshlm-watchdog-{cfg.rank}")
    try:
        return _serve_plans(control, runner, watchdog, prefix, kv_budget)
    finally:
        watchdog.close()
        control.close()
        if prefix is not None and prefix.ssd is not None:
            prefix.ssd.flush(timeout=2)


def _injected_fault() -> tuple[str, int] | None:
    """Fault injection for the failure tests: MESHLM_FAULT_INJECT=skip_step=N or stall_step=N."""
    spec = os.environ.get("MESHLM_FAULT_INJECT", "")
    if "=" not in spec:
        return None
    kind, step = spec.split("=", 1)
    return kind, int(step)


def _serve_plans(control: ControlWorker, runner: Runner, watchdog: Watchdog, prefix, kv_budget: int) -> int:
    fault = _injected_fault()
    while True:
        try:
            plan = control.next_plan()
        except LeaderLost as exc:
            log.error("%s; exiting", exc)
            return EXIT_LEADER_LOST
        if plan is None:
            log.info("leader asked to stop: %s", control.shutdown_reason)
            return EXIT_SHUTDOWN
        if fault == ("skip_step", plan.step_id):  # this rank silently misses a step: a split brain
            control.ack(plan.step_id, batch_fingerprint(runner.lengths))
            continue
        try:
            with watchdog.step(f"step {plan.step_id}"):
                if fault == ("stall_step", plan.step_id):
                    time.sleep(3600)  # a hung rank: only the watchdogs can end this
                result = runner.execute(plan)
                if result.logits is not None:
                    mx.eval(result.logits)  # every rank must take part in the step's collectives
            if prefix is not None:
                prefix.pool.trim(kv_budget - runner.kv_bytes)
        except Exception as exc:  # the group is unusable after a failed step: report, then leave
            log.exception("step %d failed", plan.step_id)
            try:
                control.ack(plan.step_id, 0, error=f"{type(exc).__name__}: {exc}")
            except LeaderLost:
                pass
            return EXIT_STEP_FAILED
        control.ack(plan.step_id, batch_fingerprint(runner.lengths))
