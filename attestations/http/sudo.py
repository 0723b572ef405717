"""Sudo mode: a signed-in session whose user confirmed their password a few minutes ago.

Creating an API key needs it, on the web page (``/keys/``) and on ``POST /api/v1/keys/``,
as GitHub's sudo mode guards its sensitive actions. A key is a long-lived credential: a
session cookie left in a browser should not be enough to mint one, and a key must never
mint another (revoking a leaked key would then not end the access it gave). So a request
authenticated with an API key is refused outright (:func:`require_sudo`: 403
``api_key_cannot_create_keys``), and a session must have confirmed its password within
``DVBENCH["SUDO_SECONDS"]`` (10 minutes by default; 403 ``password_confirmation_required``
otherwise).

The confirmation lives in the session (``SESSION_KEY``: the user's id and when), so it
ends with the session, at sign-out, and for anyone else signing in on that browser.
Wrong passwords count towards the sign-in limit of the address and the username
(``DVBENCH_RATE_LOGIN_FAILURES``): the form is not a second, unthrottled password oracle.
"""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpRequest
from rest_framework import exceptions
from rest_framework.request import Request

from attestations.accounts.models import ApiKey
from attestations.core.conf import client_ip, dvbench_int
from attestations.http.throttling import count_login_failure, login_wait

SESSION_KEY = "dvbench_sudo"

#: Where a browser confirms its password (the API key page's own form posts there).
CONFIRM_PAGE = "/keys/"


#: Why a request cannot create a key, in the API's error format (403 each).
PASSWORD_CONFIRMATION_REQUIRED = (
    "Creating an API key needs a signed-in session that confirmed its password in the last "
    f"few minutes: confirm it on {CONFIRM_PAGE} (or POST /api/v1/keys/confirm-password/ "
    'with {"password": ...} in that session), then create the key.'
)
API_KEY_CANNOT_CREATE_KEYS = (
    "An API key cannot create API keys (a key it made would outlive its revocation); "
    f"sign in to the web UI and create keys on {CONFIRM_PAGE}."
)


def _session(request: HttpRequest | Request) -> Any:
    return getattr(request, "session", None)


def confirm(request: HttpRequest | Request, password: str) -> bool:
    """Check the signed-in user's password; on success open sudo mode for this session.

    Returns:
        Whether the password was right.

    Raises:
        rest_framework.exceptions.Throttled: past the sign-in failure limit (429; the
            password is then not checked at all, as on the sign-in page).
    """
    user = request.user
    ip, username = client_ip(request.META), user.get_username()
    wait = login_wait(ip, username)
    if wait is not None:
        # DRF adds "Expected available in <wait> seconds." and the Retry-After header.
        raise exceptions.Throttled(
            wait, detail="Too many wrong passwords from this address or for this user."
        )
    if not password or not user.check_password(password):
        count_login_failure(ip, username)
        return False
    session = _session(request)
    assert session is not None, "sudo mode needs the session middleware"
    session[SESSION_KEY] = {"user": user.pk, "at": time.time()}
    return True


def seconds_left(request: HttpRequest | Request) -> int:
    """Seconds of sudo mode left to this request's session (0: none)."""
    session = _session(request)
    if session is None or not request.user.is_authenticated:
        return 0
    mark = session.get(SESSION_KEY)
    if not isinstance(mark, dict) or mark.get("user") != request.user.pk:
        return 0
    at = mark.get("at")
    if not isinstance(at, (int, float)):
        return 0
    left = at + dvbench_int("SUDO_SECONDS") - time.time()
    return max(0, int(left))


def require_sudo(request: Request) -> None:
    """Refuse an API key, and a session without a recent password confirmation.

    Raises:
        rest_framework.exceptions.PermissionDenied: 403 ``api_key_cannot_create_keys``
            for a request authenticated with an API key; 403
            ``password_confirmation_required`` for a session that has not confirmed its
            password within ``DVBENCH["SUDO_SECONDS"]``.
    """
    if isinstance(getattr(request, "auth", None), ApiKey):
        raise exceptions.PermissionDenied(
            API_KEY_CANNOT_CREATE_KEYS, code="api_key_cannot_create_keys"
        )
    if seconds_left(request) <= 0:
        raise exceptions.PermissionDenied(
            PASSWORD_CONFIRMATION_REQUIRED, code="password_confirmation_required"
        )
