"""Server-side replay end to end: real training runs, the API, the real worker.

Real zkdv.torch and zkdv.jax runs (the same small models and 8 steps as
``tests/provers``, bound to an experiment) are filed through the upload API; the
platform verifies the transcript, draws its challenges, the test answers them the way
the SDK does (upload the files the challenges need, attach them), and the replay
verdicts decide the proof. Torch runs seal ``torch.export`` programs (no AOT compile).

Tests marked ``services`` go over PostgreSQL, Redis and a separate Celery worker
process; the others run the same tasks in-process (eager) against the test database.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from attestations.accounts.models import ApiKey, Membership, Organization, Role
from attestations.audit.models import AuditEvent
from attestations.challenges.models import Challenge, ChallengeStatus
from attestations.experiments.models import Experiment, ExperimentSpec
from attestations.proofs.models import Proof, ProofArtifact, ProofStatus
from tests.attestations.base import put_parts, sha256
from tests.sources import AGENT_PYTHONPATH
from zkdv.torch.forgery import hide_learning_rate

REPO_ROOT = Path(__file__).resolve().parents[3]
STEPS = 8
FORGED_STEP = 4
ORG = "acme"
TORCH_SPEC: dict[str, Any] = {
    "framework": "torch",
    "model_description": "MLP 6-16-1, tanh",
    "optimizer": "torch.optim.AdamW(lr=0.01), two parameter groups",
    "dataset_commitment": "cd" * 32,
    "allowed_regimes": ["pretraining"],
}
JAX_SPEC: dict[str, Any] = {**TORCH_SPEC, "framework": "jax", "optimizer": "optax.adamw(0.01)"}


def spec_digest(name: str, spec: dict[str, Any]) -> str:
    """The digest the platform will give ``acme/<name>``'s first spec (no database)."""
    experiment = Experiment(owner=Organization(slug=ORG), name=name)
    return ExperimentSpec(
        experiment=experiment, **ExperimentSpec.fields_from(spec)
    ).compute_digest()


# --- Real training runs ---------------------------------------------------------------------


def train_torch(
    path: Path, name: str, *, forge: str | None = None, kind: str = "torch.export"
) -> Path:
    """8 steps of a small MLP with AdamW through zkdv.torch, bound to ``acme/<name>``.

    The learning rate halves every three steps (``StepLR``, created after ``prepare()``):
    each step record commits the rate its step used, and the replay applies it.

    ``forge``: ``invisible`` changes a weight between steps 3 and 4 along directions the
    probes cannot see; ``lr`` steps with twice the learning rate from step 4 on while the
    groups, and so the step records, say once (optimizer hooks); ``data`` trains step 4
    on other inputs than the transaction committed. ``kind``: the program's kind.
    """
    import numpy as np
    import torch
    from torch import nn
    from torch.nn import functional

    import zkdv
    import zkdv.torch

    torch.manual_seed(0)
    proof = zkdv.torch.ZKDV(
        path,
        zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0)),
        replay_snapshot_interval=3,
    )
    proof.program_kind = kind
    proof.bind_experiment(f"{ORG}/{name}", spec_digest(name, TORCH_SPEC))
    proof.start(rolling_window=4, probe_ratio=0.5)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups: list[dict[str, Any]] = [{"params": weights}, {"params": biases, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.01)
    model, optimizer = proof.prepare(model, optimizer)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)

    @proof.attest
    def attested(model: nn.Module, optimizer: Any, batch: Any) -> None:
        inputs, targets = batch
        loss = functional.mse_loss(proof.forward(model, inputs)[:, 0], targets)
        proof.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    generator = torch.Generator().manual_seed(1)
    try:
        for index in range(STEPS):
            inputs = torch.randn(4, 6, generator=generator)
            targets = torch.randn(4, generator=generator)
            if index == FORGED_STEP and forge == "invisible":
                proof.join()
                probes: Any = proof._core.probes  # type: ignore[union-attr]
                leaf = next(i for i, s in enumerate(probes.specs) if s.path == "0.weight")
                matrix = probes.matrices[leaf].astype(np.float64)
                null = np.linalg.svd(matrix.T)[2][matrix.shape[1] :]
                change = np.random.default_rng(7).standard_normal((16, len(null))) @ null * 0.05
                with torch.no_grad():
                    model[0].weight.add_(torch.from_numpy(change).float())
            if index == FORGED_STEP and forge == "lr":
                hide_learning_rate(optimizer, 2.0, group=0)
            with proof.transaction(batch=(inputs, targets)):
                if index == FORGED_STEP and forge == "data":
                    inputs.mul_(-1)  # after the transaction committed the batch
                loss = functional.mse_loss(model(inputs)[:, 0], targets)
                proof.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            schedule.step()
    finally:
        proof.close()
    return path


