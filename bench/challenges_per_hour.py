"""Challenges verified per hour per worker, through the platform's own replay path.

    python bench/challenges_per_hour.py [--width 256] [--steps 32] [--window 8]
                                        [--batch 64] [--target 0.95] [--threads 1]

A Torch run (an MLP ``64 -> w -> w -> 10`` with AdamW, ``torch.export`` program,
``replay_snapshot_interval = --window``) is trained with ZKDV, filed with the platform
(a throwaway SQLite database and data directory; tasks run in this process, as one
solo worker runs them), verified, challenged at the detection target, answered with the
files the challenges name, and replayed by the ``replay_challenge`` task: claim,
materialise the proof directory from stored blobs, ``provers.verify_challenge``, record
the verdict and progress, settle the proof.

Side by side, on the same machine and the same challenges, the bare prover:
``provers.verify_challenge`` on the finished directory with the transition loaded once.
The difference is what the platform adds per challenge (database, blob copies, the
offline verification of the transcript inside every challenge is common to both).

Reported: challenges, replayed steps, wall time of the platform's replays (the one-time
artifact load included, as a worker pays it once per proof), challenges per hour per
worker, and the platform / bare-prover ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from hashlib import sha256
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT),
    str(ROOT / "agent" / "zkdv" / "src"),
    str(ROOT / "agent" / "dvbench" / "src"),
]

FEATURES, CLASSES = 64, 10


def train(path: Path, name: str, digest: str, args: argparse.Namespace) -> Path:
    """Train ``--steps`` steps of the MLP with ZKDV, bound to ``name``."""
    import numpy as np
    import torch
    from torch import nn
    from torch.nn import functional

    import zkdv
    import zkdv.torch

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    proof = zkdv.torch.ZKDV(
        path,
        zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0)),
        replay_snapshot_interval=args.window,
    )
    proof.program_kind = "torch.export"
    proof.bind_experiment(name, digest)
    proof.start(rolling_window=4, probe_ratio=0.05)
    w = args.width
    model = nn.Sequential(
        nn.Linear(FEATURES, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, CLASSES)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = proof.prepare(model, optimizer)

    @proof.attest
    def attested(model: nn.Module, optimizer: Any, batch: Any) -> None:
        inputs, targets = batch
        loss = functional.cross_entropy(proof.forward(model, inputs), targets)
        proof.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    rng = np.random.default_rng(0)
    try:
        for _ in range(args.steps):
            inputs = torch.from_numpy(
                rng.standard_normal((args.batch, FEATURES)).astype(np.float32)
            )
            targets = torch.from_numpy(rng.integers(0, CLASSES, args.batch).astype(np.int64))
            with proof.transaction(batch=(inputs, targets)):
                loss = functional.cross_entropy(model(inputs), targets)
                proof.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        proof.close()
    return path


def store(experiment: Any, user: Any, kind: str, data: bytes, name: str = "") -> Any:
    from attestations.uploads import services as uploads
    from attestations.uploads.parts import put_part

    upload = uploads.create(
        experiment=experiment,
        kind=kind,
        size=len(data),
        sha256=sha256(data).hexdigest(),
        user=user,
        name=name,
    )
    put_part(
        upload, 1, stream=BytesIO(data), declared_sha256=upload.sha256, content_length=len(data)
    )
    return uploads.complete(upload, user=user)


def kind_of(name: str) -> str:
    """The artifact kind the SDK uploads ``name`` as (snapshots, batches, gradients...)."""
    from dvbench.uploads import kind_of as sdk_kind

    kind = sdk_kind(name)
    assert kind is not None, name
    return kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--threads", type=int, default=1, help="Torch intra-op threads")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dvbench-challenges-bench-") as root:
        for variable in ("DATABASE_URL", "REDIS_URL", "DVBENCH_S3_BUCKET"):
            os.environ.pop(variable, None)
        os.environ.update(
            DVBENCH_DATA_DIR=root,
            DJANGO_SETTINGS_MODULE="config.settings",
            DVBENCH_DETECTION_TARGET=str(args.target),
            DVBENCH_EAGER_TASKS="1",
        )
        import django

        django.setup()
        from django.contrib.auth.models import User
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        import provers
        from attestations.accounts.models import Organization
        from attestations.challenges import answers
        from attestations.challenges.models import Challenge
        from attestations.experiments.models import Experiment
        from attestations.proofs.models import Proof

        org = Organization.objects.create(slug="bench", name="Bench")
        user = User.objects.create_user("bench")
        spec = {
            "framework": "torch",
            "model_description": f"MLP 64-{args.width}-{args.width}-10",
            "optimizer": "AdamW(1e-3)",
            "dataset_commitment": "ab" * 32,
            "allowed_regimes": ["pretraining"],
        }
        experiment = Experiment.register(org, "replay", spec, user=user)
        assert experiment.current_spec is not None
        run = train(Path(root) / "run", experiment.full_name, experiment.current_spec.digest, args)
        filed = store(experiment, user, "transcript", (run / "records.cborl").read_bytes())
        proof = Proof.objects.get(upload=filed)
        assert proof.status == "challenged", (proof.status, proof.reason, proof.message)
        challenges = list(Challenge.objects.filter(proof=proof).order_by("step"))
        needed = sorted({n for c in challenges for n in c.needed_files})
        claims = []
        for name in needed:
            data = (run / name).read_bytes()
            store(experiment, user, kind_of(name), data, name)
            claims.append(
                answers.FileClaim(name, kind_of(name), sha256(data).hexdigest(), len(data))
            )
        provers.close_provers()  # the worker starts cold: the artifact load counts
        started = time.perf_counter()
        answers.attach(proof, claims, user=user)  # ready -> queued -> replayed (in process)
        platform = time.perf_counter() - started
        proof.refresh_from_db()
        assert proof.status == "valid", (proof.status, proof.reason, proof.message)

        from provers import torch_replay

        started = time.perf_counter()
        transition = torch_replay.load_transition(run)
        for challenge in challenges:
            assert provers.verify_challenge(run, challenge.step, transition=transition).ok
        bare = time.perf_counter() - started
        steps = sum(c.steps_total for c in challenges)
        print(f"{os.cpu_count()} cpus; load average {os.getloadavg()[0]:.1f}")
        print(
            f"torch MLP width {args.width}, batch {args.batch}, {args.steps} steps, window "
            f"{args.window}, target {args.target}: {len(challenges)} challenges, "
            f"{steps} replayed steps"
        )
        print(
            f"  platform (task path, cold worker)  {platform:8.2f} s  "
            f"{3600 * len(challenges) / platform:8.0f} challenges/hour/worker"
        )
        print(
            f"  bare prover (same challenges)      {bare:8.2f} s  "
            f"{3600 * len(challenges) / bare:8.0f} challenges/hour"
        )
        print(f"  platform / bare prover             {platform / bare:8.2f}")


if __name__ == "__main__":
    main()
