"""Signing keys, certificate issuance and the transparency log: the platform's service.

The cryptography is ``dvbench.attest`` (DSSE, in-toto, RFC 9162, checkpoints, bundles);
this module decides *which* key signs, *what* is certified and *where* it is logged.

Keys. The private key comes from ``DVBENCH_SIGNING_KEY_FILE`` or
``DVBENCH_SIGNING_KEY`` (production), else from ``$DVBENCH_DATA_DIR/keys/signing-key.pem``,
generated once with mode 0600. Its public half and validity window are recorded in
:class:`~attestations.certificates.models.PlatformKey`, and every change publishes a new
:class:`~attestations.certificates.models.TrustRootVersion`. A key that is not the trust
root's current key never signs (the task fails loudly instead of issuing certificates
that no verifier would accept). :func:`rotate_key` starts a new key now and ends the
old one's window at the same second.

Log. Appends are serialised: a PostgreSQL advisory lock held to the end of the
transaction (SQLite runs every write transaction ``BEGIN IMMEDIATE``, which serialises
them too), and ``LogEntry.index`` is unique as a last line of defence. The index is
reserved before signing, because the certificate names its own log entry; a checkpoint
is signed at every append, so every tree size has one.
"""

from __future__ import annotations

import base64
import importlib.metadata
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.serialization import load_pem_public_key
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.certificates.claims import compute_claims
from attestations.certificates.models import (
    Certificate,
    KeySource,
    LogCheckpoint,
    LogEntry,
    PlatformKey,
    TrustRootVersion,
)
from attestations.certificates.subjects import (
    check_model,
    file_subjects,
    guarantee_claim,
    model_claim,
    threshold_claim,
    weights_sha256,
)
from attestations.certificates.tsa import Authority, load_authority
from attestations.challenges.models import Challenge
from attestations.core.validators import SHA256_HEX
from attestations.proofs.models import Proof, ProofStatus
from dvbench.attest import (
    DEFAULT_KEY_FILENAME,
    ENV_SIGNING_KEY,
    AttestationError,
    Checkpoint,
    Claim,
    Evidence,
    Filing,
    Filings,
    KeyConfigurationError,
    LogEntryRef,
    MerkleTree,
    ReplayEvidence,
    Result,
    RunFiling,
    RunFilings,
    SigningKey,
    TrainingCertificate,
    TrustedKey,
    TrustRoot,
    canonical_json,
    dsse_entry_body,
    entry_body,
    format_time,
    inclusion_promise_payload,
    key_ids,
    leaf_hash,
    load_signing_key,
    make_bundle,
    make_sigstore_bundle,
    note_key_id,
    note_verifier_key,
    sign_certificate,
    sign_checkpoint,
    sigstore_trusted_root,
    to_seconds,
    verify_certificate,
    verify_checkpoint,
)

log = logging.getLogger(__name__)

__all__ = [
    "CERTIFIED_STATUSES",
    "NO_REPLAY_SEED",
    "CertificateNotIssuableError",
    "LogCorruptError",
    "LogRangeError",
    "LogReport",
    "bundle_for",
    "consistency",
    "current_trust_root",
    "inclusion",
    "issue_certificate",
    "latest_checkpoint",
    "log_origin",
    "rotate_key",
    "signing_key",
    "sigstore_bundle_for",
    "timestamp_authority",
    "trusted_root",
    "verifier_keys",
    "verify_log",
]

#: Proof statuses whose verdict is final and certified (``error`` is the verifier's
#: failure, not a verdict on the run, so it gets no certificate).
CERTIFIED_STATUSES: Final = frozenset({ProofStatus.VALID, ProofStatus.REJECTED})
#: The seed recorded for a run that was never challenged (rejected before replay):
#: 32 zero bytes with no challenged steps. A real seed is 32 random bytes.
NO_REPLAY_SEED: Final = "00" * 32
#: pg_advisory_xact_lock key of the log ("dvblog" in ASCII).
_LOG_LOCK: Final = 0x64_76_62_6C_6F_67
_KEY_FILE: Final = DEFAULT_KEY_FILENAME
_NEXT_KEY_FILE: Final = "next-signing-key.pem"


