"""Resumable, content-addressed upload of a proof directory, and its sync manifest.

A proof directory holds what ZKDV wrote (``records.cborl``, ``probes.bin``, the program
artifact, ``files/`` with snapshot and batch files) and ``dvbench-sync.json``, the
manifest of what has reached the platform. The manifest is rewritten atomically after
every step of an upload (upload created, part sent, upload completed), so a dropped
connection or a killed process loses at most one part:

1. each file is hashed (SHA-256) and its kind named (transcript, artifact, snapshot,
   batch);
2. a file the platform already holds for this experiment (same digest and kind) is
   *deduplicated*: recorded, never sent;
3. otherwise an upload is opened with the file's size and digest, and its parts are
   sent with ``X-Part-SHA256``; an interrupted upload asks the platform which parts it
   has and sends only the missing or different ones;
4. the transcript goes last, so the program and files are there when its proof is
   filed; then the proof's artifact list is attached
   (``POST /api/v1/proofs/<id>/artifacts/``).

Which snapshot and batch files leave the lab is ``DVBENCH_UPLOAD_FILES``: with
``challenged`` (the default) none is sent while training; once the transcript is filed
the uploader waits for the platform to verify it and draw its challenges
(``GET /api/v1/proofs/<id>/challenges/?status=pending``), then sends only the files
those challenges name, and attaches them. The platform's replays need nothing else, so
the rest of the weights and data never leave. With ``all`` every file is sent, in the
background while training, as before.

``dvbench sync DIR`` runs the same steps on a directory left by offline mode or by an
interrupted process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from dvbench._exceptions import (
    APIError,
    BadRequestError,
    ConflictError,
    DVBenchError,
    NotFoundError,
    UploadError,
)
from dvbench._progress import Progress, ProgressCallback, format_bytes

if TYPE_CHECKING:
    from dvbench._client import Client
    from dvbench._verdict import Verdict

__all__ = [
    "MANIFEST",
    "Manifest",
    "SyncResult",
    "Uploader",
    "kind_of",
    "pending_directories",
    "sync_directory",
]

log = logging.getLogger("dvbench")

MANIFEST = "dvbench-sync.json"
LOCK = ".dvbench-sync.lock"
FORMAT = "dvbench.sync/v1"
TRANSCRIPT = "records.cborl"
HASH_CHUNK = 1024 * 1024
#: Pieces a part is read and sent in: the memory one part in flight takes.
STREAM_CHUNK = 1024 * 1024
#: Refusals of a completion whose upload the platform failed and discarded: the bytes
#: that arrived were not the file's (changed meanwhile, or damaged in transit), so a
#: fresh upload sends them again.
RESEND_CODES = frozenset({"blob_digest_mismatch", "part_digest_mismatch", "incomplete_body"})
#: How long a completion may take to answer: the platform checks the transcript's
#: identity (and, with tasks run in-process, verifies it) before it answers.
COMPLETE_TIMEOUT = httpx.Timeout(300.0, connect=10.0)


def kind_of(relative: str) -> str | None:
    """The platform's artifact kind for a file of a proof directory (None: not uploaded)."""
    name = relative.rsplit("/", 1)[-1]
    if name.endswith((".partial", ".tmp")) or name in (MANIFEST, LOCK):
        return None
    if relative == TRANSCRIPT:
        return "transcript"
    if relative.startswith("files/"):
        if name.startswith("snapshot-") and name.endswith(".bin"):
            return "snapshot"
        if name.startswith("batch-") and name.endswith(".u32"):
            return "batch"
        if name.startswith("grad-") and name.endswith(".bin"):
            return "gradient"
        return None
    if relative == "probes.bin" or name.startswith("program."):
        return "artifact"
    # The final model (DVBenchProof.save_model): weights, signature, public key.
    model_file = name.endswith(".safetensors") or name in ("model.sig", "model-signing.pub")
    if relative.startswith("model/") and relative.count("/") == 1 and model_file:
        return "artifact"
    return None


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


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Manifest:
    """``dvbench-sync.json``: the experiment a proof belongs to, and each file's upload state.

    Attributes:
        data: the JSON document; ``files`` maps a relative path to
            ``{kind, size, sha256, mtime_ns, status, upload_id, part_size, parts}``
            where ``status`` is ``pending``, ``uploading``, ``complete``,
            ``deduplicated`` or ``empty`` and ``parts`` maps part numbers to digests sent.
    """

    def __init__(self, directory: Path, data: dict[str, Any]) -> None:
        self.directory = directory
        self.path = directory / MANIFEST
        self.data = data
        self._lock = threading.RLock()

    @classmethod
    def create(
        cls,
        directory: Path,
        *,
        experiment: str,
        spec_digest: str,
        backend: str | None,
        base_url: str | None,
        ephemeral: bool,
        spec: dict[str, Any] | None = None,
    ) -> Manifest:
        manifest = cls(
            directory,
            {
                "format": FORMAT,
                "experiment": experiment,
                "spec_digest": spec_digest,
                "spec": spec,
                "backend": backend,
                "base_url": base_url,
                "ephemeral": ephemeral,
                "finished": False,
                "created": _now(),
                "files": {},
                "proof": None,
                "attached": None,
                "synced": None,
            },
        )
        manifest.save()
        return manifest

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UploadError(
                f"{directory} has no {MANIFEST}: it is not a proof directory written by "
                "dvbench (a proof made with zkdv alone: `dvbench sync DIR --experiment "
                "owner/name`)",
                directory=str(directory),
            ) from None
        except ValueError as error:
            raise UploadError(
                f"{path} is not valid JSON: {error}", directory=str(directory)
            ) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UploadError(f"{path} is not a {FORMAT} manifest", directory=str(directory))
        return cls(directory, data)

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = self.data.setdefault("files", {})
        return files

    @property
    def experiment(self) -> str:
        return str(self.data["experiment"])

    def save(self) -> None:
        """Write atomically: a crash leaves the previous or the new manifest, never half."""
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{MANIFEST}.{os.getpid()}.{threading.get_ident()}")
            temporary.write_text(json.dumps(self.data, indent=1, sort_keys=True))
            os.replace(temporary, self.path)

    def update(self, **values: Any) -> None:
        with self._lock:
            self.data.update(values)
            self.save()

    def change(self, entry: dict[str, Any], *, drop: tuple[str, ...] = (), **values: Any) -> None:
        """Change one file's entry and save, under the lock: uploader threads share it."""
        with self._lock:
            for key in drop:
                entry.pop(key, None)
            entry.update(values)
            self.save()

    def add_part(self, entry: dict[str, Any], number: int, digest: str) -> None:
        with self._lock:
            entry.setdefault("parts", {})[str(number)] = digest
            self.save()

    def put(self, relative: str, entry: dict[str, Any]) -> None:
        with self._lock:
            self.files[relative] = entry
            self.save()


