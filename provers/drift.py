"""The drift test: committed-minus-recomputed differences that point one way, step after step.

A replay on other hardware judges each step's recomputed gradient within the run's
``GradientBounds``, and honest rounding uses a small share of them (``docs/reliability.md``:
1 % or less). A forger who adds a push ``p_t`` inside the bounds at every step gets them
all, and the pushes add up in the parameters only if they point the same way step after
step. Honest rounding does not: it changes with every step's data. So over the steps of
one replayed window (snapshot to challenged step), with ``d_t = c_t - r_t`` the committed
minus the recomputed computed values (every floating leaf, one vector per step) and
``G_st = <d_s, d_t>`` their Gram matrix:

    S = sum_{s<t} G_st          (how the differences align)
    V = sum_{s<t} G_st^2
    z = S / sqrt(V)

**The null model: each step's difference is as likely as its negative, independently of
the other steps.** Nothing is assumed about a step's coordinates: rounding on other
kernels is strongly correlated *within* a step (one rounding in an activation moves a
whole outer product of the backward pass; measured: a statistic that assumes independent
coordinates reaches z = 9.9 on an honest BatchNorm run), but a step's data are new, so
its sign is not tied to the previous step's. Conditional on ``|G|``, flipping the signs
``e_t`` of whole steps gives ``S(e) = sum_{s<t} e_s e_t G_st``: mean 0 and variance ``V``
exactly (the ``e_s e_t`` of distinct pairs are uncorrelated), and the exact p-value of
the observed ``S`` is the share of the ``2^(m-1)`` sign patterns of ``m`` inexact steps
with ``S(e) >= S`` (:func:`sign_flip_p`). A push ``p`` that keeps its direction makes
every ``G_st`` positive: the observed signs are the maximising pattern, ``p = 2^-(m-1)``
(and ``z = sqrt(m (m - 1) / 2)``, its largest value), whatever the push's size.

**The window test.** The replay fails a window (reason ``gradient_drift``) at the first
step where its exact p-value is at most :data:`WINDOW_P` (1e-6). Under the null that has
probability at most 1e-6 per look. A window's signs carry ``m - 1`` bits, so it is
reachable only from 21 inexact steps on: a window of the SDK's default 12 steps (whose
smallest p-value is ``2^-11``) never fails alone, and its evidence goes to the run test.
(A test at ``p <= 1e-3`` would catch one aligned window, and would also reject about one
honest window in 500.)

**The run test** (:func:`combine`, applied where the run's verdict is formed). The
windows' signs are independent under the null, so ``S_run = sum_w S_w`` has the
distribution of a sum of independent window distributions, each known exactly from its
Gram matrix. :func:`run_p` bounds its tail by Chernoff's inequality with each window's
exact moment generating function, ``P(S_run >= s) <= min_l exp(-l s) prod_w
E exp(l S_w(e))``, a valid bound whatever the windows' sizes, with no normal
approximation; the run is rejected when it is at most :data:`RUN_P` (1e-6). Two windows
of 12 steps whose every pair aligns reach ``2.4e-7``. ``z_run = sum S / sqrt(sum V)`` is
reported beside it.

Steps replayed bit for bit add nothing (``d = 0``); a window with fewer than two inexact
steps has no statistic and is judged by exactness alone. The module is framework-free
(numpy only) and pure: the replay feeds it one step at a time (:meth:`Drift.add`) and
stores :meth:`Drift.to_dict` with the verdict (``S``, ``V``, ``z``, ``p`` and the Gram
matrix, which a run's combination reads; a challenge of an earlier step of the window is
its top-left block). It keeps the window's differences (float32, one gradient per inexact
step) to form ``G``: in memory up to :data:`IN_MEMORY_BYTES` a step, above it in a
temporary file.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "REASON",
    "RUN_P",
    "WINDOW_P",
    "Drift",
    "combine",
    "run_p",
    "sign_flip_p",
    "window_values",
]

#: The replay's failure reason when a window's (or a run's) differences drift one way.
REASON = "gradient_drift"

#: The exact sign-flip p-value at or below which a window fails: reachable from 21
#: inexact steps on (``2^-20``), so a window of the default 12 steps never fails alone.
WINDOW_P = 1e-6

#: The bound on the run's sign-flip p-value (:func:`run_p`) at or below which the
#: platform rejects it.
RUN_P = 1e-6

#: Up to this many inexact steps a window's null distribution is enumerated exactly
#: (32,768 patterns); a longer window is cut into blocks of this many steps.
_EXACT_STEPS = 16

Leaves = Sequence[tuple[str, np.ndarray]]


def _floating(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or array.dtype.name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
    )


def sign_flip_p(gram: np.ndarray) -> float:
    """The share of sign patterns ``e`` (``e_0 = 1``: ``e`` and ``-e`` give the same S) with
    ``sum_{s<t} e_s e_t G_st`` at least the observed ``sum_{s<t} G_st``: exact up to
    :data:`_EXACT_STEPS` steps. A longer window is cut into blocks of that many
    consecutive steps, and its p-value is :func:`run_p` of the blocks (the pairs within a
    block only: a valid test, a little less powerful)."""
    m = gram.shape[0]
    if m < 2:
        return 1.0
    if m > _EXACT_STEPS:
        return run_p(_blocks(gram))
    upper = np.triu(gram, 1)
    values = window_values(gram)
    # A relative slack so the observed pattern counts itself despite rounding.
    return float(np.mean(values >= upper.sum() - 1e-12 * np.abs(upper).sum()))


def _blocks(gram: np.ndarray) -> list[np.ndarray]:
    m = gram.shape[0]
    return [gram[i : i + _EXACT_STEPS, i : i + _EXACT_STEPS] for i in range(0, m, _EXACT_STEPS)]


#: A window keeps each inexact step's differences (float32, one gradient each) in memory
#: up to this size per step; above it in an unlinked temporary file, which the operating
#: system pages in for the next steps' dot products, so a replay of a large model holds
#: one gradient's differences in memory, not a window's.
IN_MEMORY_BYTES = 1 << 26


def _kept(d: np.ndarray) -> np.ndarray:
    """``d`` in float32, as the window keeps it: in memory, or backed by a temporary file."""
    if d.size * 4 <= IN_MEMORY_BYTES:
        return d.astype(np.float32)
    # Unlinked at once (POSIX); the map keeps its own descriptor after the file closes.
    with tempfile.TemporaryFile(prefix="zkdv-drift-") as backing:
        kept = np.memmap(backing, dtype=np.float32, mode="w+", shape=d.shape)
    kept[:] = d
    return kept


@dataclass
class Drift:
    """The drift statistic over the steps of one replayed window, accumulated step by step."""

    window_p: float = WINDOW_P
    #: The window's first replayed step, and its last (set by the replay at the end).
    first: int | None = None
    last: int | None = None
    #: Steps added whose differences were not all zero.
    inexact: list[int] = field(default_factory=list)
    #: The exact p-value after each inexact step, in order.
    history: list[float] = field(default_factory=list)
    _differences: list[np.ndarray] = field(default_factory=list, repr=False)
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)), repr=False)

    @property
    def alignment(self) -> float:
        """``S = sum_{s<t} G_st``."""
        return float(np.triu(self._gram, 1).sum())

    @property
    def variance(self) -> float:
        """``V = sum_{s<t} G_st^2``."""
        return float(np.square(np.triu(self._gram, 1)).sum())

    @property
    def z(self) -> float | None:
        """``S / sqrt(V)``; None while no two inexact steps were added."""
        variance = self.variance
        return self.alignment / math.sqrt(variance) if variance > 0 else None

    @property
    def p(self) -> float:
        """The exact sign-flip p-value of the steps added so far."""
        return self.history[-1] if self.history else 1.0

    @property
    def exceeded(self) -> bool:
        return self.p <= self.window_p

    @property
    def cosine(self) -> float | None:
        """The mean cosine between the inexact steps' differences (1: one direction)."""
        m = len(self._differences)
        if m < 2:
            return None
        norms = np.sqrt(np.diag(self._gram))
        cosines = self._gram / np.outer(norms, norms)
        return float(cosines[np.triu_indices(m, 1)].mean())

    def add(self, step: int, recomputed: Leaves, committed: Leaves) -> float:
        """Add one replayed step's differences; returns the window's p-value so far.
        Non-finite coordinates are left out (the bounds already demand that both sides
        agree on them)."""
        if self.first is None:
            self.first = step
        parts = []
        for (_, r), (_, c) in zip(recomputed, committed, strict=True):
            r, c = np.asarray(r), np.asarray(c)
            if _floating(r) and r.shape == c.shape:
                # inf - inf (a mask's -inf on both sides) is NaN, left out just below
                with np.errstate(invalid="ignore"):
                    parts.append(
                        c.astype(np.float64).reshape(-1) - r.astype(np.float64).reshape(-1)
                    )
        d = np.concatenate(parts) if parts else np.zeros(0)
        d[~np.isfinite(d)] = 0.0
        if not d.any():
            return self.p
        row = np.array([float(previous @ d) for previous in self._differences] + [float(d @ d)])
        m = len(self._differences)
        gram = np.zeros((m + 1, m + 1))
        gram[:m, :m] = self._gram
        gram[m, :] = row
        gram[:, m] = row
        self._gram = gram
        self._differences.append(_kept(d))
        self.inexact.append(step)
        # Only a window that could fail is computed (2^-(m-1) is its smallest p-value).
        reachable = 2.0 ** -(len(self.inexact) - 1) <= self.window_p
        self.history.append(sign_flip_p(gram) if reachable else 1.0)
        return self.p

    def describe(self) -> str:
        """One sentence for a failure message: the window, its steps, z and the threshold."""
        steps = self.inexact
        z, cosine = self.z, self.cosine
        return (
            f"window from step {self.first}: the committed-minus-recomputed differences of "
            f"{len(steps)} inexact steps ({steps[0]} to {steps[-1]}) point the same way step "
            f"after step (mean cosine {cosine if cosine is not None else 0.0:.3g}; alignment "
            f"z = {z if z is not None else 0.0:.4g}, exact sign-flip p = {self.p:.3g} <= "
            f"{self.window_p:g}): rounding on other hardware does not add up, a push inside "
            "the bounds does"
        )

    def to_dict(self) -> dict[str, Any]:
        """What the verdict stores: S and V travel so a run's windows can be combined."""
        return {
            "first": self.first,
            "last": self.last,
            "inexact_steps": len(self.inexact),
            "alignment": self.alignment,
            "variance": self.variance,
            "z": self.z,
            # The window's own exact p-value, also where it could not fail the window.
            "p": sign_flip_p(self._gram) if len(self.inexact) >= 2 else 1.0,
            "min_p": min(self.history, default=1.0),
            "window_p": self.window_p,
            "cosine": self.cosine,
            "steps": list(self.inexact),
            "gram": self._gram.tolist(),
        }


