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

The platform side is ``provers/sliced.py``. This module is the lab side and the
framework-free protocol: the step commitment (:class:`StepCommitment`), openings
(:class:`TensorOpening`, :class:`RowOpening`, :class:`BatchRowOpening`), the challenge
draws, and the detection
probabilities of ``docs/scale.md``. :class:`TorchLab` records a Torch run (lazily
imported: ``import zkdv.sliced`` needs no framework) and :func:`sequence_projections` is
the one implementation of ``c_i`` that the lab and the platform share.

What this prototype does not do (``docs/scale.md``, "What is prototyped"): it runs beside
a transcript rather than inside one, hashes on the host rather than on the device, slices
whole transformer blocks (not sublayers, and not the head; the embedding only through
the input check), and trains in float32 without dropout or clipping. It answers
challenges from memory; :mod:`zkdv.sliced_store` writes a step's files to the lab's own
object store, from which the platform reads the opened ranges instead.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import cbor2
import numpy as np

from zkdv.hashing import DIGEST_BYTES, Domain, hasher
from zkdv.merkle import (
    LeafSpec,
    StateCommitment,
    chunk_hashes,
    commit_state,
    inclusion_path,
    merkle_root,
    tensor_digest,
    verify_inclusion,
)

__all__ = [
    "ACTIVATION",
    "GRADIENT",
    "SLICED_VERSION",
    "BatchRowOpening",
    "BlockLayout",
    "DigestPath",
    "RowOpening",
    "SliceAnswer",
    "SliceChallenge",
    "SliceOpening",
    "StepCommitment",
    "TensorOpening",
    "TorchLab",
    "challenges_needed",
    "detection_probability",
    "draw_challenge",
    "draw_sequences",
    "inner",
    "optimizer_paths",
    "projection_directions",
    "sequence_projections",
    "side_file_digest",
]

SLICED_VERSION = "zkdv-sliced-v0"
#: The two kinds of boundary row: the activation, and the loss gradient with respect to it.
ACTIVATION, GRADIENT = "act", "grad"
_KINDS = (ACTIVATION, GRADIENT)

# Boundary rows hash under their own key, so a row can never pass for a state chunk or a
# batch row (the protocol's other leaves); derived as zkdv.hashing derives its keys.
_ROW_KEY = blake3.blake3(b"zkdv-protocol-v1", derive_key_context="zkdv v1 sliced-row").digest()

Leaves = list[tuple[str, np.ndarray]]


def _row_leaf(micro: int, boundary: int, kind: str, row: int, data: np.ndarray) -> bytes:
    """The leaf of one boundary row: its position and shape are bound with its bytes."""
    header = cbor2.dumps(
        [micro, boundary, kind, row, str(data.dtype), list(data.shape)], canonical=True
    )
    h = blake3.blake3(key=_ROW_KEY)
    h.update(header)
    h.update(np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes())
    return h.digest()


