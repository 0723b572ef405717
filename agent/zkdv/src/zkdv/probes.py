"""Seeded orthonormal probes: small linear projections of every parameter leaf.

Per parameter leaf of last dimension ``d``, the probe matrix ``Q`` is a ``(d, k)``
matrix with orthonormal columns, ``k = max(1, ceil(probe_ratio * d))``, drawn from a
Gaussian seeded by the run's probe seed and the leaf's path and orthonormalised by QR.
The probe of a leaf ``W`` (viewed as ``(rows, d)``) is ``W @ Q``.

Leaves with more than ``MAX_PROBE_ROWS`` rows are probed on a seeded subset of that
many rows, so a probe costs microseconds and a few KiB per step however large the model
(each probed row still keeps ``probe_ratio`` of the last dimension). Probes are a
tolerance device for cross-hardware replay, not the binding commitment: every byte is
bound by the Merkle roots.

Probes are linear, so ``probe(pre) + probe(delta) == probe(post)`` and
``probe(post_t) == probe(pre_{t+1})`` hold up to float error. They let a replay on
different hardware be compared within a tolerance where exact hashes cannot match.

**The projection's arithmetic is exact by construction**, so the host (numpy), XLA and
Torch kernels that compute it agree to the bit on every backend, whatever order their
matrix products sum in (this is what makes a transcript byte-identical whether its
probes were computed on the host or on the device). It is the error-free splitting of
Ozaki et al. (2012, "Error-free transformations of matrix multiplication by using fast
routines of matrix multiplication"): with ``L = ceil(log2 d)`` and
``w = (53 - L) // 2``,

* the matrix ``Q`` is stored with each column truncated to ``w`` significant bits below
  its largest element's exponent (:func:`exact_matrix`; a change of at most
  ``2**(1 - w)`` of the column's largest entry, where ``w >= 16`` for any ``d`` below
  two million);
* each probed row ``v`` (float32, subnormals flushed to zero) is split into two slices
  of ``w`` bits below the row's largest exponent ``e`` (``|v| < 2**e``):
  ``n1 = trunc(v * 2**(w - e))`` and ``n2 = trunc(frac(v * 2**(w - e)) * 2**w)``, both
  integers below ``2**w`` (:func:`exact_rows`), so ``v ~ (n1 + n2 / 2**w) / 2**(w - e)``;
  what is below ``2w`` bits of the row's largest element (``2w >= 32``, more than
  float32's 24) is dropped, an error far below float32 rounding;
* every product of a slice element and a ``w``-bit matrix entry is an integer multiple
  of one power of two below ``2**(2w)``, so the ``d``-term sums ``n1 @ Q`` and
  ``n2 @ Q`` stay below ``2**53`` units and **every float64 GEMM computes them exactly**,
  in any order, blocked or not, with or without FMA;
* the probe is ``float32((n1 @ Q) / 2**(w-e) + (n2 @ Q) / 2**(2w-e))``: exact scalings,
  one float64 addition, one rounding (:func:`exact_finish`); results below float32's
  smallest normal are flushed to zero, zeros made positive, and a row holding an
  infinity or NaN gives the one quiet NaN.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from zkdv import _probe_pass
from zkdv._probe_pass import _kernel, padded_columns
from zkdv.hashing import Domain, hash_bytes
from zkdv.merkle import LeafSpec

__all__ = [
    "MAX_PROBE_ROWS",
    "ProbeSet",
    "exact_finish",
    "exact_matrix",
    "exact_rows",
    "probe_columns",
    "slice_width",
]

MAX_PROBE_ROWS = 64


def probe_columns(last_dim: int, probe_ratio: float) -> int:
    if not 0.0 < probe_ratio <= 1.0:
        raise ValueError(f"probe_ratio={probe_ratio!r} must be in (0, 1]")
    return max(1, math.ceil(probe_ratio * last_dim))


def _leaf_dims(spec: LeafSpec) -> tuple[int, int]:
    if len(spec.shape) == 0:
        return 1, 1
    last = spec.shape[-1]
    return (spec.size // last if last else 0), last


# OpenBLAS runs a GEMM single-threaded below m * n * k = 65536 * 4 (its
# GEMM_MULTITHREAD_THRESHOLD); above, it wakes every BLAS thread. A probe is tiny, and
# while the training step and the hashing pool own the cores, waking them cost 15-25 ms
# per leaf on a 2-core machine (0.1 ms single-threaded). Row blocks under the threshold
# keep each product single-threaded on every BLAS.
_SINGLE_THREAD_GEMM = 65536 * 4 - 1

_FLOAT32_TINY = 2.0**-126
CANONICAL_NAN = np.uint32(0x7FC00000)

#: A leaf's share of a batch of probe rows: its float64 matrix and the rows
#: ``start:stop`` it projects.
Part = tuple[np.ndarray, int, int]


def slice_width(last_dim: int) -> int:
    """Bits per slice for rows of ``last_dim`` elements: ``(53 - ceil(log2 d)) // 2``."""
    return (53 - max(0, int(last_dim) - 1).bit_length()) // 2


