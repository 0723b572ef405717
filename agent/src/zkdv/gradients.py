"""Committed gradients: the part of a step that other hardware cannot reproduce bit for bit.

A training step splits in two. The *gradient program* (forward, backward, micro-batch
accumulation, clipping, loss unscaling) computes the gradient the optimizer reads and
the state the forward pass itself updates (BatchNorm running statistics, Flax
``batch_stats``, a ``GradScaler``'s scale): its reductions round differently on another
CPU kernel family, another GPU or another thread count. The *optimizer* then updates
the parameters and its state elementwise, in a canonical form that gives the same bits
on any hardware (:mod:`zkdv.torch.optimizers.canonical`, :mod:`zkdv.jax.canonical`).

So a run commits, at every step, the gradient program's outputs as one more state tree,
the step's *computed values*:

* gradient leaves, one per trained parameter, named ``params:<parameter path>``, with
  the parameter's dtype and shape;
* carried leaves, the state the forward pass wrote, named ``opt_state:<path>`` or
  ``buffers:<path>`` after the committed state leaf they become.

The tree is hashed like any state (:func:`zkdv.merkle.commit_state`); its root is the
step record's ``grad`` and its leaves are listed in the root record's ``schema.grad``.
Its bytes are kept as ``files/grad-<step>.bin`` for the platform. A verifier on other
hardware recomputes the computed values from the committed pre-state and batch,
compares them with the committed ones within :class:`~zkdv.config.GradientBounds`
(:func:`compare`), and applies the canonical optimizer to the *committed* values, so its
post-update state hashes to the committed roots exactly. This module is the
framework-free part: names and the comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zkdv.config import GradientBounds

__all__ = [
    "TREES",
    "Comparison",
    "LeafDivergence",
    "compare",
    "leaf_name",
    "split_name",
]

#: The state trees a computed leaf may name.
TREES = ("params", "opt_state", "buffers")

Leaves = Sequence[tuple[str, np.ndarray]]


def leaf_name(tree: str, path: str) -> str:
    """The computed tree's name of a leaf of ``tree`` (``params`` for a gradient)."""
    if tree not in TREES:
        raise ValueError(f"unknown state tree {tree!r}")
    return f"{tree}:{path}"


def split_name(name: str) -> tuple[str, str]:
    """``(tree, path)`` of a computed leaf's name.

    Raises:
        ValueError: the name does not start with a state tree and a colon.
    """
    tree, colon, path = name.partition(":")
    if not colon or tree not in TREES:
        raise ValueError(
            f"computed leaf {name!r:.80} must be named '<tree>:<path>' with tree one of "
            f"{', '.join(TREES)}"
        )
    return tree, path


@dataclass(frozen=True)
class LeafDivergence:
    """How one recomputed leaf compares with the committed one."""

    path: str
    #: ``|committed - replayed|`` (L2, float64); inf where finiteness differs.
    divergence: float
    #: What the bounds allow this leaf.
    bound: float
    #: ``|replayed|``.
    norm: float
    #: Bitwise equal.
    exact: bool

    @property
    def ratio(self) -> float:
        """Divergence over bound: 0 for an exact leaf, above 1 beyond the bound."""
        if self.divergence == 0.0:
            return 0.0
        return self.divergence / self.bound if self.bound > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "divergence": self.divergence,
            "bound": self.bound,
            "norm": self.norm,
            "exact": self.exact,
        }