@dataclass
class SyncResult:
    """What a sync (or :meth:`DVBenchProof.finish`) did.

    Attributes:
        directory: the proof directory (removed afterwards if ``released``).
        experiment: ``owner/name``.
        proof_id: the platform's id of the filed proof, once the transcript is uploaded.
        complete: every file, the transcript included, is on the platform.
        offline: nothing was sent (offline mode); ``directory`` waits for ``dvbench sync``.
        verdict: the proof's :class:`~dvbench.Verdict` when it was asked for (PASSED,
            FAILED with the failed claims, pending, error); None before the proof is filed.
    """

    directory: Path
    experiment: str
    proof_id: int | None = None
    proof_url: str | None = None
    complete: bool = False
    offline: bool = False
    released: bool = False
    attached: bool | None = None
    files_uploaded: int = 0
    files_deduplicated: int = 0
    challenged_files: int | None = None
    bytes_sent: int = 0
    bytes_deduplicated: int = 0
    bytes_resumed: int = 0
    notes: list[str] = field(default_factory=list)
    verdict: Verdict | None = None

    def summary(self) -> str:
        if self.offline:
            return (
                f"dvbench: offline; proof of {self.experiment} kept in {self.directory}\n"
                f"  upload it later with: dvbench sync {self.directory}"
            )
        text = (
            f"dvbench: {self.experiment}: sent {self.files_uploaded} file(s), "
            f"{format_bytes(self.bytes_sent)}"
        )
        if self.files_deduplicated:
            text += (
                f"; {self.files_deduplicated} already on the platform "
                f"({format_bytes(self.bytes_deduplicated)} deduplicated)"
            )
        if self.bytes_resumed:
            text += f"; resumed {format_bytes(self.bytes_resumed)}"
        if self.challenged_files is not None:
            text += f"; answered challenges with {self.challenged_files} file(s)"
        if self.proof_id is not None:
            text += f"; proof {self.proof_id}"
            if self.proof_url:
                text += f" at {self.proof_url}"
        if self.verdict is not None:
            text += "\n" + self.verdict.summary()
        return text


