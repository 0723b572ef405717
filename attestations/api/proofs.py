"""The API of filed proofs, their transcripts and attached files, and background jobs.

Routes: ``proofs/``, ``proofs/{id}/`` with its ``transcript/`` and ``artifacts/``, and
``jobs/`` (``attestations/api/urls.py``). A proof the caller cannot read answers 404.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.files.storage import default_storage
from django.db.models import Prefetch, QuerySet
from django.http import FileResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import generics, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from attestations.accounts.models import (
    Capability,
    Organization,
)
from attestations.challenges.answers import FileClaim, attach
from attestations.challenges.models import ChallengeStatus
from attestations.challenges.verdicts import expire_if_due
from attestations.core.conf import api_datetime, client_ip
from attestations.core.errors import ConflictError, NotFoundError
from attestations.http.fields import Sha256Field, StrictCharField, StrictIntegerField
from attestations.http.filters import QueryFilters, check_known_parameters
from attestations.http.pagination import CursorPage
from attestations.http.permissions import HasCapability, authenticated_user, get_access, require
from attestations.proofs.models import Job, JobStatus, Proof, ProofArtifact, ProofStatus
from attestations.uploads.models import ArtifactKind


class JobSerializer(serializers.ModelSerializer[Job]):
    organization: serializers.SlugRelatedField[Organization] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )

    class Meta:
        model = Job
        fields = [
            "id",
            "kind",
            "organization",
            "proof",
            "status",
            "progress",
            "steps_done",
            "steps_total",
            "reason",
            "created",
            "started",
            "finished",
        ]


class ProofSerializer(serializers.ModelSerializer[Proof]):
    experiment = serializers.CharField(source="experiment.full_name", read_only=True)
    spec_version = serializers.IntegerField(source="spec.version", read_only=True)
    spec_digest = serializers.CharField(source="spec.digest", read_only=True)
    transcript_sha256 = serializers.CharField(source="transcript.sha256", read_only=True)
    record = serializers.IntegerField(source="record_index", read_only=True, allow_null=True)
    job = serializers.SerializerMethodField()
    challenge_plan = serializers.SerializerMethodField()

    class Meta:
        model = Proof
        fields = [
            "id",
            "experiment",
            "spec_version",
            "spec_digest",
            "status",
            "reason",
            "message",
            "record",
            "field",
            "steps",
            "checks",
            "prover",
            "transcript_sha256",
            "transcript_digest",
            "created",
            "verified",
            "job",
            "challenge_plan",
        ]

    @extend_schema_field(
        inline_serializer(
            "ChallengePlan",
            {
                "seed_commitment": serializers.CharField(),
                "seed": serializers.CharField(allow_null=True),
                "target": serializers.FloatField(
                    help_text="The probability this filing catches a run with the forged "
                    "fraction (the policy's target, tightened for later filings)"
                ),
                "forged_fraction": serializers.FloatField(),
                "filing": serializers.IntegerField(
                    allow_null=True,
                    help_text="This proof's place among the experiment's challenged proofs",
                ),
                "run_digest": serializers.CharField(
                    allow_null=True,
                    help_text="SHA-256 of the committed run the seed and steps derive from",
                ),
                "drawn": serializers.DateTimeField(),
                "deadline": serializers.DateTimeField(),
            },
            allow_null=True,
        )
    )
    def get_challenge_plan(self, proof: Proof) -> dict[str, Any] | None:
        """The platform's challenges: the seed's SHA-256 now, the seed once final."""
        if proof.challenges_drawn is None:
            return None
        return {
            "seed_commitment": proof.challenge_seed_commitment,
            "seed": proof.revealed_seed,
            "target": proof.challenge_target,
            "forged_fraction": proof.challenge_forged_fraction,
            "filing": proof.challenge_filing,
            "run_digest": proof.challenge_run_digest or None,
            "drawn": api_datetime(proof.challenges_drawn),
            "deadline": api_datetime(proof.challenge_deadline),
        }

    @extend_schema_field(JobSerializer(allow_null=True))
    def get_job(self, proof: Proof) -> dict[str, Any] | None:
        # jobs.all() is prefetched by the views: pick the latest without another query.
        jobs = sorted(proof.jobs.all(), key=lambda job: job.created)
        return JobSerializer(jobs[-1]).data if jobs else None


class ProofArtifactSerializer(serializers.ModelSerializer[ProofArtifact]):
    class Meta:
        model = ProofArtifact
        fields = ["name", "kind", "sha256", "size", "created"]
        read_only_fields = fields


class ArtifactClaimSerializer(serializers.Serializer[Any]):
    """One file of ``POST proofs/{id}/artifacts/``: an uploaded blob and its name."""

    name = StrictCharField(max_length=255)
    kind = serializers.ChoiceField(choices=ArtifactKind.choices)
    sha256 = Sha256Field()
    size = StrictIntegerField(min_value=1)


class ArtifactListSerializer(serializers.Serializer[Any]):
    files = serializers.ListField(
        child=ArtifactClaimSerializer(), allow_empty=True, max_length=100_000
    )


#: A proof's jobs, with what their serializer reads, in one query per page.
JOBS = Prefetch("jobs", queryset=Job.objects.select_related("organization"))


class ProofList(generics.ListAPIView[Proof]):
    """Proofs (filed transcripts) and their verdicts."""

    serializer_class = ProofSerializer
    permission_classes = [HasCapability]
    pagination_class = CursorPage
    filter_backends = [QueryFilters]
    query_filters = {
        "experiment": ("experiment__full_name", None),
        "owner": ("experiment__owner__slug", None),
        "status": ("status", frozenset(ProofStatus.values)),
        "verified_after": ("verified__gte", datetime),
        "verified_before": ("verified__lt", datetime),
    }
    query_filter_help = {
        "verified_after": "Verdict given at or after this ISO 8601 date or date-time.",
        "verified_before": "Verdict given before this ISO 8601 date or date-time.",
    }

    def get_queryset(self) -> QuerySet[Proof]:
        access = get_access(self.request)
        queryset = Proof.objects.filter(access.orgs(Capability.READ, "experiment__owner_id"))
        return queryset.select_related("experiment__owner", "spec", "transcript").prefetch_related(
            JOBS
        )


class ProofDetail(generics.RetrieveAPIView[Proof]):
    serializer_class = ProofSerializer
    permission_classes = [HasCapability]

    def get_object(self) -> Proof:
        proof = super().get_object()
        if expire_if_due(proof):
            proof = super().get_object()
        return proof

    def get_queryset(self) -> QuerySet[Proof]:
        access = get_access(self.request)
        return (
            Proof.objects.filter(access.orgs(Capability.READ, "experiment__owner_id"))
            .select_related("experiment__owner", "spec", "transcript")
            .prefetch_related(JOBS)
        )


class ProofTranscript(APIView):
    """The transcript bytes: an artifact, so for the lab's trainers and admins only."""

    permission_classes = [HasCapability]

    @extend_schema(responses={(200, "application/cbor-seq"): OpenApiTypes.BINARY})
    def get(self, request: Request, pk: int) -> FileResponse:
        access = get_access(request)
        proof = (
            Proof.objects.filter(access.orgs(Capability.READ, "experiment__owner_id"))
            .select_related("experiment", "transcript")
            .filter(pk=pk)
            .first()
        )
        if proof is None:
            raise NotFoundError(f"No proof {pk}.")
        require(request, Capability.ARTIFACTS, proof.experiment.owner_id)
        handle = default_storage.open(proof.transcript.storage_name, "rb")
        return FileResponse(
            handle,
            as_attachment=True,
            filename=f"{proof.experiment.name}-{proof.pk}.cborl",
            content_type="application/cbor-seq",
        )


