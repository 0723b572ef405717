"""Verify one sliced challenge: one block of one step, from what the lab opened (prototype).

The protocol is ``docs/scale.md``'s; the lab side and the shared definitions are
:mod:`zkdv.sliced`. :func:`verify_slice` is a pure function of the step's commitment,
the challenge, the lab's answer and its opening, and the block's module (its structure:
the attested program's, here the model's own class). It checks, in order, and reports
the first that fails:

1. ``tensor_opening``: every opened tensor (the block's parameters, their optimizer
   state, their committed gradient) hashes to the step's pre-state or gradient root,
   at the position the committed parameter order gives it;
2. ``row_opening``: every opened boundary row hashes to the step's boundary root, and
   the rows are exactly the drawn sequences' at the block's two boundaries;
3. ``forward``: the block run on each opened sequence's input row gives its committed
   output row, within ``activation`` of the recomputed row's L2 norm;
4. ``backward``: its backward from the committed output gradient gives the committed
   input gradient, within the same bound;
5. ``projection``: the lab's ``c_i = <R_q, G_i>`` of each opened sequence is the
   recomputed one (float64 on both sides, within ``projection`` of ``|R_q| |G_i|``);
6. ``freivalds``: for each direction ``R_q``, the lab's ``c`` summed over *every*
   sequence of the step is ``<R_q, G>`` for the committed block gradient ``G``, within
   ``freivalds * |G|``;
7. ``update``: AdamW's canonical update (``zkdv-torch-canonical-v1``) of the opened
   pre-state with the committed gradient hashes to the step's post-state roots, bit
   for bit;
8. ``input`` (with ``inputs``, whatever the block): each opened sequence's committed
   batch row, embedded with the opened embedding tensors, gives its committed
   boundary-0 activation. This is what catches training on data other than the
   committed batch, which every later boundary would otherwise carry consistently.

:func:`replay_whole_step` is today's whole-step challenge on the same run, for the
bytes-and-seconds comparison (``bench/scale_model.py --measure``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zkdv.config import GradientBounds
from zkdv.gradients import compare
from zkdv.merkle import commit_state
from zkdv.sliced import (
    ACTIVATION,
    GRADIENT,
    BlockLayout,
    SliceAnswer,
    SliceChallenge,
    SliceOpening,
    StepCommitment,
    inner,
    optimizer_paths,
    projection_directions,
    sequence_projections,
)
from zkdv.torch.optimizers import canonical

__all__ = ["SliceTolerances", "SliceVerdict", "replay_whole_step", "verify_slice"]

#: Standard deviations of honest rounding the Freivalds bound allows: with a Gaussian
#: direction ``R``, ``<R, e>`` for the honest rounding ``e`` of the committed gradient is
#: ``N(0, |e|^2)``, so a bound of ``Z * tensor * |G|`` fails an honest run with probability
#: below 2e-9 per direction while ``|e| <= tensor * |G|``.
FREIVALDS_Z = 6.0


@dataclass(frozen=True)
class SliceTolerances:
    """The relative bounds of a sliced check (float32 training).

    ``activation``: a recomputed boundary row against the committed one, relative to the
    recomputed row's L2 norm (the float32 gradient bound's ``tensor``). ``projection``: a
    recomputed ``c_i`` against the lab's, relative to ``|R| |G_i|`` (both float64).
    ``freivalds``: the sum of the lab's ``c`` against ``<R, G>``, relative to ``|G|``.
    """

    activation: float = 1e-4
    projection: float = 1e-9
    freivalds: float = FREIVALDS_Z * 1e-4

    @classmethod
    def from_bounds(cls, bounds: GradientBounds) -> SliceTolerances:
        return cls(activation=bounds.tensor, freivalds=FREIVALDS_Z * bounds.tensor)


@dataclass
class SliceVerdict:
    """The outcome of one sliced check: ``ok``, the first failing check and why."""

    ok: bool
    reason: str = ""
    message: str = ""
    #: The largest measured-to-bound ratio of each check that measures one.
    margins: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def fail(self, reason: str, message: str) -> SliceVerdict:
        self.ok, self.reason, self.message = False, reason, message
        return self


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    norm = float(torch.linalg.vector_norm(b))
    difference = float(torch.linalg.vector_norm(a.to(torch.float64) - b.to(torch.float64)))
    if difference == 0.0:
        return 0.0
    return difference / norm if norm > 0 else math.inf


def verify_slice(
    commitment: StepCommitment,
    challenge: SliceChallenge,
    answer: SliceAnswer,
    sequences: Sequence[tuple[int, int]],
    opening: SliceOpening,
    *,
    names: Sequence[str],
    layout: BlockLayout,
    block: Any,
    chunk_bytes: int,
    tolerances: SliceTolerances | None = None,
    inputs: Sequence[str] = (),
    embed: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor] | None = None,
) -> SliceVerdict:
    """Check one block of one step from an opened slice (the module docstring's checks).

    Args:
        commitment: the challenged step's commitment, from the stored side file.
        challenge: the drawn challenge; ``answer`` the lab's projections, and
            ``sequences`` the ``(micro, row)`` pairs drawn after it.
        opening: what the lab opened.
        names: the run's committed parameter order (a transcript's ``schema.params``).
        layout: the run's blocks: each block's module path (``blocks.1``, the prefix of
            its parameters' names) and parameters.
        block: a module of the challenged block's structure (its own parameters are not
            read).
        chunk_bytes: the run's Merkle chunk size.
        inputs: the embedding's parameters, for the input check; ``embed(weights,
            tokens)`` maps one committed batch row to its boundary-0 activation.

    Raises:
        ValueError: ``inputs`` without ``embed``.
    """
    if inputs and embed is None:
        raise ValueError("the input check needs the embedding function, embed=")
    started = time.perf_counter()
    tol = tolerances or SliceTolerances()
    verdict = SliceVerdict(ok=True)
    try:
        return _verify(
            verdict,
            commitment,
            challenge,
            answer,
            sequences,
            opening,
            names,
            layout,
            block,
            chunk_bytes,
            tol,
            inputs,
            embed,
        )
    finally:
        verdict.seconds = time.perf_counter() - started


class _RefusedError(Exception):
    """One of the checks failed: its name (the verdict's reason) and why."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check, self.message = check, message


def _verify(
    verdict: SliceVerdict,
    commitment: StepCommitment,
    challenge: SliceChallenge,
    answer: SliceAnswer,
    sequences: Sequence[tuple[int, int]],
    opening: SliceOpening,
    names: Sequence[str],
    layout: BlockLayout,
    block: Any,
    chunk_bytes: int,
    tol: SliceTolerances,
    inputs: Sequence[str],
    embed: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor] | None,
) -> SliceVerdict:
    """The checks of ``docs/scale.md`` in order; the first that fails names the verdict."""
    b = challenge.block
    try:
        prefix = _check_tensors(commitment, b, opening, names, layout, chunk_bytes, inputs)
        rows = _check_rows(commitment, b, opening, sequences, bool(inputs))
        if inputs and embed is not None:  # 8, first, since it is cheap
            _check_input(verdict, opening, rows, embed, tol)
        directions = projection_directions(
            challenge.seed, [t.spec for t in opening.params], challenge.projections
        )
        _check_sequences(
            verdict, commitment, challenge, answer, rows, opening, prefix, block, directions, tol
        )
        _check_freivalds(verdict, answer, opening, directions, tol)
        _check_update(commitment, opening, chunk_bytes)
    except _RefusedError as refused:
        return verdict.fail(refused.check, refused.message)
    return verdict


