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
    "TESTS",
    "TREES",
    "WHOLE",
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


#: The two tests of a computed leaf (:func:`compare`).
TESTS = ("norm", "scale")
#: The name of the whole-gradient test's entry.
WHOLE = "gradient"


@dataclass(frozen=True)
class LeafDivergence:
    """How one recomputed leaf (or the whole gradient) compares with the committed one.

    ``test`` is ``"norm"``: the divergence is ``|c - r|``; or ``"scale"``: it is the part
    of ``c - r`` along ``r``, ``|<c - r, r>| / |r|``, which honest rounding leaves far
    smaller than the norm (it points anywhere), and a forger's systematic change (a
    scaled gradient, another learning rate in disguise) does not.
    """

    path: str
    test: str
    #: The measured divergence (L2, float64); inf where finiteness differs.
    divergence: float
    #: What the bounds allow.
    bound: float
    #: ``|r|``.
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
            "test": self.test,
            "divergence": self.divergence,
            "bound": self.bound,
            "norm": self.norm,
            "exact": self.exact,
        }


@dataclass(frozen=True)
class Comparison:
    """A step's recomputed values against its committed ones: every test of every leaf."""

    leaves: tuple[LeafDivergence, ...]

    @property
    def exact(self) -> bool:
        """Every leaf bitwise equal."""
        return all(leaf.exact for leaf in self.leaves)

    @property
    def ok(self) -> bool:
        """Every test within its bound."""
        return all(leaf.divergence <= leaf.bound for leaf in self.leaves)

    @property
    def worst(self) -> LeafDivergence | None:
        """The test closest to (or furthest beyond) its bound."""
        return max(self.leaves, key=lambda leaf: leaf.ratio, default=None)

    @property
    def margin(self) -> float:
        """The largest divergence-to-bound ratio (0 when exact; above 1 fails)."""
        worst = self.worst
        return 0.0 if worst is None else worst.ratio

    def describe(self) -> str:
        """One sentence on the worst test, for a verdict's message."""
        worst = self.worst
        if worst is None or worst.exact:
            return "bitwise equal"
        what = "differs by" if worst.test == "norm" else "differs along its own direction by"
        return (
            f"{worst.path} {what} {worst.divergence:.3g} (L2), {worst.ratio:.3g} times its "
            f"bound {worst.bound:.3g} (its norm {worst.norm:.3g})"
        )


def _floating(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or array.dtype.name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
    )


def _finite64(replayed: np.ndarray, committed: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Both as flat float64 over their finite entries; None where the two disagree on a
    non-finite value (an overflow must be the same overflow)."""
    r = replayed.astype(np.float64, copy=False).reshape(-1)
    c = committed.astype(np.float64, copy=False).reshape(-1)
    finite_r, finite_c = np.isfinite(r), np.isfinite(c)
    if finite_r.all() and finite_c.all():
        return r, c
    if not np.array_equal(finite_r, finite_c):
        return None
    odd = ~finite_r
    if not ((np.isnan(r[odd]) & np.isnan(c[odd])) | (r[odd] == c[odd])).all():
        return None
    return r[finite_r], c[finite_r]


def _exact(replayed: np.ndarray, committed: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(replayed), np.ascontiguousarray(committed)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@dataclass
class _Measured:
    name: str
    exact: bool
    floating: bool
    norm: float = 0.0
    #: ``|c - r|`` and ``<c - r, r>``: inf and nan where finiteness differs.
    difference: float = 0.0
    along: float = 0.0


def _measure(name: str, replayed: np.ndarray, committed: np.ndarray) -> _Measured:
    if replayed.shape != committed.shape:
        raise ValueError(
            f"computed leaf {name}: recomputed shape {replayed.shape} is not the committed "
            f"{committed.shape}"
        )
    exact = _exact(replayed, committed)
    floating = _floating(replayed)
    if not floating:
        return _Measured(name, exact, False, difference=0.0 if exact else math.inf)
    values = _finite64(replayed, committed)
    if values is None:
        finite = replayed.astype(np.float64).reshape(-1)
        norm = float(np.linalg.norm(finite[np.isfinite(finite)]))
        return _Measured(name, False, True, norm, math.inf, math.inf)
    r, c = values
    if exact:
        return _Measured(name, True, True, float(np.linalg.norm(r)))
    d = c - r
    return _Measured(
        name, False, True, float(np.linalg.norm(r)), float(np.linalg.norm(d)), float(d @ r)
    )


def compare(replayed: Leaves, committed: Leaves, bounds: GradientBounds) -> Comparison:
    """Compare recomputed computed values with the committed ones.

    Within each group (the gradient's ``params:`` leaves; the carried ``opt_state:`` and
    ``buffers:`` leaves), with ``r`` a replayed leaf, ``c`` the committed one, ``d = c -
    r`` and ``g`` the group's replayed leaves together, every floating leaf must pass

    * the norm test: ``|d| <= tensor * |r| + total * |g|``;
    * the scale test: ``|<d, r>| / |r| <= scale * |r| + total * |g|``;

    and the whole group the scale test ``|<d, g>| / |g| <= scale * |g|`` (``d`` over every
    leaf). Integer leaves (step counters) must be equal, and so must non-finite values
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
    groups: dict[str, list[_Measured]] = {"params": [], "carried": []}
    for (name, r), (_, c) in zip(replayed, committed, strict=True):
        group = "params" if name.startswith("params:") else "carried"
        groups[group].append(_measure(name, np.asarray(r), np.asarray(c)))
    out: list[LeafDivergence] = []
    for group, measured in groups.items():
        total = math.sqrt(sum(m.norm * m.norm for m in measured))
        floor = bounds.total * total
        along_sum = 0.0
        for m in measured:
            if not m.floating:
                out.append(LeafDivergence(m.name, "norm", m.difference, 0.0, 0.0, m.exact))
                continue
            along = abs(m.along) / m.norm if m.norm > 0 else abs(m.difference)
            if math.isnan(along):
                along = math.inf
            out.append(
                LeafDivergence(
                    m.name, "norm", m.difference, bounds.tensor * m.norm + floor, m.norm, m.exact
                )
            )
            out.append(
                LeafDivergence(
                    m.name, "scale", along, bounds.scale * m.norm + floor, m.norm, m.exact
                )
            )
            along_sum += m.along
        if measured and group == "params":
            whole = abs(along_sum) / total if total > 0 else 0.0
            if math.isnan(whole):
                whole = math.inf
            out.append(
                LeafDivergence(
                    WHOLE,
                    "scale",
                    whole,
                    bounds.scale * total,
                    total,
                    all(m.exact for m in measured),
                )
            )
    return Comparison(tuple(out))