def train_jax(path: Path, name: str, *, gradient_files: str = "auto") -> Path:
    """8 steps of a small Flax MLP with Optax AdamW through zkdv.jax, bound to ``acme/<name>``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import linen as nn

    import zkdv
    import zkdv.jax
    from zkdv.jax.contrib import TrainState

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(1)(jnp.tanh(nn.Dense(16)(x)))[:, 0]

    def step_fn(state: Any, batch: jax.Array) -> Any:
        def loss(params: Any) -> jax.Array:
            prediction = state.apply_fn({"params": params}, batch[:, :6])
            return jnp.mean((prediction - batch[:, 6]) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    proof = zkdv.jax.ZKDV(
        path,
        zkdv.ZKDVConfig(
            sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0),
            gradient_files=gradient_files,
        ),
        replay_snapshot_interval=3,
    )
    proof.bind_experiment(f"{ORG}/{name}", spec_digest(name, JAX_SPEC))
    proof.start(rolling_window=2, probe_ratio=0.5)
    model = MLP()
    state = TrainState.create(
        proof=proof,
        apply_fn=model.apply,
        params=model.init(jax.random.key(0), jnp.ones((4, 6)))["params"],
        tx=optax.adamw(0.01),
    )
    step = proof.jit(step_fn, donate_argnums=(0,))
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        state = step(state, jnp.asarray(rng.standard_normal((4, 7)), jnp.float32))
    proof.close()
    return path


# --- The platform side, as the SDK drives it -------------------------------------------------


def setup_org(names: dict[str, dict[str, Any]]) -> tuple[User, str]:
    """Organisation ``acme`` with trainer alice and the experiments; alice's API key."""
    org = Organization.objects.create(slug=ORG, name="Acme Labs")
    alice = User.objects.create_user("alice", "alice@example.org", "x" * 20)
    Membership.objects.create(user=alice, organization=org, role=Role.TRAINER)
    for name, spec in names.items():
        Experiment.register(org, name, spec, user=alice)
    _, key = ApiKey.issue(alice, "tests")
    return alice, key