class CertificateNotIssuableError(Exception):
    """The proof cannot be certified (yet): its verdict is not final, or a subject is unknown."""


class LogCorruptError(Exception):
    """The stored log contradicts itself (a missing index, a root that does not match)."""


# --- configuration ----------------------------------------------------------------------


def _knob(name: str) -> str:
    value = settings.DVBENCH[name]  # type: ignore[literal-required]
    return str(value) if value else ""


def verifier_id() -> str:
    """``DVBENCH_VERIFIER_ID``: the URI naming this verifying service in certificates."""
    return _knob("VERIFIER_ID") or "https://dvbench.localhost"


def log_origin() -> str:
    """The log's name (checkpoints' first line): ``DVBENCH_LOG_ORIGIN``, else ``<host>/log``."""
    origin = _knob("LOG_ORIGIN") or f"{urlsplit(verifier_id()).netloc or 'dvbench.localhost'}/log"
    if not origin or any(character.isspace() for character in origin) or "\u2014" in origin:
        raise ImproperlyConfigured(
            f"DVBENCH_LOG_ORIGIN={origin!r} must be non-empty, without spaces or em dashes"
        )
    return origin


def _verifier_version() -> str:
    try:
        return importlib.metadata.version("dvbench-platform")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def keys_dir() -> Path:
    """Where generated private keys live: ``$DVBENCH_DATA_DIR/keys`` (mode 0700)."""
    return Path(settings.DVBENCH["DATA_DIR"]) / "keys"


def _configured_key() -> SigningKey | None:
    """The key from ``DVBENCH_SIGNING_KEY_FILE`` or ``DVBENCH_SIGNING_KEY``, if either is set."""
    path = _knob("SIGNING_KEY_FILE")
    if path:
        return SigningKey.from_file(path)
    text = _knob("SIGNING_KEY")
    if text:
        return load_signing_key(environ={ENV_SIGNING_KEY: text})
    return None


def _local_key() -> SigningKey:
    try:
        return load_signing_key(data_dir=keys_dir())
    except KeyConfigurationError:
        # Another process generated it between our look and our exclusive create.
        path = keys_dir() / _KEY_FILE
        if not path.exists():
            raise
        return SigningKey.from_file(path)


# --- the log lock and the cached tree -------------------------------------------------