def _flock(handle: Any, exclusive: bool) -> None:
    if sys.platform == "win32":  # pragma: no cover - the in-process lock still holds
        return
    import fcntl

    fcntl.flock(handle.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_UN)


@contextlib.contextmanager
def _directory_lock(directory: Path, local: threading.Lock) -> Iterator[None]:
    """One uploader per directory: this process's threads, and other processes (POSIX)."""
    with local:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / LOCK, "a+b") as handle:
            _flock(handle, True)
            try:
                yield
            finally:
                _flock(handle, False)


class Uploader:
    """Uploads the files of one proof directory; safe to run again at any point.

    Args:
        client: an online :class:`~dvbench.Client`.
        manifest: the directory's manifest (created or loaded).
        progress: where to count bytes (a quiet one if None).
        parallel: parts of one file in flight at once (default: the client's
            ``settings.parallel``, ``DVBENCH_UPLOAD_PARALLEL``).
    """

    def __init__(
        self,
        client: Client,
        manifest: Manifest,
        progress: Progress | None = None,
        *,
        parallel: int | None = None,
    ) -> None:
        self.client = client
        self.manifest = manifest
        self.directory = manifest.directory
        self.progress = progress or Progress(enabled=False)
        configured = parallel if parallel is not None else getattr(client.settings, "parallel", 1)
        self.parallel = max(1, int(configured))
        self._known: dict[tuple[str, str], int | None] | None = None
        self._local_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._inflight: dict[tuple[str, str], threading.Event] = {}
        self._result = SyncResult(self.directory, manifest.experiment)

    @property
    def challenged_only(self) -> bool:
        """Whether only the files the platform's challenges ask for are sent."""
        return str(getattr(self.client.settings, "upload_files", "all")) == "challenged"

    # --- discovery ----------------------------------------------------------------------
    def scan(self, *, final: bool) -> list[str]:
        """Files to consider, in upload order: ``files/`` first, the transcript last.

        While training (``final=False``) only ``files/`` is scanned: those files are
        written atomically and never change, while the transcript, probes and program
        are still being written.
        """
        found: list[str] = []
        files_dir = self.directory / "files"
        if files_dir.is_dir():
            found += sorted(f"files/{p.name}" for p in files_dir.iterdir() if p.is_file())
        if self.challenged_only:
            found = []  # sent when, and only if, a challenge asks for them
        if final:
            found += sorted(
                p.name for p in self.directory.iterdir() if p.is_file() and p.name != TRANSCRIPT
            )
            model_dir = self.directory / "model"
            if model_dir.is_dir():
                found += sorted(f"model/{p.name}" for p in model_dir.iterdir() if p.is_file())
            if (self.directory / TRANSCRIPT).is_file():
                found.append(TRANSCRIPT)
        return [name for name in found if kind_of(name) is not None]

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

    # --- one file -----------------------------------------------------------------------
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
            if self.parallel <= 1 or count == 1:
                for number in numbers:
                    self._send_part(descriptor, entry, number, part_size, server)
            else:
                # One part in memory per thread: ``parallel`` parts at most.
                with ThreadPoolExecutor(
                    min(self.parallel, count), thread_name_prefix="dvbench-part"
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
        self.manifest.change(entry, status="complete", proof=state.get("proof"), completed=_now())

    # --- the whole directory ------------------------------------------------------------
    def run(self, *, final: bool) -> SyncResult:
        """Upload what is there; with ``final``, the transcript too, then attach the files.

        Raises:
            UploadError: the run has not finished (``final`` on an unfinished run), or a
                file could not be uploaded.
            APIError, NetworkError: as the platform answered, after retries.
        """
        with _directory_lock(self.directory, self._local_lock):
            if final and not self.manifest.data.get("finished"):
                raise UploadError(
                    f"the run in {self.directory} has not finished (its transcript was never "
                    "closed), so the platform would reject it; finish() it, or sync files "
                    "only with `dvbench sync --partial`",
                    directory=str(self.directory),
                )
            names = self.scan(final=final)
            if names:
                self._prepare_experiment()
            if final:
                done = ("complete", "deduplicated", "empty")
                self.progress.total = sum(
                    (self.directory / n).stat().st_size
                    for n in names
                    if self.manifest.files.get(n, {}).get("status") not in done
                )
            others = [name for name in names if name != TRANSCRIPT]
            if others:
                self.known()  # listed once, before the workers share it
                self._upload_all(others)
            if final and TRANSCRIPT in names:
                self.upload(TRANSCRIPT)
                entry = self.manifest.files[TRANSCRIPT]
                proof = entry.get("proof")
                self.manifest.update(proof=proof)
                self._result.proof_id = int(proof) if proof is not None else None
                answered = self._answer() if self.challenged_only else True
                self._attach()
                self._result.complete = answered
                if answered:
                    self.manifest.update(synced=_now())
            self._result.attached = (
                self.manifest.data.get("attached") is True
                if self.manifest.data.get("attached") is not None
                else None
            )
            if self._result.proof_id is not None:
                # The proof's page in the web UI: its verdict, steps and checks.
                self._result.proof_url = f"{self.client.base_url}/proofs/{self._result.proof_id}/"
            return self._result

    def _upload_all(self, names: list[str]) -> None:
        """Upload files on a few threads: most are small, so round trips dominate."""
        workers = min(self.client.settings.concurrency, len(names))
        if workers <= 1:
            for name in names:
                self.upload(name)
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="dvbench-upload") as pool:
            futures = [pool.submit(self.upload, name) for name in names]
            wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                future.cancel()
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def _prepare_experiment(self) -> None:
        """Register an experiment declared offline, and check the spec digest it was bound to."""
        data = self.manifest.data
        if data.get("experiment_checked"):
            return
        name, digest = self.manifest.experiment, str(data.get("spec_digest") or "")
        try:
            specs = self.client.get(f"experiments/{name}/specs/")
        except NotFoundError:
            spec = data.get("spec")
            if not spec:
                raise
            self.client.create_experiment(name, spec)
            specs = self.client.get(f"experiments/{name}/specs/")
        digests = {s.get("digest") for s in specs} if isinstance(specs, list) else set()
        if digest and digest not in digests:
            raise UploadError(
                f"the transcript is bound to spec digest {digest}, which is no version of "
                f"{name}'s declared spec; the platform would reject it. Register that spec "
                "version (e.g. with `dvbench experiments create`), or re-run the training",
                directory=str(self.directory),
            )
        self.manifest.update(experiment_checked=True)

    def _wait_for_challenges(self, proof: int) -> str:
        """Poll the proof until the platform has verified it; its status then."""
        deadline = time.monotonic() + float(getattr(self.client.settings, "challenge_wait", 0))
        pause = 0.2
        while True:
            status = str(self.client.get_proof(proof).get("status"))
            if status not in ("pending", "verifying") or time.monotonic() >= deadline:
                return status
            time.sleep(pause)
            pause = min(pause * 1.5, 2.0)

    def _answer(self) -> bool:
        """Send the files the proof's pending challenges need; False if not yet drawn.

        Returns:
            True when there is nothing (more) to answer: the challenges' files are sent,
            or the proof has no challenges (no program to replay, or already final).
        """
        proof = self.manifest.data.get("proof")
        if proof is None:
            return False
        status = self._wait_for_challenges(int(proof))
        if status in ("pending", "verifying"):
            note = (
                f"proof {proof} is still {status}: its challenges are not drawn yet; "
                f"run `dvbench sync {self.directory}` later to answer them"
            )
            log.warning("dvbench: %s", note)
            self._result.notes.append(note)
            return False
        if status != "challenged":
            return True
        needed: set[str] = set()
        for challenge in self.client.paginate(
            f"proofs/{int(proof)}/challenges/", {"status": "pending"}
        ):
            needed.update(str(name) for name in challenge.get("needed_files") or [])
        missing = sorted(name for name in needed if not (self.directory / name).is_file())
        if missing:
            raise UploadError(
                f"the platform's challenges of proof {proof} need {', '.join(missing)}, which "
                f"{self.directory} does not hold; unanswered, the challenges expire and the "
                "proof is rejected",
                directory=str(self.directory),
            )
        names = sorted(name for name in needed if kind_of(name) is not None)
        self._result.challenged_files = len(names)
        if names:
            self.progress.total = (self.progress.total or 0) + sum(
                (self.directory / name).stat().st_size for name in names
            )
            self.known()
            self._upload_all(names)
        return True

    def _attach(self) -> None:
        """List the proof's files on the platform, so its replays can find them.

        Sends the files not attached yet (the manifest's ``attached_files``); attaching
        is idempotent on the platform, so a retry after a lost answer is harmless.
        """
        data = self.manifest.data
        proof = data.get("proof")
        if proof is None or data.get("attached") in ("unsupported", "final"):
            return
        done = set(data.get("attached_files") or [])
        files = [
            {"name": name, "kind": e["kind"], "sha256": e["sha256"], "size": e["size"]}
            for name, e in sorted(self.manifest.files.items())
            if e.get("status") in ("complete", "deduplicated")
            and e.get("kind") != "transcript"
            and name not in done
        ]
        if not files and data.get("attached") is True:
            return
        try:
            self.client.post(f"proofs/{int(proof)}/artifacts/", {"files": files})
        except ConflictError as error:
            if error.code != "proof_final":
                raise
            # The verdict is in (a proof with nothing to replay is final at ingest):
            # its files no longer matter, and they are stored all the same.
            self.manifest.update(attached="final")
            return
        except APIError as error:
            # The proof was just filed, so a 404 or 405 means a platform without the
            # route: the files are uploaded and content-addressed all the same.
            if error.status_code in (404, 405):
                if data.get("attached") != "unsupported":
                    log.info("dvbench: this platform has no proof artifact list; skipped")
                self.manifest.update(attached="unsupported")
                return
            raise
        self.manifest.update(
            attached=True, attached_files=sorted(done | {str(f["name"]) for f in files})
        )


