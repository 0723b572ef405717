"""The transparency log: appends, checkpoints, proofs, bundles, and re-verifying it all.

The cryptography is ``dvbench.attest`` (RFC 9162 trees, signed-note checkpoints, bundles);
this module decides *where* a certificate is logged and serves what auditors check.

Appends are serialised: a PostgreSQL advisory lock held to the end of the transaction
(:func:`~attestations.certificates.keys.lock_log`; SQLite runs every write transaction
``BEGIN IMMEDIATE``, which serialises them too), and ``LogEntry.index`` is unique as a
last line of defence. The index is reserved before signing (:func:`next_index`), because
the certificate names its own log entry; a checkpoint is signed at every append, so every
tree size has one.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from attestations.certificates.claims import lineage_total, whole_claim
from attestations.certificates.keys import key_row, log_origin, trusted_key
from attestations.certificates.models import (
    Certificate,
    LogCheckpoint,
    LogEntry,
    PlatformKey,
    TrustRootVersion,
)
from dvbench.attest import (
    AttestationError,
    Checkpoint,
    MerkleTree,
    SigningKey,
    TrustRoot,
    canonical_json,
    entry_body,
    inclusion_promise_payload,
    leaf_hash,
    make_bundle,
    make_sigstore_bundle,
    note_key_id,
    sign_checkpoint,
    to_seconds,
    verify_certificate,
    verify_checkpoint,
)

__all__ = [
    "LogCorruptError",
    "LogRangeError",
    "LogReport",
    "append",
    "bundle_for",
    "consistency",
    "inclusion",
    "latest_checkpoint",
    "next_index",
    "reset_tree",
    "sigstore_bundle_for",
    "verify_log",
]


class LogCorruptError(Exception):
    """The stored log contradicts itself (a missing index, a root that does not match)."""


# --- the cached tree ------------------------------------------------------------------


class _TreeCache:
    """The Merkle tree of the committed log, kept per process and topped up on use.

    Rebuilding costs O(n) hashes; topping up costs one query. The cached tree is checked
    against the stored hash of its last leaf, so a rolled-back append (whose leaf the
    issuing transaction added here) is noticed and the tree rebuilt.
    """

    def __init__(self) -> None:
        self._tree = MerkleTree()
        self.lock = threading.Lock()

    def synced(self) -> MerkleTree:
        """The tree of every stored leaf (hold :attr:`lock`)."""
        tree = self._tree
        if tree.size:
            last = (
                LogEntry.objects.filter(index=tree.size - 1)
                .values_list("leaf_hash", flat=True)
                .first()
            )
            if last != tree.leaf(tree.size - 1).hex():
                tree = MerkleTree()
        rows = (
            LogEntry.objects.filter(index__gte=tree.size)
            .order_by("index")
            .values_list("index", "leaf_hash")
        )
        for index, value in rows.iterator():
            if index != tree.size:
                raise LogCorruptError(
                    f"log entry {tree.size} is missing (the next stored is {index})"
                )
            tree.append(bytes.fromhex(value))
        self._tree = tree
        return tree

    def reset(self) -> None:
        with self.lock:
            self._tree = MerkleTree()


_TREE = _TreeCache()


# --- appending --------------------------------------------------------------------------


def next_index() -> int:
    """The index the next entry will take (hold the lock until it is appended)."""
    return LogEntry.objects.count()


def append(
    index: int,
    leaf: bytes,
    envelope: Mapping[str, Any],
    *,
    inclusion_promise: bytes,
    rfc3161_timestamp: bytes,
    key: SigningKey,
    moment: datetime,
    origin: str,
) -> LogEntry:
    """Store entry ``index`` and sign the checkpoint of the tree it completes (hold the lock).

    Raises:
        LogCorruptError: the stored log does not end at the new entry.
    """
    entry = LogEntry.objects.create(
        index=index,
        leaf=leaf.decode("utf-8"),
        leaf_hash=leaf_hash(leaf).hex(),
        envelope_json=canonical_json(envelope).decode("utf-8"),
        inclusion_promise=base64.b64encode(inclusion_promise).decode("ascii"),
        rfc3161_timestamp=base64.b64encode(rfc3161_timestamp).decode("ascii"),
    )
    with _TREE.lock:
        tree = _TREE.synced()
        if tree.size != index + 1:
            raise LogCorruptError(f"the log has {tree.size} entries after appending entry {index}")
        root_hash = tree.root()
    _sign_checkpoint(key, index + 1, root_hash, moment, origin)
    return entry


def reset_tree() -> None:
    """Forget the cached tree (after a rolled-back append, whose leaf it may hold)."""
    _TREE.reset()


def _sign_checkpoint(
    key: SigningKey, size: int, root_hash: bytes, moment: datetime, origin: str
) -> LogCheckpoint:
    note = sign_checkpoint(Checkpoint(origin, size, root_hash, moment), key)
    return LogCheckpoint.objects.create(
        tree_size=size, root_hash=root_hash.hex(), note=note, keyid=key.keyid, timestamp=moment
    )


# --- reading the log ----------------------------------------------------------------


def latest_checkpoint() -> LogCheckpoint | None:
    return LogCheckpoint.objects.order_by("-tree_size").first()


@contextmanager
def _tree() -> Iterator[MerkleTree]:
    with _TREE.lock:
        yield _TREE.synced()


class LogRangeError(ValueError):
    """A proof was asked for sizes or an index the log does not have.

    Attributes:
        field: the request parameter at fault.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def inclusion(index: int, tree_size: int) -> tuple[list[bytes], bytes]:
    """The RFC 9162 audit path of entry ``index`` in the tree of ``tree_size`` entries.

    Returns:
        The path (leaf to root) and the root of that tree.

    Raises:
        LogRangeError: ``tree_size`` exceeds the log, or ``index`` is not below it.
    """
    with _tree() as tree:
        if tree_size > tree.size:
            raise LogRangeError(
                "tree_size", f"tree_size {tree_size} exceeds the log's size {tree.size}"
            )
        if not 0 <= index < tree_size:
            raise LogRangeError("index", f"index {index} is not below tree_size {tree_size}")
        return tree.inclusion_proof(index, tree_size), tree.root(tree_size)


