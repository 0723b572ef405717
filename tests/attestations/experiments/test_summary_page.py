"""The experiment list's rows by cached SQL (SummaryPage) say what the ORM and to_dict say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.utils import timezone
from rest_framework.renderers import JSONRenderer

from attestations.experiments import rows as page_rows
from attestations.experiments.models import Experiment, proof_statuses, summary_dict
from attestations.experiments.rows import SummaryPage
from attestations.proofs.models import Proof, ProofStatus
from tests.attestations.base import SPEC, World

REPO_ROOT = Path(__file__).resolve().parents[3]


def _render(document: dict[str, Any]) -> Any:
    return json.loads(JSONRenderer().render(document))


def _varied(world: World) -> None:
    """Proofs of several statuses, a frozen and a revised spec, a creator deleted."""
    spec = world.experiment.current_spec
    assert spec is not None
    for status in (ProofStatus.VALID, ProofStatus.REJECTED, ProofStatus.REJECTED):
        Proof.objects.create(
            experiment=world.experiment, spec=spec, transcript=world.proof.transcript, status=status
        )
    # A proof names version 1, so the change makes version 2: current, and not frozen.
    world.experiment.revise_spec({**SPEC, "optimizer": "sgd"}, user=world.alice)
    orphan = Experiment.register(world.acme, "orphan", SPEC, user=None)
    Experiment.objects.filter(pk=orphan.pk).update(created=timezone.now() - timedelta(days=3))
    assert orphan.current_spec is not None
    Proof.objects.create(  # freezes the orphan's only spec version
        experiment=orphan, spec=orphan.current_spec, transcript=world.proof.transcript
    )
    for index in range(4):
        Experiment.register(world.evil, f"evil-{index}", {**SPEC, "framework": "torch"}, user=None)


def test_every_row_is_the_same_document_as_to_dict(world: World) -> None:
    _varied(world)
    experiments = {e.pk: e for e in Experiment.objects.with_summary()}
    Experiment.summarize(experiments.values())
    rows = SummaryPage().order_by("-created", "-id")[0:1000]
    statuses = proof_statuses()
    assert [row["id"] for row in rows] == list(
        Experiment.objects.order_by("-created", "-id").values_list("id", flat=True)
    )
    for row in rows:
        expected = _render(experiments[row["id"]].to_dict())
        assert _render(summary_dict(row, statuses)) == expected
    documents = [summary_dict(row, statuses) for row in rows]
    assert any(d["proofs"].get("rejected") == 2 for d in documents)
    assert any(d["spec"]["frozen"] for d in documents)
    assert any(not d["spec"]["frozen"] and d["spec"]["version"] == 2 for d in documents)
    assert any(d["created_by"] is None for d in documents)


def test_a_cached_shape_binds_each_request_values(world: World) -> None:
    """Same shape, other values: the SQL is reused, the answer follows the values."""
    _varied(world)
    page_rows._CACHE.clear()
    for org in (world.acme, world.evil, world.acme):
        for framework in ("jax", "torch"):
            page = (
                SummaryPage((("owner_id__in", [org.pk]),))
                .filter(current_spec__framework=framework)
                .order_by("-created", "-id")
            )
            got = [row["id"] for row in page[0:3]]
            expected = list(
                Experiment.objects.filter(owner=org, current_spec__framework=framework)
                .order_by("-created", "-id")
                .values_list("id", flat=True)[:3]
            )
            assert got == expected
    assert len(page_rows._CACHE) == 1


def test_filters_and_cursor_positions_match_the_orm(world: World) -> None:
    _varied(world)
    middle = Experiment.objects.order_by("-created", "-id")[2].created
    cases: list[tuple[str, Any]] = [
        ("owner__slug", world.evil.slug),
        ("current_spec__max_flops__gte", SPEC["max_flops"]),
        ("current_spec__max_flops__gte", SPEC["max_flops"] + 1),
        ("created__gte", middle),
        ("created__lt", str(middle)),  # a cursor's position is a string
        ("name", "orphan"),
    ]
    for lookup, value in cases:
        for offset in (0, 1):
            got = [
                row["id"]
                for row in SummaryPage()
                .filter(**{lookup: value})
                .order_by("created", "id")[offset : offset + 4]
            ]
            expected = list(
                Experiment.objects.filter(**{lookup: value})
                .order_by("created", "id")
                .values_list("id", flat=True)[offset : offset + 4]
            )
            assert got == expected, (lookup, value, offset)


def test_no_organisation_runs_no_query(world: World, django_assert_num_queries: Any) -> None:
    with django_assert_num_queries(0):
        assert SummaryPage((("owner_id__in", []),)).order_by("-created")[0:51] == []


def test_a_page_costs_one_query_however_many_rows(
    world: World, django_assert_num_queries: Any
) -> None:
    """The proof counts ride in the page query (PostgreSQL and SQLite)."""
    _varied(world)
    SummaryPage().order_by("-created", "-id")[0:51]  # compiles and caches the shape
    with django_assert_num_queries(1):
        rows = SummaryPage().order_by("-created", "-id")[0:51]
    assert len(rows) == Experiment.objects.count() > 5
    assert sum(row["proofs_rejected"] for row in rows) == 2


#: The page query on SQLite (the demo's database), in a fresh process: proof counts and
#: the frozen flag come from json_group_array there, json_agg on PostgreSQL.
SQLITE_PAGE = """
import json, django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from attestations.accounts.models import Organization
from attestations.experiments.models import Experiment, proof_statuses, summary_dict
from attestations.experiments.rows import SummaryPage
from attestations.proofs.models import Proof, ProofStatus
from attestations.uploads.models import Blob
from tests.attestations.base import SPEC

acme = Organization.objects.create(slug="acme", name="Acme")
blob = Blob.objects.create(sha256="0" * 64, size=1, storage_name="x")
busy = Experiment.register(acme, "busy", SPEC, user=None)
for status in (ProofStatus.VALID, ProofStatus.REJECTED, ProofStatus.REJECTED):
    Proof.objects.create(experiment=busy, spec=busy.current_spec, transcript=blob, status=status)
busy.revise_spec({**SPEC, "optimizer": "sgd"}, user=None)
frozen = Experiment.register(acme, "frozen", SPEC, user=None)
Proof.objects.create(experiment=frozen, spec=frozen.current_spec, transcript=blob)
Experiment.register(acme, "idle", SPEC, user=None)
experiments = list(Experiment.objects.with_summary())
Experiment.summarize(experiments)
statuses = proof_statuses()
print(json.dumps({
    "page": {r["name"]: summary_dict(r, statuses) for r in SummaryPage().order_by("-created", "-id")[0:10]},
    "orm": {e.name: e.to_dict() for e in experiments},
}, default=str))
"""


def test_the_page_query_counts_proofs_on_sqlite_too(tmp_path: Path) -> None:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DJANGO_", "DVBENCH_", "DATABASE_URL", "REDIS_URL"))
    }
    environment.update(DJANGO_SETTINGS_MODULE="config.settings", DVBENCH_DATA_DIR=str(tmp_path))
    completed = subprocess.run(
        [sys.executable, "-c", SQLITE_PAGE],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    answer = json.loads(completed.stdout.strip().splitlines()[-1])
    assert answer["page"] == answer["orm"]
    assert answer["page"]["busy"]["proofs"] == {"valid": 1, "rejected": 2}
    assert answer["page"]["busy"]["spec"]["frozen"] is False  # version 2: no proof names it
    assert answer["page"]["frozen"]["spec"]["frozen"] is True
    assert answer["page"]["idle"]["proofs"] == {}
