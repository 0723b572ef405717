"""Typed readers for settings that come from the environment.

Every reader fails loudly with :class:`~django.core.exceptions.ImproperlyConfigured`
naming the variable and the value it could not understand, in the manner of
healthchecks' ``envbool``/``envint``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def envstr(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def envbool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(
        f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no"
    )


def envint(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be at least {minimum}")
    return value


def envfloat(
    name: str, default: float, *, minimum: float | None = None, maximum: float | None = None
) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None
    if value != value:  # NaN compares false with every bound, so it would slip past them
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number")
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{name}={value} must be at most {maximum}")
    return value


def envlist(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def envchoice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name, default)
    if raw not in choices:
        raise ImproperlyConfigured(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return raw


_RATE = re.compile(r"^\s*\d+\s*/\s*(s|sec|second|m|min|minute|h|hour|d|day)\s*$")


def envrate(name: str, default: str) -> str | None:
    """A rate limit ``"<count>/<second|minute|hour|day>"``, or None for ``off``."""
    raw = os.environ.get(name, default)
    if raw.strip().lower() == "off":
        return None
    if not _RATE.match(raw):
        raise ImproperlyConfigured(
            f"{name}={raw!r} is not a rate; use '<count>/<second|minute|hour|day>' or 'off'"
        )
    return raw.strip()


@dataclass(frozen=True)
class DatabaseURL:
    engine: str
    name: str
    user: str
    password: str
    host: str
    port: str
    options: dict[str, str]

    def as_django(self) -> dict[str, object]:
        config: dict[str, object] = {
            "ENGINE": self.engine,
            "NAME": self.name,
            "USER": self.user,
            "PASSWORD": self.password,
            "HOST": self.host,
            "PORT": self.port,
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
        options: dict[str, object] = dict(self.options)
        # psycopg prepares a statement on its fifth run in a connection; only cursors that
        # bind on the server do (attestations.core.db.prepared_cursor: the per-request
        # reads). ``?prepare_threshold=none`` turns it off, for a pooler that cannot keep
        # prepared statements (PgBouncer in transaction mode before 1.21).
        threshold = options.pop("prepare_threshold", "5")
        options["prepare_threshold"] = _threshold(str(threshold))
        config["OPTIONS"] = options
        return config


def _threshold(raw: str) -> int | None:
    if raw.strip().lower() in {"none", "off"}:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ImproperlyConfigured(
            f"DATABASE_URL's prepare_threshold={raw!r} is not a count of runs or 'none'"
        )
    return value


def parse_database_url(name: str, raw: str) -> DatabaseURL:
    """Parse ``postgres://user:password@host:port/dbname?sslmode=require``."""
    parts = urlsplit(raw)
    if parts.scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ImproperlyConfigured(
            f"{name} must be a postgres:// URL (got scheme {parts.scheme!r}); "
            "unset it to use the embedded SQLite database"
        )
    database = unquote(parts.path.lstrip("/"))
    if not database:
        raise ImproperlyConfigured(f"{name} names no database (expected postgres://host/dbname)")
    try:
        port = str(parts.port or "")
    except ValueError:
        raise ImproperlyConfigured(f"{name} has an invalid port") from None
    options = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    return DatabaseURL(
        engine="django.db.backends.postgresql",
        name=database,
        user=unquote(parts.username or ""),
        password=unquote(parts.password or ""),
        host=unquote(parts.hostname or ""),
        port=port,
        options=options,
    )


def check_redis_url(name: str, raw: str) -> str:
    parts = urlsplit(raw)
    if parts.scheme not in {"redis", "rediss", "unix"}:
        raise ImproperlyConfigured(
            f"{name} must be a redis:// or rediss:// URL (got {parts.scheme!r})"
        )
    return raw
