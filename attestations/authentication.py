"""API key authentication for DRF: ``Authorization: Bearer dvb_…`` (or ``Api-Key dvb_…``)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from attestations.models import ApiKey
from attestations.throttling import check_api_key_failures, count_api_key_failure

SCHEMES = ("bearer", "api-key")


class ApiKeyAuthentication(authentication.BaseAuthentication):
    """Authenticate a personal API key.

    A request without an ``Authorization`` header (or with another scheme) is left to the
    next authenticator (the browser session); a header that names our scheme but carries
    an unknown, expired or revoked key fails with 401, never falls through.

    Failures are counted per client address (``api_key_failures`` in
    ``DVBENCH_RATE_LIMITS``); past the limit every key from that address is refused with
    429 until the window passes, before any key is looked up. The raw key is never logged
    or put in an error message.
    """

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[AbstractBaseUser, ApiKey] | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        scheme, _, raw = header.partition(" ")
        if scheme.lower() not in SCHEMES:
            return None
        check_api_key_failures(request)
        raw = raw.strip()
        if not raw or " " in raw:
            count_api_key_failure(request)
            raise exceptions.AuthenticationFailed(
                "Malformed Authorization header; expected 'Bearer <api key>'.",
                code="invalid_api_key",
            )
        key = ApiKey.authenticate(raw)
        if key is None:
            count_api_key_failure(request)
            raise exceptions.AuthenticationFailed(
                "Unknown, expired or revoked API key.", code="invalid_api_key"
            )
        if not key.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive.", code="user_inactive")
        return key.user, key

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


def _register_schema_extension() -> Any:
    from drf_spectacular.extensions import OpenApiAuthenticationExtension

    class _Extension(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
        target_class = "attestations.authentication.ApiKeyAuthentication"
        name = "apiKey"

        def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
            return {
                "type": "http",
                "scheme": "bearer",
                "description": "A personal API key, `dvb_<lookup>_<secret>`, created under "
                "API keys. `Authorization: Api-Key <key>` is accepted too.",
            }

    return _Extension


ApiKeyAuthenticationSchemeExtension = _register_schema_extension()
