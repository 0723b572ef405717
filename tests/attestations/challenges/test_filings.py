"""Challenges cannot be ground: re-filing a run never buys the trainer a better draw.

The attack of the report: file the same transcript twice (two upload sessions) and take
whichever draw missed the forged steps. Here:

* the same transcript (same bytes) filed again *is* the first proof: same id, same plan;
* a second proof with the same transcript digest (a race) is rejected as
  ``duplicate_transcript`` and draws nothing;
* near-duplicates (one byte changed in a field the run's computation does not depend
  on, re-chained; a rerun from the same seed) are the same committed run: the same seed,
  so the steps of the first draw are challenged again, with more besides;
* each further challenged proof of an experiment is drawn for half the miss probability
  of the one before (``draw.filing_target``), so all filings together keep the
  policy's bound; at most ``MAX_PROOFS_PER_EXPERIMENT`` are filed;
* every proof stays visible with its verdict, and each certificate lists them all.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from attestations.audit.models import AuditEvent
from attestations.certificates import issuance, keys
from attestations.challenges.draw import filing_target
from attestations.challenges.verdicts import expire_proof
from attestations.experiments.models import Experiment
from attestations.proofs.ingest import ingest
from attestations.proofs.models import Proof, ProofStatus
from attestations.uploads.models import Upload
from dvbench.attest import verify_certificate
from provers.challenges import random_steps_needed
from tests.attestations.base import SPEC, World, error_of, sha256, upload_blob
from tests.attestations.certificate_helpers import SGD
from tests.synthetic import write_synthetic_transcript
from zkdv.config import SamplingPolicy
from zkdv.core import ProgramInfo, ZKDVCore
from zkdv.records import ZERO_DIGEST, encode, iter_records, record_hash

Api = Callable[[str | None], APIClient]
NAME = "acme/grind"
STEPS = 400  # long enough that a draw is a strict subset of the steps


@pytest.fixture
def programmed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Synthetic runs commit a program, so the platform challenges them (and replays none)."""
    real = ZKDVCore.open

    def open_with_program(self: ZKDVCore, **kwargs: Any) -> Any:
        kwargs["program"] = ProgramInfo.of("jax-export", b"the attested program")
        return real(self, **kwargs)

    monkeypatch.setattr(ZKDVCore, "open", open_with_program)


@pytest.fixture
def experiment(world: World, api: Api, programmed: None) -> Experiment:
    created = api("alice").post(
        "/api/v1/experiments/", {"name": NAME, "spec": {**SPEC, "optimizer": SGD}}, format="json"
    )
    assert created.status_code == 201, created.content
    return Experiment.objects.get(owner__slug="acme", name="grind")


def run(
    tmp_path: Path, experiment: Experiment, label: str, *, seed: int = 0, rerun: int = 0
) -> bytes:
    """A run of STEPS steps with no self-checks (so a re-chained copy still verifies)."""
    assert experiment.current_spec is not None
    folder = write_synthetic_transcript(
        tmp_path / label,
        steps=STEPS,
        experiment=experiment.full_name,
        spec_digest=experiment.current_spec.digest,
        seed=seed,
        rerun=rerun,
        sampling=SamplingPolicy(update_check_probability=0.0),
        snapshot_interval=50,
    )
    return (folder / "records.cborl").read_bytes()


def edited(data: bytes, change: Callable[[list[dict[str, Any]]], None]) -> bytes:
    """The transcript with ``change`` applied to its records, re-chained as a forger would."""
    records = [dict(record.data) for record in iter_records(data)]
    change(records)
    out, prev = bytearray(), ZERO_DIGEST
    for record in records:
        encoded = encode({**record, "prev": prev})
        out += encoded
        prev = record_hash(encoded)
    return bytes(out)


def file(client: APIClient, data: bytes, capture: Any) -> Proof:
    with capture(execute=True):
        response = upload_blob(client, data, kind="transcript", experiment=NAME, part_size=60_000)
    assert response.status_code == 200, response.content
    return Proof.objects.get(pk=response.json()["proof"])


