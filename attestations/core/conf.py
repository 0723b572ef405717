"""The platform's own settings (``settings.DVBENCH``) and the formats its API writes."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from django.conf import settings


def dvbench_int(name: str) -> int:
    """An integer knob from ``settings.DVBENCH`` (validated when settings load)."""
    knobs: Mapping[str, object] = settings.DVBENCH
    value = knobs[name]
    assert isinstance(value, int), f"DVBENCH[{name!r}] must be an integer"
    return value


def api_datetime(value: datetime | None) -> str | None:
    """A timestamp as the API writes it (DRF's format: ISO 8601, ``Z`` for UTC)."""
    if value is None:
        return None
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def client_ip(meta: Mapping[str, object]) -> str | None:
    """The peer address of a request (``REMOTE_ADDR``; proxies are configured upstream)."""
    value = meta.get("REMOTE_ADDR")
    return str(value) if value else None