@dataclass(frozen=True)
class Comparison:
    """A step's recomputed values against its committed ones, leaf by leaf."""

    leaves: tuple[LeafDivergence, ...]

    @property
    def exact(self) -> bool:
        """Every leaf bitwise equal."""
        return all(leaf.exact for leaf in self.leaves)

    @property
    def ok(self) -> bool:
        """Every leaf within its bound."""
        return all(leaf.divergence <= leaf.bound for leaf in self.leaves)

    @property
    def worst(self) -> LeafDivergence | None:
        """The leaf closest to (or furthest beyond) its bound."""
        return max(self.leaves, key=lambda leaf: leaf.ratio, default=None)

    @property
    def margin(self) -> float:
        """The largest divergence-to-bound ratio (0 when exact; above 1 fails)."""
        worst = self.worst
        return 0.0 if worst is None else worst.ratio

    def describe(self) -> str:
        """One sentence on the worst leaf, for a verdict's message."""
        worst = self.worst
        if worst is None or worst.exact:
            return "bitwise equal"
        return (
            f"{worst.path} differs by {worst.divergence:.3g} (L2), "
            f"{worst.ratio:.3g} of its bound {worst.bound:.3g} (its norm {worst.norm:.3g})"
        )


def _floating(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or array.dtype.name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
    )


def _norm(array: np.ndarray) -> float:
    """L2 norm in float64 over the finite values (non-finite ones are compared apart)."""
    values = array.astype(np.float64, copy=False).reshape(-1)
    finite = np.isfinite(values)
    return float(np.linalg.norm(values if finite.all() else values[finite]))


def _divergence(replayed: np.ndarray, committed: np.ndarray) -> float:
    """``|c - r|`` in float64; inf where the two disagree on a non-finite value."""
    r = replayed.astype(np.float64, copy=False).reshape(-1)
    c = committed.astype(np.float64, copy=False).reshape(-1)
    finite_r, finite_c = np.isfinite(r), np.isfinite(c)
    if not (finite_r.all() and finite_c.all()):
        if not np.array_equal(finite_r, finite_c):
            return math.inf
        # The same positions are non-finite: they must be the same kind (nan, +inf, -inf).
        odd = ~finite_r
        if not ((np.isnan(r[odd]) & np.isnan(c[odd])) | (r[odd] == c[odd])).all():
            return math.inf
        r, c = r[finite_r], c[finite_r]
    return float(np.linalg.norm(c - r))


def _exact(replayed: np.ndarray, committed: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(replayed), np.ascontiguousarray(committed)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def compare(replayed: Leaves, committed: Leaves, bounds: GradientBounds) -> Comparison:
    """Compare recomputed computed values with the committed ones, leaf by leaf.

    Gradient leaves (``params:``) are bounded by ``bounds.tensor`` times their own norm
    plus ``bounds.total`` times the norm of the whole recomputed gradient; carried
    leaves (``opt_state:``, ``buffers:``) likewise against the carried leaves' total
    norm. Integer leaves (step counters) must be equal, and so must non-finite values
    (an overflow is the same overflow). Norms are the replayed values', never the
    committed ones': a forger cannot widen its own bound.

    Args:
        replayed: the verifier's recomputed leaves, in the computed tree's order.
        committed: the committed leaves, same order, names and shapes.
        bounds: the run's committed bounds.

    Raises:
        ValueError: the two trees do not have the same leaves.
    """
    if [name for name, _ in replayed] != [name for name, _ in committed]:
        raise ValueError("the recomputed and committed computed values name different leaves")
    measured: list[tuple[str, float, float, bool, bool]] = []
    totals = {"params": 0.0, "carried": 0.0}
    for (name, r), (_, c) in zip(replayed, committed, strict=True):
        r, c = np.asarray(r), np.asarray(c)
        if r.shape != c.shape:
            raise ValueError(
                f"computed leaf {name}: recomputed shape {r.shape} is not the committed {c.shape}"
            )
        exact = _exact(r, c)
        floating = _floating(r)
        norm = _norm(r) if floating else 0.0
        divergence = 0.0 if exact else (_divergence(r, c) if floating else math.inf)
        group = "params" if name.startswith("params:") else "carried"
        totals[group] += norm * norm
        measured.append((name, divergence, norm, exact, floating))
    leaves = []
    for name, divergence, norm, exact, floating in measured:
        group = "params" if name.startswith("params:") else "carried"
        bound = bounds.tensor * norm + bounds.total * math.sqrt(totals[group]) if floating else 0.0
        leaves.append(LeafDivergence(name, divergence, bound, norm, exact))
    return Comparison(tuple(leaves))
