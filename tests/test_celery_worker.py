"""A task travels through Redis to a real Celery worker process and its row lands in PostgreSQL."""

from __future__ import annotations

import uuid

import pytest
from celery.result import AsyncResult, EagerResult
from django.db import connection

from attestations.workers.models import WorkerHeartbeat
from attestations.workers.tasks import heartbeat

pytestmark = pytest.mark.services

RESULT_TIMEOUT_SECONDS = 60


def test_it_round_trips_through_a_real_worker(celery_worker_process, transactional_db) -> None:
    token = uuid.uuid4().hex

    result = heartbeat.delay(token)

    assert isinstance(result, AsyncResult)
    assert not isinstance(result, EagerResult), "the task ran in-process, not on the worker"
    hostname = result.get(timeout=RESULT_TIMEOUT_SECONDS)
    assert connection.vendor == "postgresql"
    row = WorkerHeartbeat.objects.get(token=token)
    assert row.hostname == hostname
    assert result.id in celery_worker_process.log()


def test_it_is_idempotent_on_redelivery(celery_worker_process, transactional_db) -> None:
    token = uuid.uuid4().hex

    first = heartbeat.delay(token).get(timeout=RESULT_TIMEOUT_SECONDS)
    second = heartbeat.delay(token).get(timeout=RESULT_TIMEOUT_SECONDS)

    assert first == second
    assert WorkerHeartbeat.objects.filter(token=token).count() == 1
