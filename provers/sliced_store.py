"""Read a sliced challenge's opened bytes from the lab's own object store (prototype).

The lab keeps each step's files in its own bucket (:mod:`zkdv.sliced_store` says where
each tensor and row lies) and grants the platform pre-signed ``GET`` URLs for them
(:class:`zkdv.sliced_store.Grant`). :class:`RangeReader` checks the grant (this run's,
unexpired, every URL an object under the granted prefix of the granted bucket) and reads
byte ranges with HTTP ``Range`` requests, coalescing adjacent ranges of one object into
one request and counting what moved. :func:`fetch_slice` reads exactly what a slice
opens and builds the :class:`zkdv.sliced.SliceOpening` that
:func:`provers.sliced.verify_slice` checks, with audit paths the platform computes itself
from the digest sections; :func:`verify_slice_from_store` does both.

Nothing read is trusted: every tensor and row is checked against the step's committed
roots. A grant the platform cannot use (expired, another run's, a URL outside its scope)
raises :class:`GrantError`, before anything is read. A store that does not serve what
the manifest places there (a missing object, a refused or short read, a malformed
manifest) fails the slice with reason ``store``, the lab's fault, like an opening that
does not hash.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from provers.sliced import SliceTolerances, SliceVerdict, verify_slice
from zkdv.hashing import DIGEST_BYTES
from zkdv.merkle import inclusion_path, merkle_root
from zkdv.sliced import (
    ACTIVATION,
    GRADIENT,
    BatchRowOpening,
    BlockLayout,
    DigestPath,
    RowOpening,
    SliceAnswer,
    SliceChallenge,
    SliceOpening,
    StepCommitment,
    TensorOpening,
)
from zkdv.sliced_store import ByteRange, Grant, GrantError, StepLayout, object_names

__all__ = [
    "FetchedSlice",
    "GrantError",
    "RangeReader",
    "StoreError",
    "Transfer",
    "coalesce",
    "fetch_slice",
    "verify_slice_from_store",
]


#: The largest whole object (a step's manifest) a reader takes, whatever the store sends.
MAX_OBJECT_BYTES = 64 * 1024 * 1024


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: a grant's URLs are checked, where a redirect would lead is not."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


#: urllib's opener without redirects: a 3xx is the store's error.
_OPENER = urllib.request.build_opener(_NoRedirects)


class StoreError(Exception):
    """The lab's store did not serve what the slice needs (the lab's fault)."""


@dataclass
class Transfer:
    """What moved: HTTP requests made, ranges asked for, and body bytes received."""

    requests: int = 0
    ranges: int = 0
    bytes: int = 0


def coalesce(ranges: Sequence[ByteRange]) -> list[ByteRange]:
    """The fewest spans that cover ``ranges``: adjacent or overlapping ranges of one
    object merge; empty ranges are dropped. No gap is ever read."""
    spans: list[ByteRange] = []
    for r in sorted({r for r in ranges if r.size > 0}):
        last = spans[-1] if spans else None
        if last is not None and last.name == r.name and r.start <= last.stop:
            spans[-1] = ByteRange(r.name, last.start, max(last.stop, r.stop))
        else:
            spans.append(r)
    return spans


class RangeReader:
    """Ranged ``GET`` reads through a lab's grant, for the run whose digest is ``run``.

    ``budget`` caps the bytes one reader may move (the schema's slice size, say), so a
    manifest that lies about shapes cannot make the platform read a whole snapshot.

    Raises:
        GrantError: the grant is another run's, has expired at ``now`` (default: the
            clock), or holds a URL that is not a plain object under its bucket's prefix
            at its endpoint.
    """

    def __init__(
        self,
        grant: Grant,
        *,
        run: bytes,
        now: float | None = None,
        timeout: float = 30.0,
        budget: int | None = None,
    ) -> None:
        grant.check(run, now=now)
        self.grant = grant
        self.timeout = timeout
        self.budget = budget
        self.transfer = Transfer()

    def _get(self, name: str, span: tuple[int, int] | None) -> bytes:
        url = self.grant.urls.get(name)
        if url is None:
            raise StoreError(f"the grant names no object {name!r}")
        request = urllib.request.Request(url, method="GET")  # noqa: S310 - http(s), checked
        if span is not None:
            request.add_header("Range", f"bytes={span[0]}-{span[1] - 1}")
        self.transfer.requests += 1
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                # Never more than was asked for (one byte more shows a store that
                # ignores the range), nor a whole object past MAX_OBJECT_BYTES.
                limit = span[1] - span[0] if span is not None else MAX_OBJECT_BYTES
                body: bytes = response.read(limit + 1)
                status = int(response.status)
        except urllib.error.HTTPError as error:
            why = {
                403: "refused (the grant is expired, revoked or not this object's)",
                404: "no such object",
                416: "the range lies beyond the object's end",
            }.get(error.code, error.reason)
            if 300 <= error.code < 400:
                why = "redirected, and redirects are not followed"
            raise StoreError(f"{name}: HTTP {error.code}, {why}") from error
        except (urllib.error.URLError, OSError) as error:
            raise StoreError(f"{name}: the store cannot be reached: {error}") from error
        self.transfer.bytes += len(body)
        if span is None and len(body) > MAX_OBJECT_BYTES:
            raise StoreError(f"{name}: larger than the {MAX_OBJECT_BYTES} bytes a whole read takes")
        if span is not None:
            if status != 206:
                raise StoreError(f"{name}: the store ignored the Range header (HTTP {status})")
            if len(body) != span[1] - span[0]:
                raise StoreError(
                    f"{name}: asked for bytes {span[0]}-{span[1] - 1}, got {len(body)} bytes"
                )
        return body

    def read_object(self, name: str) -> bytes:
        """One whole object (the manifest, whose size the platform does not know)."""
        return self._get(name, None)

    def read(self, ranges: Sequence[ByteRange]) -> dict[ByteRange, bytes]:
        """The bytes of each range, read in :func:`coalesce`'s spans."""
        self.transfer.ranges += len(ranges)
        planned = coalesce(ranges)
        asked = self.transfer.bytes + sum(span.size for span in planned)
        if self.budget is not None and asked > self.budget:
            raise StoreError(f"the slice would read {asked} bytes, over the budget {self.budget}")
        spans = {span: self._get(span.name, (span.start, span.stop)) for span in planned}
        out: dict[ByteRange, bytes] = {}
        for r in ranges:
            if r.size <= 0:
                out[r] = b""
                continue
            span = next(
                s for s in spans if s.name == r.name and s.start <= r.start and r.stop <= s.stop
            )
            out[r] = spans[span][r.start - span.start : r.stop - span.start]
        return out