def _check_tensors(
    commitment: StepCommitment,
    b: int,
    opening: SliceOpening,
    names: Sequence[str],
    layout: BlockLayout,
    chunk_bytes: int,
    inputs: Sequence[str],
) -> str:
    """1. The block's tensors, each at the position the committed order gives it, hash to
    the committed roots. Returns the block's prefix."""
    boundaries = commitment.shape[1]
    if not 0 <= b < boundaries - 1 or boundaries - 1 != layout.count:
        raise _RefusedError("schema", f"block {b} is not one of the run's {layout.count}")
    prefix, block_names = layout.blocks[b]
    if not set(block_names) <= set(names):
        raise _RefusedError("schema", f"block {prefix} names parameters the run does not have")
    if (len(opening.post_params), len(opening.post_opt_state)) != (
        len(block_names),
        3 * len(block_names),
    ):
        raise _RefusedError("tensor_opening", "the post-state paths are not the block's")
    indices = [list(names).index(n) for n in block_names]
    expected = [
        (opening.params, [(i, n) for i, n in zip(indices, block_names, strict=True)], 0),
        (
            opening.opt_state,
            [
                (3 * i + k, optimizer_paths(n)[k])
                for i, n in zip(indices, block_names, strict=True)
                for k in range(3)
            ],
            1,
        ),
        (opening.grad, [(i, f"params:{n}") for i, n in zip(indices, block_names, strict=True)], 2),
    ]
    if not set(inputs) <= set(names):
        raise _RefusedError("schema", "the input check names parameters the run does not have")
    if inputs:
        expected.append((opening.inputs, [(list(names).index(n), n) for n in inputs], 0))
    elif opening.inputs or opening.batch_rows:
        raise _RefusedError("tensor_opening", "an input opening for a slice without one")
    roots = (commitment.pre[0], commitment.pre[1], commitment.grad)
    for opened, wanted, tree in expected:
        if [(t.index, t.spec.path) for t in opened] != wanted:
            raise _RefusedError(
                "tensor_opening", f"tree {tree}: the opened tensors are not the block's"
            )
        for t in opened:
            if not t.verify(roots[tree], chunk_bytes):
                raise _RefusedError(
                    "tensor_opening", f"{t.spec.path} does not hash to the committed root"
                )
    return prefix


