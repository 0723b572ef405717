"""Rate limits: upload endpoints, API key failures and sign-in failures.

Counters live in Django's cache (Redis when ``REDIS_URL`` is set, so every gunicorn
worker and host shares them; process-local memory otherwise). Rates are read from
``settings.DVBENCH_RATE_LIMITS`` on every check, not frozen at import as DRF's
``SimpleRateThrottle.THROTTLE_RATES`` is, so an operator's change (or a test's override)
takes effect at once. A rate is ``"<count>/<period>"`` with period ``second``, ``minute``,
``hour`` or ``day`` (DRF's syntax); ``None`` switches the limit off.

* ``uploads``: requests to the upload endpoints (create, part, complete, abort), per user.
  The SDK honours ``Retry-After``, so a legitimate client slows down instead of failing.
* ``api_key_failures``: requests with an unknown, expired or revoked API key, per client
  address. Past the limit even a valid key is refused until the window passes, so a key
  cannot be guessed at speed.
* ``login_failures``: failed sign-ins (web login and admin login), per client address and
  per username, so neither one address nor a spread of addresses can guess one password.

Every refusal is a 429 with ``Retry-After``; API refusals are in the API's error format.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

from django.conf import settings
from django.core.cache import cache
from rest_framework import exceptions
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle

from attestations.core.conf import client_ip

_PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

#: The upload endpoints, by URL name in the ``api`` namespace (attestations/api/urls.py).
UPLOAD_URL_NAMES = frozenset({"uploads", "upload", "part", "complete", "abort"})


def parse_rate(rate: str | None) -> tuple[int, int] | None:
    """``"30/minute"`` -> ``(30, 60)``; None for no limit.

    Raises:
        ValueError: the rate is not ``<count>/<period>`` with a known period.
    """
    if rate is None:
        return None
    count, _, period = rate.partition("/")
    if not count.strip().isdigit() or not period.strip() or period.strip()[0] not in _PERIODS:
        raise ValueError(f"rate limit {rate!r} is not '<count>/<second|minute|hour|day>'")
    return int(count), _PERIODS[period.strip()[0]]


def configured_rate(scope: str) -> tuple[int, int] | None:
    rates: dict[str, str | None] = getattr(settings, "DVBENCH_RATE_LIMITS", {})
    return parse_rate(rates.get(scope))


def _key(scope: str, ident: str) -> str:
    # Hashed so that a username or an address never needs escaping for the cache, and so
    # that the cache holds no usernames in clear.
    return f"dvbench:rl:{scope}:{hashlib.sha256(ident.encode('utf-8', 'replace')).hexdigest()[:32]}"


class FixedWindow:
    """A counter per ``(scope, identity)`` over fixed windows of the scope's period.

    Fixed windows need one atomic ``incr`` per hit (no read-modify-write race between
    gunicorn workers, unlike a timestamp history), at the price of allowing up to twice
    the rate across a window boundary: acceptable for abuse limits.
    """

    def __init__(self, scope: str, ident: str) -> None:
        self.scope = scope
        self.rate = configured_rate(scope)
        self.now = time.time()
        if self.rate is not None:
            _, period = self.rate
            self.window = int(self.now // period)
            self.key = f"{_key(scope, ident)}:{self.window}"

    def _retry_after(self) -> int:
        assert self.rate is not None
        _, period = self.rate
        return max(1, math.ceil((self.window + 1) * period - self.now))

    def exceeded(self) -> int | None:
        """Seconds to wait if the limit is already reached, else None (counts nothing)."""
        if self.rate is None:
            return None
        limit, _ = self.rate
        used = cache.get(self.key, 0)
        return self._retry_after() if int(used) >= limit else None

    def hit(self) -> int | None:
        """Count one event; seconds to wait if this event went past the limit, else None."""
        if self.rate is None:
            return None
        limit, period = self.rate
        # add() is atomic and only succeeds for the first event of a window.
        if cache.add(self.key, 1, timeout=period + 1):
            used = 1
        else:
            try:
                used = cache.incr(self.key)
            except ValueError:  # expired between add and incr: this is a fresh window
                cache.set(self.key, 1, timeout=period + 1)
                used = 1
        return self._retry_after() if used > limit else None


# --- API: uploads -----------------------------------------------------------------------


class UploadRateThrottle(BaseThrottle):
    """DRF throttle for the upload endpoints, per authenticated user.

    Installed as a default throttle class; it ignores every other endpoint, so the views
    need not name it and an endpoint added later is unaffected.
    """

    scope = "uploads"

    def __init__(self) -> None:
        self.wait_seconds: int | None = None

    def allow_request(self, request: Request, view: Any) -> bool:
        match = getattr(request._request, "resolver_match", None)
        if match is None or match.namespace != "api" or match.url_name not in UPLOAD_URL_NAMES:
            return True
        if request.method in ("GET", "HEAD", "OPTIONS"):
            return True  # reading an upload's state (to resume) is not what is limited
        user = request.user
        ident = (
            f"user:{user.pk}" if user and user.is_authenticated else f"ip:{client_ip(request.META)}"
        )
        self.wait_seconds = FixedWindow(self.scope, ident).hit()
        return self.wait_seconds is None

    def wait(self) -> float | None:
        return self.wait_seconds


# --- API: API key failures --------------------------------------------------------------


#: Addresses this process saw send a bad key, with the window it saw it in. Only those
#: are checked against the shared counter, so a client that never fails costs no cache
#: round trip per request; an address guessing keys fails on every worker soon enough.
_suspects: dict[str, int] = {}
_MAX_SUSPECTS = 10_000


def _window(scope: str) -> int | None:
    rate = configured_rate(scope)
    return None if rate is None else int(time.time() // rate[1])


def check_api_key_failures(request: Request) -> None:
    """Refuse (429) a client address that sent too many bad API keys recently."""
    ip = str(client_ip(request.META))
    seen = _suspects.get(ip)
    if seen is None or seen != _window("api_key_failures"):
        return
    wait = FixedWindow("api_key_failures", ip).exceeded()
    if wait is not None:
        raise exceptions.Throttled(
            wait=wait, detail=f"Too many failed API key attempts; retry in {wait} seconds."
        )


def count_api_key_failure(request: Request) -> None:
    ip = str(client_ip(request.META))
    window = _window("api_key_failures")
    if window is None:
        return
    if len(_suspects) >= _MAX_SUSPECTS:
        _suspects.clear()
    _suspects[ip] = window
    FixedWindow("api_key_failures", ip).hit()


# --- Web: sign-in failures --------------------------------------------------------------


def login_identities(ip: str | None, username: str) -> list[tuple[str, str]]:
    """The counters a sign-in attempt touches: its address, and the username tried."""
    identities = [("login_failures", f"ip:{ip}")]
    if username:
        identities.append(("login_failures", f"user:{username.strip().lower()}"))
    return identities


def login_wait(ip: str | None, username: str) -> int | None:
    """Seconds a sign-in from ``ip`` as ``username`` must wait, or None if allowed."""
    waits = [FixedWindow(s, i).exceeded() for s, i in login_identities(ip, username)]
    present = [w for w in waits if w is not None]
    return max(present) if present else None


def count_login_failure(ip: str | None, username: str) -> None:
    for scope, ident in login_identities(ip, username):
        FixedWindow(scope, ident).hit()
