"""Resumable, content-addressed upload of one file of a proof directory.

A file the platform already holds for the experiment (same SHA-256 and kind) is
deduplicated, never sent. Otherwise an upload is opened with the file's size and digest
and its parts are sent with ``X-Part-SHA256`` (or, for a direct upload, straight to
object storage at a presigned URL); an interrupted upload asks the platform which parts
it has and sends only the missing or different ones, then completes. Each step is
recorded in the directory's manifest (``dvbench._manifest``). A part is read from the
file piece by piece, as it is hashed and as it is sent, so memory stays one piece per
part in flight whatever the file's size.

:class:`FileUploader` holds these steps; ``dvbench._sync.Uploader`` builds the whole
directory's upload on them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import httpx

from dvbench._contracts import Api
from dvbench._exceptions import (
    APIError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    UploadError,
)
from dvbench._manifest import Manifest, kind_of, sha256_file, utc_timestamp
from dvbench._progress import Progress
from dvbench._result import SyncResult

__all__ = ["FileUploader"]

log = logging.getLogger("dvbench")

#: Pieces a part is read and sent in: the memory one part in flight takes.
STREAM_CHUNK = 1024 * 1024
#: Parts of one file in flight at once, by default, when they go straight to object
#: storage (to the platform they go one at a time, in order: ``Settings.parallel``).
DIRECT_PARALLEL = 4
#: Refusals of a completion whose upload the platform failed and discarded: the bytes
#: that arrived were not the file's (changed meanwhile, or damaged in transit), so a
#: fresh upload sends them again.
RESEND_CODES = frozenset({"blob_digest_mismatch", "part_digest_mismatch", "incomplete_body"})
#: How long a completion may take to answer: the platform checks the transcript's
#: identity (and, with tasks run in-process, verifies it) before it answers.
COMPLETE_TIMEOUT = httpx.Timeout(300.0, connect=10.0)


def _range_digest(descriptor: int, offset: int, size: int) -> str:
    """SHA-256 of ``size`` bytes of an open file from ``offset``, one reused buffer."""
    digest = hashlib.sha256()
    buffer = bytearray(min(STREAM_CHUNK, max(size, 1)))
    view = memoryview(buffer)
    done = 0
    while done < size:
        want = min(len(buffer), size - done)
        count = os.preadv(descriptor, [view[:want]], offset + done)
        if count == 0:
            raise UploadError(f"the file ended {size - done} bytes early; was it truncated?")
        digest.update(view[:count])
        done += count
    return digest.hexdigest()


class _FileRange:
    """``size`` bytes of an open file from ``offset``, read piece by piece as httpx sends.

    Iterable again for each attempt, so a retried request reads the part from the file
    again instead of keeping it in memory.
    """

    def __init__(self, descriptor: int, offset: int, size: int) -> None:
        self.descriptor, self.offset, self.size = descriptor, offset, size

    def __iter__(self) -> Iterator[bytes]:
        done = 0
        while done < self.size:
            piece = os.pread(
                self.descriptor, min(STREAM_CHUNK, self.size - done), self.offset + done
            )
            if not piece:
                raise UploadError(
                    f"the file ended {self.size - done} bytes early; was it truncated?"
                )
            done += len(piece)
            yield piece


class FileUploader:
    """Sends files of one proof directory, each resumed or deduplicated, step by step.

    Safe to use from several threads at once, each uploading its own files. The steps of
    one file; :class:`~dvbench._sync.Uploader` adds those of the whole directory and
    documents the arguments.
    """

    def __init__(
        self,
        client: Api,
        manifest: Manifest,
        progress: Progress | None = None,
        *,
        parallel: int | None = None,
    ) -> None:
        self.client = client
        self.manifest = manifest
        self.directory = manifest.directory
        self.progress = progress or Progress(enabled=False)
        configured = (
            parallel if parallel is not None else getattr(client.settings, "parallel", None)
        )
        self.parallel = None if configured is None else max(1, int(configured))
        self._known: dict[tuple[str, str], int | None] | None = None
        self._local_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._inflight: dict[tuple[str, str], threading.Event] = {}
        self._result = SyncResult(self.directory, manifest.experiment)

    def _entry(self, relative: str) -> dict[str, Any]:
        path = self.directory / relative
        stat = path.stat()
        entry = self.manifest.files.get(relative)
        if entry is not None and entry.get("status") in ("complete", "deduplicated", "empty"):
            return entry
        if (
            entry is None
            or entry.get("size") != stat.st_size
            or entry.get("mtime_ns") != stat.st_mtime_ns
        ):
            digest = sha256_file(path) if stat.st_size else hashlib.sha256().hexdigest()
            if entry is not None and entry.get("sha256") != digest:
                entry = None  # the file changed: an earlier upload of it is of no use
            entry = {
                **(entry or {}),
                "kind": kind_of(relative),
                "size": stat.st_size,
                "sha256": digest,
                "mtime_ns": stat.st_mtime_ns,
            }
            entry.setdefault("status", "pending")
            entry.setdefault("parts", {})
            if stat.st_size == 0:
                # The platform stores no empty blobs; an empty state tree's file is
                # implied by its schema, so there is nothing to send.
                entry["status"] = "empty"
            self.manifest.put(relative, entry)
        return entry

    def known(self) -> dict[tuple[str, str], int | None]:
        """``(sha256, kind) -> proof id`` of completed uploads of this experiment."""
        if self._known is None:
            known: dict[tuple[str, str], int | None] = {}
            for upload in self.client.paginate(
                "uploads/", {"experiment": self.manifest.experiment, "status": "complete"}
            ):
                digest = upload.get("blob_sha256") or upload.get("sha256")
                if digest:
                    known[(str(digest), str(upload.get("kind")))] = upload.get("proof")
            self._known = known
        return self._known

    def upload(self, relative: str) -> None:
        """Send one file, resuming or deduplicating; records each step in the manifest."""
        entry = self._entry(relative)
        if entry.get("status") in ("complete", "deduplicated", "empty"):
            return
        key = (str(entry["sha256"]), str(entry["kind"]))
        while True:
            with self._count_lock:
                known = not entry.get("upload_id") and key in self.known()
                leader = None if known else self._inflight.get(key)
                if not known and leader is None:
                    self._inflight[key] = threading.Event()
            if known:
                self.manifest.change(entry, status="deduplicated", proof=self.known()[key])
                self.progress.dedup(int(entry["size"]))
                self._count(files_deduplicated=1, bytes_deduplicated=int(entry["size"]))
                return
            if leader is None:
                break
            # Another thread is sending the same bytes: wait, then deduplicate (or, if
            # it failed, send them here).
            leader.wait()
        try:
            self.progress.label(relative)
            for _ in range(3):
                if self._send(relative, entry):
                    break
                # Start over from the file as it is now (re-hashed if it changed).
                entry = self._entry(relative)
            else:
                raise UploadError(
                    f"{relative}: the platform refused to complete its upload three times",
                    directory=str(self.directory),
                )
            self.known()[key] = entry.get("proof")
            self._count(files_uploaded=1)
        finally:
            with self._count_lock:
                self._inflight.pop(key).set()

    def _count(self, **counts: int) -> None:
        with self._count_lock:
            for name, value in counts.items():
                setattr(self._result, name, getattr(self._result, name) + value)

    def _open(self, relative: str, entry: dict[str, Any]) -> tuple[bool, dict[int, str], Any]:
        """``(complete, parts the platform holds, proof)``, opening an upload if needed."""
        upload_id = entry.get("upload_id")
        if upload_id:
            try:
                state = self.client.get(f"uploads/{upload_id}/")
            except NotFoundError:
                state = None
            if state is not None and state.get("status") == "complete":
                return True, {}, state.get("proof")
            if state is not None and state.get("status") in ("open", "completing"):
                if not entry.get("part_size"):
                    self.manifest.change(entry, part_size=self._part_size(state))
                if bool(state.get("direct")) != bool(entry.get("direct")):
                    self.manifest.change(entry, direct=bool(state.get("direct")))
                parts = {int(p["number"]): str(p["sha256"]) for p in state.get("parts", [])}
                return False, parts, None
            # Aborted, failed or expired: start again with a new upload.
            self.manifest.change(entry, drop=("upload_id",), parts={})
        created = self.client.post(
            "uploads/",
            {
                "experiment": self.manifest.experiment,
                "kind": entry["kind"],
                "size": entry["size"],
                "sha256": entry["sha256"],
                # Not read by the platform yet; names the file for the artifact list.
                "name": relative,
            },
        )
        self.manifest.change(
            entry,
            upload_id=created["id"],
            part_size=self._part_size(created),
            direct=bool(created.get("direct")),
            parts={},
            status="uploading",
        )
        return False, {}, None

    def _part_size(self, upload: dict[str, Any]) -> int:
        """``DVBENCH_PART_SIZE`` within the upload's bounds (a direct upload's parts but
        the last are at least object storage's least part size, 5 MiB)."""
        wanted = int(self.client.settings.part_size)
        limit = int(upload.get("max_part_bytes") or wanted)
        least = int(upload.get("min_part_bytes") or 1)
        return max(least, min(wanted, limit))

    def _send(self, relative: str, entry: dict[str, Any]) -> bool:
        """One attempt at sending and completing; False if it must start over."""
        complete, server, proof = self._open(relative, entry)
        if complete:
            self._completed(entry, {"proof": proof})
            return True
        size, part_size = int(entry["size"]), int(entry["part_size"])
        count = max(1, -(-size // part_size))
        descriptor = os.open(self.directory / relative, os.O_RDONLY)
        try:
            numbers = range(1, count + 1)
            parallel = self.parts_in_flight(entry)
            if parallel <= 1 or count == 1:
                for number in numbers:
                    self._send_part(descriptor, entry, number, part_size, server)
            else:
                # One part in memory per thread: ``parallel`` parts at most.
                with ThreadPoolExecutor(
                    min(parallel, count), thread_name_prefix="dvbench-part"
                ) as pool:
                    futures = [
                        pool.submit(self._send_part, descriptor, entry, n, part_size, server)
                        for n in numbers
                    ]
                    wait(futures, return_when=FIRST_EXCEPTION)
                    for future in futures:
                        future.cancel()
                for future in futures:
                    if not future.cancelled() and future.exception() is not None:
                        raise future.exception()  # type: ignore[misc]
        finally:
            os.close(descriptor)
        return self._complete(relative, entry)

    def parts_in_flight(self, entry: dict[str, Any]) -> int:
        """How many of the file's parts go at once: as configured, or by default 1 to
        the platform (parts in order are written in place) and
        :data:`DIRECT_PARALLEL` straight to object storage."""
        if self.parallel is not None:
            return self.parallel
        return DIRECT_PARALLEL if entry.get("direct") else 1

    def _send_part(
        self,
        descriptor: int,
        entry: dict[str, Any],
        number: int,
        part_size: int,
        server: dict[int, str],
    ) -> None:
        """Hash and send part ``number`` (unless the platform holds it already).

        The part is read twice from the file, in ``STREAM_CHUNK`` pieces: once to hash it,
        once as it is sent (and again by a retry, which the client makes with backoff;
        sending a part again replaces it). Memory is one piece per part in flight, whatever
        the part and file sizes. ``pread`` lets the threads share one descriptor.
        """
        offset = (number - 1) * part_size
        sent = max(0, min(part_size, int(entry["size"]) - offset))
        digest = _range_digest(descriptor, offset, sent)
        if server.get(number) == digest:
            self.progress.skip(sent)
            self._count(bytes_resumed=sent)
            return
        if entry.get("direct"):
            self._put_direct(entry, number, _FileRange(descriptor, offset, sent), digest)
        else:
            self.client.request(
                "PUT",
                f"uploads/{entry['upload_id']}/parts/{number}/",
                content=_FileRange(descriptor, offset, sent),
                headers={
                    "X-Part-SHA256": digest,
                    "Content-Type": "application/octet-stream",
                    "Content-Length": str(sent),
                },
            )
        self.manifest.add_part(entry, number, digest)
        self.progress.add(sent)
        self._count(bytes_sent=sent)

    def _put_direct(
        self, entry: dict[str, Any], number: int, body: _FileRange, digest: str
    ) -> None:
        """Send a part of a direct upload straight to object storage.

        The platform declares the part (its size and SHA-256) and answers with a
        presigned URL bound to them; the bytes go to object storage, never through the
        platform. Retried with backoff like any request; a URL that expired while the
        part waited (403) is asked for again once.
        """
        for attempt in range(2):
            issued = self.client.post(
                f"uploads/{entry['upload_id']}/parts/{number}/url/",
                {"size": body.size, "sha256": digest},
            )
            try:
                self.client.put_presigned(
                    str(issued["url"]), content=body, headers=dict(issued.get("headers") or {})
                )
                return
            except APIError as error:
                if error.status_code != 403 or attempt:
                    raise

    def _complete(self, relative: str, entry: dict[str, Any]) -> bool:
        upload_id = entry["upload_id"]
        deadline = time.monotonic() + COMPLETE_TIMEOUT.read  # type: ignore[operator]
        while True:
            try:
                done = self.client.post(f"uploads/{upload_id}/complete/", timeout=COMPLETE_TIMEOUT)
            except (BadRequestError, ConflictError) as error:
                # Missing parts are a 409 (the upload's state is at fault, not the request);
                # older platforms answered 400.
                if error.code in ("missing_parts", "size_mismatch"):
                    log.warning(
                        "dvbench: %s: %s; sending the missing parts", relative, error.message
                    )
                    return False
                if isinstance(error, BadRequestError) and error.code in RESEND_CODES:
                    # The platform discarded the parts; if the file changed meanwhile its
                    # new digest starts a new upload, else the bytes were corrupted in
                    # transit and a fresh attempt resends them.
                    self.manifest.change(
                        entry, drop=("upload_id",), parts={}, status="pending", mtime_ns=None
                    )
                    return False
                if isinstance(error, BadRequestError):
                    raise
                state = (
                    (error.detail or {}).get("status") if isinstance(error.detail, dict) else None
                )
                if state == "completing" and time.monotonic() < deadline:
                    # Another request (a retry of ours) is assembling it: wait for it.
                    time.sleep(0.5)
                    current = self.client.get(f"uploads/{upload_id}/")
                    if current.get("status") == "complete":
                        done = current
                        break
                    continue
                self.manifest.change(entry, drop=("upload_id",), parts={}, status="pending")
                return False
            break
        self._completed(entry, done or {})
        return True

    def _completed(self, entry: dict[str, Any], state: dict[str, Any]) -> None:
        self.manifest.change(
            entry, status="complete", proof=state.get("proof"), completed=utc_timestamp()
        )
