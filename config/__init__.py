"""Django configuration for the DVBench platform: settings, URLs, WSGI/ASGI and Celery.

This package is deliberately *not* called ``platform``: a top-level package of that
name would shadow the standard library's ``platform`` module, which ``uuid``,
Celery and torch import.
"""

from __future__ import annotations

from config.celery_app import app as celery_app

__all__ = ["celery_app"]
