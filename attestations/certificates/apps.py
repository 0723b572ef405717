from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db import transaction


class CertificatesConfig(AppConfig):
    """Certificates: signing keys, the certificates they sign, the transparency log."""

    name = "attestations.certificates"
    verbose_name = "Certificates"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from attestations.proofs.signals import verdict_recorded

        verdict_recorded.connect(
            queue_certificate, dispatch_uid="attestations.certificates.queue_certificate"
        )


def queue_certificate(sender: Any, proof: Any, **kwargs: Any) -> None:
    """Queue ``issue_certificate`` once the transaction that recorded the verdict commits."""
    from attestations.certificates.tasks import issue_certificate

    proof_id = proof.pk
    transaction.on_commit(lambda: issue_certificate.delay(proof_id))