def consistency(first: int, second: int) -> tuple[list[bytes], bytes, bytes]:
    """The consistency proof from size ``first`` to ``second`` and both roots.

    Raises:
        LogRangeError: ``second`` exceeds the log, or ``first`` exceeds ``second``.
    """
    with _tree() as tree:
        if second > tree.size:
            raise LogRangeError("second", f"second {second} exceeds the log's size {tree.size}")
        if not 0 <= first <= second:
            raise LogRangeError("first", f"first {first} must be between 0 and second ({second})")
        return tree.consistency_proof(first, second), tree.root(first), tree.root(second)


def _log_proof(certificate: Certificate) -> tuple[LogCheckpoint, list[bytes]]:
    """The checkpoint signed at the certificate's append and the entry's path to it."""
    size = certificate.log_index + 1
    checkpoint = LogCheckpoint.objects.filter(tree_size=size).first()
    if checkpoint is None:
        raise LogCorruptError(f"the checkpoint at size {size} is missing")
    with _tree() as tree:
        if tree.size < size or tree.root(size).hex() != checkpoint.root_hash:
            raise LogCorruptError(f"checkpoint at size {size} does not match the stored log")
        return checkpoint, tree.inclusion_proof(certificate.log_index, size)


def sigstore_bundle_for(certificate: Certificate) -> dict[str, Any]:
    """The certificate as a Sigstore bundle v0.3 (``dvbench.attest._sigstore``).

    The same envelope, log entry and checkpoint as :func:`bundle_for`, so it is the
    same bytes at every download; the trust root is the auditor's own copy.

    Raises:
        LogCorruptError: the stored checkpoint's root is not the stored leaves' root.
    """
    checkpoint, path = _log_proof(certificate)
    row = key_row(checkpoint.keyid)
    entry = certificate.log_entry
    promise = entry.inclusion_promise
    return make_sigstore_bundle(
        certificate.envelope,
        log_index=certificate.log_index,
        inclusion_proof=path,
        checkpoint=checkpoint.note,
        public_key=trusted_key(row).public_key,
        kind=entry.kind,
        inclusion_promise=base64.b64decode(promise) if promise else None,
        timestamps=[base64.b64decode(entry.rfc3161_timestamp)] if entry.rfc3161_timestamp else [],
        hint=certificate.envelope["signatures"][0]["keyid"],
    )


