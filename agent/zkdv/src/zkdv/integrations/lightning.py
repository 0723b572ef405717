"""Prove a Lightning ``Trainer`` run with a callback; the ``LightningModule`` unchanged.

::

    from zkdv.integrations.lightning import ZKDVCallback

    zkdv_callback = ZKDVCallback(experiment=dvbench.experiment("acme/lm"))
    trainer = lightning.Trainer(..., callbacks=[zkdv_callback])
    trainer.fit(module, data)  # every optimizer step is one committed, replayable step

What Lightning does stays what it does: automatic optimization, the optimizer and the
LR scheduler from ``configure_optimizers`` (stepped per step or per epoch),
``accumulate_grad_batches``, ``gradient_clip_val`` (and ``configure_gradient_clipping``),
``precision="bf16-mixed"``, the module's hooks, dropout, checkpoints. The callback:

* at ``on_fit_start`` prepares the module and its optimizer (``proof.prepare``) and hands
  Lightning the prepared optimizer; the schedulers keep driving its parameter groups;
* opens each optimizer step's transaction at the first micro-batch's
  ``on_train_batch_start``, over all the step's micro-batches (it reads the rest ahead from
  the loop's own data iterator, which then yields them as usual), and closes it at the
  last micro-batch's ``on_train_batch_end``, after the optimizer step;
* attests Lightning's own step: the strategy's ``training_step`` under the precision
  plugin's autocast, the loss divided by ``accumulate_grad_batches``, the strategy's
  backward (``on_before_backward`` / ``on_after_backward``), ``on_before_optimizer_step``
  and the gradient clipping hooks, then the optimizer step;
* at ``on_fit_end`` closes the transcript; with an experiment, signs the final weights,
  uploads, and logs the digest, URL and verdict to the trainer's loggers.

Refused with a message: several devices or processes (a strategy other than a single
device), manual optimization, several optimizers, ``precision="16-mixed"`` (loss
scaling). ``self.log`` inside ``training_step`` is silenced while the step is traced
once: the traced call must not log a value twice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loops.optimization.automatic import ClosureResult

import zkdv
from zkdv.integrations._run import ProvedRun

__all__ = ["ZKDVCallback"]

UNSUPPORTED = "zkdv.integrations.lightning cannot prove this run yet: {what}"


class _Lookahead:
    """An iterator that can show what comes next without handing it out."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator
        self.ahead: list[Any] = []

    def __iter__(self) -> _Lookahead:
        return self

    def __next__(self) -> Any:
        if self.ahead:
            return self.ahead.pop(0)
        return next(self.iterator)

    def peek(self, count: int) -> list[Any]:
        while len(self.ahead) < count:
            try:
                self.ahead.append(next(self.iterator))
            except StopIteration:
                break
        return self.ahead[:count]


