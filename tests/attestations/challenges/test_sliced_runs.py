"""Sliced challenges through the platform (docs/scale.md, "The platform's path").

A lab (``zkdv.sliced.TorchLab`` on ``examples/torch/lm.py``'s model, float32, no dropout)
uploads its block programs and run file with the upload API, files the run, answers each
slice the platform draws with its projections, uploads the opening of the sequences the
answer drew, and the ``replay_slice`` task verifies it with the committed block program.
Honest runs pass; forged runs fail with the check that catches them; malformed answers,
openings and run files get precise errors and change nothing.

Tasks run in-process here (eager); ``test_an_honest_run_passes_through_the_worker`` goes
through PostgreSQL, Redis and a separate Celery worker process.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from django.utils import timezone
from rest_framework.test import APIClient
from torch import nn

from attestations.audit.models import AuditEvent
from attestations.challenges import sliced as platform_sliced
from attestations.challenges import sliced_verdicts
from attestations.challenges.models import SlicedChallenge, SlicedRun, SliceStatus
from tests.agent.zkdv.torch import test_sliced as protocol
from tests.attestations.base import World, error_of, upload_blob
from tests.attestations.challenges.test_replay import TORCH_SPEC, client_for, quiesce, setup_org
from zkdv import sliced, sliced_store

CONFIG, MICRO, ROWS, STEPS = protocol.CONFIG, protocol.MICRO, protocol.ROWS, protocol.STEPS
RUNS = "/api/v1/experiments/acme/run-1/sliced-runs/"


class LMInput(nn.Module):
    """The input check's map from one committed batch row to its boundary-0 row.

    Shares the model's two embeddings under their committed names, so the platform calls
    its program with the opened tables.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.tokens = model.tokens
        self.positions = model.positions

    def forward(self, row: torch.Tensor) -> torch.Tensor:
        ids = row[:-1]  # the recipe's model reads all but the last token of a row
        # The first positions' rows: a slice, not torch.arange, whose device the export
        # would fix (zkdv.sliced.export_program refuses that).
        return self.tokens(ids) + self.positions.weight[: ids.shape[0]]


@pytest.fixture(autouse=True)
def _small_policy(settings: Any) -> Iterator[None]:
    # Two slices of two sequences each: a real draw, small enough for a test.
    settings.DVBENCH = {**settings.DVBENCH, "SLICED_CHALLENGES": 2, "SLICED_OPENED": 2}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train(seed: int, tamper: dict[str, Callable[..., None]] | None = None) -> sliced.TorchLab:
    """The lab: the protocol tests' run (the LM recipe's model, 3 steps of 2 x 4)."""
    return protocol._train(seed, tamper)


def upload(client: APIClient, data: bytes) -> str:
    response = upload_blob(client, data, part_size=64 * 1024)
    assert response.status_code in (200, 201), response.content
    return hashlib.sha256(data).hexdigest()


def file_run(client: APIClient, lab: sliced.TorchLab) -> dict[str, Any]:
    """Upload the programs and the run file, and file the run: the lab's first calls."""
    blocks, embed, archives = lab.programs(LMInput(lab.model))
    for data in archives.values():
        upload(client, data)
    digest = upload(client, lab.run_file(blocks, embed).to_bytes())
    response = client.post(RUNS, {"run_file": digest}, format="json")
    assert response.status_code == 201, response.content
    return response.json()  # type: ignore[no-any-return]


def drawn(challenge: dict[str, Any]) -> sliced.SliceChallenge:
    return sliced.SliceChallenge(
        challenge["step"],
        challenge["block"],
        bytes.fromhex(challenge["directions"]),
        challenge["projections"],
    )


def put_answer(client: APIClient, run: dict[str, Any], index: int, body: bytes) -> Any:
    return client.put(
        f"/api/v1/sliced-runs/{run['id']}/challenges/{index}/answer/",
        data=body,
        content_type="application/octet-stream",
    )


def post_opening(client: APIClient, run: dict[str, Any], index: int, **body: Any) -> Any:
    """Open slice ``index``: ``opening=<sha256>`` of an upload, or ``grant=<dict>``."""
    return client.post(
        f"/api/v1/sliced-runs/{run['id']}/challenges/{index}/opening/", body, format="json"
    )


