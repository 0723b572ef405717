"""Migration certificates 0003: the tokens column is filled from each signed statement.

Certificates signed before the column existed get the signed ``tokens`` claim's value,
through the append-only table's trigger (disabled for the backfill only): afterwards an
UPDATE is refused again, and ``verify_log`` finds the rows as signed.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from attestations.certificates import issuance, translog
from attestations.certificates.models import Certificate
from dvbench.attest import LEGACY_KIND, canonical_json
from tests.attestations.base import World
from tests.attestations.certificate_helpers import certify

BEFORE = [("certificates", "0002_initial")]
# Forward through 0003 (the backfill) to the latest, whose columns the models read: the
# app's leaf, whatever migration comes last (the tests after this one need its columns).
AFTER = None


def _migrate(targets: list[tuple[str, str]] | None) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets or executor.loader.graph.leaf_nodes("certificates"))


@pytest.mark.django_db(transaction=True)
def test_the_backfill_reads_the_signed_claim(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    # Certificates signed before this column existed were logged before the dsse entry
    # kind too: their leaf is the envelope's canonical JSON, which the backfill reads.
    monkeypatch.setattr(issuance, "dsse_entry_body", lambda envelope, key: canonical_json(envelope))
    certificate = certify(world.proof)
    assert certificate.log_entry.kind == LEGACY_KIND
    signed = certificate.claim_value("tokens")
    assert isinstance(signed, int) and signed > 0
    _migrate(BEFORE)
    try:
        with connection.cursor() as cursor:
            columns = [
                c.name
                for c in connection.introspection.get_table_description(
                    cursor, "attestations_certificate"
                )
            ]
        assert "tokens" not in columns
    finally:
        _migrate(AFTER)
    row = Certificate.objects.get(pk=certificate.pk)
    assert row.tokens == signed
    # 0005 fills lineage_flops the same way, from the signed lineage claim.
    assert row.lineage_flops == certificate.claim_value("lineage")["flops"]
    assert translog.verify_log().problems == []
    if connection.vendor == "postgresql":
        from django.db import InternalError, ProgrammingError, transaction

        # The trigger is back: the column cannot be rewritten in SQL either.
        with (
            pytest.raises((InternalError, ProgrammingError)),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute("UPDATE attestations_certificate SET tokens = 1")
