"""Policy claims: values on a known run equal hand-computed ones; limits are running invariants.

The synthetic run (:func:`tests.synthetic.write_synthetic_transcript`) trains a linear model
with ``features`` inputs on ``rows``-row batches of ``features + 1`` uint32 words, and
records ``6 * features * rows`` FLOPs per step, so every total is known in advance.
"""

from __future__ import annotations

import hashlib
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage

from attestations.certificates.claims import (
    CLAIM_NAMES,
    ClaimSet,
    Limits,
    ReplayFacts,
    compute_claims,
    evaluate,
)
from attestations.certificates.run_facts import RunFacts, summarize
from attestations.challenges.models import Challenge, ChallengeOrigin, ChallengeStatus
from attestations.proofs.models import Proof, ProofArtifact, ProofStatus
from attestations.uploads.models import ArtifactKind, Blob
from dvbench.attest import Evidence
from tests.attestations.base import World
from tests.synthetic import write_synthetic_transcript
from zkdv.records import iter_records

STEPS, FEATURES, ROWS = 5, 6, 8
TOKENS_PER_STEP = ROWS  # the default token unit: examples, the committed batch's rows
FLOPS_PER_STEP = 6 * FEATURES * ROWS


def synthetic_run(path: Path, **options: Any) -> Path:
    return write_synthetic_transcript(path, steps=STEPS, features=FEATURES, rows=ROWS, **options)


def store(data: bytes) -> Blob:
    digest = hashlib.sha256(data).hexdigest()
    blob = Blob.objects.filter(sha256=digest).first()
    if blob is not None:
        return blob
    name = default_storage.save(Blob.address(digest), ContentFile(data))
    return Blob.objects.create(sha256=digest, size=len(data), storage_name=name)


def filed_proof(world: World, tmp_path: Path, *, batches: bool = True) -> tuple[Proof, Path]:
    """A valid synthetic run of acme/run-1 stored as a proof, with its batch files attached."""
    spec = world.experiment.current_spec
    assert spec is not None
    proof_dir = synthetic_run(
        tmp_path / "run", experiment="acme/run-1", spec_digest=spec.digest, rolling_window=4
    )
    transcript = store((proof_dir / "records.cborl").read_bytes())
    proof = Proof.objects.create(
        experiment=world.experiment,
        spec=spec,
        transcript=transcript,
        status=ProofStatus.VALID,
        steps=STEPS,
        checks=3,
        prover="whitebox-jax",
    )
    if batches:
        for path in sorted((proof_dir / "files").glob("batch-*.u32")):
            blob = store(path.read_bytes())
            ProofArtifact.objects.create(
                proof=proof,
                name=f"files/{path.name}",
                kind=ArtifactKind.BATCH,
                blob=blob,
                sha256=blob.sha256,
                size=blob.size,
            )
    return proof, proof_dir


def facts_of(path: Path) -> RunFacts:
    return summarize(iter_records(path))


# --- Pure: facts and evaluation ---------------------------------------------------------


def test_claims_of_a_known_run_equal_hand_computed_values(tmp_path: Path) -> None:
    proof_dir = synthetic_run(tmp_path / "run")
    records = [record.data for record in iter_records(proof_dir)]
    steps = [r for r in records if r["t"] == "step"]
    close = records[-1]

    claims = evaluate(facts_of(proof_dir), Limits())

    assert [claim.name for claim in claims.claims] == list(CLAIM_NAMES)
    assert claims.value("steps") == STEPS
    assert claims.value("tokens") == STEPS * TOKENS_PER_STEP == 40
    assert claims.claim("tokens").unit == "example"  # type: ignore[union-attr]
    assert claims.value("flops") == STEPS * FLOPS_PER_STEP == 1440
    hours = (steps[-1]["time"][1] - steps[0]["time"][0]) / 3600  # one device, its wall time
    assert claims.value("gpu_hours") == pytest.approx(hours, abs=1e-6)
    assert claims.value("final_parameter_root") == close["final"]["p"].hex()
    roots = b"".join(step["batch"]["root"] for step in steps)
    assert claims.value("dataset_commitment")["batch_sequence_digest"] == (
        hashlib.sha256(roots).hexdigest()
    )
    # The synthetic run's optimizer state is SGD momentum (mu_w, mu_b, count).
    assert claims.value("optimizer")["family"] == "sgd"
    assert claims.value("program_digest") is None  # the synthetic run attests no artifact
    assert claims.series.flops == tuple(float(FLOPS_PER_STEP * (k + 1)) for k in range(STEPS))
    assert claims.timeline["checked_steps"] == [0, 2, 4]  # DEBUGCheckEvery(2)
    assert claims.violations == [] and claims.ok