def client_for(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def upload(client: APIClient, experiment: str, kind: str, data: bytes, name: str = "") -> Any:
    """Create, send and complete an upload through the API; returns the completion."""
    created = client.post(
        "/api/v1/uploads/",
        {
            "experiment": experiment,
            "kind": kind,
            "size": len(data),
            "sha256": sha256(data),
            "name": name,
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    for response in put_parts(client, created.json()["id"], data, 1 << 20):
        assert response.status_code == 200, response.content
    return client.post(f"/api/v1/uploads/{created.json()['id']}/complete/")


def file_transcript(client: APIClient, run: Path, experiment: str) -> Any:
    """Upload the transcript (the proof is filed and ingested); the completion response."""
    return upload(client, experiment, "transcript", (run / "records.cborl").read_bytes())


KINDS = {"files/snapshot": "snapshot", "files/batch": "batch", "files/grad": "gradient"}


def kind_of(name: str) -> str:
    return next((k for prefix, k in KINDS.items() if name.startswith(prefix)), "artifact")


def answer(
    client: APIClient,
    proof_id: int,
    run: Path,
    experiment: str,
    *,
    replace: dict[str, bytes] | None = None,
) -> Any:
    """Upload what pending challenges need and attach it; the attach response."""
    listed = client.get(f"/api/v1/proofs/{proof_id}/challenges/?status=pending")
    assert listed.status_code == 200, listed.content
    needed = sorted({n for c in listed.json()["results"] for n in c["needed_files"]})
    files = []
    for name in needed:
        data = (replace or {}).get(name) or (run / name).read_bytes()
        done = upload(client, experiment, kind_of(name), data, name)
        assert done.status_code == 200, done.content
        files.append(
            {"name": name, "kind": kind_of(name), "sha256": sha256(data), "size": len(data)}
        )
    return client.post(f"/api/v1/proofs/{proof_id}/artifacts/", {"files": files}, format="json")


def wait_for(proof_id: int, done: Callable[[Proof], bool], worker: Any = None) -> Proof:
    deadline = time.monotonic() + 240  # generous: CI machines are shared
    proof = Proof.objects.get(pk=proof_id)
    while time.monotonic() < deadline:
        proof.refresh_from_db()
        if done(proof):
            return proof
        time.sleep(0.2)
    log = worker.log()[-3000:] if worker is not None else ""
    raise AssertionError(f"proof {proof_id} stuck in {proof.status} ({proof.reason}); {log}")


def challenge_summary(proof: Proof) -> list[tuple[int, str, str]]:
    return [(c.step, c.status, c.reason) for c in proof.challenges.order_by("step")]


# --- Runs, made once per module -------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("replay-runs")
    return {
        "honest": train_torch(base / "honest", "torch-run"),
        "invisible": train_torch(base / "invisible", "torch-run", forge="invisible"),
        "lr": train_torch(base / "lr", "torch-run", forge="lr"),
        "data": train_torch(base / "data", "torch-run", forge="data"),
    }


# --- In-process (eager tasks): the whole flow, every forgery ----------------------------------


@pytest.fixture
def platform(db: None, settings: Any, tmp_path: Path) -> Iterator[APIClient]:
    """The platform with tasks run in-process, on a fresh storage and data directory."""
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
    _, key = setup_org({"torch-run": TORCH_SPEC, "jax-run": JAX_SPEC})
    try:
        yield client_for(key)
    finally:
        app.conf.task_always_eager = eager


def file_and_answer(
    client: APIClient,
    run: Path,
    capture: Any,
    *,
    experiment: str = f"{ORG}/torch-run",
    replace: dict[str, bytes] | None = None,
) -> tuple[Proof, Any]:
    with capture(execute=True):
        filed = file_transcript(client, run, experiment)
    assert filed.status_code == 200, filed.content
    proof = Proof.objects.get(pk=filed.json()["proof"])
    assert proof.status == ProofStatus.CHALLENGED, (proof.status, proof.reason, proof.message)
    with capture(execute=True):
        attached = answer(client, proof.pk, run, experiment, replace=replace)
    proof.refresh_from_db()
    return proof, attached


def test_an_honest_torch_run_passes_every_challenge(
    platform: APIClient, runs: dict[str, Path], django_capture_on_commit_callbacks: Any
) -> None:
    proof, attached = file_and_answer(platform, runs["honest"], django_capture_on_commit_callbacks)
    assert attached.status_code == 201, attached.content
    assert proof.status == ProofStatus.VALID, challenge_summary(proof)
    # 8 steps: the detection target (95 % against 1 % forged) needs every step.
    assert [c.step for c in proof.challenges.all()] == list(range(STEPS))
    assert {c.status for c in proof.challenges.all()} == {ChallengeStatus.PASSED}
    assert proof.challenges.get(step=0).origin == "genesis"
    # The seed is revealed with the verdict and re-derives the same steps.
    from provers.challenges import draw_challenges, seed_commitment

    seed = bytes.fromhex(proof.challenge_seed)
    assert proof.revealed_seed == proof.challenge_seed
    assert seed_commitment(seed) == proof.challenge_seed_commitment
    # The draw is bound to the committed run (attestations.challenges.draw.run_digest), whose digest
    # the challenge plan publishes beside the seed.
    plan = draw_challenges(
        steps=STEPS,
        transcript_digest=proof.challenge_run_digest,
        seed=seed,
        self_checked=[],
        target=proof.challenge_target,
    )
    assert list(plan.steps) == [c.step for c in proof.challenges.all()]
    body = platform.get(f"/api/v1/proofs/{proof.pk}/").json()
    assert body["status"] == "valid"
    assert body["challenge_plan"]["seed"] == proof.challenge_seed
    assert body["challenge_plan"]["run_digest"] == proof.challenge_run_digest
    assert body["challenge_plan"]["filing"] == 1
    assert body["job"]["kind"] == "replay" and body["job"]["progress"] == 1.0
    assert body["job"]["steps_done"] == body["job"]["steps_total"] > STEPS
    # Replayed windows hold the evidence of every step.
    evidence: Any = proof.challenges.get(step=5).evidence
    assert [e["step"] for e in evidence["evidence"]] == [3, 4, 5]
    assert all(e["exact"] for e in evidence["evidence"])
    # The schedule the replay applied, shown to auditors on the proof page and report.
    from attestations.reports.render import learning_rate_svg, report_claims
    from attestations.web.views import _learning_rates

    claims = report_claims(proof)
    assert claims is not None
    assert [rates[0] for rates in claims.series.learning_rate] == [
        0.01 * 0.5 ** (step // 3) for step in range(STEPS)
    ]
    chart = learning_rate_svg(claims.series)
    assert "<polyline" in chart and "Learning rate" in chart
    assert _learning_rates(proof) == chart


@pytest.mark.slow
@pytest.mark.aot
@pytest.mark.long  # two cold AOT compiles, minutes; test_torch_aot.py compiles by default
@pytest.mark.timeout(900)  # AOT Inductor compiles: the SDK's, then the sandbox's
def test_an_aot_inductor_run_is_compiled_by_the_platform_and_passes(
    platform: APIClient, settings: Any, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    """The run commits its torch.export archive; the replay compiles it in its sandbox,
    and later challenges of the same program reuse that compile (issue 59)."""
    import hashlib

    run = train_torch(tmp_path / "aot", "torch-run", kind="aot-inductor")
    proof, attached = file_and_answer(platform, run, django_capture_on_commit_callbacks)
    assert attached.status_code == 201, attached.content
    assert proof.status == ProofStatus.VALID, challenge_summary(proof)
    # Eager training, compiled replay: within bounds, never claimed bit for bit.
    evidence: Any = proof.challenges.get(step=5).evidence
    assert not any(e["exact"] for e in evidence["evidence"])
    # One compile, kept by the program's digest, outside anything a child can see.
    digest = hashlib.sha256((run / "program.pt2").read_bytes()).hexdigest()
    compiled = sorted((Path(settings.DVBENCH["DATA_DIR"]) / "compiled").iterdir())
    assert [p.name.startswith(f"{digest}-") and p.suffix == ".pt2" for p in compiled] == [True]
    # A damaged entry is compiled again and replaced: tests/agent/zkdv/torch/test_torch_aot.py
    # (a third cold compile here, in a sandbox without Inductor's cache, cost minutes).


def _trained_elsewhere(path: Path) -> Path:
    """``train_torch``'s honest run, trained in a process on the CPU's baseline kernels
    (ATen's, oneDNN's and MKL's), as if the lab's machine were not the platform's."""
    from zkdv.calibrate import kernels

    script = (
        "import os, sys, django; from pathlib import Path; "
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'config.settings'); django.setup(); "
        "from tests.attestations.challenges.test_replay import train_torch; "
        "train_torch(Path(sys.argv[1]), 'torch-run')"
    )
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        cwd=root,
        env={
            **os.environ,
            **kernels("default"),
            "PYTHONPATH": f"{root}:{AGENT_PYTHONPATH}",
        },
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return path


def test_a_run_trained_on_other_kernels_passes_and_its_certificate_says_how(
    platform: APIClient, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    run = _trained_elsewhere(tmp_path / "elsewhere")
    proof, attached = file_and_answer(platform, run, django_capture_on_commit_callbacks)
    assert attached.status_code == 201, attached.content
    assert proof.status == ProofStatus.VALID, challenge_summary(proof)
    statement = proof.certificate.statement()  # type: ignore[attr-defined]
    assert statement["predicate"]["replay"]["gradientBounds"] == {
        "tensor": 1e-4,
        "total": 2e-5,
        "scale": 1e-5,
    }
    claims = {claim["name"]: claim["value"] for claim in statement["predicate"]["claims"]}
    guarantee = claims["detection_guarantee"]
    # Other kernels round the gradient otherwise: every step within bounds, not bitwise,
    # and the state (the canonical update of the committed gradient) bit for bit.
    assert guarantee["comparison"] == "bounds"
    within = guarantee["replayed_steps"]["within_bounds"]
    assert [step for step, _ in within] == list(range(STEPS))
    assert all(0 < margin < 0.5 for _, margin in within)
    assert "bit for bit" in guarantee["forger_budget"]["state"]
    # The drift test of every window replayed within bounds, and of the run: rounding on
    # other kernels does not point one way step after step.
    drift = guarantee["drift"]
    assert drift["windows"] and all(w["p"] > w["window_p"] for w in drift["windows"])
    assert drift["run"]["z"] is not None and not drift["run"]["exceeded"]
    assert "align step after step" in guarantee["forger_budget"]["accumulation"]
    assert guarantee["forger_budget"]["measured"].startswith("measured, not guaranteed")
    environments = guarantee["environments"]
    assert environments["training"]["cpu_capability"] == "DEFAULT"
    assert environments["training"]["precision"]["kind"] == "float32"
    assert [worker["cpu_capability"] for worker in environments["replay"]] == [torch_capability()]
    page = platform.get(f"/api/v1/proofs/{proof.pk}/report.html")
    assert page.status_code == 200, page.content[:500]
    text = page.content.decode()
    for phrase in ("Gradient bounds", "What a forger could change", "Replayed on", "DEFAULT"):
        assert phrase in text, phrase


def torch_capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def test_the_seed_stays_secret_while_challenges_are_pending(
    platform: APIClient, runs: dict[str, Path], django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        filed = file_transcript(platform, runs["honest"], f"{ORG}/torch-run")
    proof_id = filed.json()["proof"]
    body = platform.get(f"/api/v1/proofs/{proof_id}/").json()
    assert body["status"] == "challenged"
    assert body["challenge_plan"]["seed"] is None
    assert len(body["challenge_plan"]["seed_commitment"]) == 64
    listed = platform.get(f"/api/v1/proofs/{proof_id}/challenges/?status=pending").json()
    first = listed["results"][0]
    assert first["step"] == 0 and first["origin"] == "genesis"
    assert first["needed_files"] == [
        "program.pt2" if (runs["honest"] / "program.pt2").exists() else "program.bin",
        "probes.bin",
        "files/snapshot-00000000.params.bin",
        "files/snapshot-00000000.opt_state.bin",
        "files/batch-00000000.u32",
        # The step's committed gradient: the replay recomputes it and compares within
        # bounds, then applies the optimizer to it exactly.
        "files/grad-00000000.bin",
    ]


def test_a_run_without_gradient_files_is_asked_for_none_and_replays_exactly(
    platform: APIClient, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    """``gradient_files="never"`` (a TPU's default): the challenges need no gradient
    file, and the replay recomputes each gradient bit for bit."""
    pytest.importorskip("jax")
    run = train_jax(tmp_path / "jax", "jax-run", gradient_files="never")
    assert not list((run / "files").glob("grad-*"))
    with django_capture_on_commit_callbacks(execute=True):
        filed = file_transcript(platform, run, f"{ORG}/jax-run")
    proof_id = filed.json()["proof"]
    listed = platform.get(f"/api/v1/proofs/{proof_id}/challenges/?status=pending").json()
    needed = [name for c in listed["results"] for name in c["needed_files"]]
    assert "files/batch-00000000.u32" in needed
    assert not [name for name in needed if "grad-" in name]
    with django_capture_on_commit_callbacks(execute=True):
        attached = answer(platform, proof_id, run, f"{ORG}/jax-run")
    assert attached.status_code == 201, attached.content
    proof = Proof.objects.get(pk=proof_id)
    assert proof.status == ProofStatus.VALID, challenge_summary(proof)


def test_a_run_without_gradient_files_from_other_kernels_is_not_replayed_not_rejected(
    platform: APIClient, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    """Trained on XLA's SSE4.2 kernels (its gradients round otherwise than this worker's
    AVX2 ones) and keeping no gradient files: no worker here can judge its steps, and
    that is what the platform records, not a forgery."""
    pytest.importorskip("jax")
    script = (
        "import os, sys, django; from pathlib import Path; "
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'config.settings'); django.setup(); "
        "from tests.attestations.challenges.test_replay import train_jax; "
        "train_jax(Path(sys.argv[1]), 'jax-run', gradient_files='never')"
    )
    root = Path(__file__).resolve().parents[3]
    run = tmp_path / "sse"
    trained = subprocess.run(
        [sys.executable, "-c", script, str(run)],
        cwd=root,
        env={
            **os.environ,
            "XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2",
            "PYTHONPATH": f"{root}:{AGENT_PYTHONPATH}",
        },
        capture_output=True,
        text=True,
        check=False,
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    proof, attached = file_and_answer(
        platform, run, django_capture_on_commit_callbacks, experiment=f"{ORG}/jax-run"
    )
    assert attached.status_code == 201, attached.content
    statuses = {c.status for c in proof.challenges.all()}
    assert ChallengeStatus.FAILED not in statuses, challenge_summary(proof)
    unreplayed = proof.challenges.filter(status=ChallengeStatus.UNREPLAYED)
    assert unreplayed.exists(), challenge_summary(proof)
    assert all("kept no gradient files" in c.message for c in unreplayed)
    assert proof.status != ProofStatus.REJECTED, (proof.status, proof.reason, proof.message)


@pytest.mark.parametrize(
    ("run", "reason", "step"),
    [
        ("invisible", "replay_mismatch", FORGED_STEP),  # parameters changed outside the optimizer
        # Through the platform each costs eight sandboxed replays; by default the hidden rate
        # is rejected through it in test_certificates_e2e.py, and substituted batches are
        # caught by the forgery suite's replays (test_forgery_suite.py).
        pytest.param("lr", "replay_mismatch", FORGED_STEP, marks=pytest.mark.long),
        pytest.param("data", "replay_mismatch", FORGED_STEP, marks=pytest.mark.long),
    ],
)
def test_a_forged_torch_run_is_rejected_by_replay(
    platform: APIClient,
    runs: dict[str, Path],
    django_capture_on_commit_callbacks: Any,
    run: str,
    reason: str,
    step: int,
) -> None:
    proof, attached = file_and_answer(platform, runs[run], django_capture_on_commit_callbacks)
    assert attached.status_code == 201, attached.content
    assert proof.status == ProofStatus.REJECTED, challenge_summary(proof)
    assert proof.reason == reason
    assert proof.field == f"challenges.step[{step}]"
    assert proof.message.startswith(f"challenge of step {step}: step {step}:"), proof.message
    failed = proof.challenges.get(step=step)
    assert (failed.status, failed.reason) == (ChallengeStatus.FAILED, reason)
    # Steps before the forgery replay fine.
    assert {c.status for c in proof.challenges.filter(step__lt=3)} == {ChallengeStatus.PASSED}


def test_a_snapshot_that_does_not_hash_to_its_commitment_is_refused(
    platform: APIClient, runs: dict[str, Path], django_capture_on_commit_callbacks: Any
) -> None:
    run = runs["honest"]
    name = "files/snapshot-00000003.params.bin"
    tampered = bytearray((run / name).read_bytes())
    tampered[0] ^= 1
    proof, attached = file_and_answer(
        platform, run, django_capture_on_commit_callbacks, replace={name: bytes(tampered)}
    )
    assert attached.status_code == 422, attached.content
    error = attached.json()["error"]
    assert error["code"] == "snapshot_mismatch"
    assert "does not hash to the params root the transcript commits for step 3" in error["message"]
    assert ProofArtifact.objects.filter(proof=proof).count() == 0  # nothing stored
    # Unanswered, the challenges expire at the deadline and reject the proof (on read).
    Proof.objects.filter(pk=proof.pk).update(challenge_deadline=proof.created)
    body = platform.get(f"/api/v1/proofs/{proof.pk}/").json()
    assert (body["status"], body["reason"]) == ("rejected", "challenge_expired")
    assert body["challenge_plan"]["seed"] is not None


def test_a_probe_file_that_does_not_match_the_transcript_fails_the_replay(
    platform: APIClient, runs: dict[str, Path], django_capture_on_commit_callbacks: Any
) -> None:
    """``probes.bin`` arrives after ingest; the first replay checks all of it first."""
    run = runs["honest"]
    tampered = bytearray((run / "probes.bin").read_bytes())
    tampered[5] ^= 0x40  # inside step 0's probe range
    proof, attached = file_and_answer(
        platform, run, django_capture_on_commit_callbacks, replace={"probes.bin": bytes(tampered)}
    )
    assert attached.status_code == 201, attached.content
    assert (proof.status, proof.reason) == (ProofStatus.REJECTED, "probe_digest"), (
        challenge_summary(proof)
    )
    failed = proof.challenges.filter(status=ChallengeStatus.FAILED).first()
    assert failed is not None and failed.reason == "probe_digest"
    assert "probes.bin: step 0 probe bytes do not match their committed digest" in failed.message
    assert not proof.challenges.filter(status=ChallengeStatus.PASSED).exists()


def test_a_rechained_transcript_with_an_edited_batch_commitment(
    platform: APIClient,
    runs: dict[str, Path],
    django_capture_on_commit_callbacks: Any,
    tmp_path: Path,
) -> None:
    """A forger edits step 4's batch root and re-chains; the batch file cannot match it."""
    import shutil

    from zkdv.hashing import ZERO_DIGEST
    from zkdv.records import encode, iter_records, record_hash

    run = Path(shutil.copytree(runs["honest"], tmp_path / "rechained"))
    records = [dict(r.data) for r in iter_records(run)]
    for record in records:
        if record.get("t") == "step" and record["i"] == FORGED_STEP:
            record["batch"] = {**record["batch"], "root": bytes(32)}
    out, prev = bytearray(), ZERO_DIGEST
    for record in records:
        encoded = encode({**record, "prev": prev})
        out += encoded
        prev = record_hash(encoded)
    (run / "records.cborl").write_bytes(bytes(out))
    with django_capture_on_commit_callbacks(execute=True):
        filed = file_transcript(platform, run, f"{ORG}/torch-run")
    proof = Proof.objects.get(pk=filed.json()["proof"])
    if proof.status == ProofStatus.REJECTED:  # caught by the offline verifier at ingest
        assert proof.reason and proof.record_index is not None
        return
    with django_capture_on_commit_callbacks(execute=True):
        attached = answer(platform, proof.pk, run, f"{ORG}/torch-run")
    assert attached.status_code == 422, attached.content
    error = attached.json()["error"]
    assert error["code"] == "batch_mismatch"
    assert "batch-00000004.u32 does not hash to step 4's committed batch root" in error["message"]


def test_a_transcript_of_another_experiment_is_refused_at_upload(
    platform: APIClient, runs: dict[str, Path]
) -> None:
    # The torch run is bound to acme/torch-run; filed under acme/jax-run it is a 422.
    response = file_transcript(platform, runs["honest"], f"{ORG}/jax-run")
    assert response.status_code == 422, response.content
    assert response.json()["error"]["code"] == "experiment_mismatch"
    assert not Proof.objects.exists()


# --- Over PostgreSQL, Redis and the real worker ----------------------------------------------


def quiesce(timeout: float = 120.0) -> None:
    """Wait until the session's worker has nothing queued, reserved or running.

    A settled proof queues its certificate; the worker must be done writing it before
    the test database is flushed, or the flush's TRUNCATE and its inserts deadlock.
    """
    from config.celery_app import app
    from tests.conftest import WORKER_QUEUES

    deadline, quiet = time.monotonic() + timeout, 0
    while time.monotonic() < deadline and quiet < 2:
        with app.connection_for_read() as connection:
            channel: Any = connection.default_channel
            queued = sum(channel.client.llen(queue) for queue in WORKER_QUEUES)
        inspect = app.control.inspect(timeout=1.0)
        busy = [*(inspect.active() or {}).values(), *(inspect.reserved() or {}).values()]
        quiet = quiet + 1 if not queued and not any(busy) else 0
        time.sleep(0.2)


@pytest.fixture
def services(transactional_db: None, celery_worker_process: Any) -> Iterator[tuple[APIClient, Any]]:
    _, key = setup_org({"torch-run": TORCH_SPEC, "jax-run": JAX_SPEC})
    yield client_for(key), celery_worker_process
    quiesce()


@pytest.mark.services
@pytest.mark.slow
def test_honest_torch_and_jax_runs_pass_through_the_worker(
    services: tuple[APIClient, Any], runs: dict[str, Path], tmp_path: Path
) -> None:
    pytest.importorskip("jax")
    client, worker = services
    jax_run = train_jax(tmp_path / "jax", "jax-run")
    for run, experiment in ((runs["honest"], "torch-run"), (jax_run, "jax-run")):
        filed = file_transcript(client, run, f"{ORG}/{experiment}")
        assert filed.status_code == 200, filed.content
        proof_id = filed.json()["proof"]
        proof = wait_for(
            proof_id, lambda p: p.status != ProofStatus.PENDING and p.status != "verifying", worker
        )
        assert proof.status == ProofStatus.CHALLENGED, (proof.status, proof.reason, proof.message)
        attached = answer(client, proof_id, run, f"{ORG}/{experiment}")
        assert attached.status_code == 201, attached.content
        proof = wait_for(proof_id, lambda p: p.is_final, worker)
        assert proof.status == ProofStatus.VALID, (challenge_summary(proof), worker.log()[-3000:])
        assert all(c.task_id for c in proof.challenges.all())


@pytest.mark.services
def test_a_forged_run_is_rejected_through_the_worker(
    services: tuple[APIClient, Any], runs: dict[str, Path]
) -> None:
    client, worker = services
    filed = file_transcript(client, runs["lr"], f"{ORG}/torch-run")
    proof_id = filed.json()["proof"]
    wait_for(proof_id, lambda p: p.status == ProofStatus.CHALLENGED, worker)
    assert answer(client, proof_id, runs["lr"], f"{ORG}/torch-run").status_code == 201
    proof = wait_for(proof_id, lambda p: p.is_final, worker)
    assert (proof.status, proof.reason) == (ProofStatus.REJECTED, "replay_mismatch")
    assert proof.field == f"challenges.step[{FORGED_STEP}]"


# --- A worker killed mid-replay ---------------------------------------------------------------


def _worker(queue: str, log: Path, **env: str) -> subprocess.Popen[bytes]:
    from django.conf import settings

    from tests.conftest import _test_database_url

    environment = {
        **os.environ,
        "DATABASE_URL": _test_database_url(),
        "DVBENCH_DATA_DIR": str(settings.DVBENCH["DATA_DIR"]),
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    environment.pop("DVBENCH_EAGER_TASKS", None)
    handle = open(log, "ab")  # noqa: SIM115 - owned by the child process
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "--app=tests.attestations.challenges.test_replay_worker_app",
            "worker",
            f"--queues={queue}",
            "--pool=solo",
            "--concurrency=1",
            f"--hostname=kill-{uuid.uuid4().hex[:6]}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=INFO",
        ],
        cwd=REPO_ROOT,
        env=environment,
        stdout=handle,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.services
@pytest.mark.slow
def test_a_worker_killed_mid_replay_completes_the_challenge_exactly_once(
    transactional_db: None, runs: dict[str, Path], tmp_path: Path
) -> None:
    """SIGKILL while a challenge is claimed; the restarted worker finishes it once.

    The restarted worker runs with a 30 s task time limit, so the broker's visibility
    timeout is 60 s, a claim is stale after 30 s, and the replay's sandbox has 18 s (a
    10 s limit left it 5 s, which a Torch child on a loaded machine overran: CI, 7
    December); ``DVBENCH_REPLAY_TEST_DELAY`` holds the first worker inside the replay
    long enough to kill it there.
    """
    from tests.conftest import services_configured

    if not services_configured():
        pytest.skip("needs real PostgreSQL and Redis")
    from attestations.challenges.tasks import replay_challenge
    from attestations.challenges.workspace import proof_directory

    _, key = setup_org({"torch-run": TORCH_SPEC})
    client = client_for(key)
    run = runs["honest"]
    # Filed and ingested in this process (tasks are eager without the session worker).
    filed = file_transcript(client, run, f"{ORG}/torch-run")
    proof = wait_for(filed.json()["proof"], lambda p: p.status == ProofStatus.CHALLENGED)
    challenge = Challenge.objects.get(proof=proof, step=5)
    # Attach the files by hand and mark only this challenge ready: no message reaches
    # the shared replay queue.
    from django.core.files.base import ContentFile
    from django.core.files.storage import default_storage

    from attestations.uploads.models import Blob

    for name in challenge.needed_files:
        data = (run / name).read_bytes()
        digest = sha256(data)
        blob = Blob.objects.filter(sha256=digest).first() or Blob.objects.create(
            sha256=digest,
            size=len(data),
            storage_name=default_storage.save(Blob.address(digest), ContentFile(data)),
        )
        ProofArtifact.objects.create(
            proof=proof, name=name, kind=kind_of(name), blob=blob, sha256=digest, size=len(data)
        )
    Challenge.objects.filter(pk=challenge.pk).update(status=ChallengeStatus.READY)
    queue = f"replay-kill-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "workers.log"
    first = _worker(queue, log, DVBENCH_TASK_TIME_LIMIT="10", DVBENCH_REPLAY_TEST_DELAY="60")
    from config.celery_app import app

    try:
        eager, app.conf.task_always_eager = app.conf.task_always_eager, False
        try:  # this one message goes over Redis to the private queue
            replay_challenge.apply_async((challenge.pk,), queue=queue)
        finally:
            app.conf.task_always_eager = eager
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            challenge.refresh_from_db()
            if challenge.status == ChallengeStatus.REPLAYING:
                break
            assert first.poll() is None, log.read_text()
            time.sleep(0.1)
        assert challenge.status == ChallengeStatus.REPLAYING, log.read_text()
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert challenge.attempts == 1
    second = _worker(queue, log, DVBENCH_TASK_TIME_LIMIT="30")
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            challenge.refresh_from_db()
            if challenge.is_final:
                break
            assert second.poll() is None, log.read_text()
            time.sleep(0.25)
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(timeout=30)
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait()
    assert challenge.status == ChallengeStatus.PASSED, (challenge.reason, log.read_text()[-3000:])
    assert challenge.attempts == 2  # the killed attempt, and the one that finished
    assert (
        AuditEvent.objects.filter(action="challenge.passed", target_id=str(challenge.pk)).count()
        == 1
    )
    # The same verdict as replaying it here, directly.
    directory = proof_directory(proof, challenge.needed_files)
    import provers

    direct = provers.verify_challenge(directory, 5)
    recorded: Any = challenge.evidence
    assert direct.ok and recorded["evidence"] == [e.to_dict() for e in direct.evidence]