def _lock_log() -> None:
    """Serialise log appends and key changes until the current transaction ends."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOG_LOCK])


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


# --- keys and the trust root ------------------------------------------------------------


def _now() -> datetime:
    return to_seconds(timezone.now().astimezone(UTC))


def _trusted(row: PlatformKey) -> TrustedKey:
    public_key = load_pem_public_key(row.public_key.encode("ascii"))
    return TrustedKey(
        keyid=row.keyid,
        public_key=public_key,  # type: ignore[arg-type]
        not_before=to_seconds(row.not_before),
        not_after=None if row.not_after is None else to_seconds(row.not_after),
    )


def _key_row(keyid: str) -> PlatformKey:
    """The key named by either of its ids (``dvbench.attest.key_ids``).

    Keys registered before key ids followed securesystemslib's are stored under their
    SubjectPublicKeyInfo id; what they sign since names them by the new one.

    Raises:
        PlatformKey.DoesNotExist: no stored key has that id.
    """
    row = PlatformKey.objects.filter(keyid=keyid).first()
    if row is not None:
        return row
    for row in PlatformKey.objects.all():
        if keyid in key_ids(_trusted(row).public_key):
            return row
    raise PlatformKey.DoesNotExist(f"no signing key has id {keyid}")


def _publish(root: TrustRoot) -> TrustRootVersion:
    return TrustRootVersion.objects.create(
        version=root.version, document=root.to_json().decode("utf-8"), digest=root.digest()
    )


def _latest_root_row() -> TrustRootVersion | None:
    return TrustRootVersion.objects.order_by("-version").first()


def _register_initial(key: SigningKey, source: str, *, at: datetime) -> TrustRootVersion:
    root = TrustRoot.initial(key.public_key, not_before=at, log_origin=log_origin())
    PlatformKey.objects.create(
        keyid=key.keyid, public_key=key.public_pem, not_before=at, source=source
    )
    return _publish(root)


def _ensure_current(key: SigningKey, source: str) -> TrustRootVersion:
    """The trust root in force, checking that ``key`` is its current key (call under the lock).

    The very first key is registered here (trust root version 1).

    Raises:
        KeyConfigurationError: the key is retired or was never added by a rotation.
    """
    row = PlatformKey.objects.filter(keyid__in=key_ids(key.public_key)).first()
    root = _latest_root_row()
    if row is None:
        if root is None and not PlatformKey.objects.exists():
            return _register_initial(key, source, at=_now())
        current = PlatformKey.objects.filter(not_after__isnull=True).first()
        raise KeyConfigurationError(
            f"the signing key {key.keyid} is not in the trust root (current key: "
            f"{current.keyid if current else 'none'}); run `manage.py rotate_signing_key` to "
            "adopt it"
        )
    if row.not_after is not None:
        raise KeyConfigurationError(
            f"the signing key {key.keyid} was retired at {row.not_after.isoformat()}; configure "
            "the current key or rotate to a new one"
        )
    assert root is not None, "a registered key always has a trust root"
    published = root.trust_root()
    if published.log_origin is None:
        # Published before trust roots named the log: the next version carries every
        # key's signed-note verifier key too (same keys, same windows).
        return _publish(published.with_log_origin(log_origin()))
    return root


def signing_key() -> tuple[SigningKey, str]:
    """The key that signs now and where it came from (configured, else the generated one)."""
    configured = _configured_key()
    if configured is not None:
        return configured, KeySource.CONFIGURED
    return _local_key(), KeySource.GENERATED


def current_trust_root() -> TrustRootVersion:
    """The latest published trust root, registering the first key if there is none yet."""
    row = _latest_root_row()
    if row is not None:
        return row
    with transaction.atomic():
        _lock_log()
        key, source = signing_key()
        return _ensure_current(key, source)


@dataclass(frozen=True)
class Rotation:
    """What :func:`rotate_key` did."""

    old_keyid: str | None
    new_keyid: str
    at: datetime
    trust_root: TrustRootVersion


def rotate_key(new_key: SigningKey | None = None, *, actor: Any = None) -> Rotation:
    """Start a new signing key now and end the current key's window at the same second.

    With a configured key (``DVBENCH_SIGNING_KEY_FILE`` / ``DVBENCH_SIGNING_KEY``) the
    configured key is adopted: put the new key there first, then rotate. Otherwise
    ``new_key`` (imported) or a freshly generated key replaces
    ``$DVBENCH_DATA_DIR/keys/signing-key.pem``; the retired private key is deleted, since
    it may never sign again. The rotation instant is the next whole second, so every
    certificate already signed in this second stays inside the old key's window.

    Raises:
        KeyConfigurationError: the configured key is already current, or a key was given
            while one is configured.
    """
    configured = _configured_key()
    if configured is not None and new_key is not None:
        raise KeyConfigurationError(
            "a signing key is configured (DVBENCH_SIGNING_KEY_FILE or DVBENCH_SIGNING_KEY): "
            "put the new key there and rotate without --key-file"
        )
    incoming = configured or new_key or SigningKey.generate()
    source = (
        KeySource.CONFIGURED
        if configured is not None
        else KeySource.IMPORTED
        if new_key is not None
        else KeySource.GENERATED
    )
    staged: Path | None = None
    if configured is None:
        staged = _stage_key(incoming)
    try:
        with transaction.atomic():
            _lock_log()
            rotation = _rotate_rows(incoming, source)
            AuditEvent.record(
                "signing_key.rotated",
                actor=actor,
                detail={
                    "old_keyid": rotation.old_keyid,
                    "new_keyid": rotation.new_keyid,
                    "at": rotation.at.isoformat(),
                    "trust_root_version": rotation.trust_root.version,
                },
            )
            if staged is not None:
                # Inside the transaction: if the rename fails, the rotation rolls back.
                os.replace(staged, keys_dir() / _KEY_FILE)
                staged = None
    finally:
        if staged is not None:
            staged.unlink(missing_ok=True)
    return rotation


def _stage_key(key: SigningKey) -> Path:
    folder = keys_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / _NEXT_KEY_FILE
    path.unlink(missing_ok=True)  # a leftover of a rotation that failed half-way
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key.private_pem())
    return path


def _rotate_rows(incoming: SigningKey, source: str) -> Rotation:
    root_row = _latest_root_row()
    if PlatformKey.objects.filter(keyid__in=key_ids(incoming.public_key)).exists():
        raise KeyConfigurationError(
            f"key {incoming.keyid} is already in the trust root: put a new key into "
            "DVBENCH_SIGNING_KEY_FILE / DVBENCH_SIGNING_KEY first"
        )
    # The next whole second, and after the current key's start (two rotations within one
    # second would otherwise give the current key an empty window).
    at = _now() + timedelta(seconds=1)
    started = PlatformKey.objects.filter(not_after__isnull=True).values_list(
        "not_before", flat=True
    )
    for not_before in started:
        at = max(at, to_seconds(not_before) + timedelta(seconds=1))
    if root_row is None:
        published = _register_initial(incoming, source, at=at)
        return Rotation(old_keyid=None, new_keyid=incoming.keyid, at=at, trust_root=published)
    current = PlatformKey.objects.filter(not_after__isnull=True).first()
    try:
        previous = root_row.trust_root()
        if previous.log_origin is None:
            previous = replace(previous, log_origin=log_origin())
        root = previous.rotate(incoming.public_key, at=at)
    except ValueError as error:
        raise KeyConfigurationError(f"cannot rotate: {error}") from None
    PlatformKey.objects.filter(not_after__isnull=True).update(not_after=at)
    PlatformKey.objects.create(
        keyid=incoming.keyid, public_key=incoming.public_pem, not_before=at, source=source
    )
    published = _publish(root)
    return Rotation(
        old_keyid=current.keyid if current else None,
        new_keyid=incoming.keyid,
        at=at,
        trust_root=published,
    )


# --- claims and replay evidence -----------------------------------------------------


@dataclass(frozen=True)
class _ClaimSet:
    claims: tuple[Claim, ...]
    violations: tuple[dict[str, Any], ...] = field(default=())


def _claims(proof: Proof) -> _ClaimSet:
    """The proof's policy claims (``attestations.certificates.claims``) and the limits it broke.

    The broken limits are signed too, as the claim ``limit_violations`` (a list of
    ``{limit, declared, actual, step, message}``, empty for a run within its limits);
    a transcript the claims could not be read to the end of counts as a violation,
    since its limits could not be checked.
    """
    claim_set = compute_claims(proof)
    violations = [dict(violation.to_dict()) for violation in claim_set.violations]
    if claim_set.transcript_error:
        violations.append(
            {
                "limit": "transcript",
                "declared": None,
                "actual": None,
                "step": None,
                "message": f"the transcript could not be read to its end: "
                f"{claim_set.transcript_error}",
            }
        )
    # Through JSON once: a declared limit may be a Decimal, which a statement cannot hold.
    signed = json.loads(json.dumps(violations, default=str))
    claims = (*claim_set.claims, Claim("limit_violations", signed, Evidence.COMMITTED))
    return _ClaimSet(claims=claims, violations=tuple(signed))


def _flops_of(claims: Sequence[Claim]) -> Decimal | None:
    return _whole_claim(claims, "flops")


def _tokens_of(claims: Sequence[Claim]) -> Decimal | None:
    return _whole_claim(claims, "tokens")


def _whole_claim(claims: Sequence[Claim], name: str) -> Decimal | None:
    """The claim ``name``'s number as a whole Decimal (a searchable column), if numeric."""
    for claim in claims:
        value = claim.value
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if claim.name == name and numeric:
            return Decimal(int(value))
    return None