def _batch_leaf(micro: int, row: int, data: np.ndarray) -> bytes:
    """The leaf of one committed batch row (a sequence's tokens)."""
    header = cbor2.dumps(["batch", micro, row, str(data.dtype), list(data.shape)], canonical=True)
    h = blake3.blake3(key=_ROW_KEY)
    h.update(header)
    h.update(np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<")).tobytes())
    return h.digest()


def _row_index(micro: int, boundary: int, kind: str, row: int, shape: tuple[int, int]) -> int:
    boundaries, rows = shape
    return ((micro * boundaries + boundary) * 2 + _KINDS.index(kind)) * rows + row


@dataclass(frozen=True)
class BlockLayout:
    """Which parameters make up each block, in the model's committed parameter order.

    Block ``b`` reads boundary ``b`` and writes boundary ``b + 1``; boundary 0 is the
    first block's input.
    """

    blocks: tuple[tuple[str, tuple[str, ...]], ...]

    def names(self, block: int) -> tuple[str, ...]:
        return self.blocks[block][1]

    @property
    def count(self) -> int:
        return len(self.blocks)


def optimizer_paths(name: str) -> tuple[str, str, str]:
    """The optimizer-state leaves of one Adam parameter, in committed order."""
    return (f"{name}.exp_avg", f"{name}.exp_avg_sq", f"{name}.step")


@dataclass(frozen=True)
class StepCommitment:
    """What the lab commits for one step before any challenge can name it.

    ``pre`` and ``post`` are the roots of the parameters and the optimizer state
    (:func:`zkdv.merkle.commit_state`, the transcript's construction); ``grad`` the
    committed gradient's; ``boundary`` the root over every boundary row of every
    micro-batch; ``batch`` the root over the batch's rows (one sequence's tokens each,
    index ``micro * rows + row``); ``shape`` is ``(micro_batches, boundaries, rows)``.
    """

    step: int
    pre: tuple[bytes, bytes]
    post: tuple[bytes, bytes]
    grad: bytes
    boundary: bytes
    batch: bytes
    shape: tuple[int, int, int]
    hp: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "i": self.step,
            "pre": list(self.pre),
            "post": list(self.post),
            "grad": self.grad,
            "boundary": self.boundary,
            "batch": self.batch,
            "shape": list(self.shape),
            "hp": dict(self.hp),
        }

    def digest(self) -> bytes:
        return _hash(b"zkdv-sliced-v0 step", cbor2.dumps(self.to_dict(), canonical=True))


def _hash(label: bytes, *parts: bytes) -> bytes:
    h = hasher(Domain.FILE)
    h.update(label)
    for part in parts:
        h.update(part)
    return h.digest()


def side_file_digest(layout: BlockLayout, steps: Sequence[StepCommitment]) -> bytes:
    """The digest that binds a run's sliced commitments (a transcript would record it)."""
    body = cbor2.dumps(
        {
            "v": SLICED_VERSION,
            "blocks": [[name, list(names)] for name, names in layout.blocks],
            "steps": [step.to_dict() for step in steps],
        },
        canonical=True,
    )
    return _hash(b"zkdv-sliced-v0 side file", body)


# --- openings ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorOpening:
    """One whole tensor leaf of a state tree, with the audit path of its digest.

    ``tensors_root`` is the root of the tree of tensor digests; the state root is
    ``H_state(u64le(count) || tensors_root)``, so it is bound by the root it is checked
    against.
    """

    index: int
    count: int
    spec: LeafSpec
    data: bytes
    path: tuple[bytes, ...]
    tensors_root: bytes

    def array(self) -> np.ndarray:
        dtype = np.dtype(self.spec.dtype).newbyteorder("<")
        return (
            np.frombuffer(self.data, dtype=dtype).reshape(self.spec.shape).astype(self.spec.dtype)
        )

    def verify(self, root: bytes, chunk_bytes: int) -> bool:
        """True when the bytes hash, through the tensor and state trees, to ``root``."""
        if len(self.data) != self.spec.nbytes:
            return False
        digest = tensor_digest(self.spec, merkle_root(chunk_hashes(self.array(), chunk_bytes)))
        return _under(root, self.count, self.tensors_root) and verify_inclusion(
            digest, self.index, self.count, self.path, self.tensors_root
        )

    @property
    def nbytes(self) -> int:
        return len(self.data) + DIGEST_BYTES * (len(self.path) + 1) + len(self.spec.header())


@dataclass(frozen=True)
class DigestPath:
    """A tensor digest's audit path in a post-update tree (the platform computes the bytes)."""

    index: int
    count: int
    path: tuple[bytes, ...]
    tensors_root: bytes

    def verify(self, root: bytes, spec: LeafSpec, array: np.ndarray, chunk_bytes: int) -> bool:
        digest = tensor_digest(spec, merkle_root(chunk_hashes(array, chunk_bytes)))
        return _under(root, self.count, self.tensors_root) and verify_inclusion(
            digest, self.index, self.count, self.path, self.tensors_root
        )

    @property
    def nbytes(self) -> int:
        return DIGEST_BYTES * (len(self.path) + 1)


def _under(root: bytes, count: int, tensors_root: bytes) -> bool:
    # The same wrapping as zkdv.merkle.state_root, from the tree root rather than digests.
    h = hasher(Domain.STATE)
    h.update(struct.pack("<Q", count))
    h.update(tensors_root)
    return h.digest() == root


