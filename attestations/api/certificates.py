"""API views for certificates, report bundles, the trust root and the transparency log.

Who may read what:

* ``trust-root/``, ``log/checkpoint/``, ``log/verifier-key/`` and the two ``log/proof/``
  endpoints are public:
  they carry public keys and hashes only, and monitors, witnesses and offline verifiers
  need them without an account.
* ``log/entries/{index}/``, ``proofs/{id}/certificate/``, ``proofs/{id}/bundle/``,
  ``proofs/{id}/sigstore-bundle/`` and ``certificates/`` carry certificates (claims): members of the proof's organisation
  read them, regulators read those of every organisation (never artifacts), and for
  everyone else they do not exist (404).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.db.models import QuerySet
from django.db.models.functions import Coalesce
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    inline_serializer,
)
from rest_framework import generics, serializers
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from attestations.accounts.models import Capability
from attestations.certificates import keys, translog
from attestations.certificates import subjects as certificate_subjects
from attestations.certificates.models import (
    Certificate,
    CertificateResult,
    LogCheckpoint,
    LogEntry,
    TrustRootVersion,
)
from attestations.core.conf import api_datetime
from attestations.core.errors import InvalidRequestError, NotFoundError, UnavailableError
from attestations.http.filters import BigInt, QueryFilters
from attestations.http.pagination import CursorPage
from attestations.http.permissions import HasCapability, get_access
from attestations.proofs.models import Proof
from dvbench.attest import KeyConfigurationError


class SigningUnavailableError(UnavailableError):
    default_message = "The platform's signing key is not usable."
    default_code = "signing_unavailable"


# --- serializers (they document the shapes; models build them) -----------------------


class EnvelopeSignatureSerializer(serializers.Serializer[Any]):
    keyid = serializers.CharField(help_text="hex SHA-256 of the key's SubjectPublicKeyInfo")
    sig = serializers.CharField(help_text="base64 Ed25519 signature over the DSSE PAE")


class EnvelopeSerializer(serializers.Serializer[Any]):
    payload = serializers.CharField(help_text="base64 of the in-toto Statement's JSON")
    payloadType = serializers.CharField(help_text="application/vnd.in-toto+json")  # noqa: N815
    signatures = EnvelopeSignatureSerializer(many=True)


class CertificateSerializer(serializers.Serializer[Certificate]):
    """A certificate and the searchable facts repeated from its signed statement."""

    id = serializers.IntegerField()
    proof = serializers.IntegerField()
    organization = serializers.CharField(help_text="the organisation's slug")
    experiment = serializers.CharField(help_text="owner/name")
    result = serializers.ChoiceField(choices=CertificateResult.choices)
    flops = serializers.IntegerField(allow_null=True, help_text="total FLOPs claimed")
    tokens = serializers.IntegerField(allow_null=True, help_text="total tokens claimed")
    lineage_flops = serializers.IntegerField(
        allow_null=True,
        help_text="the run's FLOPs and its parent runs' (the signed lineage claim's total; "
        "null before lineages were certified or when a part is undetermined)",
    )
    lineage = inline_serializer(
        "CertificateLineage",
        {
            "flops": serializers.IntegerField(allow_null=True),
            "runs": serializers.IntegerField(help_text="runs the total adds up"),
            "parent_transcript": serializers.CharField(allow_null=True),
            "parent_certificate": serializers.IntegerField(allow_null=True),
            "declared": serializers.BooleanField(help_text="the spec declares the parent"),
            "starts_from_parent": serializers.BooleanField(
                allow_null=True,
                help_text="the run's committed initial parameters are the parent's "
                "committed final ones",
            ),
        },
        allow_null=True,
        help_text="the signed lineage claim (null for certificates issued before it existed)",
    )
    issued = serializers.DateTimeField(help_text="the signed issuedOn time")
    keyid = serializers.CharField()
    trust_root_version = serializers.IntegerField()
    transcript_digest = serializers.CharField()
    final_parameter_root = serializers.CharField()
    log_index = serializers.IntegerField()
    regulatory_thresholds = serializers.ListField(
        child=serializers.DictField(),
        help_text="the signed regulatory_thresholds claim: {name, threshold, counts (run or "
        "lineage), flops (the number compared), stays_below, description} per threshold "
        "(empty for certificates issued before it existed)",
    )
    limit_violations = serializers.ListField(
        child=inline_serializer(
            "LimitViolation",
            {
                "limit": serializers.CharField(help_text="the spec field, e.g. max_flops"),
                "declared": serializers.JSONField(help_text="the declared value"),
                "actual": serializers.JSONField(help_text="the running total or observed value"),
                "step": serializers.IntegerField(allow_null=True),
                "message": serializers.CharField(),
            },
        ),
        help_text="the signed limit_violations claim: each declared limit the run broke "
        "(empty for a run within its limits); a FAILED certificate with none was failed by "
        "its proof's verdict (see filings)",
    )
    filings = inline_serializer(
        "CertificateFilings",
        {
            "count": serializers.IntegerField(),
            "proofs": inline_serializer(
                "CertificateFiling",
                {
                    "proof": serializers.IntegerField(),
                    "transcriptSha256": serializers.CharField(),
                    "transcriptDigest": serializers.CharField(allow_null=True),
                    "status": serializers.CharField(),
                    "reason": serializers.CharField(allow_blank=True),
                    "filedOn": serializers.DateTimeField(),
                    "challengeFiling": serializers.IntegerField(allow_null=True),
                },
                many=True,
            ),
            "run": inline_serializer(
                "CertificateRunFilings",
                {
                    "digest": serializers.CharField(
                        help_text="the run digest the seed derives from"
                    ),
                    "count": serializers.IntegerField(),
                    "elsewhere": inline_serializer(
                        "CertificateRunFiling",
                        {
                            "filedOn": serializers.DateTimeField(),
                            "status": serializers.CharField(),
                            "reason": serializers.CharField(allow_blank=True),
                            "transcriptDigest": serializers.CharField(),
                            "sameOrganization": serializers.BooleanField(),
                            "challengeTarget": serializers.FloatField(),
                        },
                        many=True,
                    ),
                },
                required=False,
                help_text="the certified run and every filing of it outside this experiment, "
                "in any organisation, by date and verdict only (absent when the proof was "
                "never challenged, and from certificates signed before it existed)",
            ),
        },
        allow_null=True,
        help_text="Every proof filed for the experiment when it was signed (from the signed "
        "statement; null for certificates signed before filings were recorded)",
    )
    envelope = EnvelopeSerializer(help_text="the DSSE envelope, as signed and logged")

    def to_representation(self, instance: Certificate) -> dict[str, Any]:
        return instance.to_dict()


class CertificateDetailSerializer(CertificateSerializer):
    """One certificate, with every filing of its run as the reader may see it (detail only)."""

    run_filings = inline_serializer(
        "CertificateRunFilingsNow",
        {
            "run_digest": serializers.CharField(),
            "count": serializers.IntegerField(),
            "filings": inline_serializer(
                "CertificateRunFilingNow",
                {
                    "organization": serializers.CharField(
                        allow_null=True, help_text="slug; null where it is not yours to see"
                    ),
                    "experiment": serializers.CharField(
                        allow_null=True, help_text="owner/name; null likewise"
                    ),
                    "proof": serializers.IntegerField(allow_null=True, help_text="null likewise"),
                    "same_organization": serializers.BooleanField(),
                    "status": serializers.CharField(),
                    "reason": serializers.CharField(allow_blank=True),
                    "filed_on": serializers.DateTimeField(),
                    "transcript_digest": serializers.CharField(),
                    "challenge_target": serializers.FloatField(allow_null=True),
                },
                many=True,
            ),
            "shared_states": inline_serializer(
                "CertificateSharedStateFiling",
                {
                    "organization": serializers.CharField(allow_null=True),
                    "experiment": serializers.CharField(allow_null=True),
                    "proof": serializers.IntegerField(allow_null=True),
                    "same_organization": serializers.BooleanField(),
                    "same_run": serializers.BooleanField(
                        help_text="the same run digest: a refiling of the run itself"
                    ),
                    "shared_states": serializers.IntegerField(
                        help_text="how many of the certified proof's indexed states it shares"
                    ),
                    "state_stride": serializers.IntegerField(
                        help_text="states are indexed every this many steps, and the last"
                    ),
                    "status": serializers.CharField(),
                    "filed_on": serializers.DateTimeField(),
                    "transcript_digest": serializers.CharField(),
                },
                many=True,
                help_text="Filings anywhere that committed a state the certified proof "
                "committed: refilings, and near copies (a step changed and re-chained, so "
                "another run digest) whose shared steps' compute is claimed twice. Named "
                "as in filings.",
            ),
        },
        allow_null=True,
        help_text="Every filing of the certified run (same run digest, so the same challenge "
        "plan) outside this experiment, read now from the platform: whole for a regulator; "
        "for a lab's members, organisation, experiment and proof are null where the filing "
        "is another lab's. Null when the proof was never challenged. The signed statement "
        "carries the same filings as of signing by date and verdict only (filings.run).",
    )

    def to_representation(self, instance: Certificate) -> dict[str, Any]:
        access = get_access(self.context["request"])
        return {**instance.to_dict(), "run_filings": instance.run_filings(access.can_see)}


class CheckpointSerializer(serializers.Serializer[LogCheckpoint]):
    tree_size = serializers.IntegerField()
    root_hash = serializers.CharField(help_text="hex RFC 9162 root")
    timestamp = serializers.DateTimeField()
    keyid = serializers.CharField()
    note = serializers.CharField(help_text="the C2SP signed note (what verifiers check)")

    def to_representation(self, instance: LogCheckpoint) -> dict[str, Any]:
        return instance.to_dict()


class LogEntrySerializer(serializers.Serializer[LogEntry]):
    index = serializers.IntegerField()
    leaf_hash = serializers.CharField(help_text="hex SHA-256(0x00 || canonical envelope JSON)")
    envelope = EnvelopeSerializer()
    created = serializers.DateTimeField()
    certificate = serializers.IntegerField()
    proof = serializers.IntegerField()


class InclusionProofSerializer(serializers.Serializer[Any]):
    log_index = serializers.IntegerField()
    tree_size = serializers.IntegerField()
    leaf_hash = serializers.CharField()
    root_hash = serializers.CharField()
    hashes = serializers.ListField(child=serializers.CharField(), help_text="hex, leaf to root")
    checkpoint = serializers.CharField(allow_null=True, help_text="signed note at tree_size")


class ConsistencyProofSerializer(serializers.Serializer[Any]):
    first = serializers.IntegerField()
    second = serializers.IntegerField()
    first_root = serializers.CharField()
    second_root = serializers.CharField()
    hashes = serializers.ListField(child=serializers.CharField())
    first_checkpoint = serializers.CharField(allow_null=True)
    second_checkpoint = serializers.CharField(allow_null=True)


# --- helpers --------------------------------------------------------------------------


#: A log index, tree size or version: what a 64-bit column holds.
WHOLE_MAX = 2**63 - 1
WHOLE: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": WHOLE_MAX}


def _integer(request: Request, name: str, *, required: bool = True) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        if required:
            raise InvalidRequestError(
                f"{name}: this query parameter is required", code="required", field=name
            )
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) > WHOLE_MAX:
        raise InvalidRequestError(
            f"{name}: expected a whole number from 0 to {WHOLE_MAX}, got {raw!r}",
            code="invalid_parameter",
            field=name,
            detail={"got": raw},
        )
    return int(raw)


def _out_of_range(error: translog.LogRangeError) -> NotFoundError:
    # A well-formed request for a leaf or tree size the log does not have (yet).
    return NotFoundError(str(error), code="out_of_range", field=error.field)


def _note(size: int) -> str | None:
    return LogCheckpoint.objects.filter(tree_size=size).values_list("note", flat=True).first()


def _visible_certificate(request: Request, proof_id: int) -> Certificate:
    access = get_access(request)
    proof = (
        Proof.objects.filter(access.orgs(Capability.READ, "experiment__owner_id"))
        .filter(pk=proof_id)
        .first()
    )
    if proof is None:
        raise NotFoundError(f"No proof {proof_id}.")
    certificate = (
        Certificate.objects.select_related("organization", "log_entry")
        .filter(proof_id=proof.pk)
        .first()
    )
    if certificate is None:
        raise NotFoundError(
            f"Proof {proof_id} has no certificate yet (status {proof.status!r}); one is issued "
            "once its verdict is final.",
            code="no_certificate",
        )
    return certificate


# --- trust root -----------------------------------------------------------------------


class TrustRootView(APIView):
    """The published trust root: every signing key and its validity window."""

    permission_classes = [AllowAny]
    authentication_classes: list[type[Any]] = []

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "version", WHOLE, description="an earlier version (default: the latest)"
            )
        ],
        responses={200: OpenApiTypes.OBJECT},
        description="The trust root document (schema https://dvbench.dev/trust-root/v1), "
        "byte for byte as published; save it and pass it to `dvbench verify-report "
        "--trust-root`. Headers: X-Trust-Root-Version, X-Trust-Root-Digest (sha256 of "
        "the canonical JSON), ETag. Public: it holds public keys only.",
    )
    def get(self, request: Request) -> HttpResponse:
        version = _integer(request, "version", required=False)
        if version is None:
            try:
                row = keys.current_trust_root()
            except KeyConfigurationError as error:
                raise SigningUnavailableError(error.message) from None
        else:
            found = TrustRootVersion.objects.filter(version=version).first()
            if found is None:
                raise NotFoundError(f"No trust root version {version}.")
            row = found
        response = HttpResponse(row.document, content_type="application/json")
        response["X-Trust-Root-Version"] = str(row.version)
        response["X-Trust-Root-Digest"] = f"sha256:{row.digest}"
        response["ETag"] = f'"{row.digest}"'
        return response


class TrustedRootView(APIView):
    """The trust root in Sigstore's format (TrustedRoot v0.1): for Sigstore's verifiers."""

    permission_classes = [AllowAny]
    authentication_classes: list[type[Any]] = []

    @extend_schema(
        responses={200: OpenApiTypes.OBJECT},
        description="The platform's trust root as a Sigstore TrustedRoot v0.1 "
        "(`application/vnd.dev.sigstore.trustedroot+json;version=0.1`): every signing key as "
        "a key of the transparency log, with its validity window (a rotation closes it), log "
        "id = the signed-note key id its checkpoints use, and the RFC 3161 timestamp "
        "authority's certificate chain. `@sigstore/verify` verifies the Sigstore bundles "
        "(`proofs/ID/sigstore-bundle/`) against it, and `dvbench verify-report --trust-root` "
        "reads it. Public: it holds public keys and certificates only.",
    )
    def get(self, request: Request) -> HttpResponse:
        try:
            document = keys.trusted_root()
        except KeyConfigurationError as error:
            raise SigningUnavailableError(error.message) from None
        body = json.dumps(document, indent=2, sort_keys=True) + "\n"
        return HttpResponse(body, content_type="application/json")


class TrustRootVersionSerializer(serializers.Serializer[TrustRootVersion]):
    version = serializers.IntegerField()
    digest = serializers.CharField(help_text="hex SHA-256 of the document's canonical JSON")
    created = serializers.DateTimeField(help_text="when this version was published")
    url = serializers.CharField(help_text="where the document itself is served")

    def to_representation(self, instance: TrustRootVersion) -> dict[str, Any]:
        return {
            "version": instance.version,
            "digest": instance.digest,
            "created": api_datetime(instance.created),
            "url": f"/api/v1/trust-root/?version={instance.version}",
        }


class TrustRootVersionList(generics.ListAPIView[TrustRootVersion]):
    """Every published trust root version and its digest, newest first (public).

    Pin a digest from here (or from a second channel) and compare it with the
    ``X-Trust-Root-Digest`` of the document you verify with.
    """

    serializer_class = TrustRootVersionSerializer
    permission_classes = [AllowAny]
    authentication_classes: list[type[Any]] = []
    pagination_class = None

    def get_queryset(self) -> QuerySet[TrustRootVersion]:
        return TrustRootVersion.objects.order_by("-version")


# --- the log --------------------------------------------------------------------------


class LogCheckpointView(APIView):
    """The latest signed checkpoint of the transparency log (public)."""

    permission_classes = [AllowAny]
    authentication_classes: list[type[Any]] = []

    @extend_schema(responses=CheckpointSerializer)
    def get(self, request: Request) -> Response:
        checkpoint = translog.latest_checkpoint()
        if checkpoint is None:
            raise NotFoundError("The log is empty: no checkpoint has been signed yet.")
        return Response(checkpoint.to_dict())


class VerifierKeySerializer(serializers.Serializer[Any]):
    origin = serializers.CharField(help_text="the log's name: checkpoints' first line")
    verifier_key = serializers.CharField(
        allow_null=True, help_text="the current key: <origin>+<key hash hex>+<base64(0x01 || key)>"
    )
    keys = serializers.ListField(
        child=serializers.DictField(),
        help_text="every key: {keyid, note_verifier_key, not_before, not_after}",
    )


class LogVerifierKeyView(APIView):
    """The log's keys in C2SP signed-note verifier-key format (public)."""

    permission_classes = [AllowAny]
    authentication_classes: list[type[Any]] = []

    @extend_schema(
        responses=VerifierKeySerializer,
        description="The checkpoint keys as signed-note verifier keys "
        "(`<origin>+<key hash hex>+<base64(0x01 || Ed25519 key)>`), which note-compatible "
        "tools (Go's golang.org/x/mod/sumdb/note.NewVerifier, witnesses) take as is. The "
        "trust root carries the same strings (`note_verifier_key` of each key). Public.",
    )
    def get(self, request: Request) -> Response:
        return Response(keys.verifier_keys())


