"""Errors of organisations and memberships (kinds: ``attestations.core.errors``)."""

from __future__ import annotations

from attestations.core.errors import ConflictError, InvalidRequestError


class RoleNotAllowedError(InvalidRequestError):
    """A role the organisation's kind does not have (regulator in a lab, say)."""

    default_code = "role_not_allowed"


class LastAdminError(ConflictError):
    default_code = "last_admin"


class RegulatorConflictError(ConflictError):
    """A regulator joining a lab, or a lab member an agency."""

    default_code = "regulator_conflict"


class AgencyMembersError(ConflictError):
    """An agency's membership is changed through the API (only the operator changes it)."""

    default_code = "agency_members"


class InvitationRequiredError(ConflictError):
    """Someone who is not a member joins only by accepting an invitation."""

    default_code = "invitation_required"


class AlreadyMemberError(ConflictError):
    default_code = "already_member"


class InvitationClosedError(ConflictError):
    """An invitation already accepted, declined, revoked or expired."""

    default_code = "invitation_closed"
