"""Pipeline stages: which layers each stage holds and which rank runs it.

Stages are numbered in pipeline order: stage 0 embeds the token ids, the last
stage applies the final norm and head. The leader (rank 0) runs the *last*
stage, so logits never cross a link (as mlx-lm's pipeline does): the token ids
reach stage 0 in the StepPlan it receives anyway. Ranks 1..S-1 run stages
0..S-2, so for two stages rank 1 holds the first layers and rank 0 the rest.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageLayout:
    num_layers: int  # of the whole model
    split: tuple[int, ...]  # layers per stage, in pipeline order

    @classmethod
    def create(cls, num_layers: int, stages: int, split: tuple[int, ...] | None = None,
               weights: tuple[float, ...] | None = None) -> "StageLayout":
        """`split` as given (--pp-split), else proportional to `weights` (e.g. each host's memory), else even."""
        if stages < 2:
            raise ValueError("a pipeline needs at least 2 stages")
        if split is None:
            split = _proportional(num_layers, weights or (1.0,) * stages)
        if len(split) != stages:
            raise ValueError(f"--pp-split names {len(split)} stages, --pipeline-parallel is {stages}")
        if any(n < 1 for n in split):
            raise ValueError(f"--pp-split {','.join(map(str, split))}: every stage needs at least one layer")
        if sum(split) != num_layers:
            raise ValueError(f"--pp-split {','.join(map(str, split))} covers {sum(split)} layers, "
                             f"the model has {num_layers}")
        return cls(num_layers, tuple(split))

    @property
    def stages(self) -> int:
        return len(self.split)

    def layers(self, stage: int) -> tuple[int, int]:
        """[first, end) layer indices of `stage`."""
        first = sum(self.split[:stage])
        return first, first + self.split[stage]

    def rank_of(self, stage: int) -> int:
        return 0 if stage == self.stages - 1 else stage + 1

    def stage_of(self, rank: int) -> int:
        return self.stages - 1 if rank == 0 else rank - 1

    @property
    def name(self) -> str:
        """Names the layout in prefix-cache keys and SSD directories: another split holds other layers."""
        return "pp" + "-".join(map(str, self.split))


def _proportional(num_layers: int, weights: tuple[float, ...]) -> tuple[int, ...]:
    """Layers in proportion to `weights`, each stage at least one, summing to num_layers (largest remainder)."""
    if len(weights) > num_layers:
        raise ValueError(f"{len(weights)} stages for a model of {num_layers} layers")
    if any(w <= 0 for w in weights):
        raise ValueError("every stage's weight (memory) must be positive")
    top = max(weights)  # shares of the largest: 1e308 GB each once summed to inf, and the split to NaN
    shares = [w / top for w in weights]
    total = sum(shares)
    spare = num_layers - len(weights)
    exact = [spare * w / total for w in shares]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)[: spare - sum(counts)]:
        counts[i] += 1
    return tuple(1 + c for c in counts)
