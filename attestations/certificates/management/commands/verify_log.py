"""``manage.py verify_log``: re-verify the stored transparency log from its rows.

Recomputes every leaf hash from the stored envelope, verifies every certificate and
checkpoint signature against the latest trust root, rebuilds the Merkle tree and
compares its root with every signed checkpoint, and checks that each certificate row
repeats what its signed statement says. Prints every problem found (each naming the
row) and exits 1 if there is any, 0 otherwise; run it from cron or after a restore.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from attestations.certificates.translog import verify_log


class Command(BaseCommand):
    help = "Re-verify the transparency log, its checkpoints and certificates; exit 1 on any altered row."

    def handle(self, *args: Any, **options: Any) -> None:
        report = verify_log()
        summary = (
            f"{report.entries} log entries, {report.checkpoints} checkpoints, "
            f"{report.trust_roots} trust root versions"
        )
        if report.ok:
            self.stdout.write(f"log verified: {summary}")
            return
        for problem in report.problems:
            self.stderr.write(problem)
        raise CommandError(
            f"log verification failed: {len(report.problems)} problem(s) in {summary}"
        )
