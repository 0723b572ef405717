"""The REST API under ``/api/v1/``: views authorise, call one model or service, return.

Scope: every queryset is filtered by :class:`~attestations.accounts.models.Access`, so an object
in an organisation the user cannot read answers 404; a visible object the user's role may
not act on answers 403 (:func:`~attestations.http.permissions.require`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from django.contrib.auth.models import User
from django.core.files.storage import default_storage
from django.db import IntegrityError, transaction
from django.db.models import Prefetch, QuerySet
from django.http import FileResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    PolymorphicProxySerializer,
    extend_schema,
    inline_serializer,
)
from rest_framework import generics, serializers, status
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from attestations.accounts.models import (
    ApiKey,
    Capability,
    Invitation,
    InvitationStatus,
    Membership,
    Organization,
    not_a_member,
)
from attestations.api.serializers import (
    ApiKeySerializer,
    ArtifactListSerializer,
    AuditEventSerializer,
    ChallengeSerializer,
    ExperimentByIdSerializer,
    ExperimentByOwnerSerializer,
    ExperimentRegistration,
    ExperimentSerializer,
    InvitationSerializer,
    JobSerializer,
    MemberOutSerializer,
    MembershipSerializer,
    MeSerializer,
    NewApiKeySerializer,
    OrganizationSerializer,
    ProofArtifactSerializer,
    ProofSerializer,
    SpecSerializer,
    UploadPartURLRequestSerializer,
    UploadSerializer,
)
from attestations.audit.models import AuditEvent
from attestations.challenges import replay
from attestations.challenges.models import Challenge, ChallengeOrigin, ChallengeStatus
from attestations.core.conf import api_datetime, client_ip
from attestations.core.errors import ConflictError, InvalidRequestError, NotFoundError
from attestations.experiments.models import (
    Experiment,
    ExperimentQuerySet,
    ExperimentSpec,
    Framework,
    proof_statuses,
    summary_dict,
)
from attestations.experiments.rows import SummaryPage
from attestations.http import sudo
from attestations.http.exceptions import LengthRequiredError
from attestations.http.fields import StrictCharField
from attestations.http.filters import BigInt, QueryFilters
from attestations.http.pagination import CursorPage
from attestations.http.permissions import HasCapability, get_access, require
from attestations.http.schema import error_response
from attestations.http.sudo import API_KEY_CANNOT_CREATE_KEYS, require_sudo
from attestations.proofs.models import Job, JobStatus, Proof, ProofStatus
from attestations.uploads import services as uploads
from attestations.uploads.models import ArtifactKind, Upload, UploadStatus

#: A proof's jobs, with what their serializer reads, in one query per page.
JOBS = Prefetch("jobs", queryset=Job.objects.select_related("organization"))


# --- Identity, organisations, keys ------------------------------------------------------


def _user(request: Request) -> User:
    """The authenticated user (every view here requires one)."""
    assert isinstance(request.user, User)
    return request.user


class MeView(APIView):
    # Any signed-in user, even one in no organisation yet (the default permission).

    @extend_schema(responses=MeSerializer)
    def get(self, request: Request) -> Response:
        """Who the caller is and their role in each organisation."""
        access = get_access(request)
        orgs = Organization.objects.filter(pk__in=access.roles)
        data = MeSerializer(
            {
                "username": request.user.get_username(),
                "is_regulator": access.is_regulator,
                "organizations": orgs,
            },
            context={"access": access},
        ).data
        return Response(data)


class OrganizationList(generics.ListAPIView[Organization]):
    """Organisations the caller can see (every one, for a regulator)."""

    serializer_class = OrganizationSerializer
    permission_classes = [HasCapability]
    pagination_class = CursorPage

    def get_queryset(self) -> QuerySet[Organization]:
        return Organization.objects.filter(get_access(self.request).orgs(Capability.READ, "pk"))

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "access": get_access(self.request)}


def _organization(request: Request, slug: str, capability: str) -> Organization:
    """The organisation ``slug`` where the caller holds ``capability``.

    One that does not exist and one the caller cannot see are the same 404, byte for byte
    but the request id: a slug is not a way to learn which organisations exist.
    """
    org = Organization.objects.filter(slug=slug).first()
    if org is None or not get_access(request).can_see(org.pk):
        raise NotFoundError("No such organisation (the slug in the path).", field="slug")
    require(request, capability, org.pk)
    return org


class MemberPage(CursorPage):
    """Members, oldest first."""

    ordering = ("created", "id")


class MemberList(generics.GenericAPIView[Membership]):
    """Members of an organisation; admins change a member's role with POST.

    Nobody becomes a member by an admin's say-so: a new member is invited
    (``invitations/``) and joins by accepting. Regulators exist only in agencies, where
    the platform's operator grants the role.
    """

    serializer_class = MembershipSerializer
    pagination_class = MemberPage

    @extend_schema(responses=MemberOutSerializer(many=True))
    def get(self, request: Request, slug: str) -> Response:
        """The organisation's members (its trainers, auditors and admins)."""
        org = _organization(request, slug, Capability.AUDIT)
        rows = Membership.objects.filter(organization=org).select_related("user")
        page = self.paginate_queryset(rows)
        assert page is not None
        return self.get_paginated_response(MembershipSerializer(page, many=True).data)

    @extend_schema(request=MembershipSerializer, responses={200: MemberOutSerializer})
    def post(self, request: Request, slug: str) -> Response:
        """Change a member's role (admins). A lab always keeps one admin (409 last_admin)."""
        org = _organization(request, slug, Capability.MANAGE)
        serializer = MembershipSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        username = serializer.validated_data["user"]["username"]
        user = User.objects.filter(username=username, is_active=True).first()
        if user is None:
            # The same 409 as for an existing user who is not a member: a role change is
            # not a way to learn which usernames exist.
            raise not_a_member(org, username)
        membership = Membership.change_role(
            org,
            user,
            serializer.validated_data["role"],
            actor=_user(request),
            ip=client_ip(request.META),
        )
        return Response(MembershipSerializer(membership).data)


