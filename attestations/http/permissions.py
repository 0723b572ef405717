"""Organisation scope and role checks shared by the API and the web pages.

The rule of thumb: an object in an organisation the user cannot *read* does not exist
for them (404, so ids are not probed); an object they can read but not act on is a 403.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest
from rest_framework import exceptions, permissions
from rest_framework.request import Request

from attestations.accounts.models import Access, Capability


def authenticated_user(request: Request) -> User:
    """The authenticated user (for views that require one)."""
    assert isinstance(request.user, User)
    return request.user


def get_access(request: HttpRequest | Request) -> Access:
    """The requesting user's :class:`Access`, computed once per request."""
    cached: Access | None = getattr(request, "_dvbench_access", None)
    if cached is None:
        cached = Access.for_user(request.user)
        request._dvbench_access = cached  # type: ignore[union-attr]
    return cached


def require(request: HttpRequest | Request, capability: str, organization_id: int) -> None:
    """Raise 404 if the organisation is out of sight, 403 if the role lacks ``capability``."""
    access = get_access(request)
    if not access.can_see(organization_id):
        raise exceptions.NotFound()
    if not access.can(capability, organization_id):
        raise exceptions.PermissionDenied(
            f"Your role does not allow '{capability}' in this organisation."
        )


class HasCapability(permissions.BasePermission):
    """View-level gate: the user holds ``view.required_capability`` somewhere.

    Object-level scope is checked by the view's queryset (``access.orgs``) and by
    :func:`require`, so this only turns away users who could never succeed.
    """

    message = "Your role does not allow this action."

    def has_permission(self, request: Request, view: Any) -> bool:
        if not request.user or not request.user.is_authenticated:
            return False
        capability = getattr(view, "required_capability", None)
        if capability is None:
            capability = (
                Capability.READ
                if request.method in permissions.SAFE_METHODS
                else getattr(view, "write_capability", Capability.WRITE)
            )
        return get_access(request).any(capability)
