"""Template filters of the auditors' report (``attestations/report_body.html``)."""

from __future__ import annotations

import re
from typing import Any

from django import template

register = template.Library()

#: A hex run long enough to be a digest (128-bit and up).
_HEX_RUN = re.compile(r"[0-9a-f]{32,}")


@register.filter
def hexgroups(value: Any, enabled: bool = True) -> str:
    """Break long hex digests in ``value`` into groups of 16, as fingerprints are printed.

    For the PDF: a layout engine may then wrap a digest only between groups, never
    through a word of the text around it. With ``enabled`` false (the HTML page, where
    CSS wraps and a digest must stay one token to copy) the text is returned unchanged.
    """
    text = "" if value is None else str(value)
    if not enabled:
        return text
    return _HEX_RUN.sub(
        lambda match: " ".join(
            match.group(0)[i : i + 16] for i in range(0, len(match.group(0)), 16)
        ),
        text,
    )


@register.filter
def percent(value: Any) -> str:
    """A probability as a percentage with up to four significant digits (``95%``, ``43.61%``)."""
    if value is None or value == "":
        return "—"
    number = float(value) * 100
    return f"{number:.4g}%"


@register.filter
def worst_margin(rows: Any) -> float | None:
    """The largest divergence-to-bound ratio of ``[[step, margin], ...]`` (None: none)."""
    margins = [row[1] for row in rows or () if isinstance(row, list | tuple) and len(row) == 2]
    numbers = [float(m) for m in margins if isinstance(m, int | float)]
    return max(numbers) if numbers else None