def test_evidence_levels(tmp_path: Path) -> None:
    claims = evaluate(facts_of(synthetic_run(tmp_path / "run")), Limits())
    evidence = {claim.name: claim.evidence for claim in claims.claims}
    assert evidence["steps"] == evidence["flops"] == evidence["tokens"] == Evidence.COMMITTED
    assert evidence["final_parameter_root"] == Evidence.COMMITTED
    # Wall-clock times are the trainer's clock: its word only.
    assert evidence["gpu_hours"] == Evidence.REPORTED


@pytest.mark.parametrize(
    ("limits", "limit", "step", "actual"),
    [
        # Cumulative FLOPs: 288, 576, 864, ...: 577 is first passed at step 2.
        (Limits(max_flops=Decimal(577)), "max_flops", 2, 864),
        # Exactly reaching the limit is within it; passing it is not.
        (Limits(max_flops=Decimal(576)), "max_flops", 2, 864),
        (Limits(max_flops=Decimal(287)), "max_flops", 0, 288),
        # Cumulative tokens (examples): 8, 16, 24, ...
        (Limits(max_tokens=Decimal(30)), "max_tokens", 3, 32),
    ],
)
def test_a_limit_exceeded_is_reported_at_the_first_step_over_it(
    tmp_path: Path, limits: Limits, limit: str, step: int, actual: int
) -> None:
    claims = evaluate(facts_of(synthetic_run(tmp_path / "run")), limits)
    assert len(claims.violations) == 1, claims.violations
    violation = claims.violations[0]
    assert (violation.limit, violation.step, violation.actual) == (limit, step, actual)
    assert f"at step {step}" in violation.message
    assert not claims.ok
    assert step in claims.series.steps  # the chart can mark it


def test_limits_at_the_totals_hold(tmp_path: Path) -> None:
    limits = Limits(
        max_flops=Decimal(STEPS * FLOPS_PER_STEP),
        max_tokens=Decimal(STEPS * TOKENS_PER_STEP),
        max_gpu_hours=Decimal(1000),
    )
    assert evaluate(facts_of(synthetic_run(tmp_path / "run")), limits).violations == []


def test_gpu_hours_limit_names_the_first_step_over_it() -> None:
    facts = RunFacts(
        root={"prover": "whitebox-torch", "env": {"world_size": 8}},
        step_index=[0, 1, 2, 3],
        tokens=[10] * 4,
        flops=[1.0] * 4,
        start=[0.0, 900.0, 1800.0, 2700.0],
        end=[900.0, 1800.0, 2700.0, 3600.0],
        batch_roots=[b""] * 4,
    )
    # 8 devices x 0.25 h per step: 2, 4, 6, 8 GPU-hours.
    claims = evaluate(facts, Limits(max_gpu_hours=Decimal("5")))
    assert claims.value("gpu_hours") == 8.0
    (violation,) = claims.violations
    assert (violation.limit, violation.step, violation.actual) == ("max_gpu_hours", 2, 6.0)