def exact_matrix(matrix: np.ndarray) -> np.ndarray:
    """A probe matrix with every column truncated to :func:`slice_width` bits (float32).

    ``trunc(q * 2**s) / 2**s`` is exact in float64 for a power of two ``2**s``.
    """
    q = np.asarray(matrix, dtype=np.float32)
    q = np.where(np.abs(q) < np.float32(_FLOAT32_TINY), 0.0, q.astype(np.float64))
    _, top = np.frexp(np.abs(q).max(axis=0, initial=0.0))
    scale = np.ldexp(1.0, slice_width(q.shape[0]) - top)[None, :]
    truncated: np.ndarray = (np.trunc(q * scale) / scale).astype(np.float32)
    return truncated


def exact_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split float32 rows ``(r, d)`` into integer-valued slices.

    Returns:
        ``(slices, scale, bad)``: ``slices`` is ``[n1; n2]`` (float64 integers below
        ``2**w``, ``(2r, d)``) with ``v ~ n1 / scale + n2 / (scale * 2**w)``; ``scale``
        the per-row power of two; ``bad`` the rows holding an infinity or NaN (their
        probe is NaN).
    """
    rows, d = values.shape
    width = slice_width(d)
    with np.errstate(invalid="ignore"):
        peak = np.abs(values).max(axis=1, initial=0).astype(np.float64)
    bad = ~np.isfinite(peak)
    if bad.any():
        values = np.where(bad[:, None], np.float32(0), values)
        peak = np.where(bad, 0.0, peak)
    # Subnormal inputs reach the slices only in nonzero rows whose largest element is
    # below 2**(2w - 127); a device flushing subnormals sees zeros there, so flush them
    # too (in every row: elsewhere they give zero slices anyway).
    small = (peak > 0) & (peak < 2.0 ** (2 * width - 127))
    flushed = bool(small.any())
    if flushed:
        values = np.where(np.abs(values) < np.float32(_FLOAT32_TINY), np.float32(0), values)
        peak = np.abs(values).max(axis=1, initial=0).astype(np.float64)
    _, top = np.frexp(peak)
    scale = np.ldexp(1.0, width - top)
    out = np.empty((2 * rows, d), dtype=np.float64)
    high, low = out[:rows], out[rows:]
    if not flushed:
        # In float32, half the bytes of float64: every step is exact there too. Scaling
        # by a power of two (at most 2**(126 - w) here) is exact unless the result is
        # below float32's smallest normal, and such an element gives two zero slices
        # either way; the fraction and its scaling keep bits the value already has.
        scaled = values * scale.astype(np.float32)[:, None]
        whole = np.trunc(scaled)
        scaled -= whole
        scaled *= np.float32(2.0**width)
        np.trunc(scaled, out=scaled)
        high[...] = whole
        low[...] = scaled
        return out, scale, bad
    # Widen first: a float32 * float64 ufunc casts in small buffers, several times slower.
    low[...] = values
    low *= scale[:, None]  # v * scale, exactly (a power of two), below 2**w
    np.trunc(low, out=high)
    low -= high  # the fraction, exactly
    low *= 2.0**width
    np.trunc(low, out=low)
    return out, scale, bad


def exact_finish(
    products: np.ndarray, scale: np.ndarray, width: int, bad: np.ndarray
) -> np.ndarray:
    """``float32(P1 / s + P2 / (s * 2**w))`` of the exact slice products, canonicalised.

    Dividing by a power of two is exact, so this is one float64 addition and one
    rounding to float32; results below float32's smallest normal become zero, zeros are
    positive and bad rows the quiet NaN ``0x7FC00000``.
    """
    rows = len(products) // 2
    total = products[:rows] / scale[:, None]
    total += products[rows:] / (scale[:, None] * 2.0**width)
    # Results below the smallest normal, zeros of either sign among them, become +0;
    # every other total rounds to a nonzero normal float32 (or overflows to infinity).
    tiny = np.abs(total) < _FLOAT32_TINY
    with np.errstate(over="ignore"):
        out: np.ndarray = total.astype(np.float32)
    out[tiny] = 0
    if bad.any():
        out.view(np.uint32)[bad] = CANONICAL_NAN
    return out


def _project_groups(values: np.ndarray, parts: Sequence[Part]) -> np.ndarray:
    """Exact probes of float32 rows ``values``: rows ``start:stop`` against matrix ``q``.

    Every row is split and rounded on its own and each product is exact in any order,
    so this gives the bits of one call per part. One split and one finish
    for many leaves keep the number of numpy calls low: on a small model their fixed
    cost, not the arithmetic, is most of the time (and each call is a point where the
    training thread may take the interpreter lock back).
    """
    split, scale, bad = exact_rows(values)
    rows = len(values)
    products = np.empty((2 * rows, parts[0][0].shape[1] if parts else 0), dtype=np.float64)
    for q, start, stop in parts:
        _gemm(split[start:stop], q, products[start:stop])
        _gemm(split[rows + start : rows + stop], q, products[rows + start : rows + stop])
    return exact_finish(products, scale, slice_width(values.shape[1]), bad)


def _gemm(a: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
    """``out = a @ q`` in row blocks that keep each product single-threaded."""
    step = max(1, _SINGLE_THREAD_GEMM // max(1, q.shape[0] * q.shape[1]))
    if len(a) <= step:
        np.matmul(a, q, out=out)
        return
    for start in range(0, len(a), step):
        np.matmul(a[start : start + step], q, out=out[start : start + step])


class _Parts(NamedTuple):
    """The leaves of a block of rows: ``(leaf, start, stop)``, and the same with each
    leaf's slot in its width class's stacked matrices (for the compiled pass)."""

    spans: tuple[tuple[int, int, int], ...]
    slots: np.ndarray | None


@dataclass(frozen=True, eq=False)
class _Group:
    """One width class's block of probe rows in a :meth:`ProbeSet._layout`."""

    d: int
    rows: int
    #: Rows of the first arrays of its jobs (:meth:`ProbeSet.project_steps`' after rows).
    kind_rows: int
    #: ``(job, array position, start, stop)`` in job order.
    arrays: tuple[tuple[int, int, int, int], ...]
    parts: _Parts
    #: The parts of the first arrays only, at the same offsets.
    first: _Parts
    #: Per array position, ``(job, start, stop)`` in row order: in a ``by_kind`` layout
    #: each position's rows are one block, filled by one copy.
    kinds: tuple[tuple[tuple[int, int, int], ...], ...]