def _patterns(m: int) -> np.ndarray:
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=m - 1))).reshape(-1, m - 1)
    return np.hstack([np.ones((len(signs), 1)), signs])


def window_values(gram: np.ndarray) -> np.ndarray:
    """``S(e)`` of a window of at most :data:`_EXACT_STEPS` steps for every whole-step sign
    pattern: its exact null distribution."""
    m = gram.shape[0]
    if m < 2:
        return np.zeros(1)
    signs = _patterns(m)
    values: np.ndarray = np.einsum("ks,st,kt->k", signs, np.triu(gram, 1), signs)
    return values


def run_p(grams: Sequence[np.ndarray]) -> float:
    """A bound on the run's sign-flip p-value: ``P(sum_w S_w(e) >= sum_w S_w)`` with the
    windows' signs independent, by Chernoff's bound with each window's exact moment
    generating function: ``min_l exp(-l S) prod_w mean_e exp(l S_w(e))``.

    Valid under the null whatever the windows' sizes (no normal approximation); a window
    whose every pair aligns contributes about ``2^-(m-1)``, so a few such windows bring it
    far below :data:`RUN_P`, where a single window of 12 steps cannot go.
    """
    blocks = [b for g in grams for b in _blocks(np.asarray(g, dtype=np.float64)) if len(b) >= 2]
    values = [window_values(b) for b in blocks]
    observed = sum(float(np.triu(b, 1).sum()) for b in blocks)
    variance = sum(float(np.square(v).mean()) for v in values)
    if not values or variance <= 0 or observed <= 0:
        return 1.0
    scale = 1.0 / math.sqrt(variance)
    best = 0.0  # the log of the bound; l = 0 gives 1
    for multiplier in np.geomspace(1e-2, 1e3, 80):
        rate = multiplier * scale
        logs = -rate * observed
        for v in values:
            top = float(np.max(rate * v))
            logs += top + math.log(float(np.mean(np.exp(rate * v - top))))
        best = min(best, logs)
    return math.exp(best)