class MemberDetail(APIView):
    """One member of an organisation."""

    @extend_schema(responses={204: None})
    def delete(self, request: Request, slug: str, username: str) -> Response:
        """Remove a member (admins), or leave (any member, for themselves).

        The last admin of a lab can do neither (409 ``last_admin``).
        """
        leaving = username == request.user.get_username()
        org = _organization(request, slug, Capability.READ if leaving else Capability.MANAGE)
        membership = (
            Membership.objects.filter(organization=org, user__username=username)
            .select_related("user", "organization")
            .first()
        )
        if membership is None:
            raise NotFoundError(f"{username!r} is not a member of {slug}.")
        membership.remove(actor=_user(request), ip=client_ip(request.META))
        return Response(status=status.HTTP_204_NO_CONTENT)


class OrganizationInvitationList(generics.GenericAPIView[Invitation]):
    """Invitations of one lab: its admins offer them; the invitee accepts or declines."""

    serializer_class = InvitationSerializer
    pagination_class = CursorPage

    @extend_schema(responses=InvitationSerializer(many=True))
    def get(self, request: Request, slug: str) -> Response:
        """The lab's pending invitations (admins)."""
        org = _organization(request, slug, Capability.MANAGE)
        rows = Invitation.objects.filter(
            organization=org, status=InvitationStatus.PENDING, expires__gt=timezone.now()
        ).select_related("organization", "user", "invited_by")
        page = self.paginate_queryset(rows)
        assert page is not None
        return self.get_paginated_response(InvitationSerializer(page, many=True).data)

    @extend_schema(
        request=InvitationSerializer,
        responses={201: InvitationSerializer, 200: InvitationSerializer},
    )
    def post(self, request: Request, slug: str) -> Response:
        """Invite a username with a role (201), or change a pending invitation's role (200).

        The user joins only by accepting it (``POST /invitations/{id}/accept/``). The answer
        is the same for any username: one nobody holds, an inactive account or a
        regulator (who joins no lab) gets an invitation listed like any other that
        nobody can see or accept, and which expires. A member already is 409
        ``already_member`` (the lab's admins see their members anyway).
        """
        org = _organization(request, slug, Capability.MANAGE)
        serializer = InvitationSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        invitation, created = Invitation.offer(
            org,
            serializer.validated_data["username"],
            serializer.validated_data["role"],
            actor=_user(request),
            ip=client_ip(request.META),
        )
        return Response(
            InvitationSerializer(invitation).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class OrganizationInvitationDetail(APIView):
    @extend_schema(responses={204: None})
    def delete(self, request: Request, slug: str, pk: Any) -> Response:
        """Revoke a pending invitation (admins)."""
        org = _organization(request, slug, Capability.MANAGE)
        invitation = Invitation.objects.filter(organization=org, pk=pk).first()
        if invitation is None:
            raise NotFoundError(f"No invitation {pk} in {slug}.")
        invitation.revoke(actor=_user(request), ip=client_ip(request.META))
        return Response(status=status.HTTP_204_NO_CONTENT)


class MyInvitationList(generics.ListAPIView[Invitation]):
    """Invitations waiting for the caller's answer."""

    serializer_class = InvitationSerializer
    pagination_class = CursorPage

    def get_queryset(self) -> QuerySet[Invitation]:
        return Invitation.pending_for(_user(self.request)).select_related("user")


def _my_invitation(request: Request, pk: Any) -> Invitation:
    invitation = (
        Invitation.objects.filter(user=_user(request), pk=pk)
        .select_related("organization", "user", "invited_by")
        .first()
    )
    if invitation is None:
        raise NotFoundError(f"No invitation {pk} for you.")
    return invitation


class InvitationAccept(APIView):
    @extend_schema(request=None, responses={200: MemberOutSerializer})
    def post(self, request: Request, pk: Any) -> Response:
        """Accept an invitation: the caller becomes a member with the offered role."""
        membership = _my_invitation(request, pk).accept(ip=client_ip(request.META))
        return Response(MembershipSerializer(membership).data)


class InvitationDecline(APIView):
    @extend_schema(request=None, responses={200: InvitationSerializer})
    def post(self, request: Request, pk: Any) -> Response:
        """Decline an invitation."""
        invitation = _my_invitation(request, pk)
        invitation.decline(ip=client_ip(request.META))
        return Response(InvitationSerializer(invitation).data)


class ApiKeyList(generics.ListCreateAPIView[ApiKey]):
    """The caller's own API keys. A new key's secret is in the creation response only."""

    serializer_class = ApiKeySerializer
    pagination_class = CursorPage

    def get_queryset(self) -> QuerySet[ApiKey]:
        return ApiKey.objects.filter(user=self.request.user)  # type: ignore[misc]

    @extend_schema(
        request=ApiKeySerializer,
        responses={
            201: NewApiKeySerializer,
            400: error_response("`days` outside 1..`DVBENCH_API_KEY_MAX_DAYS`, a bad name."),
            403: error_response(
                "`api_key_cannot_create_keys`: the request carries an API key; "
                "`password_confirmation_required`: the session has not confirmed its "
                "password in the last `DVBENCH_SUDO_SECONDS` (`POST keys/confirm-password/`)."
            ),
        },
    )
    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Create a key (sudo mode): a signed-in session that confirmed its password.

        An API key cannot create keys (403 ``api_key_cannot_create_keys``): a key it made
        would outlive its revocation. A session must have confirmed its password within
        ``DVBENCH_SUDO_SECONDS`` (403 ``password_confirmation_required``). ``days`` is 1
        to ``DVBENCH_API_KEY_MAX_DAYS`` (365); more is a 400, never a silent clamp.
        """
        require_sudo(request)
        serializer = ApiKeySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key, raw = ApiKey.issue(
            _user(request),
            serializer.validated_data["name"],
            days=serializer.validated_data.get("days"),
            ip=client_ip(request.META),
        )
        data = NewApiKeySerializer(key).data
        data["key"] = raw
        return Response(data, status=status.HTTP_201_CREATED)


class ConfirmPasswordSerializer(serializers.Serializer[Any]):
    password = StrictCharField(max_length=4096, trim_whitespace=False)


class ApiKeyConfirmPassword(APIView):
    """Sudo mode for a signed-in session: confirm the password to create keys for a while."""

    @extend_schema(
        request=ConfirmPasswordSerializer,
        responses={
            200: inline_serializer("SudoMode", {"seconds_left": serializers.IntegerField()}),
            400: error_response("`wrong_password` (field `password`)."),
            403: error_response("`api_key_cannot_create_keys`: only a browser session."),
            429: error_response("`throttled`: too many wrong passwords (sign-in limit)."),
        },
    )
    def post(self, request: Request) -> Response:
        """Confirm the signed-in user's password; the session may then create keys.

        Only a browser session (an API key gets 403 ``api_key_cannot_create_keys``). A
        wrong password is 400 ``wrong_password`` (field ``password``) and counts towards
        the sign-in limit (429 past it).
        """
        if isinstance(request.auth, ApiKey):
            raise PermissionDenied(API_KEY_CANNOT_CREATE_KEYS, code="api_key_cannot_create_keys")
        body = ConfirmPasswordSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        if not sudo.confirm(request, body.validated_data["password"]):
            raise InvalidRequestError(
                "password: not the signed-in user's password.",
                code="wrong_password",
                field="password",
            )
        return Response({"seconds_left": sudo.seconds_left(request)})


class ApiKeyDetail(generics.RetrieveAPIView[ApiKey]):
    """One of the caller's keys (revoked ones too: the row is kept for the audit trail)."""

    serializer_class = ApiKeySerializer

    def get_queryset(self) -> QuerySet[ApiKey]:
        return ApiKey.objects.filter(user=self.request.user)  # type: ignore[misc]


class ApiKeyRevoke(APIView):
    @extend_schema(request=None, responses={200: ApiKeySerializer})
    def post(self, request: Request, pk: int) -> Response:
        """Revoke one of the caller's keys at once; revoking it again changes nothing.

        The key stays readable, with ``revoked`` set: it is revoked, not deleted.
        """
        key = ApiKey.objects.filter(user=_user(request), pk=pk).first()
        if key is None:
            raise NotFoundError(f"No key {pk}.")
        key.revoke(actor=_user(request), ip=client_ip(request.META))
        return Response(ApiKeySerializer(key).data)


# --- Experiments ------------------------------------------------------------------------


class ExperimentList(generics.ListCreateAPIView[Experiment]):
    """Experiments the caller can read; trainers and admins register new ones."""

    serializer_class = ExperimentSerializer
    permission_classes = [HasCapability]
    pagination_class = CursorPage
    filter_backends = [QueryFilters]
    query_filters = {
        "owner": ("owner__slug", None),
        "framework": ("current_spec__framework", frozenset(Framework.values)),
        "declared_flops_at_least": ("current_spec__max_flops__gte", BigInt),
        "created_after": ("created__gte", datetime),
        "created_before": ("created__lt", datetime),
    }
    query_filter_help = {
        "declared_flops_at_least": "Experiments whose current spec declares max_flops >= this.",
        "created_after": "Registered at or after this ISO 8601 date or date-time.",
        "created_before": "Registered before this ISO 8601 date or date-time.",
    }

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        # A page is plain rows read by SQL compiled once per query shape (SummaryPage, in
        # place of a queryset for the filters and the paginator) plus one grouped query of
        # proof counts, turned into the same document as Experiment.to_dict without
        # building model instances.
        visible = SummaryPage.visible_to(get_access(request))
        page = cast(
            "list[dict[str, Any]] | None",
            self.paginate_queryset(self.filter_queryset(visible)),  # type: ignore[arg-type]
        )
        assert page is not None
        statuses = proof_statuses()
        return self.get_paginated_response([summary_dict(row, statuses) for row in page])

    def get_queryset(self) -> ExperimentQuerySet:
        return Experiment.objects.visible_to(get_access(self.request))

    @extend_schema(
        request=PolymorphicProxySerializer(
            component_name="ExperimentRegistration",
            serializers=[ExperimentByOwnerSerializer, ExperimentByIdSerializer],
            resource_type_field_name=None,
        ),
        responses={201: ExperimentSerializer},
    )
    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Register an experiment (trainers and admins of its owner).

        An owner that does not exist or is out of sight is one 404 (``does_not_exist``);
        a name already registered is 409 ``exists``.
        """
        registration = ExperimentRegistration(data=request.data, context={"request": request})
        registration.is_valid(raise_exception=True)
        data = registration.validated_data
        try:
            with transaction.atomic():
                experiment = Experiment.register(
                    data["owner"],
                    data["name"],
                    data["spec"],
                    user=_user(request),
                    ip=client_ip(request.META),
                )
        except IntegrityError:
            # Lost a race with a concurrent registration of the same name.
            raise ConflictError(
                f"{data['owner'].slug}/{data['name']} is already registered.",
                code="exists",
                field="name",
            ) from None
        Experiment.summarize([experiment])
        return Response(experiment.to_dict(), status=status.HTTP_201_CREATED)


def _experiment(request: Request, owner: str, name: str) -> Experiment:
    experiment = (
        Experiment.objects.visible_to(get_access(request))
        .with_summary()
        .filter(owner__slug=owner, name=name)
        .first()
    )
    if experiment is None:
        raise NotFoundError(f"No experiment {owner}/{name}.")
    return experiment


class ExperimentDetail(APIView):
    permission_classes = [HasCapability]

    @extend_schema(responses=ExperimentSerializer)
    def get(self, request: Request, owner: str, name: str) -> Response:
        """An experiment and its current spec (``spec_digest`` goes into the transcript)."""
        # The list's row path (cached SQL, no model instances); the same document as
        # Experiment.to_dict.
        visible = SummaryPage.visible_to(get_access(request))
        rows = visible.filter(owner__slug=owner, name=name)[:1]
        if not rows:
            raise NotFoundError(f"No experiment {owner}/{name}.")
        return Response(summary_dict(rows[0], proof_statuses()))


class SpecList(APIView):
    permission_classes = [HasCapability]

    @extend_schema(responses=SpecSerializer(many=True))
    def get(self, request: Request, owner: str, name: str) -> Response:
        """Every version of the experiment's spec, newest first."""
        experiment = _experiment(request, owner, name)
        return Response(SpecSerializer(experiment.specs.all(), many=True).data)

    @extend_schema(request=SpecSerializer, responses={200: SpecSerializer, 201: SpecSerializer})
    def post(self, request: Request, owner: str, name: str) -> Response:
        """Change the spec: in place while no proof names it, else as a new version (201)."""
        experiment = _experiment(request, owner, name)
        require(request, Capability.WRITE, experiment.owner_id)
        serializer = SpecSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        before = experiment.current_spec_id
        spec, _ = experiment.revise_spec(
            serializer.validated_data, user=_user(request), ip=client_ip(request.META)
        )
        created = spec.pk != before
        return Response(
            SpecSerializer(spec).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class SpecDetail(APIView):
    permission_classes = [HasCapability]

    @extend_schema(responses=SpecSerializer)
    def get(self, request: Request, owner: str, name: str, version: int) -> Response:
        """One spec version, with the canonical document its digest is computed over."""
        experiment = _experiment(request, owner, name)
        spec = ExperimentSpec.objects.filter(experiment=experiment, version=version).first()
        if spec is None:
            raise NotFoundError(f"{experiment.full_name} has no spec version {version}.")
        data = dict(SpecSerializer(spec).data)
        data["canonical"] = spec.canonical_document()
        return Response(data)


# --- Proofs and jobs --------------------------------------------------------------------


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
        if replay.expire_if_due(proof):
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


def _proof(request: Request, pk: int) -> Proof:
    """A proof the caller may read (404 otherwise), its deadline checked on read."""
    proof = (
        Proof.objects.filter(get_access(request).orgs(Capability.READ, "experiment__owner_id"))
        .select_related("experiment__owner", "transcript")
        .filter(pk=pk)
        .first()
    )
    if proof is None:
        raise NotFoundError(f"No proof {pk}.")
    if replay.expire_if_due(proof):
        proof.refresh_from_db()
    return proof


class ChallengePage(CursorPage):
    """Challenges in step order, 100 a page."""

    page_size = 100
    max_page_size = 500
    ordering = ("step", "id")


class ChallengeList(generics.ListAPIView[Challenge]):
    """The platform's challenges of a proof: pending ones list the files they need."""

    serializer_class = ChallengeSerializer
    permission_classes = [HasCapability]
    pagination_class = ChallengePage
    filter_backends = [QueryFilters]
    query_filters = {
        "status": ("status", frozenset(ChallengeStatus.values)),
        "origin": ("origin", frozenset(ChallengeOrigin.values)),
    }

    def get_queryset(self) -> QuerySet[Challenge]:
        proof = _proof(self.request, int(self.kwargs["pk"]))
        return Challenge.objects.filter(proof=proof)


class ProofArtifacts(APIView):
    """The files of a proof directory attached for replay (artifacts: trainers, admins)."""

    permission_classes = [HasCapability]

    @extend_schema(responses=ProofArtifactSerializer(many=True))
    def get(self, request: Request, pk: int) -> Response:
        """The attached files, by name."""
        proof = _proof(request, pk)
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
        proof = _proof(request, pk)
        require(request, Capability.WRITE, proof.experiment.owner_id)
        body = ArtifactListSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        claims = [replay.FileClaim(**item) for item in body.validated_data["files"]]
        if proof.is_final:
            raise ConflictError(
                f"proof {proof.pk} is final ({proof.status}); its files can no longer change",
                code="proof_final",
                field="files",
                detail={"status": proof.status},
            )
        artifacts, fresh = replay.attach(
            proof,
            claims,
            user=_user(request),
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


class AuditEventList(generics.ListAPIView[AuditEvent]):
    """The append-only audit trail of the organisations the caller audits."""

    serializer_class = AuditEventSerializer
    permission_classes = [HasCapability]
    required_capability = Capability.AUDIT
    pagination_class = CursorPage
    filter_backends = [QueryFilters]
    query_filters = {
        "action": ("action", None),
        "organization": ("organization__slug", None),
        "target_type": ("target_type", None),
        "target_id": ("target_id", None),
        "after": ("created__gte", datetime),
        "before": ("created__lt", datetime),
    }

    def get_queryset(self) -> QuerySet[AuditEvent]:
        queryset = AuditEvent.objects.filter(get_access(self.request).orgs(Capability.AUDIT))
        return queryset.select_related("organization")


# --- Uploads ----------------------------------------------------------------------------


class UploadList(generics.ListCreateAPIView[Upload]):
    """Upload sessions: artifacts, so visible to the lab's trainers and admins only."""

    serializer_class = UploadSerializer
    permission_classes = [HasCapability]
    pagination_class = CursorPage
    filter_backends = [QueryFilters]
    query_filters = {
        "status": ("status", frozenset(UploadStatus.values)),
        "kind": ("kind", frozenset(ArtifactKind.values)),
        "experiment": ("experiment__full_name", None),
        "sha256": ("sha256", None),
    }
    query_filter_help = {"sha256": "Uploads of the blob with this SHA-256 (hex)."}

    @property
    def required_capability(self) -> str:
        return Capability.ARTIFACTS if self.request.method == "GET" else Capability.WRITE

    def get_queryset(self) -> QuerySet[Upload]:
        queryset = Upload.objects.filter(get_access(self.request).orgs(Capability.ARTIFACTS))
        return queryset.select_related("experiment__owner", "blob", "proof").prefetch_related(
            "parts"
        )

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Open an upload: declare experiment, kind, total size and whole-blob SHA-256.

        An experiment that does not exist and one out of sight are one 404
        (``does_not_exist``, field ``experiment``).
        """
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        full_name = data["experiment"]["full_name"]
        experiment = (
            Experiment.objects.visible_to(get_access(request))
            .by_full_name(full_name)
            .select_related("owner", "current_spec")
            .first()
        )
        if experiment is None:
            raise NotFoundError(
                f"No experiment {full_name!r}.", code="does_not_exist", field="experiment"
            )
        require(request, Capability.WRITE, experiment.owner_id)
        upload = uploads.create(
            experiment=experiment,
            kind=data["kind"],
            size=data["size"],
            sha256=data["sha256"],
            user=request.user,  # type: ignore[arg-type]
            ip=client_ip(request.META),
            name=data.get("name") or "",
        )
        return Response(UploadSerializer(upload).data, status=status.HTTP_201_CREATED)


def _upload(request: Request, pk: Any, capability: str) -> Upload:
    """An upload the caller may read (404 otherwise) and act on with ``capability``.

    Changing an upload (parts, completion, abort) is for its creator and the lab's
    admins: another trainer of the lab sees it but may not touch it (403).
    """
    access = get_access(request)
    upload = (
        Upload.objects.filter(access.orgs(Capability.READ))
        .select_related("experiment__owner", "blob")
        .filter(pk=pk)
        .first()
    )
    if upload is None:
        raise NotFoundError(f"No upload {pk}.")
    require(request, capability, upload.organization_id)
    if capability == Capability.WRITE and not (
        upload.created_by_id == request.user.pk
        or access.can(Capability.MANAGE, upload.organization_id)
    ):
        raise PermissionDenied(
            f"Upload {pk} was opened by another member; only they and the organisation's "
            "admins may send its parts, complete or abort it."
        )
    return upload


class UploadDetail(APIView):
    permission_classes = [HasCapability]

    @extend_schema(responses=UploadSerializer)
    def get(self, request: Request, pk: Any) -> Response:
        """The upload's state and the parts received so far (to resume after a failure).

        For a direct upload (``direct``: parts go straight to object storage), ``parts``
        are the declared parts object storage holds with their declared size.
        """
        upload = _upload(request, pk, Capability.ARTIFACTS)
        context = {"direct_parts": uploads.direct_parts(upload)} if upload.direct else {}
        return Response(UploadSerializer(upload, context=context).data)


class UploadAbort(APIView):
    permission_classes = [HasCapability]

    @extend_schema(request=None, responses={200: UploadSerializer})
    def post(self, request: Request, pk: Any) -> Response:
        """Abort: remove every staged part. Aborting an aborted upload is harmless.

        The upload stays readable, with status ``aborted``.
        """
        upload = _upload(request, pk, Capability.WRITE)
        uploads.abort(upload, user=request.user, ip=client_ip(request.META))  # type: ignore[arg-type]
        return Response(UploadSerializer(upload).data)


class UploadPartView(APIView):
    permission_classes = [HasCapability]
    # The body is streamed from request.stream; DRF's parsers never read it.
    parser_classes: list[Any] = []

    @extend_schema(
        request={"application/octet-stream": OpenApiTypes.BINARY},
        parameters=[
            OpenApiParameter(
                "number",
                {"type": "integer", "minimum": 1, "maximum": uploads.MAX_PARTS},
                OpenApiParameter.PATH,
                description=f"The part's number, 1 to {uploads.MAX_PARTS}.",
            ),
            OpenApiParameter(
                uploads.PART_DIGEST_HEADER,
                {"type": "string", "pattern": "^[0-9a-fA-F]{64}$"},
                OpenApiParameter.HEADER,
                required=True,
                description="SHA-256 (hex) of this part's bytes.",
            ),
        ],
        responses=inline_serializer(
            "UploadPartResult",
            {
                "number": serializers.IntegerField(),
                "size": serializers.IntegerField(),
                "sha256": serializers.CharField(),
            },
        ),
    )
    def put(self, request: Request, pk: Any, number: int) -> Response:
        """Send part ``number`` (1-based). Sending a part again replaces it."""
        upload = _upload(request, pk, Capability.WRITE)
        length = request.META.get("CONTENT_LENGTH")
        try:
            content_length = int(length) if length not in (None, "") else None
        except ValueError:
            content_length = None
        if content_length is None:
            # Django reads nothing from a body of unknown length; say so instead of
            # reporting the digest of an empty part.
            raise LengthRequiredError(field="Content-Length")
        part = uploads.put_part(
            upload,
            int(number),
            stream=request.stream if request.stream is not None else _empty(),
            declared_sha256=request.headers.get(uploads.PART_DIGEST_HEADER),
            content_length=content_length,
        )
        return Response({"number": part.number, "size": part.size, "sha256": part.sha256})


def _empty() -> Any:
    import io

    return io.BytesIO(b"")


class UploadPartURL(APIView):
    permission_classes = [HasCapability]

    @extend_schema(
        request=UploadPartURLRequestSerializer,
        parameters=[
            OpenApiParameter(
                "number",
                {"type": "integer", "minimum": 1, "maximum": uploads.MAX_PARTS},
                OpenApiParameter.PATH,
                description=f"The part's number, 1 to {uploads.MAX_PARTS}.",
            )
        ],
        responses=inline_serializer(
            "UploadPartURL",
            {
                "number": serializers.IntegerField(),
                "size": serializers.IntegerField(),
                "sha256": serializers.CharField(),
                "method": serializers.CharField(),
                "url": serializers.CharField(),
                "headers": serializers.DictField(child=serializers.CharField()),
                "expires": serializers.DateTimeField(),
            },
        ),
    )
    def post(self, request: Request, pk: Any, number: int) -> Response:
        """Declare part ``number`` of a direct upload; returns where to PUT it.

        The URL is presigned for object storage: it is valid for this upload's object, this
        part number, the declared ``size`` (Content-Length) and ``sha256`` (sent as
        ``x-amz-checksum-sha256``, base64), until ``expires``. Send exactly ``headers``.
        Declaring a part again replaces its declaration (a new URL).
        """
        upload = _upload(request, pk, Capability.WRITE)
        serializer = UploadPartURLRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = uploads.declare_part(
            upload,
            int(number),
            size=serializer.validated_data["size"],
            sha256=serializer.validated_data["sha256"],
        )
        return Response(
            {
                "number": issued.part.number,
                "size": issued.part.size,
                "sha256": issued.part.sha256,
                "method": "PUT",
                "url": issued.url,
                "headers": issued.headers,
                "expires": api_datetime(issued.expires),
            }
        )


class UploadComplete(APIView):
    permission_classes = [HasCapability]

    @extend_schema(request=None, responses=UploadSerializer)
    def post(self, request: Request, pk: Any) -> Response:
        """Assemble and verify the blob; a transcript is filed as a proof and verified."""
        upload = _upload(request, pk, Capability.WRITE)
        upload = uploads.complete(upload, user=request.user, ip=client_ip(request.META))  # type: ignore[arg-type]
        return Response(UploadSerializer(upload).data)


class UnknownEndpoint(APIView):
    """Any other path under /api/v1/: a 404 in the API's error format, not an HTML page."""

    permission_classes: list[Any] = []
    schema = None

    def _missing(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        raise NotFoundError(f"No API endpoint {request.path}; see /api/v1/docs/.", field="path")

    get = post = put = patch = delete = head = options = _missing