def answer_and_open(
    client: APIClient,
    run: dict[str, Any],
    lab: sliced.TorchLab,
    *,
    edit: Callable[[bytes], bytes] | None = None,
) -> None:
    """Answer every slice and open what each answer drew (the platform then verifies)."""
    for challenge in run["challenges"]:
        slice_ = drawn(challenge)
        answer = lab.answer(slice_)
        response = put_answer(
            client, run, challenge["index"], sliced.answer_to_bytes(answer.projections)
        )
        assert response.status_code == 200, response.content
        sequences = [tuple(s) for s in response.json()["sequences"]]
        assert len(sequences) == challenge["opened"]
        data = sliced.opening_to_bytes(lab.open(slice_, sequences))
        digest = upload(client, edit(data) if edit else data)
        response = post_opening(client, run, challenge["index"], opening=digest)
        assert response.status_code == 202, response.content


def settled(client: APIClient, run: dict[str, Any]) -> dict[str, Any]:
    return client.get(f"/api/v1/sliced-runs/{run['id']}/").json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("seed", range(10))
def test_honest_runs_pass_their_drawn_slices_through_the_api(
    seed: int,
    world: World,
    api: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = api("alice")
    lab = train(seed)
    run = file_run(client, lab)
    assert run["status"] == "challenged" and run["seed"] is None
    assert [c["status"] for c in run["challenges"]] == ["awaiting_answer"] * 2
    with django_capture_on_commit_callbacks(execute=True):
        answer_and_open(client, run, lab)
    done = settled(client, run)
    assert done["status"] == "passed", done
    for challenge in done["challenges"]:
        assert challenge["status"] == "passed", challenge
        # Honest rounding uses a small share of every bound.
        assert max(challenge["margins"].values()) < 0.1, challenge["margins"]
        assert challenge["bytes_moved"] > 0
    # The revealed seed re-derives every draw: the slices from the run file's digest,
    # the sequences from each answer's digest.
    seed_bytes = bytes.fromhex(done["seed"])
    assert hashlib.sha256(seed_bytes).hexdigest() == done["seed_commitment"]
    for challenge in done["challenges"]:
        again = sliced.draw_challenge(
            seed_bytes,
            bytes.fromhex(done["digest"]),
            index=challenge["index"],
            steps=STEPS,
            blocks=CONFIG.layers,
        )
        assert (again.step, again.block, again.seed.hex()) == (
            challenge["step"],
            challenge["block"],
            challenge["directions"],
        )
        sequences = sliced.draw_sequences(
            seed_bytes,
            again,
            bytes.fromhex(challenge["answer_digest"]),
            micro_batches=MICRO,
            rows=ROWS,
            count=challenge["opened"],
        )
        assert [list(s) for s in sequences] == challenge["sequences"]


def _nudge(step: int, params: dict[str, torch.Tensor]) -> None:
    for name in ("blocks.0.up.weight", "blocks.1.up.weight"):
        params[name][0, 0] += 1e-3


def _replace_boundaries(step: int, boundaries: list[list[dict[str, np.ndarray]]]) -> None:
    act = boundaries[0][1][sliced.ACTIVATION]  # micro-batch 0, between blocks 0 and 1
    act[:] = np.random.default_rng(step).standard_normal(act.shape).astype(np.float32)


def _scale_gradient(step: int, gradients: dict[str, torch.Tensor]) -> None:
    for name, gradient in gradients.items():
        if name.startswith("blocks."):
            gradient.mul_(1.01)


def _substitute(step: int, batch: np.ndarray) -> None:
    batch[:, :, 3] = (batch[:, :, 3] + 1) % CONFIG.vocab  # trained on other tokens


@pytest.mark.parametrize(
    ("tamper", "reasons"),
    [
        ({"post": _nudge}, {"update"}),
        ({"boundaries": _replace_boundaries}, {"forward", "backward"}),
        ({"gradient": _scale_gradient}, {"freivalds"}),
        ({"batch": _substitute}, {"input"}),
    ],
    ids=[
        "weights-nudged",
        "micro-batch-boundary-replaced",
        "block-gradient-scaled",
        "data-substituted",
    ],
)
def test_forged_runs_fail_the_check_that_catches_them(
    tamper: dict[str, Callable[..., None]],
    reasons: set[str],
    settings: Any,
    world: World,
    api: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    # Every step forged, every sequence opened: every slice must catch it.
    settings.DVBENCH = {**settings.DVBENCH, "SLICED_OPENED": MICRO * ROWS}
    client = api("alice")
    lab = train(3, tamper)
    run = file_run(client, lab)
    with django_capture_on_commit_callbacks(execute=True):
        answer_and_open(client, run, lab)
    done = settled(client, run)
    assert done["status"] == "failed", done
    for challenge in done["challenges"]:
        assert challenge["status"] == "failed"
        assert challenge["reason"] in reasons, challenge
    assert done["reason"] == done["challenges"][0]["reason"]
    assert done["message"].startswith("slice 0 (step ")
    assert done["seed"] is not None
    assert AuditEvent.objects.filter(action="sliced_run.failed").count() == 1


def test_a_malformed_opening_fails_its_slice_and_the_run(
    world: World,
    api: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = api("alice")
    lab = train(0)
    run = file_run(client, lab)
    with django_capture_on_commit_callbacks(execute=True):
        answer_and_open(client, run, lab, edit=lambda data: data[:-7])
    done = settled(client, run)
    assert done["status"] == "failed"
    assert done["challenges"][0]["reason"] == "opening_format"
    assert "not canonical CBOR" in done["challenges"][0]["message"]


def test_a_tampered_opened_tensor_fails_the_tensor_check(
    world: World,
    api: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = api("alice")
    lab = train(0)
    run = file_run(client, lab)

    def flip(data: bytes) -> bytes:
        opening = sliced.opening_from_bytes(data)
        first = opening.params[0]
        changed = bytearray(first.data)
        changed[5] ^= 1
        params = (sliced.TensorOpening(**{**first.__dict__, "data": bytes(changed)}),)
        return sliced.opening_to_bytes(
            sliced.SliceOpening(**{**opening.__dict__, "params": params + opening.params[1:]})
        )

    with django_capture_on_commit_callbacks(execute=True):
        answer_and_open(client, run, lab, edit=flip)
    assert {c["reason"] for c in settled(client, run)["challenges"]} == {"tensor_opening"}


def test_answers_are_checked_drawn_once_and_never_change(
    world: World,
    api: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    client = api("alice")
    lab = train(1)
    run = file_run(client, lab)
    challenge = run["challenges"][0]
    projections = lab.answer(drawn(challenge)).projections
    good = sliced.answer_to_bytes(projections)

    short = put_answer(client, run, 0, good[:-8])
    assert short.status_code == 400
    error = error_of(short)
    assert error["code"] == "invalid_answer" and error["field"] == "body"
    assert error["detail"] == {"expected_bytes": len(good), "got_bytes": len(good) - 8}
    assert "4 projections x 2 micro-batches x 4 rows" in error["message"]
    assert put_answer(client, run, 0, good + b"\0" * 8).status_code == 413
    nan = projections.copy()
    nan[0, 0, 0] = np.nan
    assert error_of(put_answer(client, run, 0, sliced.answer_to_bytes(nan)))["code"] == (
        "invalid_answer"
    )
    stored = SlicedChallenge.objects.get(run_id=run["id"], index=0)
    assert stored.status == SliceStatus.AWAITING_ANSWER and stored.answer is None

    # An opening before the answer: the sequences are not drawn yet.
    early = post_opening(client, run, 0, opening="ab" * 32)
    assert early.status_code == 400 and error_of(early)["code"] == "blob_not_found"
    digest = upload(client, b"an opening of nothing")
    early = post_opening(client, run, 0, opening=digest)
    assert early.status_code == 409 and error_of(early)["code"] == "slice_not_answered"

    first = put_answer(client, run, 0, good)
    assert first.status_code == 200
    again = put_answer(client, run, 0, good)
    assert again.status_code == 200 and again.json()["sequences"] == first.json()["sequences"]
    projections[1, 1, 1] += 1.0
    changed = put_answer(client, run, 0, sliced.answer_to_bytes(projections))
    assert changed.status_code == 409 and error_of(changed)["code"] == "slice_answered"
    assert put_answer(client, run, 7, good).status_code == 404


def test_roles_and_organisations(world: World, api: Any) -> None:
    lab = train(2)
    run = file_run(api("alice"), lab)
    body = sliced.answer_to_bytes(lab.answer(drawn(run["challenges"][0])).projections)
    # The lab's auditor and a regulator read the run (as they read its proofs), but
    # cannot answer for it.
    for reader in ("bob", "carol"):
        assert api(reader).get(f"/api/v1/sliced-runs/{run['id']}/").status_code == 200
        assert put_answer(api(reader), run, 0, body).status_code == 403
    # Another lab does not see it at all.
    assert api("mallory").get(f"/api/v1/sliced-runs/{run['id']}/").status_code == 404
    assert put_answer(api("mallory"), run, 0, body).status_code == 404
    assert api(None).get(f"/api/v1/sliced-runs/{run['id']}/").status_code in (401, 403)
    # Mallory cannot file acme's run file, even knowing its digest.
    response = api("mallory").post(
        "/api/v1/experiments/evil/heist/sliced-runs/", {"run_file": run["digest"]}, format="json"
    )
    assert response.status_code == 400 and error_of(response)["code"] == "blob_not_found"
    assert api("bob").post(RUNS, {"run_file": run["digest"]}, format="json").status_code == 403
    assert api("alice").get(RUNS).json()["results"][0]["id"] == run["id"]


def test_run_files_are_checked_before_anything_is_filed(world: World, api: Any) -> None:
    client = api("alice")
    lab = train(0)
    blocks, embed, archives = lab.programs(LMInput(lab.model))

    garbage = upload(client, b"not a run file")
    response = client.post(RUNS, {"run_file": garbage}, format="json")
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "invalid_run_file" and error["field"] == "run_file.run file"

    # Programs named but never uploaded.
    digest = upload(client, lab.run_file(blocks, embed).to_bytes())
    response = client.post(RUNS, {"run_file": digest}, format="json")
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["field"]) == ("blob_not_found", "run_file.programs[0]")

    # A block naming a parameter of another block.
    run_file = lab.run_file(blocks, embed)
    layout = sliced.BlockLayout(
        ((run_file.layout.blocks[0][0], run_file.layout.blocks[1][1]), run_file.layout.blocks[1])
    )
    bad = upload(client, sliced.RunFile(**{**run_file.__dict__, "layout": layout}).to_bytes())
    error = error_of(client.post(RUNS, {"run_file": bad}, format="json"))
    assert error["field"] == "run_file.blocks[0][1][0]"
    assert "is not a committed parameter under 'blocks.0'" in error["message"]
    assert SlicedRun.objects.count() == 0

    for data in archives.values():
        upload(client, data)
    first = client.post(RUNS, {"run_file": digest}, format="json")
    again = client.post(RUNS, {"run_file": digest}, format="json")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    assert SlicedChallenge.objects.count() == 2


def test_unanswered_slices_expire_at_the_deadline(world: World, api: Any) -> None:
    client = api("alice")
    run = file_run(client, train(0))
    assert sliced_verdicts.expire() == 0
    SlicedRun.objects.filter(pk=run["id"]).update(deadline=timezone.now() - timezone.timedelta(1))
    assert sliced_verdicts.expire() == 2
    done = settled(client, run)
    assert (done["status"], done["reason"]) == ("failed", "challenge_expired")


def test_the_policy_draws_enough_slices_for_its_target(settings: Any) -> None:
    settings.DVBENCH = {**settings.DVBENCH, "SLICED_CHALLENGES": 0}
    # 0.95 at 1 % forged steps: 299 slices, capped by the slices a run has.
    assert platform_sliced.challenge_count(1000, 80, 256, 4, 4) == 299
    assert platform_sliced.challenge_count(3, 2, 2, 4, 2) == 6


@pytest.fixture
def services(transactional_db: None, celery_worker_process: Any) -> Iterator[tuple[APIClient, Any]]:
    _, key = setup_org({"run-1": TORCH_SPEC})
    yield client_for(key), celery_worker_process
    quiesce()


@pytest.mark.services
def test_an_honest_run_passes_through_the_worker(services: tuple[APIClient, Any]) -> None:
    import time

    client, worker = services
    lab = train(4)
    run = file_run(client, lab)
    answer_and_open(client, run, lab)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = settled(client, run)
        if done["status"] != "challenged":
            break
        time.sleep(0.2)
    assert done["status"] == "passed", (done, worker.log()[-3000:])
    assert all(c["status"] == "passed" for c in done["challenges"])
    assert all(c.task_id for c in SlicedChallenge.objects.filter(run_id=run["id"]))


# --- Openings read from the lab's own bucket through a grant ---------------------------------


class LabBucket:
    """The lab's own S3 bucket holding every step's files, and its grants per step."""

    def __init__(self, endpoint: str, lab: sliced.TorchLab, run_digest: str) -> None:
        from tests.attestations.s3 import CREDENTIALS, REGION

        self.client = sliced_store.s3_client(
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id=CREDENTIALS["access_key"],
            aws_secret_access_key=CREDENTIALS["secret_key"],
        )
        self.name = f"zkdv-lab-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=self.name)
        self.prefix = f"runs/{run_digest[:16]}"
        self.run = bytes.fromhex(run_digest)
        self.size = 0
        for step in range(STEPS):
            self.size += sliced_store.upload_step(
                self.client, self.name, self.prefix, sliced_store.step_objects(lab, step)
            )

    def grant(self, step: int, *, run: bytes | None = None) -> dict[str, Any]:
        return sliced_store.issue_grant(
            self.client,
            run=run or self.run,
            bucket=self.name,
            prefix=self.prefix,
            names=sliced_store.object_names(step).values(),
            expires_in=600,
        ).to_dict()


def open_from_bucket(
    client: APIClient, run: dict[str, Any], lab: sliced.TorchLab, bucket: LabBucket
) -> list[Any]:
    """Answer every slice and open each through a grant on the lab's bucket."""
    responses = []
    for challenge in run["challenges"]:
        answer = lab.answer(drawn(challenge))
        body = sliced.answer_to_bytes(answer.projections)
        assert put_answer(client, run, challenge["index"], body).status_code == 200
        grant = bucket.grant(challenge["step"])
        responses.append(post_opening(client, run, challenge["index"], grant=grant))
    return responses


@pytest.fixture
def stores(settings: Any, s3_endpoint: str) -> str:
    settings.DVBENCH = {**settings.DVBENCH, "SLICED_STORE_ENDPOINTS": [s3_endpoint]}
    return s3_endpoint


def test_a_slice_read_from_the_labs_bucket_through_a_grant_passes(
    stores: str, world: World, api: Any, django_capture_on_commit_callbacks: Any
) -> None:
    client = api("alice")
    lab = train(5)
    run = file_run(client, lab)
    bucket = LabBucket(stores, lab, run["digest"])
    with django_capture_on_commit_callbacks(execute=True):
        responses = open_from_bucket(client, run, lab, bucket)
    assert [r.status_code for r in responses] == [202, 202], [r.content for r in responses]
    done = settled(client, run)
    assert done["status"] == "passed", done
    answer_bytes = 8 * 4 * MICRO * ROWS
    for challenge in done["challenges"]:
        # The answer, then the manifest, digest sections and opened ranges only.
        read = challenge["bytes_moved"] - answer_bytes
        assert 0 < read < bucket.size / STEPS, (read, bucket.size)
    # The grant is on record (its URLs are not audited: they are the lab's credentials).
    stored = SlicedChallenge.objects.get(run_id=run["id"], index=0)
    assert stored.grant is not None and stored.opening is None
    event = AuditEvent.objects.filter(action="sliced_run.opened").first()
    assert event is not None and "urls" not in event.detail["grant"]


def test_grants_are_checked_before_they_are_stored(
    stores: str, settings: Any, world: World, api: Any
) -> None:
    client = api("alice")
    lab = train(6)
    run = file_run(client, lab)
    bucket = LabBucket(stores, lab, run["digest"])
    challenge = run["challenges"][0]
    body = sliced.answer_to_bytes(lab.answer(drawn(challenge)).projections)
    assert put_answer(client, run, 0, body).status_code == 200

    def refused(grant: Any, **extra: Any) -> dict[str, Any]:
        response = post_opening(client, run, 0, grant=grant, **extra)
        assert response.status_code == 400, response.content
        return error_of(response)

    grant = bucket.grant(challenge["step"])
    assert refused(bucket.grant(challenge["step"], run=b"\1" * 32))["code"] == "invalid_grant"
    assert (
        "accepted only for the run it names"
        in refused(bucket.grant(challenge["step"], run=b"\1" * 32))["message"]
    )
    other_step = (challenge["step"] + 1) % STEPS
    error = refused(bucket.grant(other_step))
    assert (error["code"], error["field"]) == ("invalid_grant", "grant.urls")
    assert refused({"v": "zkdv-sliced-grant-v0"})["code"] == "invalid_grant"
    # Once its endpoint is allowed, a grant's URLs reach their objects and nothing else:
    # no dot-segment or encoded separator, no subdomain of the endpoint, no other query.
    name, url = next(iter(grant["urls"].items()))
    host = url.split("/")[2]
    for forged, says in [
        (
            url.replace(
                f"/{bucket.prefix}/", f"/{bucket.prefix}/../{bucket.prefix.split('/')[1]}/"
            ),
            "'..' segment",
        ),
        (url.replace(f"/{bucket.name}/", f"/{bucket.name}%2F"), "encoded"),
        (url.replace(f"//{host}/{bucket.name}/", f"//{bucket.name}.{host}/"), "not the endpoint's"),
        (url + "&response-content-type=text%2Fhtml", "query parameter 'response-content-type'"),
    ]:
        error = refused({**grant, "urls": {**grant["urls"], name: forged}})
        assert error["code"] == "invalid_grant" and says in error["message"], (forged, error)
    assert refused(grant, opening="ab" * 32)["field"] == "opening"
    settings.DVBENCH = {**settings.DVBENCH, "SLICED_STORE_ENDPOINTS": []}
    error = refused(grant)
    assert (error["code"], error["field"]) == ("store_not_allowed", "grant.endpoint")
    assert SlicedChallenge.objects.get(run_id=run["id"], index=0).status == (
        SliceStatus.AWAITING_OPENING
    )


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_bucket_fails_the_slice_with_the_lab_to_blame(
    damage: str,
    stores: str,
    settings: Any,
    world: World,
    api: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.DVBENCH = {**settings.DVBENCH, "SLICED_CHALLENGES": 1}
    client = api("alice")
    lab = train(7)
    run = file_run(client, lab)
    bucket = LabBucket(stores, lab, run["digest"])
    step = run["challenges"][0]["step"]
    key = f"{bucket.prefix}/{sliced_store.object_names(step)['params']}"
    if damage == "delete":
        bucket.client.delete_object(Bucket=bucket.name, Key=key)
    else:  # one byte of the opened block's first weight
        data = bytearray(bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read())
        names = lab.names
        first = lab.layout.names(run["challenges"][0]["block"])[0]
        offset = sum(
            a.nbytes for n, a in lab.steps[step].params if names.index(n) < names.index(first)
        )
        data[offset + 1] ^= 1
        bucket.client.put_object(Bucket=bucket.name, Key=key, Body=bytes(data))
    with django_capture_on_commit_callbacks(execute=True):
        assert [r.status_code for r in open_from_bucket(client, run, lab, bucket)] == [202]
    done = settled(client, run)
    expected = {"delete": "store", "flip": "tensor_opening"}[damage]
    assert (done["status"], done["reason"]) == ("failed", expected), done