def bundle_for(certificate: Certificate) -> dict[str, Any]:
    """The offline report bundle: envelope, inclusion proof, checkpoint, trust root.

    The checkpoint is the one signed when the certificate was appended (tree size
    ``log_index + 1``), by the same key under the same trust root, so the bundle is the
    same bytes at every download and verifies with the trust root the auditor held at
    issuance. That the log still holds the entry later is shown by a consistency proof
    from that checkpoint to any newer one (``GET log/proof/consistency/``).

    Raises:
        LogCorruptError: the stored checkpoint's root is not the stored leaves' root.
    """
    size = certificate.log_index + 1
    checkpoint, path = _log_proof(certificate)
    root = TrustRootVersion.objects.get(version=certificate.trust_root_version).trust_root()
    return make_bundle(
        certificate.envelope,
        log_index=certificate.log_index,
        inclusion_proof=path,
        checkpoint=checkpoint.note,
        tree_size=size,
        trust_root=root,
        kind=certificate.log_entry.kind,
    )


# --- re-verifying the stored log --------------------------------------------------------


@dataclass
class LogReport:
    """What :func:`verify_log` checked and every problem it found."""

    entries: int = 0
    checkpoints: int = 0
    trust_roots: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_log() -> LogReport:
    """Recompute every leaf, certificate and checkpoint from the stored rows.

    Checks: trust root versions parse and hash to their stored digest; every entry's
    stored leaf hash is the hash of its stored leaf, the envelope verifies under the
    latest trust root and names its own index and this log's origin, the leaf is the
    entry of its kind recomputed from the envelope, its signed entry timestamp (if any)
    verifies, and its
    certificate row repeats the signed facts; every checkpoint verifies and its root is
    the root recomputed from the envelopes at its size. Never raises for bad rows.
    """
    report = LogReport()
    roots = list(TrustRootVersion.objects.order_by("version"))
    report.trust_roots = len(roots)
    trust_root: TrustRoot | None = None
    for expected, row in enumerate(roots, start=1):
        if row.version != expected:
            report.problems.append(f"trust root version {expected} is missing")
        try:
            parsed = row.trust_root()
        except AttestationError as error:
            report.problems.append(f"trust root version {row.version}: {error.message}")
            continue
        if parsed.digest() != row.digest or parsed.version != row.version:
            report.problems.append(
                f"trust root version {row.version}: the stored digest {row.digest} is not the "
                f"document's ({parsed.digest()}); the row was altered"
            )
        trust_root = parsed
    if trust_root is not None:
        _check_keys(trust_root, report)
    origin = log_origin()
    certificates = {c.log_entry_id: c for c in Certificate.objects.all()}
    tree = MerkleTree()
    for entry in LogEntry.objects.order_by("index").iterator():
        report.entries += 1
        if entry.index != tree.size:
            report.problems.append(f"log entry {tree.size} is missing (next is {entry.index})")
        recomputed = leaf_hash(entry.leaf.encode("utf-8"))
        if recomputed.hex() != entry.leaf_hash:
            report.problems.append(
                f"log entry {entry.index}: the stored leaf hash {entry.leaf_hash} is not the "
                f"hash of the stored leaf ({recomputed.hex()}); the row was altered"
            )
        tree.append(recomputed)
        _check_entry(entry, certificates.get(entry.pk), trust_root, origin, report)
    for checkpoint in LogCheckpoint.objects.order_by("tree_size").iterator():
        report.checkpoints += 1
        _check_checkpoint(checkpoint, tree, trust_root, report)
    return report


def _check_keys(trust_root: TrustRoot, report: LogReport) -> None:
    # The key table decides which key may sign next; it must say what the latest
    # published trust root says, or issuance would follow a window nobody published.
    published = {key.keyid: key for key in trust_root.keys}
    stored = {row.keyid: trusted_key(row) for row in PlatformKey.objects.all()}
    for keyid in sorted(published.keys() | stored.keys()):
        if published.get(keyid) != stored.get(keyid):
            report.problems.append(
                f"signing key {keyid}: the key table and trust root version "
                f"{trust_root.version} disagree on it (missing, or another window)"
            )


