"""Fixtures for the reliability tests: the attestations actors and world (``base.py``)."""

from __future__ import annotations

from tests.attestations.base import api, storage, world

__all__ = ["api", "storage", "world"]
