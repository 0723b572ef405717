"""``/health``: database, broker and storage status as JSON, 503 when one is down."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage, storages
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET


def _database() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return connection.vendor


def _broker() -> str:
    if settings.CELERY_TASK_ALWAYS_EAGER:
        return "in-process"
    from config.celery_app import app

    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=2)
    return conn.transport_cls if isinstance(conn.transport_cls, str) else "redis"


def _storage() -> str:
    name = default_storage.save(f"health/{secrets.token_hex(8)}", ContentFile(b"ok"))
    try:
        with default_storage.open(name) as handle:
            if handle.read() != b"ok":
                raise OSError("storage returned different bytes than were written")
    finally:
        default_storage.delete(name)
    # default_storage is a lazy proxy; name the configured backend, not the proxy.
    return type(storages["default"]).__name__


CHECKS: dict[str, Callable[[], str]] = {
    "database": _database,
    "broker": _broker,
    "storage": _storage,
}


@never_cache
@require_GET
def health(request: HttpRequest) -> JsonResponse:
    components: dict[str, dict[str, str]] = {}
    for name, check in CHECKS.items():
        try:
            components[name] = {"status": "ok", "backend": check()}
        except Exception as error:  # noqa: BLE001 - any failure means "down", with its reason
            components[name] = {"status": "down", "error": f"{type(error).__name__}: {error}"}
    healthy = all(item["status"] == "ok" for item in components.values())
    return JsonResponse(
        {"status": "ok" if healthy else "down", "components": components},
        status=200 if healthy else 503,
    )