class LogEntryView(APIView):
    """One log entry: its envelope and leaf hash (the certificate's readers only)."""

    permission_classes = [HasCapability]

    @extend_schema(responses=LogEntrySerializer)
    def get(self, request: Request, index: int) -> Response:
        access = get_access(request)
        certificate = (
            Certificate.objects.filter(access.orgs(Capability.READ))
            .select_related("log_entry")
            .filter(log_entry__index=index)
            .first()
        )
        if certificate is None:
            raise NotFoundError(f"No log entry {index}.")
        return Response(
            {
                **certificate.log_entry.to_dict(),
                "certificate": certificate.pk,
                "proof": certificate.proof_id,
            }
        )


class InclusionProofView(APIView):
    """An RFC 9162 inclusion proof of entry ``index`` in the tree of ``tree_size`` (public)."""

    permission_classes = [AllowAny]
    authentication_classes: list[type[Any]] = []

    @extend_schema(
        parameters=[
            OpenApiParameter("index", WHOLE, required=True, description="the leaf index"),
            OpenApiParameter(
                "tree_size", WHOLE, description="default: the latest checkpoint's tree size"
            ),
        ],
        responses=InclusionProofSerializer,
    )
    def get(self, request: Request) -> Response:
        index = _integer(request, "index")
        assert index is not None
        tree_size = _integer(request, "tree_size", required=False)
        if tree_size is None:
            latest = translog.latest_checkpoint()
            tree_size = latest.tree_size if latest is not None else 0
        try:
            hashes, root = translog.inclusion(index, tree_size)
        except translog.LogRangeError as error:
            raise _out_of_range(error) from None
        leaf = LogEntry.objects.values_list("leaf_hash", flat=True).get(index=index)
        return Response(
            {
                "log_index": index,
                "tree_size": tree_size,
                "leaf_hash": leaf,
                "root_hash": root.hex(),
                "hashes": [value.hex() for value in hashes],
                "checkpoint": _note(tree_size),
            }
        )


