"""Replays routed per platform kind: a run is replayed on workers of the kind it trained on.

A JAX run is trained here with its platform kind read as ``tpu`` (the backend's kind is
the one value changed: ``zkdv.environments.kind_of_backend``), so its root record is a
TPU run's. Filed and answered through the API with tasks in-process (as
``test_replay.py`` does), its replays go by ``attestations/challenges/routing.py``:

* no worker of kind ``tpu``: the challenges are ``unreplayed`` (``no_replay_worker``),
  the proof has no replay verdict against it, and the certificate names the steps, claims
  no detection probability and applies no CPU bounds;
* this process serving ``tpu`` (and replaying as one): every step replayed and judged
  exact, the certificate naming both platforms;
* cross-kind replay allowed by the operator: the CPU replays it, judged within bounds;
* a CPU process that took a TPU run's challenge without that permission replays nothing.

The worker registry (``attestations/workers/presence.py``) is tested on its own below.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from attestations.audit.models import AuditEvent
from attestations.challenges.models import ChallengeStatus
from attestations.challenges.routing import Route, misrouted, route
from attestations.proofs.models import Proof, ProofStatus
from attestations.workers.models import ReplayWorker
from attestations.workers.presence import announce, kind_of_queue, queue_for, serves, withdraw
from tests.attestations.challenges.test_replay import (
    JAX_SPEC,
    ORG,
    STEPS,
    answer,
    client_for,
    file_and_answer,
    file_transcript,
    setup_org,
    train_jax,
)

pytest.importorskip("jax")
pytest.importorskip("flax")

EXPERIMENT = f"{ORG}/jax-run"


@pytest.fixture(scope="module")
def tpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The JAX run of ``test_replay``, its root record naming platform kind ``tpu``."""
    from zkdv import environments

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(environments, "kind_of_backend", lambda backend: "tpu")
        return train_jax(tmp_path_factory.mktemp("tpu") / "run", "jax-run")


