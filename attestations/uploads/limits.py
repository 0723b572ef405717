"""What an upload and its parts may be: how many parts, how large, named how."""

from __future__ import annotations

from typing import Any

from django.db.models import Sum

from attestations.core.conf import dvbench_int
from attestations.core.errors import InvalidRequestError
from attestations.uploads.errors import SizeExceededError

MAX_PARTS = 10_000
PART_DIGEST_HEADER = "X-Part-SHA256"


def max_blob_bytes() -> int:
    return dvbench_int("MAX_BLOB_BYTES")


def max_part_bytes() -> int:
    return dvbench_int("MAX_PART_BYTES")


def check_part_number(number: int) -> None:
    if not 1 <= number <= MAX_PARTS:
        raise InvalidRequestError(
            f"part number must be between 1 and {MAX_PARTS}, got {number}",
            code="invalid_part_number",
            field="number",
            detail={"minimum": 1, "maximum": MAX_PARTS, "got": number},
        )


def size_exceeded(number: int, total: int, declared: int) -> SizeExceededError:
    return SizeExceededError(
        f"part {number}: the parts received and in flight would hold {total} bytes, more "
        f"than the declared size of {declared}",
        code="size_exceeded",
        field="body",
        detail={"expected": declared, "got": total},
    )


def total_size(queryset: Any) -> int:
    return int(queryset.aggregate(total=Sum("size"))["total"] or 0)
