"""The API of organisations, their members and invitations, the caller, and API keys.

Routes: ``me/``, ``organizations/`` (members, invitations), ``invitations/`` and ``keys/``
(``attestations/api/urls.py``). Every queryset is filtered by
:class:`~attestations.accounts.models.Access`, so an object in an organisation the user
cannot read answers 404; a visible object the user's role may not act on answers 403
(:func:`~attestations.http.permissions.require`).
"""

from __future__ import annotations

import re
from typing import Any

from django.contrib.auth.models import User
from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import (
    extend_schema,
    extend_schema_field,
    extend_schema_serializer,
    inline_serializer,
)
from rest_framework import generics, serializers, status
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from attestations.accounts.models import (
    LAB_ROLE_CHOICES,
    ApiKey,
    Capability,
    Invitation,
    InvitationStatus,
    Membership,
    Organization,
    Role,
    not_a_member,
)
from attestations.core.conf import api_datetime, client_ip, dvbench_int
from attestations.core.errors import InvalidRequestError, NotFoundError
from attestations.http import sudo
from attestations.http.fields import StrictCharField, StrictIntegerField
from attestations.http.pagination import CursorPage
from attestations.http.permissions import HasCapability, authenticated_user, get_access, require
from attestations.http.schema import error_response
from attestations.http.sudo import API_KEY_CANNOT_CREATE_KEYS, require_sudo


class OrganizationSerializer(serializers.ModelSerializer[Organization]):
    role = serializers.SerializerMethodField()

    class Meta:
        model = Organization
        fields = ["slug", "name", "kind", "created", "role"]

    @extend_schema_field(serializers.ChoiceField(choices=Role.choices, allow_null=True))
    def get_role(self, org: Organization) -> str | None:
        access = self.context.get("access")
        return access.roles.get(org.pk) if access is not None else None


#: Django's username rule (``UnicodeUsernameValidator``), for the schema and the fields.
USERNAME_PATTERN = r"^[\w.@+-]{1,150}$"


@extend_schema_field({"type": "string", "pattern": USERNAME_PATTERN, "maxLength": 150})
class UsernameField(StrictCharField):
    """A username, checked for its form only: whether anyone holds it is never revealed."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 150)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if not re.fullmatch(USERNAME_PATTERN, value):
            raise serializers.ValidationError(
                "Enter a username: letters, digits and @ . + - _ only.", code="invalid"
            )
        return value


class MembershipSerializer(serializers.ModelSerializer[Membership]):
    """A member and their role. POST changes an existing member's role."""

    username = UsernameField(source="user.username")
    role = serializers.ChoiceField(
        choices=LAB_ROLE_CHOICES,
        help_text="A lab's roles. Regulators exist only in agencies, granted by the operator.",
    )

    class Meta:
        model = Membership
        fields = ["username", "role", "created"]
        read_only_fields = ["created"]

    def to_representation(self, instance: Membership) -> dict[str, Any]:
        # Agency members are regulators, a role this serializer does not accept as input.
        return {
            "username": instance.user.get_username(),
            "role": instance.role,
            "created": api_datetime(instance.created),
        }


@extend_schema_serializer(component_name="Member")
class MemberOutSerializer(serializers.Serializer[Membership]):
    """How a member is shown (an agency's members are regulators)."""

    username = serializers.CharField()
    role = serializers.ChoiceField(choices=Role.choices)
    created = serializers.DateTimeField()


class InvitationSerializer(serializers.ModelSerializer[Invitation]):
    """An invitation to join a lab: POST offers one (admins); the invitee accepts it."""

    username = UsernameField(help_text="Who is invited (the answer is the same for any name).")
    role = serializers.ChoiceField(choices=LAB_ROLE_CHOICES)
    organization: serializers.SlugRelatedField[Organization] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    invited_by: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True, help_text="The admin who invited."
    )

    class Meta:
        model = Invitation
        fields = [
            "id",
            "organization",
            "username",
            "role",
            "status",
            "invited_by",
            "created",
            "expires",
            "responded",
        ]
        read_only_fields = ["id", "status", "created", "expires", "responded"]


class MeSerializer(serializers.Serializer[Any]):
    username = serializers.CharField()
    is_regulator = serializers.BooleanField()
    organizations = OrganizationSerializer(many=True)


class ApiKeySerializer(serializers.ModelSerializer[ApiKey]):
    prefix = serializers.CharField(read_only=True)
    is_active = serializers.BooleanField(read_only=True)
    name = StrictCharField(max_length=100, help_text="Where the key will live, e.g. 'ci'.")
    days = StrictIntegerField(write_only=True, required=False, min_value=1)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The policy's maximum as configured now (a longer lifetime is a 400, not clamped).
        longest = dvbench_int("API_KEY_MAX_DAYS")
        self.fields["days"] = StrictIntegerField(
            write_only=True,
            required=False,
            min_value=1,
            max_value=longest,
            help_text=f"Lifetime in days, 1 to {longest} (DVBENCH_API_KEY_MAX_DAYS); "
            f"{dvbench_int('API_KEY_TTL_DAYS')} if absent.",
        )

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "created",
            "expires",
            "revoked",
            "last_used",
            "is_active",
            "days",
        ]
        read_only_fields = ["id", "created", "expires", "revoked", "last_used"]


class NewApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The key itself, shown only once.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


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
        page = self.paginate_queryset(self.filter_queryset(rows))
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
            actor=authenticated_user(request),
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
        membership.remove(actor=authenticated_user(request), ip=client_ip(request.META))
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
        page = self.paginate_queryset(self.filter_queryset(rows))
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
            actor=authenticated_user(request),
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
        invitation.revoke(actor=authenticated_user(request), ip=client_ip(request.META))
        return Response(status=status.HTTP_204_NO_CONTENT)


class MyInvitationList(generics.ListAPIView[Invitation]):
    """Invitations waiting for the caller's answer."""

    serializer_class = InvitationSerializer
    pagination_class = CursorPage

    def get_queryset(self) -> QuerySet[Invitation]:
        return Invitation.pending_for(authenticated_user(self.request)).select_related("user")


def _my_invitation(request: Request, pk: Any) -> Invitation:
    invitation = (
        Invitation.objects.filter(user=authenticated_user(request), pk=pk)
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
            authenticated_user(request),
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
        key = ApiKey.objects.filter(user=authenticated_user(request), pk=pk).first()
        if key is None:
            raise NotFoundError(f"No key {pk}.")
        key.revoke(actor=authenticated_user(request), ip=client_ip(request.META))
        return Response(ApiKeySerializer(key).data)
