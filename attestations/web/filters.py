"""Template filters for the web UI (``{% load dvbench %}``; ``TEMPLATES`` in config/settings.py)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django import template

register = template.Library()


@register.filter
def sci(value: Any) -> str:
    """A large whole number as ``1.2 x 10^25`` (with a multiplication sign) for reading (the exact value goes in a title)."""
    if value is None or value == "":
        return "—"
    number = Decimal(value)
    if abs(number) < 10**7:
        return f"{int(number):,}" if number == number.to_integral_value() else f"{number:,}"
    exponent = len(str(abs(int(number)))) - 1
    mantissa = number / (Decimal(10) ** exponent)
    return f"{mantissa:.2f} \N{MULTIPLICATION SIGN} 10^{exponent}".replace(".00 ", " ")


@register.filter
def short_digest(value: Any, length: int = 12) -> str:
    text = str(value or "")
    return text if len(text) <= length else f"{text[:length]}…"


@register.filter
def percent(value: Any) -> int:
    try:
        return max(0, min(100, round(float(value) * 100)))
    except (TypeError, ValueError):
        return 0
