"""Django admin: the platform's challenges to proofs and how each replay went, read-only."""

from __future__ import annotations

from django.contrib import admin

from attestations.challenges.models import Challenge
from attestations.core.admin import ReadOnlyAdmin


@admin.register(Challenge)
class ChallengeAdmin(ReadOnlyAdmin):
    """What the platform asked a proof to answer, and how each replay went."""

    list_display = ["pk", "proof", "step", "through", "origin", "status", "reason", "created"]
    list_filter = ["status", "origin"]
    search_fields = ["reason", "message"]
    list_select_related = ["proof"]
    raw_id_fields = ["proof"]