def release(directory: Path) -> None:
    """Remove a synced temporary proof directory."""
    shutil.rmtree(directory, ignore_errors=True)


def sync_directory(
    client: Client,
    directory: Path,
    *,
    progress: bool | None = None,
    partial: bool = False,
    experiment: str | None = None,
    wait: bool = False,
    timeout: float = 1800.0,
    parallel: int | None = None,
    on_progress: ProgressCallback | None = None,
) -> SyncResult:
    """Upload a proof directory incrementally; see the module docstring.

    Args:
        client: an online client.
        directory: a proof directory with ``dvbench-sync.json`` (or, with ``experiment``,
            a proof directory written by zkdv alone).
        progress: draw the progress bar (default: when stderr is a terminal).
        partial: upload the files of an unfinished run, not its transcript.
        experiment: ``owner/name`` for a directory without a manifest; its spec digest is
            read from the transcript's root record.
        wait: wait (up to ``timeout`` seconds) for the certificate, answering challenges
            drawn meanwhile; ``result.verdict`` says PASSED, FAILED, error or pending.
            Without it the verdict is asked once (usually still pending).
        parallel: parts of one file in flight at once (default
            ``DVBENCH_UPLOAD_PARALLEL``, 1: in order).
        on_progress: called as ``on_progress(done, total)`` in bytes after every part
            sent or found on the platform and every deduplicated file, from the
            uploading threads.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise UploadError(f"{directory} is not a directory", directory=str(directory))
    if not (directory / MANIFEST).exists() and experiment is not None:
        _adopt(directory, experiment, client.base_url)
    manifest = Manifest.load(directory)
    if client.offline:
        return SyncResult(directory, manifest.experiment, offline=True)
    bar = Progress(enabled=progress, callback=on_progress)
    uploader = Uploader(client, manifest, bar, parallel=parallel)
    try:
        result = uploader.run(final=not partial)
    except DVBenchError as error:
        bar.close()
        if not isinstance(error, UploadError):
            error.add_note(
                f"The proof is kept in {directory}; run `dvbench sync {directory}` again to "
                "resume the upload."
            )
        raise
    bar.close()
    if not partial:
        settle(client, uploader, result, wait=wait, timeout=timeout)
    if result.complete and manifest.data.get("ephemeral"):
        release(directory)
        result.released = True
    return result


def settle(
    client: Client, uploader: Uploader, result: SyncResult, *, wait: bool, timeout: float
) -> Verdict | None:
    """Set ``result.verdict``: asked once, or (``wait``) polled until final or ``timeout``.

    While waiting, challenges the platform draws meanwhile are answered (the directory is
    still there: it is released only afterwards). Never raises for the verdict itself: a
    failure to ask is a note, and the caller decides what FAILED means.
    """
    if result.proof_id is None:
        return None
    if not wait:
        try:
            result.verdict = client.verdict(result.proof_id)
        except DVBenchError as error:
            note = f"could not ask for the verdict of proof {result.proof_id}: {error}"
            log.warning("dvbench: %s", note)
            result.notes.append(note)
        return result.verdict
    uploader.progress = Progress(enabled=False)

    def answer() -> None:
        if not result.complete:
            uploader.run(final=True)

    result.verdict = client.wait_for_verdict(result.proof_id, timeout=timeout, poll=answer)
    return result.verdict


def _adopt(directory: Path, experiment: str, base_url: str) -> None:
    """Write a manifest for a proof directory written by zkdv without dvbench."""
    from zkdv.records import iter_records

    transcript = directory / TRANSCRIPT
    if not transcript.is_file():
        raise UploadError(f"{directory} holds no {TRANSCRIPT}", directory=str(directory))
    with open(transcript, "rb") as handle:
        first = next(iter_records(handle.read(16 * 1024 * 1024)), None)
    root = first.data if first is not None and isinstance(first.data, dict) else {}
    bound = root.get("experiment") if isinstance(root.get("experiment"), dict) else None
    if not bound or bound.get("name") != experiment:
        raise UploadError(
            f"{transcript} is bound to experiment "
            f"{(bound or {}).get('name')!r}, not {experiment!r}: a transcript can only be "
            "filed under the experiment it was bound to before its first step",
            directory=str(directory),
        )
    manifest = Manifest.create(
        directory,
        experiment=experiment,
        spec_digest=str(bound.get("spec_digest") or ""),
        backend=str(root.get("prover", "")).removeprefix("whitebox-") or None,
        base_url=base_url,
        ephemeral=False,
    )
    manifest.update(finished=True)


def pending_directories(root: Path, *, finished: bool | None = None) -> list[Path]:
    """Proof directories under ``root`` (the cache's ``runs/``) not yet fully synced.

    Args:
        finished: only runs whose ``finish()`` closed the transcript (True), only runs
            that never got there (False), or both (None).
    """
    if not root.is_dir():
        return []
    found = []
    for manifest in sorted(root.rglob(MANIFEST)):
        try:
            data = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("synced"):
            continue
        if finished is None or bool(data.get("finished")) == finished:
            found.append(manifest.parent)
    return found