def combine(windows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's drift over its challenged windows: ``z = sum S / sqrt(sum V)`` and the
    bound :func:`run_p` on its sign-flip p-value, which decides (``exceeded``: at most
    :data:`RUN_P`).

    ``windows`` are verdicts' ``drift`` entries (their Gram matrices); a window replayed
    by several challenges (each from its snapshot to its own step) is counted once, by
    the challenge that replayed furthest (its Gram matrix holds the shorter ones').
    """
    furthest: dict[int, Mapping[str, Any]] = {}
    for window in windows:
        first, last = window.get("first"), window.get("last")
        if not isinstance(first, int) or not isinstance(last, int):
            continue
        kept = furthest.get(first)
        if kept is None or int(kept["last"]) < last:
            furthest[first] = window
    grams = [np.asarray(w.get("gram") or np.zeros((0, 0)), np.float64) for w in furthest.values()]
    alignment = sum(float(np.triu(g, 1).sum()) for g in grams if g.size)
    variance = sum(float(np.square(np.triu(g, 1)).sum()) for g in grams if g.size)
    z = alignment / math.sqrt(variance) if variance > 0 else None
    p = run_p([g for g in grams if g.size])
    return {
        "windows": sorted(furthest),
        "alignment": alignment,
        "variance": variance,
        "z": z,
        "p": p,
        "run_p": RUN_P,
        "exceeded": p <= RUN_P,
    }
