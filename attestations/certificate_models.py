"""Signing keys, attestation certificates and the transparency log (models)."""

from __future__ import annotations

__all__: list[str] = []
