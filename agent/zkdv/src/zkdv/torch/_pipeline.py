"""Canonical Torch transaction pipeline above the protocol boundary.

:class:`Pipeline` holds what a sampled check needs once the first transaction sealed
the program: the committed layout (parameter, optimizer-state and buffer leaves), the
loaded program artifact, the optimizer's functional contract, the batch packing, and
the :class:`~zkdv.torch._checkpoint.ReplayCheckpoint`. :meth:`Pipeline.replay`
recomputes one challenged step from the snapshot that precedes it:

    for each step k from the snapshot to the challenged step t:
        gradients, buffers' = program(parameters, buffers, batch_k; seed_k)
        parameters', state' = contract(parameters, state, gradients; options_k)

and returns the challenged update coordinate ``parameters'[i] - parameters[i]`` and
post-update optimizer-state coordinate of step t. Under DDP the committed batch holds
every rank's rows; the program runs once per rank's rows and the gradients are
averaged as DDP's all-reduce does (each divided by the world size, then summed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zkdv.driver.protocol import ReplayOutcome
from zkdv.sampling import Challenge
from zkdv.torch._checkpoint import ReplayCheckpoint
from zkdv.torch._packing import BatchLayout
from zkdv.torch._rng import step_seed
from zkdv.torch.optimizers.bridge import OptimizerBridge

__all__ = ["CommittedValues", "FlatIndex", "Pipeline"]

State = dict[str, Any]


@dataclass(frozen=True)
class CommittedValues:
    """One step's committed computed values (:mod:`zkdv.gradients`), as the update reads
    them: gradients per parameter (None: not trained), the buffers after the step, and a
    GradScaler's ``(found_inf, growth_tracker, scale)``; ``within`` says whether a
    recomputation of them lies within the run's gradient bounds."""

    gradients: list[torch.Tensor | None]
    buffers: list[torch.Tensor]
    scaler: list[torch.Tensor] | None
    within: Any