@dataclass(frozen=True)
class RowOpening:
    """One boundary row (one sequence's activation or gradient) and its audit path."""

    micro: int
    boundary: int
    kind: str
    row: int
    data: np.ndarray
    path: tuple[bytes, ...]

    def verify(self, root: bytes, shape: tuple[int, int, int]) -> bool:
        micro_batches, boundaries, rows = shape
        if not (
            0 <= self.micro < micro_batches
            and 0 <= self.boundary < boundaries
            and 0 <= self.row < rows
            and self.kind in _KINDS
        ):
            return False
        index = _row_index(self.micro, self.boundary, self.kind, self.row, (boundaries, rows))
        leaf = _row_leaf(self.micro, self.boundary, self.kind, self.row, self.data)
        return verify_inclusion(leaf, index, micro_batches * boundaries * 2 * rows, self.path, root)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + DIGEST_BYTES * len(self.path)


@dataclass(frozen=True)
class BatchRowOpening:
    """One committed batch row (a sequence's tokens) and its audit path."""

    micro: int
    row: int
    data: np.ndarray
    path: tuple[bytes, ...]

    def verify(self, root: bytes, shape: tuple[int, int, int]) -> bool:
        micro_batches, _, rows = shape
        if not (0 <= self.micro < micro_batches and 0 <= self.row < rows):
            return False
        leaf = _batch_leaf(self.micro, self.row, self.data)
        index = self.micro * rows + self.row
        return verify_inclusion(leaf, index, micro_batches * rows, self.path, root)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + DIGEST_BYTES * len(self.path)


def _open_tensor(commitment: StateCommitment, leaves: Leaves, index: int) -> TensorOpening:
    digests = list(commitment.tensor_digests)
    array = np.ascontiguousarray(leaves[index][1])
    return TensorOpening(
        index=index,
        count=len(digests),
        spec=commitment.specs[index],
        data=array.astype(array.dtype.newbyteorder("<")).tobytes(),
        path=tuple(inclusion_path(digests, index)),
        tensors_root=merkle_root(digests),
    )


def _digest_path(commitment: StateCommitment, index: int) -> DigestPath:
    digests = list(commitment.tensor_digests)
    return DigestPath(
        index, len(digests), tuple(inclusion_path(digests, index)), merkle_root(digests)
    )


# --- challenges -------------------------------------------------------------------------
@dataclass(frozen=True)
class SliceChallenge:
    """``(step, block)`` and the seed of the Freivalds directions, drawn after commitment."""

    step: int
    block: int
    seed: bytes
    projections: int = 4


def _stream(*parts: bytes) -> Any:
    h = hasher(Domain.SAMPLE)
    for part in parts:
        h.update(part)
    offset = 0
    while True:
        block = h.digest(length=512, seek=offset)
        offset += len(block)
        for i in range(0, len(block), 8):
            yield int.from_bytes(block[i : i + 8], "little")


def _uniform(values: Any, n: int) -> int:
    limit = (1 << 64) - ((1 << 64) % n)  # rejection sampling: no modulo bias
    for value in values:
        if value < limit:
            return int(value % n)
    raise AssertionError("unreachable: the stream is unbounded")


def draw_challenge(
    seed: bytes, side_digest: bytes, *, index: int, steps: int, blocks: int, projections: int = 4
) -> SliceChallenge:
    """The ``index``-th sliced challenge of a run: a uniform step and a uniform block.

    Args:
        seed: the platform's secret 32-byte seed (revealed in the certificate).
        side_digest: :func:`side_file_digest` of the committed run.
    """
    if len(seed) != 32:
        raise ValueError(f"the challenge seed must be 32 bytes, got {len(seed)}")
    values = _stream(b"zkdv-sliced-v0 challenge", seed, side_digest, struct.pack("<Q", index))
    step = _uniform(values, steps)
    block = _uniform(values, blocks)
    directions = _hash(b"zkdv-sliced-v0 directions", seed, side_digest, struct.pack("<Q", index))
    return SliceChallenge(step, block, directions, projections)


