"""Serializer fields that take JSON as it was sent: a string is a string, an integer an integer.

Shared by every API view (the serializers of ``attestations.api``' modules, one per noun).
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from attestations.core.validators import SHA256_HEX

#: The largest value a 64-bit signed integer column (ids, counts) holds.
INT64_MAX = 2**63 - 1


class StrictCharField(serializers.CharField):
    """A JSON string, and only a string: DRF's CharField would turn ``0`` into ``"0"``.

    Whitespace is kept as sent (trimming would turn ``" "`` into a blank the schema
    allows); a NUL character is refused, as the schema says (``attestations/http/schema.py``).
    """

    default_error_messages = {"invalid": "Enter a string (a JSON string, not a number)."}

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer, and only an integer (DRF's accepts ``"5"``, ``5.0`` and ``true``)."""

    default_error_messages = {"invalid": "Enter a whole number (a JSON integer)."}

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_value", INT64_MAX)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return int(super().to_internal_value(data))


@extend_schema_field({"type": "string", "pattern": "^[0-9a-fA-F]{64}$"})
class Sha256Field(StrictCharField):
    """A SHA-256 hex digest; upper-case input is normalised to lower case."""

    def to_internal_value(self, data: Any) -> str:
        value = str(super().to_internal_value(data)).lower()
        if not SHA256_HEX.match(value):
            raise serializers.ValidationError(
                f"Enter a SHA-256 hex digest of 64 characters, got {len(value)} characters."
                if len(value) != 64
                else "Enter a SHA-256 hex digest (characters 0-9 and a-f only).",
                code="invalid_digest",
            )
        return value
