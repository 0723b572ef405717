"""The API of a proof's challenges: what is replayed, what it needs, progress, verdicts.

Route: ``proofs/{id}/challenges/`` (``attestations/api/urls.py``).
"""

from __future__ import annotations

from django.db.models import QuerySet
from rest_framework import generics, serializers

from attestations.api.proofs import visible_proof
from attestations.challenges.models import Challenge, ChallengeOrigin, ChallengeStatus
from attestations.http.filters import QueryFilters
from attestations.http.pagination import CursorPage
from attestations.http.permissions import HasCapability


class ChallengeSerializer(serializers.ModelSerializer[Challenge]):
    """One challenge: what is replayed, what it needs, how far it got, its verdict."""

    class Meta:
        model = Challenge
        fields = [
            "id",
            "proof",
            "step",
            "through",
            "origin",
            "status",
            "needed_files",
            "steps_total",
            "steps_replayed",
            "attempts",
            "reason",
            "message",
            "evidence",
            "created",
            "answered",
            "finished",
        ]
        read_only_fields = fields


class ChallengePage(CursorPage):
    """Challenges in step order, 100 a page."""

    page_size = 100
    max_page_size = 500
    ordering = ("step", "id")


class ChallengeList(generics.ListAPIView[Challenge]):
    """The platform's challenges of a proof: pending ones list the files they need."""

    serializer_class = ChallengeSerializer
    permission_classes = [HasCapability]
    pagination_class = ChallengePage
    filter_backends = [QueryFilters]
    query_filters = {
        "status": ("status", frozenset(ChallengeStatus.values)),
        "origin": ("origin", frozenset(ChallengeOrigin.values)),
    }

    def get_queryset(self) -> QuerySet[Challenge]:
        proof = visible_proof(self.request, int(self.kwargs["pk"]))
        return Challenge.objects.filter(proof=proof)
