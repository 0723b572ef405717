"""Errors a task's retry may cure, shared by the apps' Celery tasks."""

from __future__ import annotations

from django.db import DatabaseError, InterfaceError, OperationalError
from kombu.exceptions import OperationalError as KombuOperationalError

#: Errors a retry may cure: the database, the broker or the disk were briefly unavailable.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseError,
    InterfaceError,
    OperationalError,
    KombuOperationalError,
    OSError,
)

__all__ = ["TRANSIENT_ERRORS"]