@pytest.fixture
def as_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process replays as a TPU host would (its environment's kind reads ``tpu``).

    The replay runs here, not in the sandboxed child a worker starts
    (``test_sandboxed.py`` tests that child): a child reads its own backend's kind, which
    no patch in this process reaches, and would replay as the CPU it runs on.
    """
    import provers
    from attestations.challenges import execution
    from zkdv import environments

    monkeypatch.setattr(environments, "kind_of_backend", lambda backend: "tpu")

    def replay_here(directory: Path, needed: Any, step: int, through: int | None) -> Any:
        return provers.verify_challenge(directory, step, through=through).to_dict()

    def environment_here(prover: str) -> Any:
        return importlib.import_module(prover).environment()

    monkeypatch.setattr(execution.sandboxed, "replay", replay_here)
    monkeypatch.setattr(execution.sandboxed, "replay_environment", environment_here)


@pytest.fixture
def platform(db: None, settings: Any, tmp_path: Path) -> Iterator[APIClient]:
    """The platform with tasks run in-process (as ``test_replay.platform``)."""
    from config.celery_app import app

    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "media")},
        },
    }
    settings.DVBENCH = {**settings.DVBENCH, "DATA_DIR": tmp_path / "data"}
    eager = app.conf.task_always_eager
    app.conf.task_always_eager = True
    _, key = setup_org({"jax-run": JAX_SPEC})
    try:
        yield client_for(key)
    finally:
        app.conf.task_always_eager = eager


def _kinds(settings: Any, *, in_process: list[str], cross: list[str] | None = None) -> None:
    settings.DVBENCH = {
        **settings.DVBENCH,
        "REPLAY_IN_PROCESS_KINDS": in_process,
        "REPLAY_CROSS_KIND": cross or [],
    }


def _guarantee(proof: Proof) -> dict[str, Any]:
    statement = proof.certificate.statement()  # type: ignore[attr-defined]
    claims = {claim["name"]: claim for claim in statement["predicate"]["claims"]}
    claim = claims["detection_guarantee"]
    return {**claim["value"], "evidence": claim["evidence"]}


def test_a_tpu_run_without_a_tpu_worker_gets_no_replay_verdict(
    platform: APIClient, tpu_run: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    _kinds(settings, in_process=["cpu"])
    proof, attached = file_and_answer(
        platform, tpu_run, django_capture_on_commit_callbacks, experiment=EXPERIMENT
    )
    assert attached.status_code == 201, attached.content
    challenges = list(proof.challenges.all())
    assert [c.step for c in challenges] == list(range(STEPS))
    assert {(c.status, c.reason) for c in challenges} == {
        (ChallengeStatus.UNREPLAYED, "no_replay_worker")
    }
    assert all(c.evidence is None for c in challenges)  # nothing replayed, no CPU bounds
    assert "replay-tpu" in challenges[0].message
    # No replay verdict against the run: settled on what was verified, and says why.
    assert proof.status == ProofStatus.VALID
    assert proof.message.startswith(f"{STEPS} of {STEPS} challenges were not replayed")
    assert AuditEvent.objects.filter(action="challenge.unreplayed").count() == 1
    guarantee = _guarantee(proof)
    assert guarantee["not_replayed"]["steps"] == list(range(STEPS))
    assert guarantee["not_replayed"]["reason"] == "no_replay_worker"
    assert guarantee["not_replayed"]["platform_kind"] == "tpu"
    assert guarantee["detection_probability"] == guarantee["detection_probability_exact"] == 0.0
    assert guarantee["comparison"] is None
    assert guarantee["judgement"] == {"exact": [], "within_bounds": [], "within_tolerance": []}
    assert guarantee["environments"]["training"]["platform_kind"] == "tpu"
    assert guarantee["environments"]["replay"] == []
    # Nothing on the certificate is backed by a replay that did not happen.
    statement = proof.certificate.statement()  # type: ignore[attr-defined]
    levels = {claim["evidence"] for claim in statement["predicate"]["claims"]}
    assert guarantee["evidence"] == "committed_in_transcript"
    assert "verified_by_replay" not in levels
    page = platform.get(f"/api/v1/proofs/{proof.pk}/report.html").content.decode()
    assert "Not replayed" in page and "no_replay_worker" in page
    # The offline verifier accepts the certificate as it is (the claim's new fields are
    # signed with the rest).
    from dvbench.attest import TrustRoot, verify_bundle

    bundle = platform.get(f"/api/v1/proofs/{proof.pk}/bundle/")
    assert bundle.status_code == 200, bundle.content[:300]
    root = TrustRoot.from_json(platform.get("/api/v1/trust-root/").content)
    verified = verify_bundle(bundle.content, root)
    assert verified.ok, verified.reason
    # The proof page's challenge timeline counts them apart.
    from attestations.web.views import challenge_timeline

    assert challenge_timeline(proof, challenges)["counts"]["unreplayed"] == STEPS


def test_a_tpu_run_with_a_tpu_worker_is_replayed_and_judged_exact(
    platform: APIClient,
    tpu_run: Path,
    settings: Any,
    as_tpu: None,
    django_capture_on_commit_callbacks: Any,
) -> None:
    _kinds(settings, in_process=["tpu"])
    proof, attached = file_and_answer(
        platform, tpu_run, django_capture_on_commit_callbacks, experiment=EXPERIMENT
    )
    assert attached.status_code == 201, attached.content
    assert proof.status == ProofStatus.VALID, [(c.step, c.status) for c in proof.challenges.all()]
    assert {c.status for c in proof.challenges.all()} == {ChallengeStatus.PASSED}
    assert proof.message == ""
    guarantee = _guarantee(proof)
    assert guarantee["not_replayed"] is None
    assert guarantee["judgement"] == {
        "exact": list(range(STEPS)),
        "within_bounds": [],
        "within_tolerance": [],
    }
    assert guarantee["detection_probability"] > 0 and guarantee["challenges"] == STEPS
    environments = guarantee["environments"]
    assert environments["training"]["platform_kind"] == "tpu"
    [worker] = environments["replay"]
    assert (worker["platform_kind"], worker["judgement"], worker["differs_in"]) == (
        "tpu",
        "exact",
        [],
    )
    assert worker["steps"] == list(range(STEPS))


def test_cross_kind_replay_when_the_operator_allows_it_is_judged_within_bounds(
    platform: APIClient, tpu_run: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    _kinds(settings, in_process=["cpu"], cross=["tpu"])
    proof, attached = file_and_answer(
        platform, tpu_run, django_capture_on_commit_callbacks, experiment=EXPERIMENT
    )
    assert attached.status_code == 201, attached.content
    assert proof.status == ProofStatus.VALID
    guarantee = _guarantee(proof)
    # The CPU's replay may well land on the same bits; it is judged by the bounds anyway.
    assert guarantee["judgement"] == {
        "exact": [],
        "within_bounds": list(range(STEPS)),
        "within_tolerance": [],
    }
    [worker] = guarantee["environments"]["replay"]
    assert worker["platform_kind"] == "cpu" and worker["judgement"] == "within_bounds"
    assert "platform_kind" in worker["differs_in"]
    assert guarantee["gradient_bounds"] is not None and guarantee["not_replayed"] is None


def test_a_worker_of_another_kind_replays_nothing(
    platform: APIClient, tpu_run: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    # Told it serves TPU runs, but this process replays on a CPU.
    _kinds(settings, in_process=["tpu"])
    proof, _ = file_and_answer(
        platform, tpu_run, django_capture_on_commit_callbacks, experiment=EXPERIMENT
    )
    challenge = proof.challenges.first()
    assert challenge is not None
    assert (challenge.status, challenge.reason) == (ChallengeStatus.UNREPLAYED, "no_replay_worker")
    assert "this worker replays on 'cpu'" in challenge.message
    assert proof.status == ProofStatus.VALID and "not replayed" in proof.message


def test_with_a_broker_a_challenge_waits_for_a_worker_of_its_kind_then_goes_unreplayed(
    platform: APIClient, tpu_run: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    from attestations.challenges.verdicts import requeue_lost
    from config.celery_app import app

    _kinds(settings, in_process=["cpu", "tpu"])  # not consulted: a broker, not in-process
    with django_capture_on_commit_callbacks(execute=True):
        filed = file_transcript(platform, tpu_run, EXPERIMENT)
    proof = Proof.objects.get(pk=filed.json()["proof"])
    app.conf.task_always_eager = False  # the messages go to the (in-memory) broker
    with django_capture_on_commit_callbacks(execute=True):
        assert answer(platform, proof.pk, tpu_run, EXPERIMENT).status_code == 201
    # No TPU worker yet: queued on replay-tpu all the same, for a worker to come.
    challenges = proof.challenges.all()
    assert {c.status for c in challenges} == {ChallengeStatus.READY}
    assert all(c.task_id for c in challenges)
    # Past twice the task time limit, a TPU worker alive: sent again, still waiting.
    later = timezone.now() + timedelta(seconds=2 * settings.CELERY_TASK_TIME_LIMIT + 60)
    announce("celery@tpu-host", ["replay-tpu"])
    ReplayWorker.objects.update(last_seen=later)
    assert requeue_lost(later) == STEPS
    assert {c.status for c in proof.challenges.all()} == {ChallengeStatus.READY}
    # Still unclaimed and no TPU worker alive any more: no replay verdict.
    withdraw("celery@tpu-host")
    assert requeue_lost(later) == STEPS
    proof.refresh_from_db()
    assert {(c.status, c.reason) for c in proof.challenges.all()} == {
        (ChallengeStatus.UNREPLAYED, "no_replay_worker")
    }
    assert proof.status == ProofStatus.VALID and "not replayed" in proof.message


# --- The worker registry ------------------------------------------------------------------


def test_queues_per_kind() -> None:
    assert [queue_for(kind) for kind in ("cpu", "gpu", "tpu")] == [
        "replay",
        "replay-gpu",
        "replay-tpu",
    ]
    assert [kind_of_queue(q) for q in ("replay", "replay-tpu", "ingest", "replay-")] == [
        "cpu",
        "tpu",
        None,
        None,
    ]


def test_a_worker_announces_the_kinds_it_serves_and_routing_follows(
    db: None, settings: Any, tpu_run: Path, tmp_path: Path
) -> None:
    from attestations.workers.tasks import replay_presence
    from config.celery_app import app
    from zkdv.replay import root_record

    eager = app.conf.task_always_eager
    app.conf.task_always_eager = False  # as with a broker: only registered workers count
    try:
        _kinds(settings, in_process=["cpu", "tpu"])
        proof = Proof(report={"root": root_record(tpu_run)})
        assert not serves("tpu") and route(proof) == Route("tpu", None)
        # The presence task beat sends to replay-tpu, run by the worker that took it.
        assert replay_presence.run("replay-tpu") == ["tpu"]
        row = ReplayWorker.objects.get(queue="replay-tpu")
        assert row.kind == "tpu" and "jax" in row.environment
        assert serves("tpu") and route(proof) == Route("tpu", "replay-tpu")
        # Not seen for longer than the TTL: no longer counts.
        ttl = settings.DVBENCH["REPLAY_WORKER_TTL"]
        ReplayWorker.objects.update(last_seen=timezone.now() - timedelta(seconds=ttl + 1))
        assert not serves("tpu")
        announce(row.hostname, ["replay-tpu", "ingest"], {"platform_kind": "tpu"})
        # This worker's rows only: the suite's Celery worker process (tests/conftest.py),
        # started by an earlier test of this process, renews its own row in this database
        # every minute (ci8, 2026-12-07: a "replay" row appeared mid-test).
        mine = ReplayWorker.objects.filter(hostname=row.hostname)
        assert list(mine.values_list("queue", flat=True)) == ["replay-tpu"]
        assert mine.get().environment == {"platform_kind": "tpu"}
        assert serves("tpu")
        # A CPU worker is the route only where the operator allows cross-kind replay.
        withdraw(row.hostname)
        announce("celery@cpu", ["replay"])
        assert route(proof) == Route("tpu", None)
        _kinds(settings, in_process=[], cross=["tpu"])
        assert route(proof) == Route("tpu", "replay", cross_kind=True)
        assert misrouted(proof, {"platform_kind": "cpu"}) is None
        _kinds(settings, in_process=[])
        assert "replays on 'cpu'" in str(misrouted(proof, {"platform_kind": "cpu"}))
        assert misrouted(proof, {"platform_kind": "tpu"}) is None
    finally:
        app.conf.task_always_eager = eager


def test_unknown_platform_kinds_in_the_settings_fail_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from config.settings import platform_kinds

    monkeypatch.setenv("DVBENCH_REPLAY_CROSS_KIND", "tpu, quantum")
    with pytest.raises(ImproperlyConfigured, match="'quantum' is not a platform kind"):
        platform_kinds("DVBENCH_REPLAY_CROSS_KIND", [])
    monkeypatch.setenv("DVBENCH_REPLAY_CROSS_KIND", "tpu,gpu")
    assert platform_kinds("DVBENCH_REPLAY_CROSS_KIND", []) == ["tpu", "gpu"]
