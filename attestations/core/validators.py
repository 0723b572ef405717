"""Validators of the identifiers every app stores: SHA-256 digests and slugs."""

from __future__ import annotations

import re

from django.core.validators import RegexValidator

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
sha256_validator = RegexValidator(
    SHA256_HEX, "Enter a lowercase hex SHA-256 digest (64 characters)."
)
SLUG = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$")
slug_validator = RegexValidator(
    SLUG, "Use 1-50 lowercase letters, digits or hyphens, not starting or ending with a hyphen."
)
