"""``manage.py issue_certificates``: issue every certificate that is due but missing.

The ``issue_certificate`` task runs when a verdict becomes final; if it failed (an
unusable signing key, a database outage past its retries) the proof has a final verdict
and no certificate. This finds such proofs (or takes ``--proof ID``) and issues their
certificates in this process, one at a time, each exactly once.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from attestations.certificates import issuance
from attestations.proofs.models import DUPLICATE_TRANSCRIPT, Proof
from dvbench.attest import AttestationError


class Command(BaseCommand):
    help = "Issue the certificates of final proofs that have none (or of --proof ID)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--proof", type=int, action="append", help="only this proof (repeatable)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["proof"]:
            ids = list(options["proof"])
        else:
            ids = list(
                Proof.objects.filter(
                    status__in=issuance.CERTIFIED_STATUSES, certificate__isnull=True
                )
                .exclude(reason=DUPLICATE_TRANSCRIPT)
                .order_by("pk")
                .values_list("pk", flat=True)
            )
        failures = 0
        for proof_id in ids:
            try:
                certificate = issuance.issue_certificate(proof_id)
            except Proof.DoesNotExist:
                self.stderr.write(f"proof {proof_id}: no such proof")
                failures += 1
            except issuance.CertificateNotIssuableError as error:
                self.stderr.write(f"proof {proof_id}: {error}")
                failures += 1
            except AttestationError as error:
                raise CommandError(f"proof {proof_id}: {error.message}") from None
            else:
                self.stdout.write(
                    f"proof {proof_id}: certificate {certificate.pk} ({certificate.result}), "
                    f"log entry {certificate.log_index}"
                )
        if failures:
            raise CommandError(f"{failures} of {len(ids)} proof(s) could not be certified")
        if not ids:
            self.stdout.write("no certificate is missing")
