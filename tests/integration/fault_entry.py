"""Test-only entry point: `python fault_entry.py KIND ARG [meshlm arguments...]` runs meshlm with a fault
planted by patching classes before `meshlm.cli.main` starts. Production code has no fault hooks at all:
neither HTTP nor the environment of a real run can reach these.

Kinds (ARG is a token id or a step id):
  forward_raise TOKEN  the runner raises when a step runs a chunk holding token id TOKEN
  schedule_raise TOKEN the scheduler raises while a waiting prompt holds TOKEN (a bug before any forward)
  skip_step STEP       a worker rank applies nothing at step STEP but acknowledges it (a split brain)
  stall_step STEP      a worker rank hangs at step STEP (only the watchdogs can end it)
  corrupt_activation STEP  a pipeline stage sends activation packets with an unknown dtype code from STEP on
  stall_load SECONDS   the rank sleeps SECONDS before it loads its model (a slow disk)
  exit_before_join CODE  the rank exits with status CODE after the roll call, just before the MLX group's join
  unmasked_token TOKEN  the sampler ignores every grammar's mask and favours token id TOKEN (a sampler bug)
  slow_prefill SECONDS  this rank's forward of a plan of 32 tokens or more first sleeps SECONDS (a long step)

Run with MESHLM_OPENBLAS=0: the OpenBLAS preload re-executes `python -m meshlm`, which would drop the patch.
"""

from __future__ import annotations

import sys
import time


def _plant(kind: str, arg: int) -> None:
    from meshlm.engine.scheduler import Scheduler
    from meshlm.model.runner import Runner

    # Every step is Runner.prepare (the plan) then Runner.launch (the forward); Runner.execute is both.
    prepare, launch, schedule = Runner.prepare, Runner.launch, Scheduler.schedule

    def raising_launch(self, prepared, *rest, **kw):
        if any(arg in c.token_ids for c in prepared.plan.chunks):
            raise RuntimeError(f"injected forward failure (token {arg})")
        return launch(self, prepared, *rest, **kw)

    def raising_schedule(self, *args, **kwargs):
        if any(arg in s.prompt_ids for s in self.waiting):
            raise OverflowError(f"injected scheduler failure (token {arg})")
        return schedule(self, *args, **kwargs)

    def skipping_prepare(self, plan, *rest, **kw):
        if plan.step_id == arg:  # acknowledged with this rank's old batch: the leader sees a split brain
            from meshlm.model.runner import Prepared

            return Prepared(plan, [], 0.0, 0.0)
        return prepare(self, plan, *rest, **kw)

    def skipping_launch(self, prepared, *rest, **kw):
        if prepared.plan.step_id == arg:
            from meshlm.model.runner import StepResult

            return StepResult([], None)
        return launch(self, prepared, *rest, **kw)

    def stalling_prepare(self, plan, *rest, **kw):
        if plan.step_id == arg:
            print(f"fault: stalling step {arg}", file=sys.stderr, flush=True)
            time.sleep(3600)
        return prepare(self, plan, *rest, **kw)

    from meshlm.transport import stage_wire
    from meshlm.transport.stage_link import StageLink

    send_activation = StageLink.send_activation

    def corrupting_send(self, step, pos, hidden, timeout):
        if step < arg:  # the first activation at or after step `arg` (plans without tokens send none)
            return send_activation(self, step, pos, hidden, timeout)
        packet = bytearray(stage_wire.encode_activation(self.own, self.peer, step, pos, hidden))
        packet[stage_wire.HEADER.size + 1:stage_wire.HEADER.size + 5] = (99).to_bytes(4, "big")  # the dtype code
        self.send(bytes(packet), timeout)

    def nan_send(self, step, pos, hidden, timeout):  # a well-formed packet of NaN from step `arg` on
        import mlx.core as mx

        return send_activation(self, step, pos, hidden if step < arg else mx.full(hidden.shape, mx.nan), timeout)

    from meshlm.model import loader

    load_model = loader.load_model

    def stalling_load(*args, **kw):
        print(f"fault_entry: stalling the load for {arg} s", file=sys.stderr, flush=True)
        time.sleep(arg)
        return load_model(*args, **kw)

    import os

    from meshlm.cluster import ranks

    def exiting_join(*args, **kw):
        print(f"fault_entry: exiting with status {arg} before the join", file=sys.stderr, flush=True)
        os._exit(arg)

    from meshlm.engine import sampler

    process_logits = sampler.process_logits

    def unmasking_process_logits(row, state, ahead=(), allowed=None):
        return process_logits(row, state, ahead).at[arg].add(1e4)

    def slow_launch(self, prepared, *rest, **kw):
        if sum(len(c.token_ids) for c in prepared.plan.chunks) >= 32:
            time.sleep(arg)
        return launch(self, prepared, *rest, **kw)

    patches = {"forward_raise": [(Runner, "launch", raising_launch)],
               "schedule_raise": [(Scheduler, "schedule", raising_schedule)],
               "skip_step": [(Runner, "prepare", skipping_prepare), (Runner, "launch", skipping_launch)],
               "stall_step": [(Runner, "prepare", stalling_prepare)],
               "corrupt_activation": [(StageLink, "send_activation", corrupting_send)],
               "nan_activation": [(StageLink, "send_activation", nan_send)],
               "stall_load": [(loader, "load_model", stalling_load)],
               "exit_before_join": [(ranks, "init_group", exiting_join)],
               "unmasked_token": [(sampler, "process_logits", unmasking_process_logits)],
               "slow_prefill": [(Runner, "launch", slow_launch)]}
    for cls, name, fn in patches[kind]:
        setattr(cls, name, fn)


if __name__ == "__main__":
    _plant(sys.argv[1], int(sys.argv[2]))
    from meshlm.cli import main

    main(sys.argv[3:])
