"""Fixtures for the attestations tests; the actors and helpers live in ``base.py``."""

from __future__ import annotations

from tests.attestations.base import api, storage, world

__all__ = ["api", "storage", "world"]