class ConsistencyProofView(APIView):
    """An RFC 9162 consistency proof between tree sizes ``first`` and ``second`` (public)."""

    permission_classes = [AllowAny]
    authentication_classes: list[type[Any]] = []

    @extend_schema(
        parameters=[
            OpenApiParameter("first", WHOLE, required=True, description="the older tree size"),
            OpenApiParameter("second", WHOLE, required=True, description="the newer tree size"),
        ],
        responses=ConsistencyProofSerializer,
    )
    def get(self, request: Request) -> Response:
        first = _integer(request, "first")
        second = _integer(request, "second")
        assert first is not None and second is not None
        try:
            hashes, first_root, second_root = translog.consistency(first, second)
        except translog.LogRangeError as error:
            raise _out_of_range(error) from None
        return Response(
            {
                "first": first,
                "second": second,
                "first_root": first_root.hex(),
                "second_root": second_root.hex(),
                "hashes": [value.hex() for value in hashes],
                "first_checkpoint": _note(first),
                "second_checkpoint": _note(second),
            }
        )


# --- certificates ---------------------------------------------------------------------


class ProofCertificateView(APIView):
    """A proof's certificate: the signed envelope and its metadata."""

    permission_classes = [HasCapability]

    @extend_schema(responses=CertificateDetailSerializer)
    def get(self, request: Request, pk: int) -> Response:
        certificate = _visible_certificate(request, pk)
        return Response(CertificateDetailSerializer(certificate, context={"request": request}).data)