class _Rows:
    """The opened boundary rows of the drawn sequences, by (micro-batch, boundary, kind,
    row)."""

    def __init__(self, got: dict[tuple[int, int, str, int], Any], sequences: Sequence[Any]):
        self.got = got
        self.sequences = list(sequences)

    def __call__(self, boundary: int, kind: str) -> torch.Tensor:
        return torch.from_numpy(
            np.stack([self.got[(m, boundary, kind, r)].data for m, r in self.sequences])
        )


def _check_rows(
    commitment: StepCommitment,
    b: int,
    opening: SliceOpening,
    sequences: Sequence[tuple[int, int]],
    inputs: bool,
) -> _Rows:
    """2. The drawn sequences' rows at the block's two boundaries, and nothing else, hash
    to the committed boundary root (and their batch rows to the batch root)."""
    wanted_rows = {
        (m, boundary, kind, r)
        for m, r in sequences
        for boundary in (b, b + 1)
        for kind in (ACTIVATION, GRADIENT)
    }
    if inputs:
        wanted_rows |= {(m, 0, ACTIVATION, r) for m, r in sequences}
        if [(o.micro, o.row) for o in opening.batch_rows] != list(sequences):
            raise _RefusedError("row_opening", "the opened batch rows are not the drawn sequences'")
        for batch_row in opening.batch_rows:
            if not batch_row.verify(commitment.batch, commitment.shape):
                raise _RefusedError(
                    "row_opening",
                    f"batch row {batch_row.row} of micro-batch {batch_row.micro} does not "
                    "hash to the committed batch root",
                )
    got = {(o.micro, o.boundary, o.kind, o.row): o for o in opening.rows}
    if set(got) != wanted_rows or len(got) != len(opening.rows):
        raise _RefusedError("row_opening", "the opened rows are not the drawn sequences'")
    shapes = {(o.data.dtype.str, o.data.shape) for o in opening.rows}
    if len(shapes) != 1 or next(iter(shapes))[0] != "<f4" or len(next(iter(shapes))[1]) != 2:
        raise _RefusedError("row_opening", "the opened rows are not float32 rows of one shape")
    for o in opening.rows:
        if not o.verify(commitment.boundary, commitment.shape):
            raise _RefusedError(
                "row_opening",
                f"boundary {o.boundary} {o.kind} of micro-batch {o.micro} row {o.row} does "
                "not hash to the committed boundary root",
            )
    return _Rows(got, sequences)


def _worst(verdict: SliceVerdict, check: str, ratio: float) -> None:
    verdict.margins[check] = max(verdict.margins.get(check, 0.0), ratio)


def _check_input(
    verdict: SliceVerdict,
    opening: SliceOpening,
    rows: _Rows,
    embed: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
    tol: SliceTolerances,
) -> None:
    """8. The committed batch rows, embedded, are the committed boundary-0 activations."""
    tables = {t.spec.path: torch.from_numpy(t.array()) for t in opening.inputs}
    committed_inputs = rows(0, ACTIVATION)
    for i, batch_row in enumerate(opening.batch_rows):
        try:
            with torch.no_grad():
                embedded = embed(tables, torch.from_numpy(np.array(batch_row.data)))
            ratio = _relative(committed_inputs[i], embedded) / tol.activation
        except (RuntimeError, IndexError, ValueError) as error:
            # Committed rows of the wrong shape or out-of-range tokens: the lab's fault.
            raise _RefusedError("input", f"the input check cannot run: {error}") from None
        _worst(verdict, "input", ratio)
        if ratio > 1.0:
            raise _RefusedError(
                "input",
                f"micro-batch {batch_row.micro} row {batch_row.row}: the committed batch "
                "row, embedded, is "
                f"not the committed boundary-0 activation ({ratio:.3g} times the bound)",
            )