@dataclass
class FetchedSlice:
    opening: SliceOpening
    files: StepLayout


def fetch_slice(
    reader: RangeReader,
    commitment: StepCommitment,
    challenge: SliceChallenge,
    sequences: Sequence[tuple[int, int]],
    *,
    names: Sequence[str],
    layout: BlockLayout,
    inputs: Sequence[str] = (),
) -> FetchedSlice:
    """Read what the slice opens from the lab's store and assemble the opening.

    One request for the manifest, then one request per coalesced span: the block's
    tensors of the pre-state, the optimizer state and the gradient (each contiguous in
    its file), the digest sections of the five state trees and of the row and batch
    trees, the opened sequences' boundary rows, and with ``inputs`` the embedding tensors
    and the opened batch rows.

    Raises:
        StoreError: a read failed or the manifest does not fit the commitment.
    """
    files = _manifest(reader, commitment, challenge.step)
    plan = _SlicePlan.of(files, challenge, names=names, layout=layout, inputs=inputs)
    read = _ReadSlice.of(files, reader.read(plan.ranges(files, sequences)), plan.sections)
    params, opt, embedding = plan.params, plan.opt, plan.embedding
    opening = SliceOpening(
        params=tuple(read.tensor("params", "params", i) for i in params),
        opt_state=tuple(read.tensor("opt_state", "opt_state", i) for i in opt),
        grad=tuple(read.tensor("grad", "grad", i) for i in params),
        post_params=tuple(read.post("post_params", i) for i in params),
        post_opt_state=tuple(read.post("post_opt_state", i) for i in opt),
        rows=read.rows(sequences, plan.wanted_rows),
        inputs=tuple(read.tensor("params", "params", i) for i in embedding),
        batch_rows=read.batch_rows(sequences) if plan.inputs else (),
    )
    return FetchedSlice(opening, files)


