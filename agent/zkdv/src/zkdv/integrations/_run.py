"""What the framework integrations share: the proof they open, and how a run ends.

A :class:`ProvedRun` owns one :class:`zkdv.torch.ZKDV` (or, given a DVBench experiment,
the experiment's proof, which uploads) and the one transaction open at a time: the
framework's loop opens it when a step's micro-batches are known and closes it right after
the optimizer step. At the end of training it closes the transcript, and with an
experiment saves the signed final weights, uploads, and tells the user's tracker the
proof's digest, its platform URL and the certificate's verdict.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import zkdv
from zkdv.torch.eager import EagerTransaction

__all__ = ["ProvedRun", "tracker_fields"]

log = logging.getLogger("zkdv")

#: A step's micro-batch count differs from the sealed step's.
WINDOW_CHANGED = (
    "zkdv: optimizer step {step} accumulates {got} micro-batches, the proof's sealed step "
    "{sealed}; the last step of an epoch gets fewer when the epoch's batch count is not a "
    "multiple of the accumulation steps: make it one (drop_last=True on the data loader, "
    "or a dataset whose size divides evenly)"
)


class ProvedRun:
    """One proved training run: the proof, the open transaction, the ending.

    Args:
        path: the proof directory (without ``experiment``; with one, where the
            experiment's proof is written, by default a temporary directory).
        experiment: a ``dvbench.Experiment``: the proof is ``experiment.proof("torch")``,
            bound to it, uploaded by :meth:`finish`.
        config: the run's :class:`zkdv.ZKDVConfig`.
        save_model: with an experiment, at the end of training write the final weights
            as safetensors signed in the OpenSSF format, bound to the certificate.
        wait: with an experiment, wait at the end of training for the certificate and
            raise unless it records PASSED.
        rolling_window, probe_ratio: :meth:`zkdv.torch.ZKDV.start`'s.
        driver_options: for :class:`zkdv.torch.ZKDV` (``replay_snapshot_interval``,
            ``max_in_flight``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        experiment: Any = None,
        config: zkdv.ZKDVConfig | None = None,
        save_model: bool = True,
        wait: bool = False,
        rolling_window: int = 8,
        probe_ratio: float = 0.05,
        **driver_options: Any,
    ) -> None:
        if experiment is None and path is None:
            raise ValueError("pass the proof directory, a DVBench experiment, or both")
        self.experiment = experiment
        self.save_model_at_end = save_model
        self.wait = wait
        if experiment is not None:
            self.proof: Any = experiment.proof(
                "torch", config, path=path, progress=False, **driver_options
            )
        else:
            self.proof = zkdv.torch.ZKDV(path, config, **driver_options)
        self._start = (rolling_window, probe_ratio)
        self.started = False
        self.transaction: EagerTransaction | None = None
        #: Micro-batches per step, fixed by the first step.
        self.window: int | None = None
        self.result: Any = None
        self.saved: Any = None
        self.closed = False

    @property
    def path(self) -> Path:
        """The proof directory."""
        return Path(self.proof.path)

    @property
    def digest(self) -> str | None:
        """The transcript's digest (hex), once the transcript is closed."""
        digest = self.proof.digest
        return digest.hex() if digest else None

    @property
    def url(self) -> str | None:
        """The proof's page on the platform, once uploaded."""
        return getattr(self.result, "proof_url", None)

    @property
    def steps(self) -> int:
        """Optimizer steps committed so far."""
        return int(self.proof.steps)

    def start(self) -> None:
        if not self.started:
            self.proof.start(rolling_window=self._start[0], probe_ratio=self._start[1])
            self.started = True

    def open(self, batch: Any, micro_batches: int) -> None:
        """Open the step's transaction over its committed ``batch``.

        Raises:
            RuntimeError: a transaction is already open (a step that never reached its
                optimizer step), or the step accumulates another number of micro-batches.
        """
        if self.transaction is not None:
            raise RuntimeError(
                "zkdv: a new optimizer step began before the previous one stepped its "
                "optimizer; every step must end with optimizer.step()"
            )
        if self.window is None:
            self.window = micro_batches
        elif micro_batches != self.window:
            raise RuntimeError(
                WINDOW_CHANGED.format(step=self.steps, got=micro_batches, sealed=self.window)
            )
        self.start()
        self.transaction = self.proof.transaction(batch=batch)

    def close_step(self) -> None:
        """Close the open transaction: the optimizer has stepped."""
        transaction, self.transaction = self.transaction, None
        if transaction is not None:
            transaction.__exit__(None, None, None)

    def abort(self, error: BaseException) -> None:
        """Training raised: drop the open step, close the transcript, keep the directory."""
        transaction, self.transaction = self.transaction, None
        if transaction is not None:
            transaction.__exit__(type(error), error, error.__traceback__)
        if not self.closed and self.started:
            self.closed = True
            try:
                self.proof.close()
            except Exception:  # the training error is the one to raise
                log.warning(
                    "zkdv: closing the proof after a training error failed too", exc_info=True
                )

    def end(self, model: torch.nn.Module, trackers: Callable[[dict[str, Any]], None]) -> None:
        """Training ended: close the transcript; with an experiment save, upload, report."""
        if self.transaction is not None:
            raise RuntimeError(
                "zkdv: training ended inside an optimizer step (its micro-batches ran but "
                "the optimizer never stepped); the step is not committed"
            )
        if self.closed or not self.started:
            return
        if self.experiment is None:
            self.proof.close()
            self.closed = True
            trackers(tracker_fields(self))
            return
        if self.save_model_at_end:
            self.saved = self.save_model(model)
        self.finish(wait=self.wait, trackers=trackers)

    def save_model(self, model: torch.nn.Module, directory: Any = None) -> Any:
        """The signed final weights (:meth:`dvbench.DVBenchProof.save_model`)."""
        if self.experiment is None:
            raise RuntimeError(
                "zkdv: save_model signs the final weights for a DVBench experiment; "
                "pass experiment= to prove() (without one, the transcript's close "
                "record commits them)"
            )
        if self.saved is not None and directory is None:
            return self.saved
        saved = self.proof.save_model(_unwrapped(model), directory)
        self.closed = True
        return saved

    def finish(
        self, *, wait: bool = False, trackers: Callable[[dict[str, Any]], None] | None = None
    ) -> Any:
        """Upload the proof (``DVBenchProof.finish``) and tell the trackers its verdict."""
        if self.experiment is None:
            if not self.closed:
                self.proof.close()
                self.closed = True
            return None
        try:
            self.result = self.proof.finish(wait=wait)
        finally:
            self.closed = True
            if trackers is not None:
                trackers(tracker_fields(self))
        return self.result


def tracker_fields(run: ProvedRun) -> dict[str, Any]:
    """What a tracker records of a proved run: digest, steps, URL, verdict."""
    fields: dict[str, Any] = {"zkdv/transcript_digest": run.digest, "zkdv/steps": run.steps}
    if run.result is not None:
        fields["zkdv/proof_url"] = run.url
        verdict = getattr(run.result, "verdict", None)
        if verdict is not None:
            fields["zkdv/verdict"] = verdict.state
            if verdict.certificate_id is not None:
                fields["zkdv/certificate_id"] = verdict.certificate_id
    return {name: value for name, value in fields.items() if value is not None}


def log_to_active_trackers(fields: dict[str, Any]) -> None:
    """Record ``fields`` in the active W&B run and MLflow run, if the user has one.

    Only trackers the training script already imported are looked at: ZKDV never starts
    a run of its own.
    """
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is not None:
        run.summary.update(fields)
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        mlflow.set_tags({name: str(value) for name, value in fields.items()})


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module under a DistributedDataParallel wrapper."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model