class ProofBundleView(APIView):
    """The offline report bundle of a proof's certificate (``dvbench download-report``)."""

    permission_classes = [HasCapability]

    @extend_schema(
        responses={
            200: OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="format https://dvbench.dev/report-bundle/v1: envelope, "
                "inclusion_proof, checkpoint, trust_root. Verify offline with `dvbench "
                "verify-report BUNDLE --trust-root FILE`.",
            )
        }
    )
    def get(self, request: Request, pk: int) -> HttpResponse:
        certificate = _visible_certificate(request, pk)
        bundle = translog.bundle_for(certificate)
        response = HttpResponse(
            json.dumps(bundle, indent=2, sort_keys=True) + "\n", content_type="application/json"
        )
        name = certificate.experiment.replace("/", "-")
        response["Content-Disposition"] = (
            f'attachment; filename="{name}-proof-{certificate.proof_id}.bundle.json"'
        )
        return response


class ProofSigstoreBundleView(APIView):
    """The proof's certificate as a Sigstore bundle v0.3 (``dvbench download-report --sigstore-out``)."""

    permission_classes = [HasCapability]

    @extend_schema(
        responses={
            200: OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="media type application/vnd.dev.sigstore.bundle.v0.3+json: "
                "dsseEnvelope, verificationMaterial.publicKey.hint and one tlogEntries item "
                "with its inclusion proof and signed checkpoint. Verify offline with "
                "`dvbench verify-report BUNDLE --trust-root FILE`; docs/certificates.md says "
                "what Sigstore's own tools check of it.",
            )
        }
    )
    def get(self, request: Request, pk: int) -> HttpResponse:
        certificate = _visible_certificate(request, pk)
        bundle = translog.sigstore_bundle_for(certificate)
        response = HttpResponse(
            json.dumps(bundle, indent=2, sort_keys=True) + "\n", content_type="application/json"
        )
        name = certificate.experiment.replace("/", "-")
        response["Content-Disposition"] = (
            f'attachment; filename="{name}-proof-{certificate.proof_id}.sigstore.json"'
        )
        return response


