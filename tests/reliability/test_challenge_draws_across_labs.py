"""Issue 34, finding 4: the same run filed in another lab got a fresh challenge draw.

The report: a same-seed rerun filed in lab ``rival`` had the run digest of the proof in
``demo`` but another seed commitment and another plan, and neither certificate listed the
other filing. Now the seed is HMAC(platform key, run digest), the same run's earlier seed
stands even across a change of key, its plan is never drawn for less than before, and each
certificate lists the other filings: by date and verdict to the lab's auditors, whole to
regulators (docs/provers.md, "Challenges cannot be ground").
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from attestations.accounts.models import Membership, Role
from attestations.certificates import issuance, keys
from attestations.challenges.draw import STATE_STRIDE, challenge_seed, filing_target
from attestations.challenges.secret import challenge_key
from attestations.experiments.models import Experiment
from attestations.proofs.models import Proof, ProofStatus
from dvbench.attest import format_time, to_seconds, verify_certificate
from provers.challenges import seed_commitment
from tests.attestations.base import SPEC, World, make_user, upload_blob
from tests.attestations.certificate_helpers import SGD
from tests.attestations.challenges.test_filings import STEPS, programmed, steps_of
from tests.synthetic import write_synthetic_transcript
from zkdv.config import SamplingPolicy

__all__ = ["programmed"]

Api = Callable[[str | None], APIClient]


@pytest.fixture
def labs(world: World, api: Api, programmed: None) -> tuple[Experiment, Experiment]:
    """``acme/grind`` (alice) and ``evil/grind`` (mallory), one spec; eve audits evil."""
    eve = make_user("eve")
    Membership.objects.create(user=eve, organization=world.evil, role=Role.AUDITOR)
    world.users["eve"] = eve
    for actor, name in (("alice", "acme/grind"), ("mallory", "evil/grind")):
        created = api(actor).post(
            "/api/v1/experiments/",
            {"name": name, "spec": {**SPEC, "optimizer": SGD}},
            format="json",
        )
        assert created.status_code == 201, created.content
    return (
        Experiment.objects.get(owner__slug="acme", name="grind"),
        Experiment.objects.get(owner__slug="evil", name="grind"),
    )


def run(
    tmp_path: Path,
    experiment: Experiment,
    label: str,
    *,
    seed: int = 0,
    rerun: int = 0,
    **forge: Any,
) -> bytes:
    """A run of STEPS steps and no self-checks; ``rerun`` changes only timestamps and probes,
    ``forge``/``forge_step`` change the training from that step on
    (``tests.synthetic.write_synthetic_transcript``)."""
    assert experiment.current_spec is not None
    folder = write_synthetic_transcript(
        tmp_path / label,
        steps=STEPS,
        experiment=experiment.full_name,
        spec_digest=experiment.current_spec.digest,
        seed=seed,
        rerun=rerun,
        **forge,
        sampling=SamplingPolicy(update_check_probability=0.0),
        snapshot_interval=50,
    )
    return (folder / "records.cborl").read_bytes()


def file(client: APIClient, experiment: Experiment, data: bytes, capture: Any) -> Proof:
    with capture(execute=True):
        response = upload_blob(
            client, data, kind="transcript", experiment=experiment.full_name, part_size=60_000
        )
    assert response.status_code == 200, response.content
    proof = Proof.objects.get(pk=response.json()["proof"])
    assert proof.status == ProofStatus.CHALLENGED, (proof.reason, proof.message)
    return proof


def test_a_rerun_filed_in_another_lab_gets_the_same_plan(
    labs: tuple[Experiment, Experiment],
    api: Api,
    tmp_path: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    acme, evil = labs
    capture = django_capture_on_commit_callbacks
    first = file(api("alice"), acme, run(tmp_path, acme, "a"), capture)
    # The report's attack: a same-seed rerun (new timestamps) filed in the other lab.
    second = file(api("mallory"), evil, run(tmp_path, evil, "b", rerun=1), capture)
    assert second.transcript_digest != first.transcript_digest
    assert second.challenge_run_digest == first.challenge_run_digest
    assert (first.challenge_filing, second.challenge_filing) == (1, 1)
    assert second.challenge_seed == first.challenge_seed
    assert second.challenge_seed_commitment == first.challenge_seed_commitment
    assert second.challenge_seed_commitment == seed_commitment(bytes.fromhex(first.challenge_seed))
    assert steps_of(second) == steps_of(first)
    assert 0 < len(steps_of(first)) < STEPS
    # What the seed is: the platform's key and the run digest, nothing of the organisation.
    assert bytes.fromhex(first.challenge_seed) == challenge_seed(
        challenge_key(), first.challenge_run_digest
    )
    # Both labs' trainers read the same commitment in their proof's challenge plan.
    plans = [
        api(actor).get(f"/api/v1/proofs/{proof.pk}/").json()["challenge_plan"]
        for actor, proof in (("alice", first), ("mallory", second))
    ]
    assert plans[0]["seed_commitment"] == plans[1]["seed_commitment"]
    assert plans[0]["run_digest"] == plans[1]["run_digest"]


def test_a_run_is_never_drawn_for_less_than_before_nor_anew_under_a_new_key(
    labs: tuple[Experiment, Experiment],
    api: Api,
    tmp_path: Path,
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    acme, evil = labs
    capture = django_capture_on_commit_callbacks
    # Two other runs first: the acme filing of the run is its experiment's third.
    for label, seed in (("x", 1), ("y", 2)):
        file(api("alice"), acme, run(tmp_path, acme, label, seed=seed), capture)
    big = file(api("alice"), acme, run(tmp_path, acme, "a"), capture)
    assert big.challenge_filing == 3
    assert big.challenge_target == pytest.approx(filing_target(0.95, 3))
    # The operator changes the challenge key (or a worker has another one): a run drawn
    # before keeps its seed, and evil's first filing of it is drawn for acme's target.
    settings.DVBENCH = {**settings.DVBENCH, "CHALLENGE_KEY": "ab" * 32}
    small = file(api("mallory"), evil, run(tmp_path, evil, "b", rerun=1), capture)
    assert small.challenge_filing == 1
    assert small.challenge_seed == big.challenge_seed
    assert small.challenge_target == pytest.approx(big.challenge_target)
    assert steps_of(small) == steps_of(big)
    # A run never drawn before gets its seed from the new key.
    fresh = file(api("mallory"), evil, run(tmp_path, evil, "c", seed=3), capture)
    assert bytes.fromhex(fresh.challenge_seed) == challenge_seed(
        bytes.fromhex("ab" * 32), fresh.challenge_run_digest
    )


def _valid_certificate(proof: Proof) -> Any:
    # Give the proof its verdict as the replays would (they are not run here).
    Proof.objects.filter(pk=proof.pk).update(
        status=ProofStatus.VALID, challenge_seed_revealed=proof.challenges_drawn
    )
    return issuance.issue_certificate(proof.pk)


def test_each_certificate_lists_the_other_labs_filing_without_naming_it(
    labs: tuple[Experiment, Experiment],
    api: Api,
    tmp_path: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    acme, evil = labs
    capture = django_capture_on_commit_callbacks
    ours = file(api("alice"), acme, run(tmp_path, acme, "a"), capture)
    theirs = file(api("mallory"), evil, run(tmp_path, evil, "b", rerun=1), capture)
    mine, other = _valid_certificate(ours), _valid_certificate(theirs)
    trust = keys.current_trust_root().trust_root()

    # Acme's was signed while evil's filing was still open; evil's after acme's verdict.
    for certificate, proof, elsewhere, status, stranger in (
        (mine, ours, theirs, "challenged", ("evil", "Evil Corp")),
        (other, theirs, ours, "valid", ("acme", "Acme Labs")),
    ):
        # Signed: the other filing's date, verdict and digest; never its lab.
        signed = verify_certificate(certificate.envelope, trust)
        assert signed.filings is not None and signed.filings.run is not None
        run_filings = signed.filings.run
        assert run_filings.digest == proof.challenge_run_digest
        assert run_filings.count == 1
        (listed,) = run_filings.elsewhere
        assert format_time(listed.filed_on) == format_time(to_seconds(elsewhere.created))
        assert (listed.status, listed.reason, listed.same_organization) == (status, "", False)
        assert listed.transcript_digest == elsewhere.transcript_digest
        assert listed.challenge_target == pytest.approx(filing_target(0.95, 1))
        payload = base64.b64decode(certificate.envelope["payload"]).decode()
        for name in stranger:
            assert name not in payload

    # The lab's auditors: the count and date, never the other lab.
    for actor, certificate, proof, elsewhere, stranger in (
        ("bob", mine, ours, theirs, ("evil", "Evil Corp")),
        ("eve", other, theirs, ours, ("acme", "Acme Labs")),
    ):
        for path in (
            f"/api/v1/certificates/{certificate.pk}/",
            f"/api/v1/proofs/{proof.pk}/certificate/",
        ):
            response = api(actor).get(path)
            assert response.status_code == 200, response.content
            body = response.json()
            assert body["filings"]["run"]["count"] == 1
            now = body["run_filings"]
            assert now["run_digest"] == proof.challenge_run_digest and now["count"] == 1
            (seen,) = now["filings"]
            assert (seen["organization"], seen["experiment"], seen["proof"]) == (None, None, None)
            assert seen["status"] == "valid" and seen["same_organization"] is False
            assert seen["transcript_digest"] == elsewhere.transcript_digest
            text = response.content.decode()
            for name in stranger:
                assert name not in text
        report = api(actor).get(f"/api/v1/proofs/{proof.pk}/report.html")
        assert report.status_code == 200
        html = report.content.decode()
        assert (
            "another organisation" in html
            and format_time(to_seconds(elsewhere.created))[:10] in html
        )
        for name in stranger:
            assert name not in html
        # The other lab's certificate is not theirs at all.
        foreign = other if certificate is mine else mine
        assert api(actor).get(f"/api/v1/certificates/{foreign.pk}/").status_code == 404

    # A regulator reads every filing whole: organisation, experiment, proof, verdict, date.
    for certificate, elsewhere in ((mine, theirs), (other, ours)):
        body = api("carol").get(f"/api/v1/certificates/{certificate.pk}/").json()
        (seen,) = body["run_filings"]["filings"]
        owner = elsewhere.experiment.owner.slug
        assert {key: seen[key] for key in ("organization", "experiment", "proof", "status")} == {
            "organization": owner,
            "experiment": f"{owner}/grind",
            "proof": elsewhere.pk,
            "status": "valid",
        }
        assert seen["filed_on"][:19] == format_time(to_seconds(elsewhere.created))[:19]


def test_a_near_copy_filed_in_another_lab_is_listed_by_the_states_it_shares(
    labs: tuple[Experiment, Experiment],
    api: Api,
    tmp_path: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    # Evil refiles acme's run with the learning rate changed from step 300 on and the
    # chain re-written: a new run digest, so a draw of its own, but the same committed
    # states up to step 299, whose compute both transcripts now claim.
    acme, evil = labs
    capture = django_capture_on_commit_callbacks
    ours = file(api("alice"), acme, run(tmp_path, acme, "a"), capture)
    copy = file(api("mallory"), evil, run(tmp_path, evil, "b", forge="lr", forge_step=300), capture)
    unrelated = file(api("mallory"), evil, run(tmp_path, evil, "c", seed=5), capture)
    assert copy.challenge_run_digest != ours.challenge_run_digest
    certificate = _valid_certificate(ours)
    # Indexed every STATE_STRIDE steps (and the last): 15, 31, ..., 287 are shared.
    shared = len(range(STATE_STRIDE - 1, 300, STATE_STRIDE))
    body = api("carol").get(f"/api/v1/certificates/{certificate.pk}/").json()
    (seen,) = body["run_filings"]["shared_states"]
    assert (seen["organization"], seen["proof"]) == ("evil", copy.pk)
    assert (seen["same_run"], seen["shared_states"], seen["state_stride"]) == (
        False,
        shared,
        STATE_STRIDE,
    )
    assert seen["transcript_digest"] == copy.transcript_digest
    assert unrelated.pk not in [f["proof"] for f in body["run_filings"]["shared_states"]]
    # The lab's auditor learns that a filing elsewhere shares its states, not whose.
    body = api("bob").get(f"/api/v1/certificates/{certificate.pk}/").json()
    (seen,) = body["run_filings"]["shared_states"]
    assert (seen["organization"], seen["experiment"], seen["proof"]) == (None, None, None)
    assert seen["shared_states"] == shared and seen["same_organization"] is False
    assert "evil" not in json.dumps(body)


def test_the_challenge_key_is_generated_once_or_read_as_configured(
    settings: Any, tmp_path: Path
) -> None:
    from django.core.exceptions import ImproperlyConfigured

    settings.DVBENCH = {
        **settings.DVBENCH,
        "DATA_DIR": tmp_path,
        "CHALLENGE_KEY": "",
        "CHALLENGE_KEY_FILE": "",
    }
    generated = challenge_key()
    path = tmp_path / "keys" / "challenge-key"
    assert len(generated) == 32 and challenge_key() == generated
    assert path.stat().st_mode & 0o777 == 0o600
    assert bytes.fromhex(path.read_text()) == generated
    # A configured file wins; a short or non-hex one is refused, naming the variable.
    configured = tmp_path / "mounted"
    configured.write_text("cd" * 32 + "\n")
    settings.DVBENCH = {**settings.DVBENCH, "CHALLENGE_KEY_FILE": str(configured)}
    assert challenge_key() == bytes.fromhex("cd" * 32)
    configured.write_text("cd" * 31)
    with pytest.raises(ImproperlyConfigured, match="DVBENCH_CHALLENGE_KEY_FILE must hold"):
        challenge_key()
    settings.DVBENCH = {**settings.DVBENCH, "CHALLENGE_KEY_FILE": str(tmp_path / "missing")}
    with pytest.raises(ImproperlyConfigured, match=r"DVBENCH_CHALLENGE_KEY_FILE=.*cannot be read"):
        challenge_key()