@dataclass(frozen=True)
class FlatIndex:
    """Map a flat coordinate over ordered leaves to ``(leaf, element)``."""

    ends: np.ndarray

    @classmethod
    def of(cls, sizes: Sequence[int]) -> FlatIndex:
        return cls(np.cumsum(np.asarray(list(sizes), dtype=np.int64)))

    @property
    def total(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def locate(self, index: int) -> tuple[int, int]:
        leaf = int(np.searchsorted(self.ends, index, side="right"))
        if leaf >= len(self.ends):
            raise IndexError(f"coordinate {index} is beyond {self.total} committed elements")
        start = int(self.ends[leaf - 1]) if leaf else 0
        return leaf, index - start


def element(tensors: Sequence[torch.Tensor], index: FlatIndex, flat: int) -> float:
    """The value at flat coordinate ``flat`` of ``tensors`` (0.0 for an empty state)."""
    if index.total == 0:
        return 0.0
    leaf, offset = index.locate(flat)
    return float(tensors[leaf].reshape(-1)[offset].item())


class Pipeline:
    """Replay sampled steps with the sealed program and the functional optimizer.

    Args:
        program: the loaded program (flat inputs to flat outputs).
        unused: per parameter, whether the attested step gives it no gradient.
        bridge: the prepared optimizer's bridge (layout and functional transition).
        layout: the batch packing.
        checkpoint: snapshots and committed batches.
        device: where the replay runs (the parameters' device).
        world_size: DDP replicas whose rows the committed batch holds.
        run_seed: the committed run seed (``env.rng``) of a program with random
            operators, else None.
        committed: ``step -> CommittedValues | None``: a step's committed computed
            values, when the run commits them and keeps their files (None: none).
    """

    def __init__(
        self,
        program: Any,
        unused: Sequence[bool],
        bridge: OptimizerBridge,
        layout: BatchLayout,
        checkpoint: ReplayCheckpoint,
        *,
        parameter_sizes: Sequence[int],
        state_sizes: Sequence[int],
        buffer_count: int,
        device: torch.device,
        world_size: int = 1,
        run_seed: int | None = None,
        committed: Any = None,
    ) -> None:
        self.program = program
        self.unused = tuple(unused)
        self.bridge = bridge
        self.layout = layout
        self.checkpoint = checkpoint
        self.parameter_index = FlatIndex.of(parameter_sizes)
        self.state_index = FlatIndex.of(state_sizes)
        self.buffer_count = buffer_count
        self.device = device
        self.world_size = world_size
        self.run_seed = run_seed
        self.committed = committed

    def gradients(
        self,
        parameters: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        words: np.ndarray,
        step: int,
        scaler: State | None = None,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor], list[torch.Tensor] | None]:
        """Run the sealed program on step ``step``'s committed batch (every rank's rows).

        Rank ``r``'s random operators draw from ``step_seed(run_seed, step, r)``, as that
        rank's eager step did.

        Args:
            scaler: a GradScaler's state before the step (``growth_tracker``, ``scale``).

        Returns:
            The gradients, the buffers after the step, and with a GradScaler the
            program's ``(found_inf, growth_tracker, scale)``.
        """
        rows = self.layout.rows
        total: list[torch.Tensor] | None = None
        buffers_after: list[torch.Tensor] = list(buffers)
        scaler_after: list[torch.Tensor] | None = None
        count = len(parameters)
        extra = [] if scaler is None else [scaler["growth_tracker"], scaler["scale"]]
        for rank in range(self.world_size):
            batch = self.layout.unpack(words[rank * rows : (rank + 1) * rows], self.device)
            tensors = self.layout.tensor_leaves(batch)
            seed = None if self.run_seed is None else step_seed(self.run_seed, step, rank)
            outputs = self.program(*parameters, *buffers, *extra, *tensors, seed=seed)
            gradients = outputs[:count]
            if rank == 0:
                # DDP broadcasts rank 0's buffers: its forward's running stats are kept.
                buffers_after = list(outputs[count : count + len(buffers)])
                if scaler is not None:
                    scaler_after = list(outputs[count + len(buffers) :])
            if self.world_size > 1:
                gradients = [gradient / self.world_size for gradient in gradients]
            total = (
                list(gradients)
                if total is None
                else [a + b for a, b in zip(total, gradients, strict=True)]
            )
        assert total is not None
        gradients_out = [None if skip else g for skip, g in zip(self.unused, total, strict=True)]
        return gradients_out, buffers_after, scaler_after

    def replay(self, challenge: Challenge, committed_post: float) -> ReplayOutcome:
        """Recompute the challenged coordinates from the snapshot preceding the step.

        Args:
            challenge: the sampled step and coordinates.
            committed_post: the committed post-update value of the challenged parameter
                coordinate; the committed update is formed against the replayed
                pre-update value (exact at a snapshot step, within replay drift after).
        """
        snapshot, inputs = self.checkpoint.get(challenge.step)
        device = self.device
        parameters = [p.to(device, copy=True) for p in snapshot.parameters]
        # Each state tensor goes where torch.optim keeps the live one (a non-capturable
        # ``step`` stays on the host).
        states = [
            {
                name: value.to(live[name].device, copy=True)
                if isinstance(value, torch.Tensor) and isinstance(live.get(name), torch.Tensor)
                else value.clone()
                if isinstance(value, torch.Tensor)
                else value
                for name, value in state.items()
            }
            for state, live in zip(snapshot.states, self.bridge.live_states(), strict=True)
        ]
        buffers = [b.to(device, copy=True) for b in snapshot.buffers]
        start = snapshot.step
        gradient_within: bool | None = None
        for offset, step in enumerate(inputs):
            index = start + offset
            committed = None if self.committed is None else self.committed(index)
            if committed is not None and index != challenge.step:
                # As the platform does: the committed gradient, which the canonical update
                # turns into the committed state bit for bit, whatever the program rounds.
                gradients, buffers_after, scaler = (
                    committed.gradients,
                    committed.buffers,
                    committed.scaler,
                )
            else:
                gradients, buffers_after, scaler = self.gradients(
                    parameters,
                    buffers,
                    step.words,
                    index,
                    states[-1] if self.bridge.scaled else None,
                )
                if committed is not None:
                    # The checked step's verdict covers its whole gradient, as the
                    # platform's replay does (docs/transcript.md, the check record).
                    gradient_within = committed.within(gradients, buffers_after, scaler)
                    if gradient_within:
                        # Within the bounds, the step is checked on the committed gradient
                        # (a compiled program rounds otherwise than the eager training
                        # did); beyond them, the check fails whatever its values show.
                        gradients, buffers_after, scaler = (
                            committed.gradients,
                            committed.buffers,
                            committed.scaler,
                        )
            after, states_after = self.bridge.step(
                parameters, states, gradients, step.hyperparameters, scaler=scaler
            )
            if start + offset == challenge.step:
                before = element(parameters, self.parameter_index, challenge.param_index)
                delta = element(after, self.parameter_index, challenge.param_index) - before
                leaves = self.bridge.leaves(states_after, after)
                state_value = element(leaves, self.state_index, challenge.state_index)
                return ReplayOutcome(
                    delta,
                    state_value,
                    start,
                    challenge.step - start,
                    committed_delta=committed_post - before,
                    gradient_within=gradient_within,
                )
            parameters, states, buffers = after, states_after, buffers_after
        raise RuntimeError(f"ZKDV replay window of step {challenge.step} is incomplete")