def _check_sequences(
    verdict: SliceVerdict,
    commitment: StepCommitment,
    challenge: SliceChallenge,
    answer: SliceAnswer,
    rows: _Rows,
    opening: SliceOpening,
    prefix: str,
    block: Any,
    directions: Any,
    tol: SliceTolerances,
) -> None:
    """3-5. Forward, backward and projections of the opened sequences, recomputed and
    held to the committed boundaries and the answered projections."""
    b = challenge.block
    micro_batches, _, row_count = commitment.shape
    weights = {t.spec.path[len(prefix) + 1 :]: torch.from_numpy(t.array()) for t in opening.params}
    try:
        h_out, dh_in, c, norms = sequence_projections(
            block, weights, rows(b, ACTIVATION), rows(b + 1, GRADIENT), directions
        )
        committed_out = rows(b + 1, ACTIVATION)
        if committed_out.shape != h_out.shape:
            raise ValueError(
                f"committed rows {tuple(committed_out.shape)}, recomputed {tuple(h_out.shape)}"
            )
    except (RuntimeError, ValueError) as error:
        # Rows or tensors the block cannot take (the lab committed them): a failed check.
        raise _RefusedError(
            "forward", f"the block cannot run on the opened rows: {error}"
        ) from None
    for name, recomputed, committed in (
        ("forward", h_out, committed_out),
        ("backward", dh_in, rows(b, GRADIENT)),
    ):
        for i, (m, r) in enumerate(rows.sequences):
            ratio = _relative(committed[i], recomputed[i]) / tol.activation
            _worst(verdict, name, ratio)
            if ratio > 1.0:
                raise _RefusedError(
                    name,
                    f"micro-batch {m} row {r}: the committed {name} boundary differs from the "
                    f"recomputed one by {ratio:.3g} times the bound",
                )
    if answer.projections.shape != (challenge.projections, micro_batches, row_count):
        raise _RefusedError("projection", "the answer does not project every sequence")
    if not np.isfinite(answer.projections).all():
        raise _RefusedError("projection", "the answer holds a non-finite projection")
    direction_norms = [math.sqrt(sum(inner(x, x) for x in d)) for d in directions]
    for q in range(challenge.projections):
        for i, (m, r) in enumerate(rows.sequences):
            bound = tol.projection * direction_norms[q] * norms[i]
            difference = abs(float(answer.projections[q, m, r]) - float(c[q, i]))
            ratio = difference / bound if bound > 0 else (math.inf if difference else 0.0)
            _worst(verdict, "projection", ratio)
            if ratio > 1.0:
                raise _RefusedError(
                    "projection",
                    f"micro-batch {m} row {r}: the answered projection {q} is not the "
                    f"recomputed one ({ratio:.3g} times the bound)",
                )


def _check_freivalds(
    verdict: SliceVerdict,
    answer: SliceAnswer,
    opening: SliceOpening,
    directions: Any,
    tol: SliceTolerances,
) -> None:
    """6. Freivalds: every sequence's projections sum to <R, G> for the committed
    gradient."""
    gradient = [t.array().astype(np.float64) for t in opening.grad]
    g_norm = math.sqrt(sum(inner(g, g) for g in gradient))
    for q, direction in enumerate(directions):
        along = sum(inner(x, g) for x, g in zip(direction, gradient, strict=True))
        answered = float(answer.projections[q].sum())
        bound = tol.freivalds * g_norm
        ratio = abs(answered - along) / bound if bound > 0 else math.inf
        _worst(verdict, "freivalds", ratio)
        if ratio > 1.0:
            raise _RefusedError(
                "freivalds",
                f"direction {q}: <R, G> of the committed gradient is {along:.6g}, the "
                f"sequences' projections sum to {answered:.6g} ({ratio:.3g} times the bound)",
            )


