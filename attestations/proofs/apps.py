from __future__ import annotations

from django.apps import AppConfig


class ProofsConfig(AppConfig):
    """Proofs (filed transcripts), their jobs, ingest, and filing a transcript upload."""

    name = "attestations.proofs"
    verbose_name = "Proofs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from attestations.proofs.filing import TranscriptFiling
        from attestations.uploads.kinds import register_kind
        from attestations.uploads.models import ArtifactKind

        # A completed transcript upload is filed as a proof (attestations/proofs/filing.py).
        register_kind(ArtifactKind.TRANSCRIPT, TranscriptFiling())