def _numbers(values: Any) -> dict[str, float]:
    return {
        name: value
        for name, value in (values or {}).items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def _replay_evidence(proof: Proof) -> ReplayEvidence:
    report: Mapping[str, Any] = proof.report or {}
    config = (report.get("root") or {}).get("config") or {}
    tolerance = _numbers(config.get("tolerance"))
    bounds = _numbers(config.get("bounds")) or None
    seed = proof.revealed_seed
    if not seed:
        return ReplayEvidence(NO_REPLAY_SEED, (), tolerance, bounds)
    steps: set[int] = set()
    for step, through in Challenge.objects.filter(proof=proof).values_list("step", "through"):
        steps.update(range(step, (through if through is not None else step) + 1))
    return ReplayEvidence(seed, tuple(sorted(steps)), tolerance, bounds)


def _filings(proof: Proof) -> Filings:
    """Every proof filed for the proof's experiment now, oldest first, as it stands.

    Signed into the certificate: a run re-filed until a draw missed its forged steps
    would show every abandoned or rejected try beside the one certified.
    """
    rows = (
        Proof.objects.filter(experiment_id=proof.experiment_id)
        .select_related("transcript")
        .order_by("pk")
    )
    filings = tuple(
        Filing(
            proof=row.pk,
            transcript_sha256=row.transcript.sha256,
            transcript_digest=row.transcript_digest
            if SHA256_HEX.match(row.transcript_digest)
            else None,
            status=str(row.status),
            reason=row.reason,
            filed_on=row.created,
            challenge_filing=row.challenge_filing,
        )
        for row in rows
    )
    return Filings(count=len(filings), proofs=filings, run=_run_filings(proof))


def _run_filings(proof: Proof) -> RunFilings | None:
    """The proof's committed run and its other filings, anywhere, as they stand.

    The plan depends on the run digest and the platform's key only, so a filing of the
    same run in another experiment or lab faced the same steps. Signed as dates, verdicts
    and digests, never as organisation, experiment or proof: the certificate's auditors
    read it, and another lab's identity is not theirs to see (regulators read it whole
    from :meth:`~attestations.certificates.models.Certificate.run_filings`).
    """
    digest = proof.challenge_run_digest
    if not digest:
        return None
    rows = (
        Proof.objects.filter(challenge_run_digest=digest, challenges_drawn__isnull=False)
        .exclude(experiment_id=proof.experiment_id)
        .select_related("experiment")
        .order_by("created", "pk")
    )
    owner = proof.experiment.owner_id
    elsewhere = tuple(
        RunFiling(
            filed_on=row.created,
            status=str(row.status),
            reason=row.reason,
            transcript_digest=row.transcript_digest,
            same_organization=row.experiment.owner_id == owner,
            challenge_target=float(row.challenge_target or 0.0),
        )
        for row in rows
    )
    return RunFilings(digest=digest, count=len(elsewhere), elsewhere=elsewhere)


def _subjects(proof: Proof) -> tuple[str, str]:
    report: Mapping[str, Any] = proof.report or {}
    digest = proof.transcript_digest or report.get("digest") or ""
    final = report.get("final") or {}
    root = final.get("p") if isinstance(final, Mapping) else None
    for what, value in (("transcript digest", digest), ("final parameter root", root)):
        if not isinstance(value, str) or len(value) != 64:
            raise CertificateNotIssuableError(
                f"proof {proof.pk} has no {what} (the transcript never reached its close "
                "record), so there is nothing a certificate could name"
            )
    return str(digest), str(root)


# --- issuance -------------------------------------------------------------------------


def issue_certificate(proof_id: int) -> Certificate:
    """Sign, log and store the certificate of a proof with a final verdict; idempotent.

    Returns the proof's certificate: the one already issued, if any. Two concurrent
    calls serialise on the log lock and the second returns the first's certificate; the
    unique constraint on ``Certificate.proof`` backs that up.

    Raises:
        Proof.DoesNotExist: no such proof.
        CertificateNotIssuableError: the verdict is not final or a subject is unknown.
        KeyConfigurationError: the signing key is unusable or not the trust root's current key.
    """
    try:
        with transaction.atomic():
            _lock_log()
            existing = Certificate.objects.filter(proof_id=proof_id).first()
            if existing is not None:
                return existing
            return _issue(
                Proof.objects.select_related("experiment__owner", "spec", "transcript").get(
                    pk=proof_id
                )
            )
    except IntegrityError:
        # Another process won a race the lock should have prevented (e.g. SQLite in a
        # deferred transaction): its certificate stands, this attempt rolled back.
        _TREE.reset()
        existing = Certificate.objects.filter(proof_id=proof_id).first()
        if existing is None:
            raise
        return existing
    except BaseException:
        # A rolled-back append may have left its leaf in the cached tree. The next use
        # would notice by the last-leaf check; a reset is cheap and certain.
        _TREE.reset()
        raise


def _issue(proof: Proof) -> Certificate:
    if proof.status not in CERTIFIED_STATUSES:
        raise CertificateNotIssuableError(
            f"proof {proof.pk} is {proof.status!r}; certificates are issued for "
            f"{sorted(CERTIFIED_STATUSES)} only"
        )
    if proof.is_duplicate:
        raise CertificateNotIssuableError(
            f"proof {proof.pk} repeats a transcript already filed for "
            f"{proof.experiment.full_name}; that proof's certificate covers it"
        )
    transcript_digest, parameter_root = _subjects(proof)
    key, source = signing_key()
    root_row = _ensure_current(key, source)
    trust_root = root_row.trust_root()
    window = trust_root.key(key.keyid)
    # Never before the key's start: a rotation starts the new key at the next second.
    moment = max(_now(), window.not_before)
    window.check_valid_at(moment, "certificate")
    claim_set = _claims(proof)
    passed = proof.status == ProofStatus.VALID and not claim_set.violations
    replay = _replay_evidence(proof)
    model = check_model(proof)
    # Statements beside the run's claims (attestations/certificates/subjects.py).
    stated = (
        model_claim(model),
        threshold_claim(claim_set.claims),
        guarantee_claim(proof, replay.tolerance, replay.gradient_bounds),
    )
    claims = (*claim_set.claims, *(claim for claim in stated if claim is not None))
    index = LogEntry.objects.count()
    origin = log_origin()
    certificate = TrainingCertificate(
        transcript_digest=transcript_digest,
        final_parameter_root=parameter_root,
        verifier_id=verifier_id(),
        verifier_version=_verifier_version(),
        issued_at=moment,
        policy_digest=proof.spec.digest,
        result=Result.PASSED if passed else Result.FAILED,
        claims=claims,
        replay=replay,
        log=LogEntryRef(origin=origin, index=index),
        trust_root_version=root_row.version,
        trust_root_digest=root_row.digest,
        experiment=proof.experiment.full_name,
        extra_subjects=file_subjects(proof, model),
        transcript_sha256=proof.transcript.sha256,
        parameters_sha256=weights_sha256(model),
        filings=_filings(proof),
    )
    envelope = sign_certificate(certificate, key)
    # The leaf is the Rekor dsse entry of the envelope (dvbench.attest._rekor); the
    # envelope itself is stored beside it, and the log's signed entry timestamp makes
    # the checkpoint's time (integratedTime) a signed time of this very entry.
    leaf = dsse_entry_body(envelope, key.public_key)
    hashed = leaf_hash(leaf)
    promise = key.sign(
        inclusion_promise_payload(
            leaf,
            integrated_time=int(moment.timestamp()),
            log_index=index,
            log_id=note_key_id(origin, key.public_key),
        )
    )
    stamped = timestamp_authority().stamp(
        base64.b64decode(envelope["signatures"][0]["sig"]), moment
    )
    entry = LogEntry.objects.create(
        index=index,
        leaf=leaf.decode("utf-8"),
        leaf_hash=hashed.hex(),
        envelope_json=canonical_json(envelope).decode("utf-8"),
        inclusion_promise=base64.b64encode(promise).decode("ascii"),
        rfc3161_timestamp=base64.b64encode(stamped).decode("ascii"),
    )
    with _TREE.lock:
        tree = _TREE.synced()
        if tree.size != index + 1:
            raise LogCorruptError(f"the log has {tree.size} entries after appending entry {index}")
        root_hash = tree.root()
    _sign_checkpoint(key, index + 1, root_hash, moment, origin)
    row = Certificate.objects.create(
        proof=proof,
        organization=proof.experiment.owner,
        experiment=proof.experiment.full_name,
        result=certificate.result.value,
        flops=_flops_of(claim_set.claims),
        tokens=_tokens_of(claim_set.claims),
        issued=moment,
        keyid=key.keyid,
        trust_root_version=root_row.version,
        transcript_digest=transcript_digest,
        final_parameter_root=parameter_root,
        log_entry=entry,
    )
    AuditEvent.record(
        "certificate.issued",
        organization=proof.experiment.owner,
        target=row,
        detail={
            "proof": proof.pk,
            "result": row.result,
            "log_index": index,
            "keyid": key.keyid,
            "violations": list(claim_set.violations),
        },
    )
    log.info("issued certificate %s for proof %s as log entry %s", row.pk, proof.pk, index)
    return row


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
    row = _key_row(checkpoint.keyid)
    entry = certificate.log_entry
    promise = entry.inclusion_promise
    return make_sigstore_bundle(
        certificate.envelope,
        log_index=certificate.log_index,
        inclusion_proof=path,
        checkpoint=checkpoint.note,
        public_key=_trusted(row).public_key,
        kind=entry.kind,
        inclusion_promise=base64.b64decode(promise) if promise else None,
        timestamps=[base64.b64decode(entry.rfc3161_timestamp)] if entry.rfc3161_timestamp else [],
        hint=certificate.envelope["signatures"][0]["keyid"],
    )


def timestamp_authority() -> Authority:
    """The platform's RFC 3161 timestamp authority (``keys/tsa.pem``, made on first use)."""
    return load_authority(keys_dir())


def trusted_root() -> dict[str, Any]:
    """The trust root as a Sigstore TrustedRoot v0.1 (``dvbench.attest._trusted_root``).

    The latest published trust root's keys (as the log's keys, with their windows, which
    a rotation updates) and the timestamp authority.
    """
    root = current_trust_root().trust_root()
    return sigstore_trusted_root(
        root,
        log_origin=log_origin(),
        timestamp_authorities=[timestamp_authority().descriptor()],
    )


def verifier_keys() -> dict[str, Any]:
    """The log's keys as signed-note verifier keys (``<origin>+<hash>+<base64 key>``).

    Returns:
        ``{origin, verifier_key, keys}``: the current key's verifier key (None before the
        first key exists) and every key's, with its validity window.
    """
    origin = log_origin()
    keys = []
    current = None
    for row in PlatformKey.objects.order_by("not_before"):
        trusted = _trusted(row)
        vkey = note_verifier_key(origin, trusted.public_key)
        if row.not_after is None:
            current = vkey
        keys.append(
            {
                "keyid": row.keyid,
                "note_verifier_key": vkey,
                "not_before": format_time(trusted.not_before),
                "not_after": None if trusted.not_after is None else format_time(trusted.not_after),
            }
        )
    return {"origin": origin, "verifier_key": current, "keys": keys}


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
    stored = {row.keyid: _trusted(row) for row in PlatformKey.objects.all()}
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
        "flops": _flops_of(certificate.claims),
        "tokens": _tokens_of(certificate.claims),
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
