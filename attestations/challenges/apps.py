from __future__ import annotations

from django.apps import AppConfig


class ChallengesConfig(AppConfig):
    """Challenges: drawing the steps a proof must answer, their answers, replays, verdicts."""

    name = "attestations.challenges"
    verbose_name = "Challenges"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The Celery tasks register here: answers.enqueue sends the replay task by name.
        from attestations.challenges import draw, tasks  # noqa: F401
        from attestations.proofs.ingest import register_challenger

        # A transcript the verifier accepts is challenged (attestations/proofs/ingest.py).
        register_challenger(draw)
