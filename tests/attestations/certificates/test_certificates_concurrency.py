"""Issuance under concurrency on PostgreSQL: one certificate per proof, a gapless log.

Threads here hold their own database connections, so the log lock (a PostgreSQL
advisory lock) and the unique constraints are exercised for real; the worker test sends
the task over Redis to a separate Celery process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection, connections

from attestations.accounts.models import Organization
from attestations.certificates import issuance, keys, translog
from attestations.certificates.models import Certificate, LogCheckpoint, LogEntry
from attestations.certificates.tasks import issue_certificate
from attestations.experiments.models import Experiment
from attestations.proofs.models import Proof
from tests.attestations.base import SPEC
from tests.attestations.certificate_helpers import finalize

pytestmark = pytest.mark.services


def _proofs(count: int) -> list[Proof]:
    org = Organization.objects.create(slug="acme", name="Acme")
    user = User.objects.create_user("alice", password="x" * 20)
    experiment = Experiment.register(org, "concurrent", SPEC, user=user)
    assert experiment.current_spec is not None
    proofs = []
    for seed in range(count):
        proof = Proof.objects.create(
            experiment=experiment,
            spec=experiment.current_spec,
            transcript=finalize_blob(experiment, seed),
        )
        proofs.append(finalize(proof, seed=seed))
    return proofs


def finalize_blob(experiment: Experiment, seed: int) -> Any:
    from tests.attestations.certificate_helpers import declare_sgd, stored_transcript

    declare_sgd(experiment)
    return stored_transcript(experiment, seed)[0]


def _race(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls in threads released together; return their results or exceptions."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(position: int, call: Callable[[], Any]) -> None:
        try:
            barrier.wait()
            results[position] = call()
        except Exception as error:  # noqa: BLE001 - reported by the test
            results[position] = error
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_concurrent_issuance_issues_once_per_proof_and_keeps_the_log_gapless(
    transactional_db: None,
) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL: SQLite serialises writers by locking the whole file")
    proofs = _proofs(3)
    keys.current_trust_root()  # the first key, registered once before the race
    calls = [
        (lambda pk=proof.pk: issuance.issue_certificate(pk).pk)
        for proof in (*proofs, proofs[0], proofs[0], proofs[1])
    ]
    results = _race(calls)
    assert not [r for r in results if isinstance(r, Exception)], results
    assert results[0] == results[3] == results[4]
    assert results[1] == results[5]
    assert Certificate.objects.count() == 3
    assert sorted(LogEntry.objects.values_list("index", flat=True)) == [0, 1, 2]
    assert sorted(LogCheckpoint.objects.values_list("tree_size", flat=True)) == [1, 2, 3]
    report = translog.verify_log()
    assert report.ok, report.problems


def test_the_task_through_a_real_worker_issues_once(
    transactional_db: None, celery_worker_process: Any
) -> None:
    (proof,) = _proofs(1)
    first = issue_certificate.delay(proof.pk)
    second = issue_certificate.delay(proof.pk)
    timeout = 120  # generous: CI machines are shared
    results = (first.get(timeout=timeout), second.get(timeout=timeout))
    certificate = Certificate.objects.get()
    assert results == (f"certificate {certificate.pk}",) * 2, celery_worker_process.log()[-2000:]
    assert certificate.proof_id == proof.pk and LogEntry.objects.count() == 1
    report = translog.verify_log()
    assert report.ok, report.problems