def _manifest(reader: RangeReader, commitment: StepCommitment, step: int) -> StepLayout:
    """The step's manifest, read whole and checked against the committed step."""
    try:
        files = StepLayout.from_bytes(reader.read_object(object_names(step)["manifest"]))
    except ValueError as error:
        raise StoreError(f"step {step}: {error}") from error
    if files.step != step or files.shape != commitment.shape:
        raise StoreError(f"step {step}: the manifest does not describe the committed step")
    return files


@dataclass(frozen=True)
class _SlicePlan:
    """What a slice opens: tensor indices in each file, boundary rows and digest sections.

    Attributes:
        params: the block's parameters (their indices in the run's parameter order).
        embedding: the embedding tensors, with ``inputs``.
        opt: the block's optimizer-state tensors (three per parameter).
        wanted_rows: ``(boundary, kind)`` of each row opened per sequence.
        sections: the digest sections read whole, to build audit paths.
        inputs: whether the slice opens the batch rows and the embedding.
    """

    params: list[int]
    embedding: list[int]
    opt: list[int]
    wanted_rows: list[tuple[int, str]]
    sections: tuple[str, ...]
    inputs: bool

    @classmethod
    def of(
        cls,
        files: StepLayout,
        challenge: SliceChallenge,
        *,
        names: Sequence[str],
        layout: BlockLayout,
        inputs: Sequence[str],
    ) -> _SlicePlan:
        step, b = challenge.step, challenge.block
        block_names = layout.names(b)
        order = list(names)
        try:
            params = [order.index(n) for n in block_names]
            embedding = [order.index(n) for n in inputs]
        except ValueError as error:
            raise StoreError(
                f"the block names a parameter the run does not have: {error}"
            ) from error
        opt = [3 * i + k for i in params for k in range(3)]
        for tree, indices in (("params", params + embedding), ("opt_state", opt), ("grad", params)):
            if indices and max(indices) >= len(files.specs[tree]):
                raise StoreError(f"step {step}: the manifest's {tree} file is shorter than the run")
        wanted_rows = [(bd, kind) for bd in (b, b + 1) for kind in (ACTIVATION, GRADIENT)]
        if inputs and b != 0:
            wanted_rows.append((0, ACTIVATION))
        sections: tuple[str, ...] = ("params", "opt_state", "grad", "post_params", "post_opt_state")
        sections += ("rows", "batch") if inputs else ("rows",)
        return cls(params, embedding, opt, wanted_rows, sections, bool(inputs))

    def ranges(self, files: StepLayout, sequences: Sequence[tuple[int, int]]) -> list[ByteRange]:
        """Every byte range the slice reads, in the order the plan lists them."""
        ranges = [files.tensor("params", i) for i in self.params + self.embedding]
        ranges += [files.tensor("opt_state", i) for i in self.opt]
        ranges += [files.tensor("grad", i) for i in self.params]
        ranges += [files.digests(s) for s in self.sections]
        ranges += [
            files.boundary_row(m, bd, kind, r)
            for m, r in sequences
            for bd, kind in self.wanted_rows
        ]
        if self.inputs:
            ranges += [files.batch(m, r) for m, r in sequences]
        return ranges


