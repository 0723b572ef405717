"""API key authentication for DRF: ``Authorization: Bearer dvb_…`` (or ``Api-Key dvb_…``)."""

from __future__ import annotations

import hmac
from datetime import timedelta
from functools import cache
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import connections
from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from attestations.accounts.models import (
    API_KEY_PREFIX,
    ApiKey,
    Membership,
    Organization,
    remember_memberships,
)
from attestations.core.db import prepared_cursor
from attestations.http.throttling import check_api_key_failures, count_api_key_failure

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
        key = authenticate_key(raw)
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


# --- The per-request key lookup -------------------------------------------------------
# Every API request authenticates, so this is the hottest query of the platform. It is
# ApiKey.authenticate's logic over one hand-built SQL statement (key and user in one
# round trip): building the same query through the ORM cost more than running it
# (~0.9 ms to compile, ~0.6 ms to execute, measured on the 2-core CI machine).


Converter = tuple[list[Any], Any]


@cache
def _key_query(vendor: str) -> tuple[str, list[str], list[str], list[Converter]]:
    connection = connections["default"]
    quote = connection.ops.quote_name
    user_model = get_user_model()
    key_fields = list(ApiKey._meta.concrete_fields)
    user_fields = list(user_model._meta.concrete_fields)

    def column(field: Any) -> str:
        return quote(str(field.column))

    columns = [f"k.{column(f)}" for f in key_fields] + [f"u.{column(f)}" for f in user_fields]
    # Only names from the models' metadata, quoted; the lookup value is a parameter.
    table, users = quote(ApiKey._meta.db_table), quote(user_model._meta.db_table)
    user_pk, user_fk = column(user_model._meta.pk), column(ApiKey._meta.get_field("user"))
    lookup = column(ApiKey._meta.get_field("lookup"))
    # The user's memberships ride along (one row each, or one row of NULLs), so the
    # request's Access needs no second round trip (Access.for_user, remember_memberships).
    members, orgs = quote(Membership._meta.db_table), quote(Organization._meta.db_table)
    member_user, member_org = (
        column(Membership._meta.get_field("user")),
        column(Membership._meta.get_field("organization")),
    )
    columns += [
        f"m.{member_org}",
        f"m.{column(Membership._meta.get_field('role'))}",
        f"o.{column(Organization._meta.get_field('kind'))}",
    ]
    select = ", ".join(columns)
    sql = (
        f"SELECT {select} FROM {table} k JOIN {users} u ON u.{user_pk} = k.{user_fk} "  # noqa: S608
        f"LEFT JOIN {members} m ON m.{member_user} = u.{user_pk} "
        f"LEFT JOIN {orgs} o ON o.{column(Organization._meta.pk)} = m.{member_org} "
        f"WHERE k.{lookup} = %s"
    )
    # What the ORM's compiler applies to each column (SQLite's datetimes arrive as text).
    converters: list[Converter] = []
    for field in key_fields + user_fields:
        expression = field.get_col(field.model._meta.db_table)
        found = connection.ops.get_db_converters(expression) + field.get_db_converters(connection)
        converters.append((found, expression))
    return sql, [f.attname for f in key_fields], [f.attname for f in user_fields], converters


def _fetch_key(lookup: str) -> ApiKey | None:
    connection = connections["default"]
    sql, key_names, user_names, converters = _key_query(connection.vendor)
    with prepared_cursor() as cursor:
        cursor.execute(sql, [lookup])
        rows = cursor.fetchall()
    if not rows:
        return None
    *values, _, _, _ = rows[0]
    for index, (functions, expression) in enumerate(converters):
        for function in functions:
            values[index] = function(values[index], expression, connection)
    split = len(key_names)
    key = ApiKey.from_db("default", key_names, values[:split])
    key.user = get_user_model().from_db("default", user_names, values[split:])
    memberships = [(org, role, kind) for *_, org, role, kind in rows if org is not None]
    remember_memberships(key.user, memberships)
    return key


def authenticate_key(raw: str) -> ApiKey | None:
    """The active key matching ``raw``, or None; as :meth:`ApiKey.authenticate`.

    The stored SHA-256 is compared with ``hmac.compare_digest`` (constant time), and
    ``last_used`` is written at most once a minute.
    """
    parts = raw.split("_", 2)
    if len(parts) != 3 or parts[0] != API_KEY_PREFIX or not parts[1].isalnum():
        return None
    key = _fetch_key(parts[1])
    if key is None or not hmac.compare_digest(key.digest, ApiKey.hash(raw)):
        return None
    if not key.is_active:
        return None
    now = timezone.now()
    if key.last_used is None or now - key.last_used > timedelta(minutes=1):
        ApiKey.objects.filter(pk=key.pk).update(last_used=now)
        key.last_used = now
    return key


def _register_schema_extension() -> Any:
    from drf_spectacular.extensions import OpenApiAuthenticationExtension

    class _Extension(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
        target_class = "attestations.http.authentication.ApiKeyAuthentication"
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