def test_jax_flops_count_every_device_of_a_sharded_program() -> None:
    facts = RunFacts(
        root={
            "prover": "whitebox-jax",
            "env": {"device_count": 4},
            "schema": {"sharding": {"params": [{"mesh": {"data": 2, "model": 2}, "spec": []}]}},
        },
        step_index=[0, 1, 2],
        tokens=[1, 1, 1],
        flops=[100.0, 100.0, 100.0],
        start=[0.0, 1.0, 2.0],
        end=[1.0, 2.0, 3.0],
        batch_roots=[b""] * 3,
    )
    claims = evaluate(facts, Limits())
    assert claims.value("flops") == 3 * 100 * 4
    assert claims.details["flops"]["replicas"] == 4


def test_missing_flops_fall_back_to_six_n_d() -> None:
    facts = RunFacts(
        root={"schema": {"params": [{"path": "w", "dtype": "float32", "shape": [10, 3]}]}},
        step_index=[0, 1],
        tokens=[7, 7],
        flops=[None, None],
        start=[0.0, 1.0],
        end=[1.0, 2.0],
        batch_roots=[b"", b""],
    )
    claims = evaluate(facts, Limits())
    assert claims.value("flops") == 2 * 6 * 30 * 7
    assert claims.details["flops"]["steps_without_count"] == 2


def torch_root(contract: str) -> dict[str, Any]:
    return {
        "prover": "whitebox-torch",
        "program": {"kind": "torch.export", "digest": b"\x01" * 32, "bytes": 10},
        "env": {
            "world_size": 1,
            "optimizer": {"contract": contract, "groups": [{"lr": 0.001, "betas": (0.9, 0.99)}]},
        },
    }


def test_optimizer_from_the_torch_root_record_and_replay_evidence() -> None:
    facts = RunFacts(root=torch_root("adamw"), program_digests=["01" * 32])
    committed = evaluate(facts, Limits(optimizer="torch.optim.AdamW(lr=1e-3)"))
    optimizer = committed.claim("optimizer")
    assert optimizer is not None
    assert optimizer.value["contract"] == "adamw"
    assert optimizer.value["hyperparameters"] == [{"lr": 0.001, "betas": [0.9, 0.99]}]
    assert optimizer.value["matches_declared"] is True
    assert optimizer.evidence == Evidence.COMMITTED
    # Passing replays ran the committed program and optimizer transition.
    replayed = evaluate(facts, Limits(), ReplayFacts(passed=(0, 3)))
    assert replayed.claim("optimizer").evidence == Evidence.REPLAYED  # type: ignore[union-attr]
    assert replayed.claim("program_digest").evidence == Evidence.REPLAYED  # type: ignore[union-attr]
    # Each replay recounted every step record's tokens against the program's batch.
    assert replayed.claim("tokens").evidence == Evidence.REPLAYED  # type: ignore[union-attr]
    # A failed replay takes that back.
    failed = evaluate(facts, Limits(), ReplayFacts(passed=(0,), failed=(3,)))
    assert failed.claim("optimizer").evidence == Evidence.COMMITTED  # type: ignore[union-attr]
    assert failed.claim("tokens").evidence == Evidence.COMMITTED  # type: ignore[union-attr]


def test_an_optimizer_other_than_declared_is_a_violation() -> None:
    facts = RunFacts(root=torch_root("sgd"))
    claims = evaluate(facts, Limits(optimizer="AdamW, lr 3e-4"))
    (violation,) = claims.violations
    assert (violation.limit, violation.declared, violation.actual) == (
        "optimizer",
        "AdamW, lr 3e-4",
        "sgd",
    )


def test_a_declared_regime_outside_the_allowed_ones_is_a_violation() -> None:
    root = {"experiment": {"name": "acme/x", "spec_digest": "0", "regime": "rl"}}
    claims = evaluate(RunFacts(root=root), Limits(allowed_regimes=("pretraining",)))
    (violation,) = claims.violations
    assert (violation.limit, violation.actual) == ("allowed_regimes", "rl")
    allowed = evaluate(RunFacts(root=root), Limits(allowed_regimes=("pretraining", "rl")))
    assert allowed.violations == []