@dataclass(frozen=True)
class _ReadSlice:
    """The bytes a slice read, with the digest sections split into leaves and their roots.

    Builds each opening with the audit path the platform computes itself from the
    digest sections (an index past a section's end gets an empty path, which fails).
    """

    files: StepLayout
    data: dict[ByteRange, bytes]
    digests: dict[str, list[bytes]]
    roots: dict[str, bytes]

    @classmethod
    def of(
        cls, files: StepLayout, data: dict[ByteRange, bytes], sections: Sequence[str]
    ) -> _ReadSlice:
        digests = {}
        for s in sections:
            blob = data[files.digests(s)]
            digests[s] = [blob[i : i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES)]
        roots = {s: merkle_root(d) for s, d in digests.items()}
        return cls(files, data, digests, roots)

    def _path(self, section: str, index: int) -> tuple[bytes, ...]:
        leaves = self.digests[section]
        return tuple(inclusion_path(leaves, index)) if index < len(leaves) else ()

    def tensor(self, tree: str, section: str, index: int) -> TensorOpening:
        return TensorOpening(
            index=index,
            count=len(self.digests[section]),
            spec=self.files.specs[tree][index],
            data=self.data[self.files.tensor(tree, index)],
            path=self._path(section, index),
            tensors_root=self.roots[section],
        )

    def post(self, section: str, index: int) -> DigestPath:
        leaves = self.digests[section]
        return DigestPath(index, len(leaves), self._path(section, index), self.roots[section])

    def rows(
        self, sequences: Sequence[tuple[int, int]], wanted_rows: Sequence[tuple[int, str]]
    ) -> tuple[RowOpening, ...]:
        files = self.files
        row_dtype = np.dtype(files.row[0]).newbyteorder("<")
        rows = []
        for m, r in sequences:
            for bd, kind in wanted_rows:
                index = (
                    (m * files.shape[1] + bd) * 2 + (0 if kind == ACTIVATION else 1)
                ) * files.shape[2] + r
                array = np.frombuffer(
                    self.data[files.boundary_row(m, bd, kind, r)], dtype=row_dtype
                )
                rows.append(
                    RowOpening(
                        m, bd, kind, r, array.reshape(files.row[1]), self._path("rows", index)
                    )
                )
        return tuple(rows)

    def batch_rows(self, sequences: Sequence[tuple[int, int]]) -> tuple[BatchRowOpening, ...]:
        files = self.files
        batch_dtype = np.dtype(files.batch_row[0]).newbyteorder("<")
        return tuple(
            BatchRowOpening(
                m,
                r,
                np.frombuffer(self.data[files.batch(m, r)], dtype=batch_dtype).reshape(
                    files.batch_row[1]
                ),
                self._path("batch", m * files.shape[2] + r),
            )
            for m, r in sequences
        )


def verify_slice_from_store(
    reader: RangeReader,
    commitment: StepCommitment,
    challenge: SliceChallenge,
    answer: SliceAnswer,
    sequences: Sequence[tuple[int, int]],
    *,
    names: Sequence[str],
    layout: BlockLayout,
    block: Any,
    chunk_bytes: int,
    tolerances: SliceTolerances | None = None,
    inputs: Sequence[str] = (),
    embed: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor] | None = None,
) -> SliceVerdict:
    """:func:`fetch_slice`, then :func:`provers.sliced.verify_slice` on what it read.

    A :class:`StoreError` is the verdict's ``store`` failure; the bytes moved are
    ``reader.transfer``.
    """
    started = time.perf_counter()
    try:
        fetched = fetch_slice(
            reader, commitment, challenge, sequences, names=names, layout=layout, inputs=inputs
        )
    except StoreError as error:
        verdict = SliceVerdict(ok=True).fail("store", str(error))
        verdict.seconds = time.perf_counter() - started
        return verdict
    verdict = verify_slice(
        commitment,
        challenge,
        answer,
        sequences,
        fetched.opening,
        names=names,
        layout=layout,
        block=block,
        chunk_bytes=chunk_bytes,
        tolerances=tolerances,
        inputs=inputs,
        embed=embed,
    )
    verdict.seconds = time.perf_counter() - started
    return verdict
