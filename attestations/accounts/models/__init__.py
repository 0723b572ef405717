"""Organisations, their members and roles, invitations, and personal API keys.

Behaviour lives in the models (fat models, thin views), one module of this package per
noun: the kinds of organisation and their roles (``organizations``: a lab trains and
files proofs; an agency holds regulators), the access rules of :class:`Membership`
(``memberships``) and :class:`Access` (``access``), consent to join (:class:`Invitation`,
``invitations``), and issuing and checking :class:`ApiKey` (``api_keys``). Every change
is recorded in the audit trail (``attestations.audit``). The names this package exports
are the app's models and rules, imported from ``attestations.accounts.models``.
"""

from __future__ import annotations

from attestations.accounts.models.access import Access, remember_memberships
from attestations.accounts.models.api_keys import API_KEY_PREFIX, ApiKey, ApiKeyQuerySet
from attestations.accounts.models.invitations import Invitation, InvitationStatus
from attestations.accounts.models.memberships import (
    Membership,
    check_role,
    check_role_allowed,
    not_a_member,
)
from attestations.accounts.models.organizations import (
    AGENCY_ROLES,
    LAB_ROLE_CHOICES,
    LAB_ROLES,
    ROLE_CAPABILITIES,
    Capability,
    Organization,
    OrganizationKind,
    Role,
)

__all__ = [
    "AGENCY_ROLES",
    "API_KEY_PREFIX",
    "LAB_ROLES",
    "LAB_ROLE_CHOICES",
    "ROLE_CAPABILITIES",
    "Access",
    "ApiKey",
    "ApiKeyQuerySet",
    "Capability",
    "Invitation",
    "InvitationStatus",
    "Membership",
    "Organization",
    "OrganizationKind",
    "Role",
    "check_role",
    "check_role_allowed",
    "not_a_member",
    "remember_memberships",
]
