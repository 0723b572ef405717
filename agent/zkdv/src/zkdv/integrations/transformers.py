"""Prove a Hugging Face ``transformers.Trainer`` run: two lines, the script unchanged.

::

    from zkdv.integrations.transformers import prove

    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    proof = prove(trainer, experiment=dvbench.experiment("acme/gpt2-lora"))
    trainer.train()  # every optimizer step is one committed, replayable step

What the Trainer does stays what it does: its own optimizer and LR scheduler,
``gradient_accumulation_steps``, ``max_grad_norm`` clipping, ``bf16=True`` autocast,
the data collator, the loss normalised by ``num_items_in_batch``,
``model(**batch).loss``, dropout, PEFT adapters (frozen base weights are committed and
checked unchanged), checkpoints and ``save_model``; ``accelerate launch`` runs prove as
the DDP support does. :func:`prove` adds to this one trainer:

* the optimizer the Trainer creates is prepared (``proof.prepare(model, optimizer)``)
  before Accelerate wraps it, so the scheduler the Trainer creates next drives it;
* each optimizer step is one transaction: it opens when the Trainer has fetched the
  step's micro-batches (``get_batch_samples``), over all of them, and closes right after
  ``optimizer.step()`` (the ``on_optimizer_step`` callback);
* the attested step, the program a sampled check and the platform's replay run, is the
  Trainer's own: ``training_step`` on each micro-batch (the same loss normalisation, the
  same ``accelerator.backward``), then ``_clip_grad_norm`` and the optimizer step;
* at the end of training the transcript is closed; with an experiment, the final
  weights are saved and signed (``proof.save_model``), the proof is uploaded, and the
  active W&B or MLflow run records its digest, URL and verdict.

Refused, with a message, before anything trains: DeepSpeed, FSDP, ``fp16=True`` (loss
scaling; use ``bf16=True``), ``torch_compile``, several GPUs in one process
(``DataParallel``), and under ``accelerate launch`` gradient clipping (``max_grad_norm``
must be 0 there: the replay averages the ranks' gradients after their programs, so it
cannot yet clip the average).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import torch

import zkdv
from zkdv.integrations._run import ProvedRun, log_to_active_trackers

__all__ = ["TrainerProof", "prove"]

UNSUPPORTED = "zkdv.integrations.transformers cannot prove this Trainer run yet: {what}"


class TrainerProof(ProvedRun):
    """The proof of one ``transformers.Trainer`` run (made by :func:`prove`).

    Attributes:
        proof: the :class:`zkdv.torch.ZKDV` driver (a ``dvbench.DVBenchProof`` with an
            experiment).
        result: after an upload, the ``dvbench`` sync result (``proof_id``,
            ``proof_url``, ``verdict``).
        saved: the signed final weights, when they were saved at the end of training.
    """

    def __init__(self, trainer: Any, path: Any, **options: Any) -> None:
        super().__init__(path, **options)
        self.trainer = trainer

    def save_model(self, model: Any = None, directory: Any = None) -> Any:
        """Save the Trainer's final weights, signed (``model/model.safetensors``).

        Args:
            model: defaults to the trainer's model.
            directory: also copy the signed files there.
        """
        return super().save_model(self.trainer.model if model is None else model, directory)


def prove(
    trainer: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    experiment: Any = None,
    config: zkdv.ZKDVConfig | None = None,
    save_model: bool = True,
    wait: bool = False,
    rolling_window: int = 8,
    probe_ratio: float = 0.05,
    **driver_options: Any,
) -> TrainerProof:
    """Make ``trainer.train()`` write a ZKDV proof of every optimizer step.

    Call it once, after creating the Trainer and before ``trainer.train()``.

    Args:
        trainer: a ``transformers.Trainer`` (or a subclass: SFTTrainer...).
        path: the proof directory. Required without ``experiment``.
        experiment: a ``dvbench.Experiment``: the proof is bound to it and uploaded at
            the end of training, with the signed final weights (``save_model``).
        config: the run's :class:`zkdv.ZKDVConfig` (sampling policy, token unit...).
        save_model: with an experiment, save and sign the final weights at the end.
        wait: with an experiment, wait for the certificate at the end of training and
            raise ``dvbench.CertificateFailedError`` unless it records PASSED.
        rolling_window, probe_ratio: passed to ``proof.start``.
        **driver_options: passed to :class:`zkdv.torch.ZKDV`
            (``replay_snapshot_interval``, ``max_in_flight``).

    Returns:
        The :class:`TrainerProof`: ``.path``, ``.digest``, ``.url``, ``.result``,
        ``.save_model()``, ``.finish()``.

    Raises:
        ValueError: a Trainer setup ZKDV cannot prove (see the module's documentation).
    """
    _refuse_unsupported(trainer)
    run = TrainerProof(
        trainer,
        path,
        experiment=experiment,
        config=config,
        save_model=save_model,
        wait=wait,
        rolling_window=rolling_window,
        probe_ratio=probe_ratio,
        **driver_options,
    )
    _instrument(trainer, run)
    return run


def _refuse_unsupported(trainer: Any) -> None:
    args = trainer.args
    problems = []
    if getattr(trainer, "is_deepspeed_enabled", False):
        problems.append("DeepSpeed (its engine owns the optimizer step)")
    if getattr(trainer, "is_fsdp_enabled", False):
        problems.append("FSDP through Accelerate")
    if args.fp16:
        problems.append("fp16=True (Accelerate's loss scaling); use bf16=True")
    if args.torch_compile:
        problems.append("torch_compile=True (the proof seals the eager step)")
    if args.n_gpu > 1:
        problems.append(f"{args.n_gpu} GPUs in one process (DataParallel); use accelerate launch")
    if args.world_size > 1 and args.max_grad_norm and args.max_grad_norm > 0:
        problems.append(
            f"max_grad_norm={args.max_grad_norm} under {args.world_size} processes: a replay "
            "cannot yet clip the ranks' averaged gradient; set max_grad_norm=0"
        )
    if problems:
        raise ValueError(UNSUPPORTED.format(what="; ".join(problems)))


def _instrument(trainer: Any, run: TrainerProof) -> None:
    """Wrap this trainer's optimizer creation, batch fetching and training (instance only)."""
    from transformers import TrainerCallback

    proof = run.proof
    create_optimizer = trainer.create_optimizer
    get_batch_samples = trainer.get_batch_samples
    train = trainer.train
    # The global token count each rank divides its loss by is a collective: computed by
    # the Trainer and committed with the batch under several processes; recomputed from
    # the committed labels by the attested step in one.
    distributed = trainer.args.world_size > 1

    @functools.wraps(create_optimizer)
    def prepared_optimizer(*args: Any, **kwargs: Any) -> Any:
        optimizer = create_optimizer(*args, **kwargs)
        if not isinstance(optimizer, zkdv.torch._prepared.PreparedOptimizer):
            _, optimizer = proof.prepare(trainer.model, optimizer)
            trainer.optimizer = optimizer
        return optimizer

    @functools.wraps(get_batch_samples)
    def open_step(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        batch_samples, num_items = get_batch_samples(epoch_iterator, num_batches, device)
        if batch_samples:
            # The Trainer calls model.train() in training_step; an evaluation in between
            # left the model in eval mode, and the step must open as it runs.
            trainer.model.train()
            # A collator's BatchEncoding is a Mapping, not a dict: commit its tensors.
            micro_batches = [
                dict(inputs) if isinstance(inputs, Mapping) else inputs for inputs in batch_samples
            ]
            batch: dict[str, Any] = {"micro_batches": micro_batches}
            if distributed and num_items is not None:
                batch["num_items_in_batch"] = torch.as_tensor(num_items)
            run.open(batch, len(batch_samples))
        return batch_samples, num_items

    def attested_step(model: Any, optimizer: Any, batch: dict[str, Any]) -> None:
        """The Trainer's step: what its loop runs between fetching and stepping."""
        micro_batches = batch["micro_batches"]
        if "num_items_in_batch" in batch:
            num_items = batch["num_items_in_batch"]
        else:
            num_items = trainer._get_num_items_in_batch(micro_batches, trainer.args.device)
        trainer.current_gradient_accumulation_steps = len(micro_batches)
        for inputs in micro_batches:
            trainer.training_step(model, inputs, num_items)
        if trainer.args.max_grad_norm is not None and trainer.args.max_grad_norm > 0:
            trainer._clip_grad_norm(model)
        optimizer.step()
        optimizer.zero_grad()

    class _StepEnd(TrainerCallback):
        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            run.close_step()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            run.end(trainer.model, log_to_active_trackers)

    @functools.wraps(train)
    def proved_train(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        except BaseException as error:
            run.abort(error)
            raise

    proof.attest(attested_step)
    trainer.create_optimizer = prepared_optimizer
    trainer.get_batch_samples = open_step
    trainer.train = proved_train
    # First: a tracker's own callback (MLflow's) ends its run in on_train_end.
    trainer.callback_handler.callbacks.insert(0, _StepEnd())
