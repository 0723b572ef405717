"""A Hugging Face ``Trainer`` run filed with DVBench through ``zkdv.integrations``.

``examples/torch/hf_trainer.py``'s Trainer, reporting to W&B (offline: W&B's own run,
nothing sent), proved with ``prove(trainer, experiment=...)`` against a live platform:
at the end of training the proof is uploaded with the signed final weights, the
platform verifies it, and the W&B run records the proof's digest, URL and verdict.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import zkdv
from dvbench import Client

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]


def test_a_trainer_run_is_filed_with_its_signed_weights_and_tracked(
    platform, tmp_path, monkeypatch
):
    pytest.importorskip("transformers")
    wandb = pytest.importorskip("wandb")
    from zkdv.integrations.transformers import prove

    monkeypatch.setenv("ZKDV_TORCH_PROGRAM", "torch.export")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    path = REPO / "examples" / "torch" / "hf_trainer.py"
    spec = importlib.util.spec_from_file_location("zkdv_example_hf_trainer", path)
    assert spec is not None and spec.loader is not None
    hf_trainer = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = hf_trainer
    spec.loader.exec_module(hf_trainer)

    trainer = hf_trainer.make_trainer(tmp_path / "out", max_steps=4, report_to="wandb")
    with Client(platform.url, api_key=platform.key("alice")) as client:
        experiment = client.experiment("acme/hf-trainer")
        policy = zkdv.SamplingPolicy(update_check_probability=0.25)
        proof = prove(
            trainer, experiment=experiment, config=zkdv.ZKDVConfig(sampling_policy=policy)
        )
        try:
            trainer.train()
            recorded = dict(wandb.run.summary)
        finally:
            wandb.finish()
        (listed,) = experiment.proofs()
        # finish() at the end of training asks for the verdict once; the replays of its
        # challenges run in the live server (eager tasks, inside the upload request) and
        # may outlast it, so the status is read once final.
        filed = client.wait_for_proof(listed["id"], timeout=240, interval=1.0)
        uploads = list(client.paginate("uploads/", {"experiment": "acme/hf-trainer"}))

    assert filed["status"] == "valid", filed
    assert filed["steps"] == 4 and filed["prover"] == "whitebox-torch"
    assert proof.result.proof_id == listed["id"] and str(listed["id"]) in proof.url
    # The signed final weights went with the proof.
    names = {upload["name"] for upload in uploads if upload["status"] == "complete"}
    assert {"model/model.safetensors", "model/model.sig"} <= names, names
    assert proof.saved is not None and proof.saved.path.name == "model.safetensors"
    # The tracker's run holds the proof's fields.
    assert recorded["zkdv/transcript_digest"] == proof.digest
    assert recorded["zkdv/proof_url"] == proof.url
    assert recorded["zkdv/steps"] == 4
    assert recorded["zkdv/verdict"] in {"PASSED", "pending"}