class ZKDVCallback(pl.Callback):
    """Write a ZKDV proof of every optimizer step of ``trainer.fit``.

    Args:
        path: the proof directory. Required without ``experiment``.
        experiment: a ``dvbench.Experiment``: the proof is bound to it and uploaded at
            the end of training, with the signed final weights (``save_model``).
        config: the run's :class:`zkdv.ZKDVConfig`.
        save_model: with an experiment, save and sign the final weights at the end.
        wait: with an experiment, wait for the certificate at the end of ``fit`` and
            raise ``dvbench.CertificateFailedError`` unless it records PASSED.
        rolling_window, probe_ratio: passed to ``proof.start``.
        **driver_options: passed to :class:`zkdv.torch.ZKDV`.

    Attributes:
        run: the :class:`~zkdv.integrations._run.ProvedRun` (``.path``, ``.digest``,
            ``.url``, ``.result``, ``.proof``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        experiment: Any = None,
        config: zkdv.ZKDVConfig | None = None,
        save_model: bool = True,
        wait: bool = False,
        rolling_window: int = 8,
        probe_ratio: float = 0.05,
        **driver_options: Any,
    ) -> None:
        self.run = ProvedRun(
            path,
            experiment=experiment,
            config=config,
            save_model=save_model,
            wait=wait,
            rolling_window=rolling_window,
            probe_ratio=probe_ratio,
            **driver_options,
        )
        self._seen = 0
        self._first_index = 0

    # --- shortcuts ----------------------------------------------------------------------
    @property
    def proof(self) -> Any:
        """The :class:`zkdv.torch.ZKDV` driver (a ``dvbench.DVBenchProof`` with an experiment)."""
        return self.run.proof

    @property
    def path(self) -> Any:
        return self.run.path

    @property
    def digest(self) -> str | None:
        return self.run.digest

    # --- Lightning hooks ----------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _refuse_unsupported(trainer, pl_module)
        proof = self.run.proof
        optimizer = trainer.optimizers[0]
        _, prepared = proof.prepare(pl_module, optimizer)
        trainer.strategy.optimizers = [prepared]
        # The schedulers configure_optimizers made drive the parameter groups the prepared
        # optimizer shares; they track the steps of the optimizer they were given, which
        # the prepared one now takes (their "scheduler before optimizer" warning is moot).
        optimizer._opt_called = True  # type: ignore[attr-defined]
        proof.attest(self._attested_step(trainer, pl_module))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        window = trainer.accumulate_grad_batches
        if self.run.transaction is not None:
            self._seen += 1
            return
        ahead = _lookahead(trainer).peek(window - 1)
        rest = [_transferred(trainer, pl_module, item) for item, _, _ in ahead]
        self._seen = 1
        self._first_index = batch_idx
        self.run.open({"micro_batches": [batch, *rest]}, 1 + len(rest))

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.run.transaction is not None and self._seen == self.run.window:
            self.run.close_step()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.run.end(pl_module, lambda fields: _log_to_loggers(trainer, fields))

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.run.abort(exception)

    # --- the attested step ----------------------------------------------------------------
    def _attested_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        strategy = trainer.strategy
        precision = trainer.precision_plugin

        def attested_step(module: Any, optimizer: Any, batch: dict[str, Any]) -> None:
            """Lightning's automatic optimization of one step, as its loop runs it."""
            with _silenced(pl_module):
                for offset, micro_batch in enumerate(batch["micro_batches"]):
                    output = strategy.training_step(micro_batch, self._first_index + offset)
                    result = ClosureResult.from_training_step_output(
                        output, trainer.accumulate_grad_batches
                    )
                    if result.closure_loss is None:
                        raise RuntimeError(
                            "zkdv: training_step returned no loss; a proved step must "
                            "train on every micro-batch"
                        )
                    strategy.backward(result.closure_loss, optimizer)
                precision._after_closure(pl_module, optimizer)
            optimizer.step()
            optimizer.zero_grad()

        return attested_step


def _refuse_unsupported(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    problems = []
    if trainer.world_size > 1 or not isinstance(
        trainer.strategy, pl.strategies.SingleDeviceStrategy
    ):
        problems.append(
            f"the {type(trainer.strategy).__name__} strategy over {trainer.world_size} "
            "processes (one device, one process is supported)"
        )
    if not pl_module.automatic_optimization:
        problems.append("manual optimization (automatic_optimization=False)")
    if len(trainer.optimizers) != 1:
        problems.append(f"{len(trainer.optimizers)} optimizers (one is supported)")
    precision = str(trainer.precision)
    if precision.startswith("16"):
        problems.append(f"precision={precision!r} (loss scaling); use 'bf16-mixed'")
    if problems:
        raise ValueError(UNSUPPORTED.format(what="; ".join(problems)))


def _lookahead(trainer: pl.Trainer) -> _Lookahead:
    """The fit loop's data iterator, able to read the step's other micro-batches ahead."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None or fetcher.iterator is None:
        raise RuntimeError("zkdv: the fit loop has no data iterator to read the step's batches")
    if not isinstance(fetcher.iterator, _Lookahead):
        fetcher.iterator = _Lookahead(fetcher.iterator)
    return fetcher.iterator


def _transferred(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> Any:
    """A batch read ahead, prepared as the loop prepares it before ``training_step``."""
    batch = trainer.precision_plugin.convert_input(batch)
    batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


@contextlib.contextmanager
def _silenced(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` does nothing while the attested step is traced."""

    def quiet(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.log = quiet  # type: ignore[method-assign]
    pl_module.log_dict = quiet  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log
        del pl_module.log_dict


def _log_to_loggers(trainer: pl.Trainer, fields: dict[str, Any]) -> None:
    """Record the proof's fields with each of the trainer's loggers (W&B, MLflow...)."""
    for logger in trainer.loggers:
        logger.log_hyperparams(fields)
        logger.save()