class CertificatePage(CursorPage):
    # Many certificates can share a second; the id makes the order total, so the
    # cursor's offset within one second always counts the same rows.
    ordering = ("-issued", "-id")


class CertificateList(generics.ListAPIView[Certificate]):
    """Certificates, newest first: every organisation's for a regulator, else your own."""

    serializer_class = CertificateSerializer
    permission_classes = [HasCapability]
    pagination_class = CertificatePage
    filter_backends = [QueryFilters]
    query_filters = {
        "organization": ("organization__slug", None),
        "experiment": ("experiment", None),
        "issued_after": ("issued__gte", datetime),
        "issued_before": ("issued__lt", datetime),
        "flops_min": ("flops__gte", BigInt),
        "flops_max": ("flops__lte", BigInt),
        "tokens_min": ("tokens__gte", BigInt),
        "tokens_max": ("tokens__lte", BigInt),
        "lineage_flops_min": ("lineage_flops__gte", BigInt),
        "lineage_flops_max": ("lineage_flops__lte", BigInt),
        "result": ("result", frozenset(CertificateResult.values)),
    }
    query_filter_help = {
        "organization": "Organisation slug.",
        "experiment": "Experiment id, owner/name.",
        "issued_after": "Issued at or after this ISO 8601 date or date-time (UTC if no offset).",
        "issued_before": "Issued before this ISO 8601 date or date-time.",
        "flops_min": "At least this many FLOPs claimed (a whole number).",
        "flops_max": "At most this many FLOPs claimed (a whole number); a certificate whose "
        "compute is undetermined matches neither flops_min nor flops_max.",
        "tokens_min": "At least this many tokens claimed (a whole number).",
        "tokens_max": "At most this many tokens claimed (a whole number); a certificate "
        "without a tokens claim matches neither tokens_min nor tokens_max.",
        "lineage_flops_min": "At least this many FLOPs in the run and its parent runs together "
        "(the lineage claim; a whole number).",
        "lineage_flops_max": "At most this many FLOPs in the run and its parent runs together; "
        "a certificate whose lineage total is undetermined matches neither.",
        "result": "PASSED or FAILED.",
    }
    #: Read by _by_threshold, not by QueryFilters; allowed all the same.
    query_params_also = ("below_threshold", "above_threshold")

    def get_queryset(self) -> QuerySet[Certificate]:
        access = get_access(self.request)
        queryset = Certificate.objects.filter(access.orgs(Capability.READ)).select_related(
            "organization", "log_entry"
        )
        return _by_threshold(self.request, queryset)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "below_threshold",
                str,
                description="A configured regulatory threshold's name (e.g. "
                "eu-ai-act-systemic-risk): certificates whose claimed compute is at or below it.",
            ),
            OpenApiParameter(
                "above_threshold",
                str,
                description="A threshold's name: certificates whose claimed compute exceeds it.",
            ),
        ]
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