def _check_update(commitment: StepCommitment, opening: SliceOpening, chunk_bytes: int) -> None:
    """7. The optimizer, exactly: the canonical update of the opened pre-state is the
    opened post-state."""
    parameters = [torch.from_numpy(t.array()) for t in opening.params]
    states = []
    for i in range(len(parameters)):
        first, second, count = (opening.opt_state[3 * i + k].array() for k in range(3))
        states.append(
            {
                "exp_avg": torch.from_numpy(first),
                "exp_avg_sq": torch.from_numpy(second),
                "step": torch.from_numpy(np.array(count, dtype=np.float32).reshape(())),
            }
        )
    hp = commitment.hp
    group = {
        "lr": hp["lr"],
        "betas": (hp["beta1"], hp["beta2"]),
        "eps": hp["eps"],
        "weight_decay": hp["weight_decay"],
        "amsgrad": False,
        "maximize": False,
    }
    canonical.update(
        "AdamW", parameters, [torch.from_numpy(g.array()) for g in opening.grad], states, group
    )
    for i, (p, t) in enumerate(zip(parameters, opening.params, strict=True)):
        if not opening.post_params[i].verify(commitment.post[0], t.spec, p.numpy(), chunk_bytes):
            raise _RefusedError(
                "update", f"{t.spec.path}: the canonical update is not the committed post-state"
            )
        for k, key in enumerate(("exp_avg", "exp_avg_sq", "step")):
            spec = opening.opt_state[3 * i + k].spec
            array = states[i][key].numpy().reshape(spec.shape)
            if not opening.post_opt_state[3 * i + k].verify(
                commitment.post[1], spec, array, chunk_bytes
            ):
                raise _RefusedError(
                    "update", f"{spec.path}: the canonical update is not the committed post-state"
                )


def replay_whole_step(
    commitment: StepCommitment,
    whole: dict[str, Any],
    *,
    model: Any,
    loss: Callable[[Any, Any], Any],
    chunk_bytes: int,
    bounds: GradientBounds | None = None,
) -> SliceVerdict:
    """Today's whole-step challenge on the same run: hash the full pre-state, recompute
    the full gradient over every micro-batch, compare it within the gradient bounds,
    apply the canonical update to everything and demand the post-state roots.

    Args:
        whole: :meth:`zkdv.sliced.TorchLab.whole_step`'s files.
        model: a model of the run's structure; its parameters are overwritten.
        loss: the run's ``loss(model, micro_batch)``.
    """
    started = time.perf_counter()
    verdict = SliceVerdict(ok=True)
    try:
        params, opt_state, grad = whole["params"], whole["opt_state"], whole["grad"]
        pre = (commit_state(params, chunk_bytes).root, commit_state(opt_state, chunk_bytes).root)
        if pre != commitment.pre or commit_state(grad, chunk_bytes).root != commitment.grad:
            return verdict.fail(
                "state_opening", "the snapshot does not hash to the committed roots"
            )
        named = dict(model.named_parameters())
        with torch.no_grad():
            for name, array in params:
                named[name].copy_(torch.from_numpy(array))
                named[name].grad = None
        for micro in torch.from_numpy(whole["batch"]).unbind(0):
            loss(model, micro).backward()
        replayed = [(f"params:{n}", named[n].grad.numpy()) for n, _ in params]
        comparison = compare(replayed, grad, bounds or GradientBounds.default("float32"))
        verdict.margins["gradient"] = comparison.margin
        if not comparison.ok:
            return verdict.fail("gradient", comparison.describe())
        tensors = [named[n].detach().clone() for n, _ in params]
        states = [
            {
                "exp_avg": torch.from_numpy(opt_state[3 * i][1].copy()),
                "exp_avg_sq": torch.from_numpy(opt_state[3 * i + 1][1].copy()),
                "step": torch.from_numpy(opt_state[3 * i + 2][1].copy().reshape(())),
            }
            for i in range(len(params))
        ]
        hp = commitment.hp
        group = {
            "lr": hp["lr"],
            "betas": (hp["beta1"], hp["beta2"]),
            "eps": hp["eps"],
            "weight_decay": hp["weight_decay"],
            "amsgrad": False,
            "maximize": False,
        }
        canonical.update("AdamW", tensors, [torch.from_numpy(g) for _, g in grad], states, group)
        post_params = [(n, t.numpy()) for (n, _), t in zip(params, tensors, strict=True)]
        post_opt = []
        for (n, _), s in zip(params, states, strict=True):
            paths = optimizer_paths(n)
            post_opt += [
                (paths[0], s["exp_avg"].numpy()),
                (paths[1], s["exp_avg_sq"].numpy()),
                (paths[2], s["step"].numpy().reshape(())),
            ]
        post = (
            commit_state(post_params, chunk_bytes).root,
            commit_state(post_opt, chunk_bytes).root,
        )
        if post != commitment.post:
            return verdict.fail("update", "the canonical update is not the committed post-state")
        return verdict
    finally:
        verdict.seconds = time.perf_counter() - started