def test_a_program_change_mid_run_is_named() -> None:
    facts = RunFacts(
        step_index=[0, 1, 2],
        tokens=[1, 1, 1],
        flops=[1.0, 1.0, 1.0],
        start=[0.0, 1.0, 2.0],
        end=[1.0, 2.0, 3.0],
        batch_roots=[b""] * 3,
        program_digests=["aa", "aa", "bb"],
        program_changes=[(1, "aa"), (2, "bb")],
    )
    claims = evaluate(facts, Limits())
    (violation,) = claims.violations
    assert (violation.limit, violation.step) == ("program", 2)
    assert claims.value("regime")["program_phases"] == 2


def test_a_truncated_transcript_yields_claims_up_to_the_fault(tmp_path: Path) -> None:
    data = (synthetic_run(tmp_path / "run") / "records.cborl").read_bytes()
    claims = evaluate(summarize(iter_records(data[:-7])), Limits())
    assert claims.transcript_error is not None and "truncated" in claims.transcript_error
    assert claims.value("steps") == STEPS  # the cut falls in the close record
    assert claims.value("final_parameter_root") is None
    assert not claims.ok


def test_a_claim_set_survives_its_json_round_trip(tmp_path: Path) -> None:
    claims = evaluate(facts_of(synthetic_run(tmp_path / "run")), Limits(max_flops=Decimal(600)))
    assert ClaimSet.from_dict(claims.to_dict()).to_dict() == claims.to_dict()


# --- A proof's claims -------------------------------------------------------------------


def test_compute_claims_reads_the_stored_transcript(world: World, tmp_path: Path) -> None:
    spec = world.experiment.current_spec
    assert spec is not None
    proof, _ = filed_proof(world, tmp_path, batches=False)
    claims = compute_claims(proof)
    assert claims.value("flops") == STEPS * FLOPS_PER_STEP
    # acme/run-1 declares 1e25 FLOPs and 2e12 tokens, which hold, and optax.adam, which the
    # synthetic run's momentum-SGD state contradicts.
    assert [(v.limit, v.declared, v.actual) for v in claims.violations] == [
        ("optimizer", "optax.adam(1e-2)", "sgd")
    ]


def test_compute_claims_checks_the_spec_the_proof_names(world: World, tmp_path: Path) -> None:
    proof, _ = filed_proof(world, tmp_path, batches=False)
    proof.spec.max_flops = Decimal(1000)  # in memory only: the cache key holds the digest
    proof.spec.digest = "f" * 64
    violation = compute_claims(proof).violations[0]
    assert (violation.limit, violation.step) == ("max_flops", 3)


def test_claims_are_cached_by_transcript(world: World, tmp_path: Path) -> None:
    proof, _ = filed_proof(world, tmp_path, batches=False)
    first = compute_claims(proof)
    default_storage.delete(proof.transcript.storage_name)
    # The cached result answers without the transcript; a recomputation needs it.
    assert compute_claims(proof).to_dict() == first.to_dict()
    with pytest.raises(FileNotFoundError):
        compute_claims(proof, use_cache=False)


def test_replays_recorded_on_the_proof_change_the_evidence(world: World, tmp_path: Path) -> None:
    proof, _ = filed_proof(world, tmp_path, batches=False)
    assert compute_claims(proof).timeline["replay_passed"] == []
    Challenge.objects.create(
        proof=proof, step=1, through=2, origin=ChallengeOrigin.RANDOM, status=ChallengeStatus.PASSED
    )
    Challenge.objects.create(
        proof=proof, step=0, origin=ChallengeOrigin.GENESIS, status=ChallengeStatus.PASSED
    )
    claims = compute_claims(proof)
    assert claims.timeline["replay_passed"] == [0, 1, 2]
    # The synthetic run attests no program artifact and keeps no optimizer options: its
    # optimizer is inferred from the committed state leaves, not upgraded.
    assert claims.claim("optimizer").evidence == Evidence.COMMITTED  # type: ignore[union-attr]