def _by_threshold(request: Request, queryset: QuerySet[Certificate]) -> QuerySet[Certificate]:
    """``below_threshold`` / ``above_threshold``: by a configured threshold's name.

    A certificate whose compute is undetermined matches neither. The comparison is on the
    certificate's signed FLOPs against the threshold as configured now: the run's, or for a
    threshold that counts the lineage, the run's and its parent runs' (a certificate from
    before lineages counts its run's). Each certificate also states the thresholds in force
    when it was signed (``regulatory_thresholds``).
    """
    configured = certificate_subjects.thresholds()
    known = {threshold.name: threshold.flops for threshold in configured}
    counts = {threshold.name: threshold.counts for threshold in configured}
    queryset = queryset.alias(lineage_or_run=Coalesce("lineage_flops", "flops"))
    for param, compare in (("below_threshold", "lte"), ("above_threshold", "gt")):
        value = request.query_params.get(param)
        if value is None:
            continue
        # An empty name is no threshold either (the schema's enum says so).
        if value not in known:
            raise InvalidRequestError(
                f"{param}: {value!r} is not a configured threshold; one of "
                f"{', '.join(sorted(known))}",
                code="invalid_filter",
                field=param,
                detail={"allowed": sorted(known), "got": value[:100]},
            )
        column = "lineage_or_run" if counts[value] == "lineage" else "flops"
        queryset = queryset.filter(**{f"{column}__{compare}": known[value]})
    return queryset


class CertificateDetail(generics.RetrieveAPIView[Certificate]):
    serializer_class = CertificateDetailSerializer
    permission_classes = [HasCapability]

    def get_queryset(self) -> QuerySet[Certificate]:
        access = get_access(self.request)
        return Certificate.objects.filter(access.orgs(Capability.READ)).select_related(
            "organization", "log_entry"
        )