def draw_sequences(
    seed: bytes,
    challenge: SliceChallenge,
    answer_digest: bytes,
    *,
    micro_batches: int,
    rows: int,
    count: int,
) -> tuple[tuple[int, int], ...]:
    """Which sequences ``(micro, row)`` to open, drawn only after the lab's projections.

    The lab learns the opened sequences only after it has sent every ``c_i``, so it
    cannot put a lie where nobody looks. The draw uses the platform's *secret* seed (the
    lab knows ``challenge.seed``, the directions' seed, and could otherwise try answers
    until the draw avoided its lie); binding it to the answer's digest lets anyone re-derive
    it once the seed is revealed in the certificate.

    Args:
        seed: the platform's secret 32-byte seed, the one :func:`draw_challenge` took.
    """
    if len(seed) != 32:
        raise ValueError(f"the challenge seed must be 32 bytes, got {len(seed)}")
    population = micro_batches * rows
    if not 1 <= count <= population:
        raise ValueError(f"cannot open {count} of {population} sequences")
    values = _stream(
        b"zkdv-sliced-v0 sequences",
        seed,
        challenge.seed,
        struct.pack("<QQ", challenge.step, challenge.block),
        answer_digest,
    )
    chosen: list[int] = []
    while len(chosen) < count:
        pick = _uniform(values, population)
        if pick not in chosen:
            chosen.append(pick)
    return tuple(sorted((pick // rows, pick % rows) for pick in chosen))


def projection_directions(
    seed: bytes, specs: Sequence[LeafSpec], count: int
) -> list[list[np.ndarray]]:
    """``count`` independent standard-normal directions ``R``, one array per block tensor.

    Drawn with numpy's PCG64 from the challenge seed (float64), so the lab and the
    platform draw the same ones on any machine.
    """
    generator = np.random.Generator(np.random.PCG64(int.from_bytes(seed[:16], "little")))
    return [[generator.standard_normal(spec.shape) for spec in specs] for _ in range(count)]


# --- the lab's answer and opening -------------------------------------------------------
@dataclass(frozen=True)
class SliceAnswer:
    """The lab's first reply: ``c[q][micro][row] = <R_q, G_(micro,row)>`` for every sequence."""

    projections: np.ndarray  # float64, (projections, micro_batches, rows)

    def digest(self) -> bytes:
        data = np.ascontiguousarray(self.projections, dtype="<f8")
        return _hash(b"zkdv-sliced-v0 answer", struct.pack("<3Q", *data.shape), data.tobytes())

    @property
    def nbytes(self) -> int:
        return int(self.projections.nbytes)


@dataclass(frozen=True)
class SliceOpening:
    """Everything the platform reads for one sliced challenge, after the sequences are drawn."""

    params: tuple[TensorOpening, ...]
    opt_state: tuple[TensorOpening, ...]
    grad: tuple[TensorOpening, ...]
    post_params: tuple[DigestPath, ...]
    post_opt_state: tuple[DigestPath, ...]
    rows: tuple[RowOpening, ...]
    #: The input check (a lab with ``inputs``): the embedding's tensors and the opened
    #: sequences' batch rows; ``rows`` then also holds their boundary-0 activations.
    inputs: tuple[TensorOpening, ...] = ()
    batch_rows: tuple[BatchRowOpening, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes moved: tensor and row bytes plus every audit path."""
        return (
            sum(t.nbytes for t in (*self.params, *self.opt_state, *self.grad, *self.inputs))
            + sum(p.nbytes for p in (*self.post_params, *self.post_opt_state))
            + sum(r.nbytes for r in self.rows)
            + sum(r.nbytes for r in self.batch_rows)
        )


# --- soundness ----------------------------------------------------------------------------
def detection_probability(
    forgery: str,
    *,
    forged_fraction: float,
    blocks: int,
    sequences: int,
    opened: int,
    per_micro_batch: int = 1,
    lied: int = 1,
) -> float:
    """Probability that one sliced challenge catches a run in which ``forged_fraction`` of
    steps carry ``forgery`` (``docs/scale.md``, "Soundness").

    ``"step"``: every block of a forged step is wrong, so any slice of it fails.
    ``"block"``: one block's update (weights nudged, gradient changed within the
    projections); caught when that block is drawn. ``"micro-batch"``: one micro-batch's
    boundary at one interior boundary, read by two blocks; caught when one of them is
    drawn and an opened sequence is in the micro-batch. ``"data"``: the tokens of
    ``per_micro_batch`` sequences substituted (trained on, not committed), everything
    downstream consistent; the input check of any block catches it when one of them is
    opened. ``"projection"``: a block's gradient changed and the difference hidden in
    ``lied`` sequences' projections; caught when the block is drawn and one of them is
    opened.
    """
    hit_micro = 1.0 - _miss(sequences, per_micro_batch, opened)
    per_step = {
        "step": 1.0,
        "block": 1.0 / blocks,
        "micro-batch": min(1.0, 2.0 / blocks) * hit_micro,
        "data": hit_micro,
        "projection": (1.0 / blocks) * (1.0 - _miss(sequences, lied, opened)),
    }
    if forgery not in per_step:
        raise ValueError(f"unknown forgery {forgery!r}; one of {', '.join(per_step)}")
    return forged_fraction * per_step[forgery]


def _miss(population: int, marked: int, drawn: int) -> float:
    """Probability that ``drawn`` of ``population`` without replacement miss ``marked``."""
    if marked <= 0:
        return 1.0
    if drawn > population - marked:
        return 0.0
    return math.comb(population - marked, drawn) / math.comb(population, drawn)


def challenges_needed(per_challenge: float, target: float = 0.95) -> int:
    """Independent challenges so that at least one catches the forger with ``target``."""
    if not 0.0 < per_challenge <= 1.0:
        raise ValueError(f"per-challenge detection {per_challenge!r} must be in (0, 1]")
    if per_challenge == 1.0:
        return 1
    return math.ceil(math.log(1.0 - target) / math.log(1.0 - per_challenge))


def inner(a: np.ndarray, b: np.ndarray) -> float:
    """``<a, b>`` in float64 over all elements.

    An elementwise product and numpy's pairwise sum, not ``np.vdot``: BLAS ``ddot``
    runs on OpenBLAS's thread pool, which on a loaded machine spent milliseconds per
    call here waking threads for a few thousand elements.
    """
    return float(np.multiply(a, b, dtype=np.float64).sum())


# --- Torch: the shared per-sequence projection, and the lab ------------------------------
def sequence_projections(
    block: Any,
    params: dict[str, Any],
    h_in: Any,
    dh_out: Any,
    directions: Sequence[Sequence[np.ndarray]],
) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """Run one block forward and backward on some sequences, from committed boundaries.

    The lab computes its answer with this function and the platform recomputes the opened
    sequences with it: one implementation on both sides. Everything runs in float64 (the
    boundaries and weights are float32 values, exactly representable), so the two sides
    differ only by summation order, far below the tolerances.

    Args:
        block: the block module (its own parameters are not used).
        params: the block's parameters by name, relative to the block.
        h_in: ``(sequences, length, width)`` float tensor, the block's input rows.
        dh_out: the loss gradient at the block's output, same shape.
        directions: ``[q][tensor]`` Freivalds directions in ``params``' order.

    Returns:
        ``(h_out, dh_in, c, norms)``: float64 output and input gradient, ``c[q][i] =
        <R_q, G_i>`` for each sequence ``i``, and ``|G_i|`` (L2 over the block).
    """
    import torch
    from torch.func import functional_call

    names = list(params)
    rows = int(h_in.shape[0])
    c = np.zeros((len(directions), rows))
    norms = np.zeros(rows)
    outs, grads_in = [], []
    for i in range(rows):
        weights = {k: v.detach().to(torch.float64).requires_grad_(True) for k, v in params.items()}
        x = h_in[i : i + 1].detach().to(torch.float64).requires_grad_(True)
        with torch.enable_grad():
            out = functional_call(block, weights, (x,))
            gradients = torch.autograd.grad(
                out, [x, *(weights[k] for k in names)], dh_out[i : i + 1].to(torch.float64)
            )
        outs.append(out.detach())
        grads_in.append(gradients[0])
        flat = [g.numpy() for g in gradients[1:]]
        norms[i] = math.sqrt(sum(inner(g, g) for g in flat))
        for q, direction in enumerate(directions):
            c[q, i] = sum(inner(r, g) for r, g in zip(direction, flat, strict=True))
    return torch.cat(outs), torch.cat(grads_in), c, norms


@dataclass
class _Step:
    commitment: StepCommitment
    params: Leaves
    opt_state: Leaves
    grad: Leaves
    pre: tuple[StateCommitment, StateCommitment]
    post: tuple[StateCommitment, StateCommitment]
    grad_tree: StateCommitment
    #: ``[micro][boundary][kind]`` arrays of shape ``(rows, length, width)``.
    boundaries: list[list[dict[str, np.ndarray]]]
    batch: np.ndarray


@dataclass
class TorchLab:
    """The lab's side of the prototype, for a Torch model of sequential blocks.

    Per step it records, with hooks, each block's input and output activations and the
    loss gradients at them for every micro-batch; accumulates the gradient; commits the
    pre-state, the gradient and the boundary rows; applies AdamW through the canonical
    update (``zkdv.torch.optimizers.canonical``, bitwise reproducible); and commits the
    post-state. It keeps everything in memory and answers sliced challenges from it.

    Args:
        model: the model; its ``named_parameters()`` order is the committed order.
        blocks: ``(name, module)`` of each block, in forward order; a block maps one
            tensor to one tensor of the same shape.
        group: AdamW's options (``lr``, ``betas``, ``eps``, ``weight_decay``).
        chunk_bytes: Merkle chunk size of the state trees.
        inputs: the parameters that map a batch row to boundary 0 (the embedding's);
            with them, every slice also opens what the platform's input check reads.
        tamper: test hooks that forge the run (``docs/scale.md`` lists the forgeries).
    """

    model: Any
    blocks: Sequence[tuple[str, Any]]
    group: dict[str, Any]
    chunk_bytes: int = 1 << 16
    inputs: tuple[str, ...] = ()
    tamper: dict[str, Callable[..., None]] = field(default_factory=dict)
    steps: list[_Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        import torch

        self._names = [name for name, _ in self.model.named_parameters()]
        self._params = dict(self.model.named_parameters())
        self._state = {
            name: {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
            for name, p in self._params.items()
        }
        self.layout = BlockLayout(
            tuple(
                (prefix, tuple(n for n in self._names if n.startswith(prefix + ".")))
                for prefix, _ in self.blocks
            )
        )

    # The three trees, as numpy leaves in committed order.
    def _leaves(self) -> tuple[Leaves, Leaves]:
        params = [(n, self._params[n].detach().numpy().copy()) for n in self._names]
        opt: Leaves = []
        for n in self._names:
            s = self._state[n]
            paths = optimizer_paths(n)
            opt += [
                (paths[0], s["exp_avg"].numpy().copy()),
                (paths[1], s["exp_avg_sq"].numpy().copy()),
                (paths[2], s["step"].numpy().reshape(()).copy()),
            ]
        return params, opt

    def step(self, batch: Any, loss: Callable[[Any, Any], Any]) -> float:
        """One training step over ``batch`` (``(micro_batches, rows, ...)``); returns the loss.

        ``loss(model, micro_batch)`` is the micro-batch's loss, already divided by the
        number of micro-batches (the gradient is their sum).
        """
        import torch

        from zkdv.torch.optimizers import canonical

        index = len(self.steps)
        params, opt = self._leaves()
        pre = (commit_state(params, self.chunk_bytes), commit_state(opt, self.chunk_bytes))
        boundaries: list[list[dict[str, np.ndarray]]] = []
        total = 0.0
        for micro in batch.unbind(0):
            acts: list[Any] = [None] * (len(self.blocks) + 1)
            grads: list[Any] = [None] * (len(self.blocks) + 1)
            handles = [
                self.blocks[0][1].register_forward_pre_hook(_keeper(0, acts, grads, pre=True))
            ]
            handles += [
                module.register_forward_hook(_keeper(b + 1, acts, grads, pre=False))
                for b, (_, module) in enumerate(self.blocks)
            ]
            try:
                value = loss(self.model, micro)
                value.backward()
            finally:
                for handle in handles:
                    handle.remove()
            total += float(value.detach())
            boundaries.append(
                [
                    {
                        ACTIVATION: a.numpy().astype(np.float32),
                        GRADIENT: g.numpy().astype(np.float32),
                    }
                    for a, g in zip(acts, grads, strict=True)
                ]
            )
        gradients = {n: self._params[n].grad.detach().clone() for n in self._names}
        if "gradient" in self.tamper:
            self.tamper["gradient"](index, gradients)
        if "boundaries" in self.tamper:
            self.tamper["boundaries"](index, boundaries)
        grad_leaves = [(f"params:{n}", gradients[n].numpy().copy()) for n in self._names]
        grad_tree = commit_state(grad_leaves, self.chunk_bytes)
        shape = (len(boundaries), len(self.blocks) + 1, int(batch.shape[1]))
        boundary_root = merkle_root(_row_leaves(boundaries))
        committed_batch = batch.detach().numpy().copy()
        if "batch" in self.tamper:
            self.tamper["batch"](index, committed_batch)
        batch_root = merkle_root(_batch_leaves(committed_batch))
        canonical.update(
            "AdamW",
            [self._params[n].data for n in self._names],
            [gradients[n] for n in self._names],
            [self._state[n] for n in self._names],
            {**self.group, "amsgrad": False, "maximize": False},
        )
        for p in self._params.values():
            p.grad = None
        if "post" in self.tamper:
            with torch.no_grad():
                self.tamper["post"](index, self._params)
        post_params, post_opt = self._leaves()
        post = (
            commit_state(post_params, self.chunk_bytes),
            commit_state(post_opt, self.chunk_bytes),
        )
        hp = {k: float(v) for k, v in self.group.items() if k in ("lr", "eps", "weight_decay")}
        hp["beta1"], hp["beta2"] = (float(b) for b in self.group["betas"])
        commitment = StepCommitment(
            index,
            (pre[0].root, pre[1].root),
            (post[0].root, post[1].root),
            grad_tree.root,
            boundary_root,
            batch_root,
            shape,
            hp,
        )
        self.steps.append(
            _Step(
                commitment,
                params,
                opt,
                grad_leaves,
                pre,
                post,
                grad_tree,
                boundaries,
                committed_batch,
            )
        )
        return total

    @property
    def names(self) -> list[str]:
        """The committed parameter order (``named_parameters()``, tied ones once)."""
        return list(self._names)

    @property
    def commitments(self) -> list[StepCommitment]:
        return [s.commitment for s in self.steps]

    def digest(self) -> bytes:
        return side_file_digest(self.layout, self.commitments)

    def _block_indices(self, block: int) -> tuple[list[int], list[int]]:
        names = self.layout.names(block)
        params = [self._names.index(n) for n in names]
        opt = [3 * i + k for i in params for k in range(3)]
        return params, opt

    def answer(
        self, challenge: SliceChallenge, *, lie: Callable[..., None] | None = None
    ) -> SliceAnswer:
        """The projections ``c`` of every sequence of the challenged step and block.

        ``lie(c)`` edits them before they are sent (a forger's test hook).
        """
        import torch

        record = self.steps[challenge.step]
        params_index, _ = self._block_indices(challenge.block)
        prefix, module = self.blocks[challenge.block]
        specs = [record.pre[0].specs[i] for i in params_index]
        directions = projection_directions(challenge.seed, specs, challenge.projections)
        weights = {
            record.params[i][0][len(prefix) + 1 :]: torch.from_numpy(record.params[i][1])
            for i in params_index
        }
        micro_batches, _, rows = record.commitment.shape
        c = np.zeros((challenge.projections, micro_batches, rows))
        for m in range(micro_batches):
            rows_m = record.boundaries[m]
            h_in = torch.from_numpy(rows_m[challenge.block][ACTIVATION])
            dh_out = torch.from_numpy(rows_m[challenge.block + 1][GRADIENT])
            _, _, projected, _ = sequence_projections(module, weights, h_in, dh_out, directions)
            c[:, m, :] = projected
        if lie is not None:
            lie(c)
        return SliceAnswer(c)

    def open(self, challenge: SliceChallenge, sequences: Sequence[tuple[int, int]]) -> SliceOpening:
        """Open the challenged block's tensors and the drawn sequences' boundary rows."""
        record = self.steps[challenge.step]
        params_index, opt_index = self._block_indices(challenge.block)
        leaves = _row_leaves(record.boundaries)
        _, boundaries, rows = record.commitment.shape
        opened_rows = []
        wanted = [
            (boundary, kind)
            for boundary in (challenge.block, challenge.block + 1)
            for kind in _KINDS
        ]
        if self.inputs and challenge.block != 0:
            wanted.append((0, ACTIVATION))  # what the input check compares
        for micro, row in sequences:
            for boundary, kind in wanted:
                data = record.boundaries[micro][boundary][kind][row]
                index = _row_index(micro, boundary, kind, row, (boundaries, rows))
                opened_rows.append(
                    RowOpening(
                        micro, boundary, kind, row, data, tuple(inclusion_path(leaves, index))
                    )
                )
        inputs: tuple[TensorOpening, ...] = ()
        batch_rows: tuple[BatchRowOpening, ...] = ()
        if self.inputs:
            inputs = tuple(
                _open_tensor(record.pre[0], record.params, self._names.index(name))
                for name in self.inputs
            )
            batch_leaves = _batch_leaves(record.batch)
            batch_rows = tuple(
                BatchRowOpening(
                    micro,
                    row,
                    record.batch[micro, row],
                    tuple(inclusion_path(batch_leaves, micro * rows + row)),
                )
                for micro, row in sequences
            )
        return SliceOpening(
            inputs=inputs,
            batch_rows=batch_rows,
            params=tuple(_open_tensor(record.pre[0], record.params, i) for i in params_index),
            opt_state=tuple(_open_tensor(record.pre[1], record.opt_state, i) for i in opt_index),
            grad=tuple(_open_tensor(record.grad_tree, record.grad, i) for i in params_index),
            post_params=tuple(_digest_path(record.post[0], i) for i in params_index),
            post_opt_state=tuple(_digest_path(record.post[1], i) for i in opt_index),
            rows=tuple(opened_rows),
        )

    def whole_step(self, step: int) -> dict[str, Any]:
        """What a whole-step challenge moves today: the full pre-state, gradient and batch."""
        record = self.steps[step]
        leaves = (*record.params, *record.opt_state, *record.grad)
        return {
            "commitment": record.commitment,
            "params": record.params,
            "opt_state": record.opt_state,
            "grad": record.grad,
            "batch": record.batch,
            "nbytes": sum(int(a.nbytes) for _, a in leaves) + int(record.batch.nbytes),
        }


def _keeper(position: int, acts: list[Any], grads: list[Any], *, pre: bool) -> Callable[..., None]:
    """A forward (pre-)hook that keeps a boundary activation and, later, its gradient."""

    def keep(_module: Any, inputs: Any, output: Any = None) -> None:
        tensor = inputs[0] if pre else output
        acts[position] = tensor.detach().clone()

        def on_grad(gradient: Any) -> None:
            grads[position] = gradient.detach().clone()

        tensor.register_hook(on_grad)

    return keep


def _batch_leaves(batch: np.ndarray) -> list[bytes]:
    """Every batch row's leaf, micro-batch by micro-batch."""
    return [
        _batch_leaf(micro, row, batch[micro, row])
        for micro in range(batch.shape[0])
        for row in range(batch.shape[1])
    ]


def _row_leaves(boundaries: list[list[dict[str, np.ndarray]]]) -> list[bytes]:
    """Every boundary row's leaf, in :func:`_row_index` order."""
    out = []
    for micro, per_boundary in enumerate(boundaries):
        for boundary, kinds in enumerate(per_boundary):
            for kind in _KINDS:
                for row, data in enumerate(kinds[kind]):
                    out.append(_row_leaf(micro, boundary, kind, row, data))
    return out