def visible_proof(request: Request, pk: int) -> Proof:
    """A proof the caller may read (404 otherwise), its deadline checked on read."""
    proof = (
        Proof.objects.filter(get_access(request).orgs(Capability.READ, "experiment__owner_id"))
        .select_related("experiment__owner", "transcript")
        .filter(pk=pk)
        .first()
    )
    if proof is None:
        raise NotFoundError(f"No proof {pk}.")
    if expire_if_due(proof):
        proof.refresh_from_db()
    return proof


class ProofArtifacts(APIView):
    """The files of a proof directory attached for replay (artifacts: trainers, admins)."""

    permission_classes = [HasCapability]

    @extend_schema(responses=ProofArtifactSerializer(many=True))
    def get(self, request: Request, pk: int) -> Response:
        """The attached files, by name."""
        # Not a generic view, so no filter backend: refuse unknown parameters here.
        check_known_parameters(request, self)
        proof = visible_proof(request, pk)
        require(request, Capability.ARTIFACTS, proof.experiment.owner_id)
        return Response(ProofArtifactSerializer(proof.artifacts.all(), many=True).data)

    @extend_schema(
        request=ArtifactListSerializer,
        responses=inline_serializer(
            "AttachedArtifacts",
            {
                "attached": serializers.IntegerField(),
                "files": ProofArtifactSerializer(many=True),
                "ready": serializers.IntegerField(),
                "pending": serializers.IntegerField(),
            },
        ),
    )
    def post(self, request: Request, pk: int) -> Response:
        """Attach uploaded blobs to the proof under their proof-directory names.

        All or nothing and idempotent. Files its challenges need are checked against the
        transcript's commitments (422 on a mismatch); challenges whose files are all
        attached are queued for replay.
        """
        proof = visible_proof(request, pk)
        require(request, Capability.WRITE, proof.experiment.owner_id)
        body = ArtifactListSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        claims = [FileClaim(**item) for item in body.validated_data["files"]]
        if proof.is_final:
            raise ConflictError(
                f"proof {proof.pk} is final ({proof.status}); its files can no longer change",
                code="proof_final",
                field="files",
                detail={"status": proof.status},
            )
        artifacts, fresh = attach(
            proof,
            claims,
            user=authenticated_user(request),
            ip=client_ip(request.META),
        )
        counts = {
            status_: proof.challenges.filter(status=status_).count()
            for status_ in (ChallengeStatus.READY, ChallengeStatus.PENDING)
        }
        return Response(
            {
                "attached": fresh,
                "files": ProofArtifactSerializer(artifacts, many=True).data,
                "ready": counts[ChallengeStatus.READY],
                "pending": counts[ChallengeStatus.PENDING],
            },
            status=status.HTTP_201_CREATED if fresh else status.HTTP_200_OK,
        )


class JobList(generics.ListAPIView[Job]):
    serializer_class = JobSerializer
    permission_classes = [HasCapability]
    pagination_class = CursorPage
    filter_backends = [QueryFilters]
    query_filters = {
        "status": ("status", frozenset(JobStatus.values)),
        "proof": ("proof_id", int),
        "kind": ("kind", None),
    }

    def get_queryset(self) -> QuerySet[Job]:
        queryset = Job.objects.filter(get_access(self.request).orgs(Capability.READ))
        return queryset.select_related("organization")


class JobDetail(generics.RetrieveAPIView[Job]):
    serializer_class = JobSerializer
    permission_classes = [HasCapability]

    def get_queryset(self) -> QuerySet[Job]:
        return Job.objects.filter(get_access(self.request).orgs(Capability.READ)).select_related(
            "organization"
        )