def abandon(proof: Proof) -> None:
    """Let the proof's challenges expire unanswered (its deadline passes)."""
    assert proof.challenge_deadline is not None
    with_capture = expire_proof(proof.pk, now=proof.challenge_deadline + timedelta(seconds=1))
    assert with_capture > 0
    proof.refresh_from_db()
    assert (proof.status, proof.reason) == (ProofStatus.REJECTED, "challenge_expired")


def steps_of(proof: Proof) -> set[int]:
    return set(proof.challenges.values_list("step", flat=True))


def test_the_same_transcript_filed_twice_is_one_proof(
    experiment: Experiment,
    api: Api,
    tmp_path: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    data = run(tmp_path, experiment, "a")
    first = file(api("alice"), data, django_capture_on_commit_callbacks)
    assert first.status == ProofStatus.CHALLENGED, (first.reason, first.message)
    drawn = steps_of(first)
    assert 0 < len(drawn) < STEPS
    # The report's attack: another upload session of the same records.cborl.
    again = file(api("admin"), data, django_capture_on_commit_callbacks)
    assert again.pk == first.pk
    assert Proof.objects.filter(experiment=experiment).count() == 1
    assert steps_of(Proof.objects.get(pk=first.pk)) == drawn
    second_upload = Upload.objects.filter(kind="transcript").order_by("-created").first()
    assert second_upload is not None and second_upload.duplicate_of_id == first.pk
    assert AuditEvent.objects.filter(action="proof.refiled", target_id=str(first.pk)).exists()
    # The API says which proof the second upload is.
    body = api("admin").get(f"/api/v1/uploads/{second_upload.pk}/").json()
    assert body["proof"] == first.pk


def test_a_second_proof_of_the_same_digest_draws_nothing(
    experiment: Experiment, api: Api, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    data = run(tmp_path, experiment, "a")
    first = file(api("alice"), data, django_capture_on_commit_callbacks)
    # A race past the upload check: a second proof row of the same transcript.
    twin = Proof.objects.create(experiment=experiment, spec=first.spec, transcript=first.transcript)
    assert Proof.claim(twin.pk)
    with django_capture_on_commit_callbacks(execute=True):
        ingest(twin)
    twin.refresh_from_db()
    assert (twin.status, twin.reason) == (ProofStatus.REJECTED, "duplicate_transcript")
    assert f"proof {first.pk}" in twin.message
    assert twin.challenges.count() == 0 and twin.challenge_seed == ""
    # A duplicate is certified by the proof it repeats, never on its own.
    with pytest.raises(issuance.CertificateNotIssuableError):
        issuance.issue_certificate(twin.pk)


def test_a_near_duplicate_gets_the_same_draw_and_more(
    experiment: Experiment, api: Api, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    data = run(tmp_path, experiment, "a")
    first = file(api("alice"), data, django_capture_on_commit_callbacks)

    def nudge_time(records: list[dict[str, Any]]) -> None:
        # One byte of a field the computation does not depend on: a step's timestamp.
        last = next(r for r in reversed(records) if r["t"] == "step")
        start, end = last["time"]
        last["time"] = [start, end + 1e-6]

    near = edited(data, nudge_time)
    assert near != data
    second = file(api("alice"), near, django_capture_on_commit_callbacks)
    assert second.pk != first.pk and second.status == ProofStatus.CHALLENGED
    assert second.transcript_digest != first.transcript_digest
    # The same committed run: the same seed, so every step the first draw chose is
    # challenged again; the second filing draws for half the miss probability, so more.
    assert second.challenge_run_digest == first.challenge_run_digest
    assert second.challenge_seed == first.challenge_seed
    assert (first.challenge_filing, second.challenge_filing) == (1, 2)
    assert steps_of(first) < steps_of(second)


def test_a_rerun_from_the_same_seed_is_the_same_committed_run(
    experiment: Experiment, api: Api, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    first = file(api("alice"), run(tmp_path, experiment, "a"), django_capture_on_commit_callbacks)
    rerun = run(tmp_path, experiment, "b", seed=0, rerun=1)  # new timestamps and probe seed
    second = file(api("alice"), rerun, django_capture_on_commit_callbacks)
    assert second.transcript.sha256 != first.transcript.sha256
    assert second.challenge_run_digest == first.challenge_run_digest
    assert steps_of(first) <= steps_of(second)
    # Another seed trains another run: a fresh draw, but on the tighter budget.
    other = file(
        api("alice"), run(tmp_path, experiment, "c", seed=1), django_capture_on_commit_callbacks
    )
    assert other.challenge_run_digest != first.challenge_run_digest
    assert other.challenge_seed != first.challenge_seed
    assert other.challenge_filing == 3
    assert other.challenge_target == pytest.approx(filing_target(0.95, 3))


def test_each_filing_halves_the_miss_probability(settings: Any) -> None:
    target = 0.95
    misses = [1 - filing_target(target, n) for n in range(1, 40)]
    assert misses[0] == pytest.approx((1 - target) / 2)
    assert all(b == pytest.approx(a / 2) for a, b in pairwise(misses))
    # Whatever the number of filings, a run with the forged fraction escapes them all
    # with probability below 1 - target (union bound).
    assert sum(misses) < 1 - target
    # The price: about ln 2 / -ln(1 - f) more random steps per filing (69 at f = 1 %).
    needed = [
        random_steps_needed(10**6, target=filing_target(target, n), forged_fraction=0.01)
        for n in (1, 2, 3)
    ]
    assert [b - a for a, b in pairwise(needed)] == [69, 69]
    assert filing_target(0.0, 5) == 0.0


def test_filings_are_limited_and_every_one_stays_on_the_record(
    experiment: Experiment,
    api: Api,
    tmp_path: Path,
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.DVBENCH = {**settings.DVBENCH, "MAX_PROOFS_PER_EXPERIMENT": 2}
    original = run(tmp_path, experiment, "a")
    first = file(api("alice"), original, django_capture_on_commit_callbacks)
    # The first is abandoned: its challenges expire unanswered.
    abandon(first)
    assert first.verdict_label == "abandoned"
    second = file(
        api("alice"), run(tmp_path, experiment, "b", seed=1), django_capture_on_commit_callbacks
    )
    third = run(tmp_path, experiment, "c", seed=2)
    refused = api("alice").post(
        "/api/v1/uploads/",
        {"experiment": NAME, "kind": "transcript", "size": len(third), "sha256": sha256(third)},
        format="json",
    )
    assert refused.status_code == 409
    assert error_of(refused)["code"] == "too_many_proofs"
    # Filing one of the two again is still the same proof, not a third.
    assert file(api("alice"), original, django_capture_on_commit_callbacks).pk == first.pk
    # Auditors and regulators see both, with their verdicts.
    for actor in ("bob", "carol"):
        listed = api(actor).get("/api/v1/proofs/", {"experiment": NAME}).json()["results"]
        assert {(p["id"], p["status"]) for p in listed} == {
            (first.pk, "rejected"),
            (second.pk, "challenged"),
        }
    from django.test import Client

    page = Client()
    page.force_login(experiment.owner.memberships.get(role="auditor").user)
    html = page.get("/experiments/acme/grind/").content.decode()
    assert "abandoned" in html and f"#{second.pk}" in html


def test_a_certificate_lists_every_proof_filed_for_its_experiment(
    experiment: Experiment, api: Api, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    abandoned = file(
        api("alice"), run(tmp_path, experiment, "a"), django_capture_on_commit_callbacks
    )
    abandon(abandoned)
    certified = file(
        api("alice"), run(tmp_path, experiment, "b", seed=1), django_capture_on_commit_callbacks
    )
    # Give the second its verdict as the replays would (they are not run here).
    Proof.objects.filter(pk=certified.pk).update(status=ProofStatus.VALID)
    certificate = issuance.issue_certificate(certified.pk)
    signed = verify_certificate(certificate.envelope, keys.current_trust_root().trust_root())
    assert signed.filings is not None and signed.filings.count == 2
    assert [(f.proof, f.status, f.reason, f.challenge_filing) for f in signed.filings.proofs] == [
        (abandoned.pk, "rejected", "challenge_expired", 1),
        (certified.pk, "valid", "", 2),
    ]
    body = api("carol").get(f"/api/v1/certificates/{certificate.pk}/").json()
    assert body["filings"]["count"] == 2
    report = api("bob").get(f"/api/v1/proofs/{certified.pk}/report.html").content.decode()
    assert "Proofs filed for the experiment" in report and "challenge_expired" in report