def _check_entry(
    entry: LogEntry,
    row: Certificate | None,
    trust_root: TrustRoot | None,
    origin: str,
    report: LogReport,
) -> None:
    where = f"log entry {entry.index}"
    if trust_root is None:
        report.problems.append(f"{where}: no trust root to verify it with")
        return
    try:
        certificate = verify_certificate(entry.envelope, trust_root)
    except (AttestationError, ValueError) as error:
        message = error.message if isinstance(error, AttestationError) else str(error)
        report.problems.append(f"{where}: the envelope does not verify: {message}")
        return
    if certificate.log.index != entry.index or certificate.log.origin != origin:
        report.problems.append(
            f"{where}: the certificate names entry {certificate.log.index} of "
            f"{certificate.log.origin!r}"
        )
    _check_leaf(entry, trust_root, certificate.issued_at, where, report)
    if row is None:
        report.problems.append(f"{where}: no certificate row refers to it")
        return
    signed = {
        "result": certificate.result.value,
        "issued": certificate.issued_at,
        "transcript_digest": certificate.transcript_digest,
        "final_parameter_root": certificate.final_parameter_root,
        "trust_root_version": certificate.trust_root_version,
        "experiment": certificate.experiment,
        "flops": whole_claim(certificate.claims, "flops"),
        "tokens": whole_claim(certificate.claims, "tokens"),
        "lineage_flops": lineage_total(certificate.claims),
        "keyid": entry.envelope["signatures"][0]["keyid"],
    }
    for name, value in signed.items():
        stored = getattr(row, name)
        if isinstance(stored, datetime):
            stored = to_seconds(stored)
        if stored != value:
            report.problems.append(
                f"{where}: certificate {row.pk} has {name}={stored!r}, the signed certificate "
                f"says {value!r}; the row was altered"
            )


def _check_leaf(
    entry: LogEntry, trust_root: TrustRoot, issued: datetime, where: str, report: LogReport
) -> None:
    # The leaf must be the entry of its kind recomputed from the envelope (a dsse body
    # names the envelope's hashes and key), and a dsse entry's signed entry timestamp
    # must verify over it.
    envelope = entry.envelope
    key = trust_root.key(envelope["signatures"][0]["keyid"])
    if entry_body(entry.kind, envelope, key.public_key).decode("utf-8") != entry.leaf:
        report.problems.append(
            f"{where}: the stored leaf is not the {entry.kind['kind']} entry of the stored "
            "envelope; the row was altered"
        )
        return
    if not entry.inclusion_promise:
        return  # entries logged before signed entry timestamps existed
    try:
        key.verify(
            base64.b64decode(entry.inclusion_promise),
            inclusion_promise_payload(
                entry.leaf.encode("utf-8"),
                integrated_time=int(issued.timestamp()),
                log_index=entry.index,
                log_id=note_key_id(log_origin(), key.public_key),
            ),
            "signed entry timestamp",
        )
    except AttestationError as error:
        report.problems.append(f"{where}: {error.message}")


def _check_checkpoint(
    checkpoint: LogCheckpoint, tree: MerkleTree, trust_root: TrustRoot | None, report: LogReport
) -> None:
    where = f"checkpoint at size {checkpoint.tree_size}"
    if trust_root is None:
        report.problems.append(f"{where}: no trust root to verify it with")
        return
    try:
        signed = verify_checkpoint(checkpoint.note, trust_root)
    except AttestationError as error:
        report.problems.append(f"{where}: the signed note does not verify: {error.message}")
        return
    if signed.tree_size != checkpoint.tree_size or signed.root_hash.hex() != checkpoint.root_hash:
        report.problems.append(f"{where}: the row's size or root differs from its signed note")
    if signed.tree_size > tree.size:
        report.problems.append(
            f"{where}: it signs {signed.tree_size} entries, the log holds {tree.size}; "
            "entries were removed"
        )
        return
    if tree.root(signed.tree_size) != signed.root_hash:
        report.problems.append(
            f"{where}: the root recomputed from the stored envelopes differs from the signed "
            "root; an entry was altered, inserted or removed"
        )
