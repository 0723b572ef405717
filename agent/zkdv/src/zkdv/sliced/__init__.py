"""Sliced challenges (prototype, ``zkdv-sliced-v0``): open one block of one step, not the step.

A whole-step challenge moves a full snapshot and replays the whole model; at 70B that is
about 1.1 TB and thousands of GPU-seconds per challenge (``docs/scale.md``). A sliced
challenge names ``(step, block)`` and, after the lab has answered with its gradient
projections, a random subset of the step's sequences; the platform then checks that one
block from what the lab opens:

* the block's tensors of the pre-update parameters, the optimizer state and the
  committed gradient, each proven against the state roots by its tensor digest and one
  logarithmic audit path (:mod:`zkdv.merkle`'s per-tensor trees, unchanged);
* the block's boundary rows for the opened sequences: the activation entering and
  leaving the block and the loss gradient at both, each proven against the step's
  boundary root (one Merkle tree over every row of every boundary of every micro-batch);
* per-sequence gradient projections ``c_i = <R, G_i>`` of the block's weight gradient
  onto random directions ``R`` the challenge draws (Freivalds' check: their sum must be
  ``<R, G>`` for the committed ``G``, and the opened sequences' ``c_i`` are recomputed);
* with ``inputs`` (the embedding's parameters), the opened sequences' committed batch
  rows, the embedding tensors and boundary 0, so that any slice catches training on
  other data than the committed batch (the input check).

The platform side is ``provers/sliced.py``. This package is the lab side and the
framework-free protocol: the step commitment (:class:`StepCommitment`, in ``_commitment``),
openings (:class:`TensorOpening`, :class:`RowOpening`, :class:`BatchRowOpening`, in
``_openings``), the challenge draws and the detection probabilities of ``docs/scale.md``
(``_challenges``). :class:`TorchLab` (``_lab``) records a Torch run (lazily imported:
``import zkdv.sliced`` needs no framework) and :func:`sequence_projections`
(``_projections``) is the one implementation of ``c_i`` that the lab and the platform
share.

What this prototype does not do (``docs/scale.md``, "What is prototyped"): it runs beside
a transcript rather than inside one, hashes on the host rather than on the device, slices
whole transformer blocks (not sublayers, and not the head; the embedding only through
the input check), and trains in float32 without dropout or clipping. It answers
challenges from memory; :mod:`zkdv.sliced_store` writes a step's files to the lab's own
object store, from which the platform reads the opened ranges instead.
"""

from __future__ import annotations

from zkdv.sliced._bounded import SlicedFormatError
from zkdv.sliced._challenges import (
    SliceChallenge,
    challenges_needed,
    detection_probability,
    draw_challenge,
    draw_sequences,
)
from zkdv.sliced._commitment import (
    ACTIVATION,
    GRADIENT,
    SLICED_VERSION,
    BlockLayout,
    StepCommitment,
    batch_leaves,
    optimizer_paths,
    row_leaves,
    side_file_digest,
)
from zkdv.sliced._lab import TorchLab
from zkdv.sliced._openings import (
    BatchRowOpening,
    DigestPath,
    RowOpening,
    SliceAnswer,
    SliceOpening,
    TensorOpening,
)
from zkdv.sliced._projections import inner, projection_directions, sequence_projections
from zkdv.sliced._wire import (
    MAX_BLOCKS,
    MAX_NAMES,
    MAX_STEPS,
    RunFile,
    answer_from_bytes,
    answer_to_bytes,
    export_program,
    load_program,
    opening_from_bytes,
    opening_to_bytes,
)

__all__ = [
    "ACTIVATION",
    "GRADIENT",
    "MAX_BLOCKS",
    "MAX_NAMES",
    "MAX_STEPS",
    "SLICED_VERSION",
    "BatchRowOpening",
    "BlockLayout",
    "DigestPath",
    "RowOpening",
    "RunFile",
    "SliceAnswer",
    "SliceChallenge",
    "SliceOpening",
    "SlicedFormatError",
    "StepCommitment",
    "TensorOpening",
    "TorchLab",
    "answer_from_bytes",
    "answer_to_bytes",
    "batch_leaves",
    "challenges_needed",
    "detection_probability",
    "draw_challenge",
    "draw_sequences",
    "export_program",
    "inner",
    "load_program",
    "opening_from_bytes",
    "opening_to_bytes",
    "optimizer_paths",
    "projection_directions",
    "row_leaves",
    "sequence_projections",
    "side_file_digest",
]