def _compiled_pass(layout: Sequence[_Group]) -> Any:
    """The compiled pass for projecting ``layout``, or None for the numpy path: without
    Numba, or for at most :data:`~zkdv._probe_pass.SMALL_PROJECTION_VALUES` values."""
    if sum(group.rows * group.d for group in layout) <= _probe_pass.SMALL_PROJECTION_VALUES:
        return None
    return _kernel()


#: Layouts a ProbeSet keeps (a run has one or two; a caller of many shapes, more).
_LAYOUTS_KEPT = 64


@dataclass
class ProbeSet:
    """The probe matrices of one run, one per parameter leaf (computed once, reused)."""

    specs: tuple[LeafSpec, ...]
    probe_ratio: float
    seed: bytes
    matrices: tuple[np.ndarray, ...]
    rows: tuple[np.ndarray | None, ...]
    #: The matrices in float64 (:meth:`_matrix64`).
    _wide: dict[int, np.ndarray] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: Per last dimension, the stacked float64 matrices (:meth:`_stacked`).
    _by_width: dict[int, tuple[np.ndarray, dict[int, int]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: Per leaf, ``(rows, last dimension)``: the matrix a probe reads the leaf as.
    row_shapes: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    #: Where :meth:`project_many` and :meth:`project_steps` put each array (:meth:`_layout`).
    _layouts: dict[Any, tuple[_Group, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: Per width class, the two blocks of rows :meth:`project_steps` fills in turn.
    _blocks: dict[int, list[np.ndarray]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: Per width class, the layout of the last :meth:`project_steps`, its post-update rows
    #: and their probes: the next step's pre-update rows are usually these bits.
    _last_post: dict[int, tuple[_Group, np.ndarray, dict[int, np.ndarray]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # Worked out once: a step selects the rows of every leaf, two or three times.
        self.row_shapes = tuple(_leaf_dims(spec) for spec in self.specs)

    @classmethod
    def create(cls, specs: Sequence[LeafSpec], probe_ratio: float, seed: bytes) -> ProbeSet:
        matrices = []
        selections: list[np.ndarray | None] = []
        for spec in specs:
            n_rows, d = _leaf_dims(spec)
            k = probe_columns(max(d, 1), probe_ratio)
            digest = hash_bytes(Domain.PROBE, seed, spec.header(), length=32)
            rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))
            if n_rows > MAX_PROBE_ROWS:
                selections.append(np.sort(rng.choice(n_rows, MAX_PROBE_ROWS, replace=False)))
            else:
                selections.append(None)
            if d == 0:
                matrices.append(np.zeros((0, k), dtype=np.float32))
                continue
            gaussian = rng.standard_normal((d, min(k, d)))
            q, r = np.linalg.qr(gaussian)
            # Fix QR's sign ambiguity so the matrix is a function of the seed alone.
            q *= np.sign(np.diag(r))
            matrices.append(np.ascontiguousarray(exact_matrix(q.astype(np.float32))))
        return cls(
            tuple(specs), float(probe_ratio), bytes(seed), tuple(matrices), tuple(selections)
        )

    def select(self, leaf: int, array: np.ndarray) -> np.ndarray:
        """The float32 rows of a leaf that its probe reads; reduced precision is upcast
        (exactly), wider dtypes are rounded to float32."""
        values = np.asarray(array).reshape(self.row_shapes[leaf])
        selected = self.rows[leaf]
        if selected is not None:
            values = values[selected]
        return values.astype(np.float32, copy=False)

    def project(self, leaf: int, array: np.ndarray) -> np.ndarray:
        """The probe of one leaf as float32 ``(rows, k)``."""
        return self.project_rows(leaf, self.select(leaf, array))

    def project_rows(self, leaf: int, rows: np.ndarray) -> np.ndarray:
        """The probe of already selected float32 rows of ``leaf`` (``(rows, d)``).

        For a frontend that keeps only the probed rows of a pre-update state (and
        projects ``post_rows - pre_rows`` as the delta): the same arithmetic as
        :meth:`project`.
        """
        return self.project_many([(leaf, [np.asarray(rows, dtype=np.float32)])])[0][0]

    def project_many(
        self, jobs: Sequence[tuple[int, Sequence[np.ndarray]]]
    ) -> list[list[np.ndarray]]:
        """:meth:`project_rows` of float32 row arrays of many leaves: ``[(leaf, arrays)]``.

        The bits of one call per array; the arrays of all leaves with the same last
        dimension (hence the same number of probe columns) are split, multiplied and
        finished together, in one compiled pass where Numba is installed. The layout of
        a list of jobs is worked out once (:meth:`_layout`): training projects the same
        shapes every step, and on a model of many small leaves the per-leaf Python, not
        the arithmetic, was most of the time.
        """
        layout = self._layout(tuple((leaf, tuple(len(a) for a in arrays)) for leaf, arrays in jobs))
        results: list[list[np.ndarray]] = [[] for _ in jobs]
        kernel = _compiled_pass(layout)
        for group in layout:
            values = _scratch("values", (group.rows, group.d), np.float32)
            for index, position, start, stop in group.arrays:
                values[start:stop] = jobs[index][1][position]
            probes, _ = self._project(group, group.parts, values, kernel)
            for index, _, start, stop in group.arrays:
                results[index].append(probes[start:stop])
        return results

    def project_steps(
        self,
        before: Sequence[np.ndarray],
        after: Sequence[np.ndarray],
        grads: Sequence[np.ndarray | None] | None = None,
    ) -> tuple[list[np.ndarray], ...]:
        """Pre-update, post-update and delta probes from every leaf's selected float32 rows.

        The bits of :meth:`project_rows` of ``before``, ``after`` and ``after - before``
        for each leaf, and with ``grads`` (each leaf's selected gradient rows, None for
        a parameter without a gradient: its probe is zeros) the gradient's probes too.
        The pre-update probes of a width class are the previous call's post-update
        probes when ``before`` holds, bit for bit, the rows they came from (the usual
        case: nothing changes the parameters between two steps), so most steps project
        two arrays per leaf, not three; the deltas of a width class are one subtraction.

        Returns:
            ``(pre, post, delta)``, or ``(pre, post, delta, grad)`` with ``grads``.
        """
        # One job per leaf: (after, change[, grad]) rows, laid out in each width class as
        # [after of every leaf | change of every leaf | gradients], so that the changes
        # are one subtraction and the after rows one block the next step compares with.
        jobs = tuple(
            (leaf, (len(rows),) * (2 if grads is None or grads[leaf] is None else 3))
            for leaf, rows in enumerate(after)
        )
        layout = self._layout(jobs, by_kind=True)
        count = len(after)
        pre: list[np.ndarray] = [None] * count  # type: ignore[list-item]
        post, delta, grad = list(pre), list(pre), list(pre)
        kernel = _compiled_pass(layout)
        for group in layout:
            values = self._next_block(group)
            kind = group.kind_rows
            earlier = _scratch("earlier", (kind, group.d), np.float32)
            # Each kind's rows are one block, filled by one call rather than one per leaf.
            afters = group.kinds[0]
            np.concatenate([after[index] for index, _, _ in afters], out=values[:kind])
            np.concatenate([before[index] for index, _, _ in afters], out=earlier)
            if len(group.kinds) > 2:
                assert grads is not None
                gradients = [grads[index] for index, _, _ in group.kinds[2]]
                np.concatenate(gradients, out=values[2 * kind :])  # type: ignore[arg-type]
            last = self._last_post.get(group.d)
            held = last[1] if last is not None and last[0] is group else None
            # The changes (rows kind:2 * kind) and the comparison with the last post-update
            # rows are worked out in the same pass as the probes.
            probes, same = self._project(group, group.parts, values, kernel, earlier, held)
            for results, entries in zip((post, delta, grad), group.kinds, strict=False):
                for index, start, stop in entries:
                    results[index] = probes[start:stop]
            if same:
                assert last is not None
                for index, rows in last[2].items():
                    pre[index] = rows
            else:
                known, _ = self._project(group, group.first, earlier, kernel)
                for index, start, stop in afters:
                    pre[index] = known[start:stop]
            # The after rows' block, not a view of a tensor the next update overwrites.
            self._last_post[group.d] = (
                group,
                values[:kind],
                {index: post[index] for index, _, _ in afters},
            )
        if grads is None:
            return pre, post, delta
        # A parameter without a gradient has a zero gradient probe (zkdv.probes).
        grad = [np.zeros_like(p) if g is None else g for p, g in zip(post, grad, strict=True)]
        return pre, post, delta, grad

    def _next_block(self, group: _Group) -> np.ndarray:
        """The block :meth:`project_steps` fills for ``group``: one of two kept per width
        class, the other holding the last call's after rows. Kept rather than allocated:
        a fresh block of a megabyte costs its page faults on every step."""
        blocks = self._blocks.get(group.d)
        shape = (group.rows, group.d)
        if blocks is None or blocks[0].shape != shape:
            blocks = self._blocks[group.d] = [np.empty(shape, np.float32) for _ in range(2)]
        blocks.reverse()
        return blocks[0]

    def _layout(
        self, jobs: tuple[tuple[int, tuple[int, ...]], ...], by_kind: bool = False
    ) -> tuple[_Group, ...]:
        """Where each job's arrays go in its width class's block of rows (cached).

        ``jobs`` is ``((leaf, row counts of its arrays), ...)``. By default a job's
        arrays are consecutive; ``by_kind`` puts every job's first arrays first, then
        every second, then every third (:meth:`project_steps`).
        """
        key = (jobs, by_kind)
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        members: dict[int, list[int]] = {}
        for index, (leaf, _) in enumerate(jobs):
            members.setdefault(int(self.matrices[leaf].shape[0]), []).append(index)
        groups = []
        for d, indices in members.items():
            placed: list[tuple[int, int, int, int]] = []
            if by_kind:
                start = 0
                for position in range(max(len(jobs[i][1]) for i in indices)):
                    for index in indices:
                        if position < len(jobs[index][1]):
                            stop = start + jobs[index][1][position]
                            placed.append((index, position, start, stop))
                            start = stop
                placed.sort(key=lambda entry: (entry[0], entry[1]))
            else:
                start = 0
                for index in indices:
                    for position, rows in enumerate(jobs[index][1]):
                        placed.append((index, position, start, start + rows))
                        start += rows
            groups.append(self._group(d, jobs, placed))
        layout = tuple(groups)
        if len(self._layouts) >= _LAYOUTS_KEPT:
            self._layouts.clear()
        self._layouts[key] = layout
        return layout

    def _group(
        self,
        d: int,
        jobs: tuple[tuple[int, tuple[int, ...]], ...],
        placed: list[tuple[int, int, int, int]],
    ) -> _Group:
        def parts(entries: Sequence[tuple[int, int, int, int]]) -> _Parts:
            spans = tuple((jobs[index][0], start, stop) for index, _, start, stop in entries)
            if d == 0:
                return _Parts(spans, None)
            _, slot = self._stacked(d)
            return _Parts(spans, np.array([(slot[leaf], a, b) for leaf, a, b in spans], np.int64))

        firsts = [entry for entry in placed if entry[1] == 0]
        positions = 1 + max((entry[1] for entry in placed), default=-1)
        return _Group(
            d=d,
            rows=max((entry[3] for entry in placed), default=0),
            kind_rows=sum(entry[3] - entry[2] for entry in firsts),
            arrays=tuple(placed),
            parts=parts(placed),
            first=parts(firsts),
            kinds=tuple(
                tuple(
                    (index, start, stop)
                    for index, _, start, stop in sorted(
                        (entry for entry in placed if entry[1] == position),
                        key=lambda entry: entry[2],
                    )
                )
                for position in range(positions)
            ),
        )

    def _project(
        self,
        group: _Group,
        parts: _Parts,
        values: np.ndarray,
        kernel: Any,
        earlier: np.ndarray | None = None,
        last: np.ndarray | None = None,
    ) -> tuple[np.ndarray, bool]:
        """The exact probes of ``values``, rows ``start:stop`` by each part's leaf, by
        the compiled pass ``kernel`` (:func:`_kernel`) or, where it is None, numpy.

        With ``earlier``, :meth:`project_steps`' pre-update rows, the ``n`` rows after
        the first ``n`` of ``values`` are their changes (``values[i] - earlier[i]``),
        which this works out itself; it returns too whether ``earlier`` holds the bits
        of ``last``, the last step's post-update rows (False without them).
        """
        if parts.slots is not None and kernel is not None:
            none = np.empty((0, group.d), np.float32)
            stacked, _ = self._stacked(group.d)
            k = probe_columns(group.d, self.probe_ratio)
            probes = np.empty((len(values), k), dtype=np.float32)
            before = none if earlier is None else earlier
            same = kernel(
                values,
                before,
                none if last is None else last,
                stacked,
                parts.slots,
                slice_width(group.d),
                probes,
            )
            return probes, bool(same) and earlier is not None and last is not None
        if earlier is not None:
            kind = len(earlier)
            np.subtract(values[:kind], earlier, out=values[kind : 2 * kind])
        matrices = [(self._matrix64(leaf), a, b) for leaf, a, b in parts.spans]
        same = earlier is not None and last is not None and _same_bits(last, earlier)
        return _project_groups(values, matrices), same

    def project_all(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [self.project(i, array) for i, array in enumerate(arrays)]

    def _stacked(self, d: int) -> tuple[np.ndarray, dict[int, int]]:
        """The float64 matrices of every leaf of last dimension ``d``, transposed,
        padded with zero columns (:func:`padded_columns`) and stacked ``(n, padded k, d)``
        for the compiled pass, and each such leaf's slot in the stack (built on first
        use)."""
        held = self._by_width.get(d)
        if held is None:
            leaves = [leaf for leaf, m in enumerate(self.matrices) if m.shape[0] == d]
            k = self.matrices[leaves[0]].shape[1]
            stacked = np.zeros((len(leaves), padded_columns(k), d))
            for n, leaf in enumerate(leaves):
                stacked[n, :k] = self._matrix64(leaf).T
            held = self._by_width[d] = (stacked, {leaf: n for n, leaf in enumerate(leaves)})
        return held

    def _matrix64(self, leaf: int) -> np.ndarray:
        """A leaf's matrix in float64, as the exact products take it (built on first use)."""
        wide = self._wide.get(leaf)
        if wide is None:
            wide = self._wide[leaf] = self.matrices[leaf].astype(np.float64)
        return wide

    @property
    def floats(self) -> int:
        """Number of float32 values in one probe of the whole state."""
        return sum(
            min(rows, MAX_PROBE_ROWS) * m.shape[1]
            for (rows, _), m in zip(self.row_shapes, self.matrices, strict=True)
        )


_scratches = threading.local()


def _scratch(name: str, shape: tuple[int, int], dtype: type) -> np.ndarray:
    """A block this thread reuses for ``name`` (a fresh large one faults in its pages on
    every call); grown when a larger one is asked for."""
    kept: dict[str, np.ndarray] = _scratches.__dict__.setdefault("blocks", {})
    block = kept.get(name)
    size = shape[0] * shape[1]
    if block is None or block.size < size or block.dtype != dtype:
        block = kept[name] = np.empty(max(size, 1), dtype)
    return block[:size].reshape(shape)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two float32 blocks hold the same bits (NaN payloads, signed zeros)."""
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
