"""The ZKDV transcript, protocol version 1: ``<proof dir>/records.cborl``.

File format
-----------
A CBOR sequence (RFC 8742): canonical CBOR maps (RFC 8949 section 4.2.1 deterministic
encoding) written back to back, with no framing. Every record carries ``prev``, the
BLAKE3 ``record``-domain hash of the previous record's encoded bytes (32 zero bytes for
the root), so the file is a hash chain; the hash of the last record (the close record)
is the *transcript digest*.

Records (keys are short because a step record must stay under 1 KiB)::

    root   {t: "root", v: 1, prev, prover: "whitebox-jax" | "whitebox-torch",
            config: {name, sampling, tolerance, chunk_bytes, rolling_window, probe_ratio,
                     snapshot_interval, max_in_flight},
            program: {kind, digest, bytes} | null,    # digest of the attested artifact
            schema: {params: [leaf], opt_state: [leaf], buffers: [leaf],
                     batch: {cols, dtype: "uint32"}, sharding?},  # leaf = {path, dtype, shape}
            initial: {p, o, b},                      # state roots before step 0
            env: {...}, experiment: {name, spec_digest, regime?} | null,
            probe_seed: bytes(16), created: float}
    step   {t: "step", i, prev, batch: {root, rows, cols, win}, post: {p, o, b},
            probe: {off, len, digest} | null, tokens, flops | null, time: [start, end],
            hp?: [{option: number | [number]}]}
    check  {t: "check", i, prev, param: {index, committed, replayed},
            state: {index, committed, replayed}, from, replayed, ok}
    snap   {t: "snap", i, prev, roots: {p, o, b}, files: {name: {digest, bytes}}}
    close  {t: "close", prev, steps, checks, final: {p, o, b}}

Every field shown is required (``null`` where the diagram allows it) except those marked
``?``, and a record or nested map holds no other field; ``env`` and ``sharding`` are
free-form maps. ``p``, ``o`` and ``b`` are the state roots (see :mod:`zkdv.merkle`) of
parameters, optimizer state (step counters included) and buffers. ``i`` is the step
index.

Positions are rules, not accidents (with ``N = config.snapshot_interval``):

* step records carry ``i = 0, 1, 2, ...`` in order;
* a ``snap`` record commits the pre-state of step ``i`` (its roots equal the post roots of
  step ``i - 1``, or ``initial`` for step 0) and the digests of the snapshot and batch
  files kept for the platform. There is one before step 0's record and before the record
  of every step ``i`` with ``i mod N = 0`` that the run reaches, between step ``i - 1``'s
  record and step ``i``'s, and none elsewhere (none after the last step);
* a ``check`` for step ``t`` follows step ``t``'s record (possibly after later steps and
  snapshots: checks complete asynchronously) and precedes the close record; there is one
  for exactly the sampled steps. It replays from the snapshot before its step:
  ``from = t - t mod N`` and ``replayed = t - from`` (steps replayed before ``t``);
* probes live in the sidecar ``probes.bin`` (float32, little endian: pre, post and delta
  probes of every parameter leaf, in schema order); a step record binds its block by
  offset, length and digest. Blocks follow one another: the first starts at 0, each
  next one where the previous ended, and each is ``3 x 4 x`` the probe's float count
  (:attr:`zkdv.probes.ProbeSet.floats`, fixed by the schema and ``probe_ratio``).

``hp`` (Torch step records only, optional): the hyperparameters ``optimizer.step()``
used at that step, which an LR scheduler changes between steps. One map per optimizer
parameter group, in the order of the root's ``env.optimizer.groups``, from option name
(text) to a finite number (int or float) or a list of at most 16 finite numbers (Adam's
``betas``); at most 1024 groups. When the root records ``env.optimizer.groups`` as a
list, ``hp`` has one map per group and each map's keys are among that group's recorded
options. JAX step records never carry it: a JAX run's schedule is part of its program.

:mod:`zkdv.verify` enforces every rule above; ``docs/transcript.md`` tabulates them
with their reason codes and tests.

Durability
----------
:class:`TranscriptWriter` opens the file with ``O_APPEND`` and writes each record with a
single ``write`` of its complete encoding, so a crash can only leave a truncated *last*
record, never damage an earlier one; the reader reports such a tail precisely. A step's
probe block is written to ``probes.bin`` (unbuffered) before the record that binds it.
The writer ``fsync``\\ s after the root, after every check and snapshot record, every
``fsync_every`` step records, and at close.

With ``background=True`` (what :class:`~zkdv.core.ZKDVCore` uses under a training run)
the caller only encodes and hashes: the chain and the record's hash (hence the sampling
decision) are fixed at once, and the bytes go to one writer thread that performs every
``write`` and ``fsync``, and every file job handed to :meth:`TranscriptWriter.submit`,
strictly in submission order. So, for a step of a training run:

* it is **decided** when its record is hashed (on the commit stage);
* it is **committed** when the writer has handed its bytes to the kernel, after the
  batch and gradient files and the probe block it refers to: from then on it survives
  the process being killed (``kill -9``), and every record before it does too;
* it is **durable** (survives a power loss or an OS crash) after the next ``fsync``:
  at the latest ``fsync_every`` step records later, at the next snapshot or check
  record, or at close.

The writer holds at most ``max_pending_bytes`` of queued work (a single larger item is
admitted alone); beyond that :meth:`TranscriptWriter.append` and
:meth:`TranscriptWriter.submit` wait, which is the pipeline's back-pressure when the
disk falls behind. :meth:`TranscriptWriter.flush` waits until everything queued is
committed; ``close()`` also ``fsync``\\ s. A write that fails stops every later one and
is raised by the next call.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import cbor2

from zkdv import workers
from zkdv.errors import TranscriptError, TruncatedTranscriptError
from zkdv.hashing import ZERO_DIGEST, Domain, hash_bytes, hasher

__all__ = [
    "PROBES_FILE",
    "PROTOCOL_VERSION",
    "RECORDS_FILE",
    "Record",
    "TranscriptWriter",
    "encode",
    "iter_records",
    "record_hash",
]

PROTOCOL_VERSION = 1
RECORDS_FILE = "records.cborl"
PROBES_FILE = "probes.bin"
# A record larger than this is malformed: the largest legitimate one is a root record
# whose schema lists every leaf of a very large model.
MAX_RECORD_BYTES = 64 * 1024 * 1024
#: A background writer's default bound on queued work (records, probes and files).
DEFAULT_PENDING_BYTES = 256 * 1024 * 1024
_APPEND_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)


def encode(record: dict[str, Any]) -> bytes:
    return cbor2.dumps(record, canonical=True)


_RECORD_HASHER = hasher(Domain.RECORD)


def record_hash(encoded: bytes | memoryview) -> bytes:
    h = _RECORD_HASHER.copy()
    h.update(encoded)
    return h.digest()


class TranscriptWriter:
    """Append-only, hash-chaining writer of ``records.cborl`` (and ``probes.bin``).

    Args:
        directory: the proof directory; created if missing. It must not already hold a
            transcript: a run never appends to another run's records.
        fsync_every: fsync after this many step records (roots, checks, snapshots and
            the close record are always synced).
        background: write and fsync on one writer thread, in submission order (see the
            module's "Durability"); otherwise every call writes before it returns.
        max_pending_bytes: with ``background``, the most bytes of queued work before a
            call waits for the writer (back-pressure).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync_every: int = 64,
        background: bool = False,
        max_pending_bytes: int = DEFAULT_PENDING_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / RECORDS_FILE
        if self.path.exists() and self.path.stat().st_size:
            raise FileExistsError(
                f"{self.path} already holds a transcript; use a new proof directory per run"
            )
        self._fd: int | None = os.open(self.path, _APPEND_FLAGS, 0o644)
        self._probes: int | None = None
        self._probe_offset = 0
        self._prev = ZERO_DIGEST
        self._unsynced = 0
        self._fsync_every = max(1, fsync_every)
        self.records = 0
        # Encoding, chaining and queueing happen under one lock, so the writer thread
        # receives records in chain order whichever thread appends them.
        self._order = threading.Lock()
        self._space = threading.Condition()
        self._pending = 0
        self._pending_jobs = 0
        self._max_pending = max(1, int(max_pending_bytes))
        self._error: BaseException | None = None
        # One worker: FIFO. An executor's worker is joined at interpreter exit, so
        # records queued when a script ends without close() are still written.
        self._executor = (
            ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="zkdv-writer", initializer=workers.demote
            )
            if background
            else None
        )

    @property
    def digest(self) -> bytes:
        """Hash of the last record appended (the transcript digest once closed)."""
        return self._prev

    @property
    def background(self) -> bool:
        return self._executor is not None

    def append(self, record: dict[str, Any], *, sync: bool = False) -> bytes:
        """Chain, encode and append one record; returns its hash.

        With ``background`` the record is queued: its hash and place in the chain are
        final, its bytes reach the file when the writer thread gets to them.
        """
        with self._order:
            fd = self._require_fd()
            record = {**record, "prev": self._prev}
            encoded = encode(record)
            self._prev = record_hash(encoded)
            self.records += 1
            self._unsynced += 1
            self._enqueue(lambda: _write_all(fd, memoryview(encoded)), len(encoded))
            if sync or self._unsynced >= self._fsync_every:
                self._unsynced = 0
                self._enqueue(self._fsync, 0)
            return self._prev

    def append_probes(self, data: bytes | memoryview) -> dict[str, Any]:
        """Append probe floats to the sidecar; returns the step record's ``probe`` field.

        ``data`` must not change afterwards: with ``background`` it is written later,
        before any record appended after this call.
        """
        with self._order:
            self._require_fd()
            if self._probes is None:
                self._probes = os.open(self.directory / PROBES_FILE, _APPEND_FLAGS, 0o644)
            fd = self._probes
            view = memoryview(data).cast("B")
            offset = self._probe_offset
            self._probe_offset += len(view)
            self._enqueue(lambda: _write_all(fd, view), len(view))
            return {"off": offset, "len": len(view), "digest": hash_bytes(Domain.PROBE, view)}

    def submit(self, job: Callable[[], object], nbytes: int = 0) -> None:
        """Run ``job`` on the writer, after everything appended or submitted before.

        A file the next record refers to (a committed batch) is submitted before that
        record, so a record is never committed before its files. ``nbytes``: what the
        job holds in memory until it runs, counted against ``max_pending_bytes``.
        """
        with self._order:
            self._require_fd()
            self._enqueue(job, nbytes)

    def flush(self) -> None:
        """Wait until everything queued is written (committed, not necessarily synced).

        Raises:
            OSError: (or whatever a job raised) a queued write failed.
        """
        if self._executor is not None:
            with self._space:
                self._wait_for(lambda: not self._pending_jobs or self._error is not None)
        self._raise()

    def sync(self) -> None:
        """Write everything queued, then ``fsync`` both files before returning."""
        self.flush()
        self._fsync()
        self._unsynced = 0

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.sync()
        finally:
            if self._executor is not None:
                with workers.waiting():
                    self._executor.shutdown(wait=True)
            os.close(self._fd)
            self._fd = None
            if self._probes is not None:
                os.close(self._probes)
                self._probes = None

    # --- the writer thread -------------------------------------------------------------
    def _require_fd(self) -> int:
        if self._fd is None:
            raise ValueError("transcript writer is closed")
        self._raise()
        return self._fd

    def _raise(self) -> None:
        error = self._error
        if error is not None:
            raise OSError(f"ZKDV transcript writer failed: {error}") from error

    def _enqueue(self, job: Callable[[], object], nbytes: int) -> None:
        executor = self._executor
        if executor is None:
            job()
            return
        with self._space:
            # Back-pressure: wait for room, but always admit an item into an empty queue.
            self._wait_for(
                lambda: (
                    not self._pending
                    or self._pending + nbytes <= self._max_pending
                    or self._error is not None
                )
            )
            self._raise()
            self._pending += nbytes
            self._pending_jobs += 1
        executor.submit(self._run, job, nbytes)

    def _wait_for(self, done: Callable[[], bool]) -> None:
        """Wait on ``_space`` (held) until ``done()``; one :func:`workers.waiting` for all
        of it, entered only if the caller must wait at all."""
        if not done():
            with workers.waiting():
                self._space.wait_for(done)

    def _run(self, job: Callable[[], object], nbytes: int) -> None:
        try:
            if self._error is None:
                job()
        except BaseException as error:  # noqa: BLE001 - kept, raised by the next call
            self._error = error
        finally:
            with self._space:
                self._pending -= nbytes
                self._pending_jobs -= 1
                self._space.notify_all()

    def _fsync(self) -> None:
        if self._probes is not None:
            os.fsync(self._probes)
        if self._fd is not None:
            os.fsync(self._fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


class Record:
    """One decoded record with its position and the hash of its encoded bytes.

    A slotted plain class rather than a frozen dataclass: the verifier builds one per
    record and construction cost matters at 100,000 records a second.
    """

    __slots__ = ("data", "hash", "index", "offset", "size")

    def __init__(
        self, index: int, offset: int, size: int, hash: bytes, data: dict[str, Any]
    ) -> None:
        self.index = index
        self.offset = offset
        self.size = size
        self.hash = hash
        self.data = data


def _decode_error(index: int, offset: int, error: BaseException) -> TranscriptError:
    return TranscriptError(
        "malformed_record",
        f"not a valid CBOR record at byte offset {offset}: {type(error).__name__}: {error}",
        record=index,
    )


def iter_records(
    source: str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes],
) -> Iterator[Record]:
    """Stream the records of a transcript, hashing each one's exact bytes.

    Args:
        source: a proof directory, a ``records.cborl`` path, the file's bytes, or a
            binary file object.

    Raises:
        TruncatedTranscriptError: the data ends inside a record.
        TranscriptError: a record is not valid CBOR, not a map, or too large.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        yield from _iter_buffer(memoryview(source))
        return
    if hasattr(source, "read"):
        yield from _iter_buffer(memoryview(source.read()))
        return
    path = Path(source)
    if path.is_dir():
        path = path / RECORDS_FILE
    # The whole file is read at once: step records are a few hundred bytes, so even a
    # million-step run is a few hundred MB, and an mmap's exported slices would outlive
    # an exception's traceback and make the mapping impossible to close.
    yield from _iter_buffer(memoryview(path.read_bytes()))


def _iter_buffer(view: memoryview) -> Iterator[Record]:
    """Decode records back to back with cbor2's C decoder, tracking their byte spans.

    The decoder reads from a stream, so a record's exact bytes are the span between two
    ``tell()`` positions. When the decoder fails, the bounded header scanner below
    names the failure precisely (truncation, absurd lengths, nesting) without having
    allocated anything for it.
    """
    total = len(view)
    stream = io.BytesIO(view)
    decoder = cbor2.CBORDecoder(stream)
    decode = decoder.decode
    offset = 0
    index = 0
    while offset < total:
        try:
            data = decode()
        except Exception as error:  # noqa: BLE001 - any decoder failure is malformed input
            _item_length(view, offset, index)  # raises the precise structural error, if any
            raise _decode_error(index, offset, error) from None
        end = stream.tell()
        size = end - offset
        if size > MAX_RECORD_BYTES:
            raise TranscriptError(
                "malformed_record", f"record exceeds {MAX_RECORD_BYTES} bytes", record=index
            )
        if type(data) is not dict:
            raise TranscriptError(
                "malformed_record", f"expected a CBOR map, got {type(data).__name__}", record=index
            )
        yield Record(index, offset, size, record_hash(view[offset:end]), data)
        offset = end
        index += 1


# --- A bounded CBOR item-length scanner --------------------------------------------------
# Finding record boundaries by scanning headers (instead of decoding into a growing stream)
# lets the reader hash each record's exact bytes, report a truncated tail precisely, and
# refuse absurd declared lengths and nesting before allocating anything.

_MAX_DEPTH = 64


def _truncated(index: int, start: int, total: int) -> TruncatedTranscriptError:
    return TruncatedTranscriptError(
        "truncated",
        f"the transcript ends inside record {index}, which starts at byte offset {start} "
        f"({total - start} bytes of it present); the run was interrupted or the file was cut",
        record=index,
    )


def _malformed(index: int, message: str) -> TranscriptError:
    return TranscriptError("malformed_record", message, record=index)


def _item_length(view: memoryview, start: int, index: int) -> int:
    """Length in bytes of the CBOR data item starting at ``start`` (headers only)."""
    total = len(view)
    pos = start
    # Items still expected in each open container; -1 marks an indefinite-length one.
    stack: list[int] = [1]
    while stack:
        if stack[-1] == 0:
            stack.pop()
            continue
        if pos >= total:
            raise _truncated(index, start, total)
        initial = view[pos]
        pos += 1
        if initial == 0xFF:
            if stack[-1] != -1:
                raise _malformed(index, f"unexpected CBOR break code at byte {pos - 1}")
            stack.pop()
            continue
        if stack[-1] > 0:
            stack[-1] -= 1
        major, info = initial >> 5, initial & 0x1F
        if info == 31:
            if major not in (2, 3, 4, 5):
                raise _malformed(index, f"invalid indefinite length for CBOR major type {major}")
            stack.append(-1)
        else:
            if info < 24:
                argument = info
            elif info <= 27:
                width = 1 << (info - 24)
                if pos + width > total:
                    raise _truncated(index, start, total)
                argument = int.from_bytes(view[pos : pos + width], "big")
                pos += width
            else:
                raise _malformed(index, f"invalid CBOR additional information {info}")
            if major in (2, 3):
                if argument > MAX_RECORD_BYTES:
                    raise _malformed(
                        index, f"a string declares {argument} bytes, over the record limit"
                    )
                pos += argument
                if pos > total:
                    raise _truncated(index, start, total)
            elif major in (4, 5):
                if argument > MAX_RECORD_BYTES:
                    raise _malformed(
                        index, f"a container declares {argument} items, over the record limit"
                    )
                if argument:
                    stack.append(argument * (2 if major == 5 else 1))
            elif major == 6:
                stack.append(1)  # a tag wraps exactly one item
            # majors 0, 1 and 7 carry their value in the header
        if len(stack) > _MAX_DEPTH:
            raise _malformed(index, f"CBOR nesting deeper than {_MAX_DEPTH} levels")
        if pos - start > MAX_RECORD_BYTES:
            raise _malformed(index, f"record exceeds {MAX_RECORD_BYTES} bytes")
    return pos - start
