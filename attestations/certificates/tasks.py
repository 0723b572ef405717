"""Celery tasks that issue certificates.

``issue_certificate`` is enqueued on commit when a proof's verdict becomes final. It is
idempotent: issuance holds the log lock, returns the certificate already issued for the
proof if there is one, and ``Certificate.proof`` is unique. So it acknowledges late and
is redelivered if its worker dies mid-way, without ever issuing twice.
"""

from __future__ import annotations

import logging

from celery import shared_task
from django.db import OperationalError

from attestations.certificates import issuance
from attestations.proofs.models import Proof

log = logging.getLogger(__name__)


@shared_task(
    name="attestations.certificates.tasks.issue_certificate",
    acks_late=True,
    reject_on_worker_lost=True,
    # A database that is briefly unavailable or locked is worth a few more tries;
    # everything else is a fault to look at (``manage.py issue_certificates`` re-issues).
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=5,
)
def issue_certificate(proof_id: int) -> str | None:
    """Sign and log the certificate of a proof whose verdict is final.

    Returns:
        ``"certificate <id>"``, or None when the proof cannot be certified (it is gone,
        its verdict is not final, or its transcript never named a final state): those
        are logged, not retried, since retrying would not change them.

    Raises:
        KeyConfigurationError: the signing key is unusable; the task fails loudly so an
            operator sees it, and ``manage.py issue_certificates`` (after fixing the key)
            issues what is missing.
    """
    try:
        certificate = issuance.issue_certificate(proof_id)
    except Proof.DoesNotExist:
        log.warning("issue_certificate: proof %s does not exist", proof_id)
        return None
    except issuance.CertificateNotIssuableError as error:
        log.warning("issue_certificate: %s", error)
        return None
    return f"certificate {certificate.pk}"
