"""Personal API keys: issued once, stored only as a digest, checked in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from typing import ClassVar

from django.conf import settings
from django.contrib.auth.models import User
from django.db import models
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.core.conf import dvbench_int
from attestations.core.errors import InvalidRequestError

API_KEY_PREFIX = "dvb"


class ApiKeyQuerySet(models.QuerySet["ApiKey"]):
    def active(self) -> ApiKeyQuerySet:
        return self.filter(revoked__isnull=True, expires__gt=timezone.now())


class ApiKey(models.Model):
    """A personal API key: ``dvb_<lookup>_<secret>``.

    Only the SHA-256 of the whole key is stored. The secret has 256 bits of entropy, so a
    fast hash is the right tool (a slow password hash would only slow every API request);
    ``lookup`` is a random public prefix that finds the row without a scan, and the
    digest comparison is constant-time.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys"
    )
    name = models.CharField(max_length=100)
    lookup = models.CharField(max_length=16, unique=True)
    digest = models.CharField(max_length=64)
    created = models.DateTimeField(default=timezone.now)
    expires = models.DateTimeField()
    revoked = models.DateTimeField(null=True, blank=True)
    last_used = models.DateTimeField(null=True, blank=True)

    objects: ClassVar[ApiKeyQuerySet] = ApiKeyQuerySet.as_manager()  # type: ignore[assignment]

    class Meta:
        db_table = "attestations_apikey"
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    @property
    def prefix(self) -> str:
        """The part of the key that is safe to show again: it identifies, never authenticates."""
        return f"{API_KEY_PREFIX}_{self.lookup}"

    @property
    def is_active(self) -> bool:
        return self.revoked is None and self.expires > timezone.now()

    @staticmethod
    def hash(raw: str) -> str:
        return hashlib.sha256(raw.encode("utf-8")).hexdigest()

    @classmethod
    def issue(
        cls, user: User, name: str, *, days: int | None = None, ip: str | None = None
    ) -> tuple[ApiKey, str]:
        """Create a key and return it with its raw value, which is never retrievable again.

        Records ``api_key.created`` in the audit trail. Only a signed-in user who confirmed
        their password creates keys through the web or the API, never a key
        (``attestations/http/sudo.py``).

        Raises:
            InvalidRequestError: ``days`` outside 1..``DVBENCH["API_KEY_MAX_DAYS"]`` (400
                ``invalid``, field ``days``): no key outlives the policy.
        """
        ttl = days if days is not None else dvbench_int("API_KEY_TTL_DAYS")
        longest = dvbench_int("API_KEY_MAX_DAYS")
        if not 1 <= ttl <= longest:
            raise InvalidRequestError(
                f"days: a key lives 1 to {longest} days (DVBENCH_API_KEY_MAX_DAYS); got {ttl}.",
                field="days",
                detail={"min": 1, "max": longest, "got": ttl},
            )
        lookup = secrets.token_hex(6)
        raw = f"{API_KEY_PREFIX}_{lookup}_{secrets.token_urlsafe(32)}"
        key = cls.objects.create(
            user=user,
            name=name,
            lookup=lookup,
            digest=cls.hash(raw),
            expires=timezone.now() + timedelta(days=ttl),
        )
        AuditEvent.record(
            "api_key.created",
            actor=user,
            target=key,
            detail={"name": key.name, "prefix": key.prefix, "expires": key.expires.isoformat()},
            ip=ip,
        )
        return key, raw

    @classmethod
    def authenticate(cls, raw: str) -> ApiKey | None:
        """Return the active key matching ``raw``, or None. Records ``last_used``."""
        parts = raw.split("_", 2)
        if len(parts) != 3 or parts[0] != API_KEY_PREFIX:
            return None
        key = cls.objects.select_related("user").filter(lookup=parts[1]).first()
        if key is None or not hmac.compare_digest(key.digest, cls.hash(raw)):
            return None
        if not key.is_active:
            return None
        now = timezone.now()
        # One write a minute at most: an API client polling a job must not turn every
        # read into a row update.
        if key.last_used is None or now - key.last_used > timedelta(minutes=1):
            cls.objects.filter(pk=key.pk).update(last_used=now)
            key.last_used = now
        return key

    def revoke(self, *, actor: User | None = None, ip: str | None = None) -> bool:
        """Revoke the key (recording ``api_key.revoked``); False if it already was."""
        updated = ApiKey.objects.filter(pk=self.pk, revoked__isnull=True).update(
            revoked=timezone.now()
        )
        self.refresh_from_db(fields=["revoked"])
        if updated:
            AuditEvent.record(
                "api_key.revoked",
                actor=actor,
                target=self,
                detail={"name": self.name, "prefix": self.prefix},
                ip=ip,
            )
        return bool(updated)
