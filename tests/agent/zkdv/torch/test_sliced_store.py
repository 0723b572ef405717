"""Sliced challenges read from the lab's own bucket (docs/scale.md, "Where the lab's files
live"): the lab uploads a step's files to its S3 bucket and grants pre-signed GETs; the
platform reads only the opened byte ranges and reaches the verdict it reaches from the
lab's in-memory opening.

Against a real S3 API: ``tests/attestations/s3.py``'s ``moto_server`` (or the one
``DVBENCH_TEST_S3_ENDPOINT`` names), one bucket per test.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.nn import functional

from provers.sliced import verify_slice
from provers.sliced_store import GrantError, RangeReader, coalesce, verify_slice_from_store
from tests.attestations.s3 import CREDENTIALS, REGION, s3_endpoint
from tests.examples import torch_example
from zkdv import sliced, sliced_store
from zkdv.sliced_store import ByteRange

__all__ = ["s3_endpoint"]  # the session's S3 API, a fixture


lm = torch_example("lm")
CONFIG = lm.LMConfig(width=16, heads=2, layers=4, context=8, dropout=0.0)
MICRO, ROWS, STEPS = 2, 4, 2
GROUP = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
INPUTS = ("tokens.weight", "positions.weight")
SEQUENCES = ((0, 1), (1, 3))


def _embed(tables: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    ids = tokens[:-1]
    return tables["tokens.weight"][ids] + tables["positions.weight"][: ids.shape[0]]


def _loss(model: Any, micro: torch.Tensor) -> torch.Tensor:
    logits = model(micro[:, :-1])
    loss = functional.cross_entropy(logits.reshape(-1, CONFIG.vocab), micro[:, 1:].reshape(-1))
    return loss / MICRO


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lab() -> sliced.TorchLab:
    torch.manual_seed(0)
    model = lm.TinyLM(CONFIG)
    lab = sliced.TorchLab(
        model,
        [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)],
        dict(GROUP),
        inputs=INPUTS,
    )
    for batch in lm.token_batches(CONFIG, steps=STEPS, micro_batches=MICRO, rows=ROWS, seed=0):
        lab.step(batch, _loss)
    return lab


@dataclasses.dataclass
class Bucket:
    client: Any
    name: str
    prefix: str
    objects: dict[int, dict[str, bytes]]

    def grant(self, lab: sliced.TorchLab, expires_in: int = 3600) -> sliced_store.Grant:
        names = [n for step in self.objects.values() for n in step]
        return sliced_store.issue_grant(
            self.client,
            run=lab.digest(),
            bucket=self.name,
            prefix=self.prefix,
            names=names,
            expires_in=expires_in,
        )


@pytest.fixture
def bucket(s3_endpoint: str, lab: sliced.TorchLab) -> Bucket:
    """The lab's own bucket, holding every step's files under one run's prefix."""
    client = sliced_store.s3_client(
        endpoint_url=s3_endpoint,
        region_name=REGION,
        aws_access_key_id=CREDENTIALS["access_key"],
        aws_secret_access_key=CREDENTIALS["secret_key"],
    )
    name = f"zkdv-lab-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=name)
    prefix = f"runs/{lab.digest().hex()[:16]}"
    objects = {step: sliced_store.step_objects(lab, step) for step in range(STEPS)}
    for step_objects in objects.values():
        sliced_store.upload_step(client, name, prefix, step_objects)
    return Bucket(client, name, prefix, objects)


def _verify_both(
    lab: sliced.TorchLab, reader: RangeReader, challenge: sliced.SliceChallenge
) -> tuple[Any, Any, sliced.SliceOpening]:
    """The same challenge verified from the lab's in-memory opening and from the store."""
    answer = lab.answer(challenge)
    common: dict[str, Any] = {
        "names": lab.names,
        "layout": lab.layout,
        "block": lm.TinyLM(CONFIG).blocks[challenge.block],
        "chunk_bytes": lab.chunk_bytes,
        "inputs": INPUTS,
        "embed": _embed,
    }
    commitment = lab.steps[challenge.step].commitment
    opening = lab.open(challenge, SEQUENCES)
    local = verify_slice(commitment, challenge, answer, SEQUENCES, opening, **common)
    stored = verify_slice_from_store(reader, commitment, challenge, answer, SEQUENCES, **common)
    return local, stored, opening


@pytest.mark.parametrize(("step", "block"), [(0, 0), (1, 1)])
def test_an_honest_slice_read_from_the_labs_bucket_passes_as_it_does_from_memory(
    lab: sliced.TorchLab, bucket: Bucket, step: int, block: int
) -> None:
    reader = RangeReader(bucket.grant(lab), run=lab.digest())
    challenge = sliced.SliceChallenge(step, block, bytes([7]) * 32)
    local, stored, opening = _verify_both(lab, reader, challenge)
    assert local.ok and stored.ok, (local.message, stored.message)
    assert stored.margins == local.margins  # the very same bytes were checked

    # What moved: the manifest, then exactly the opened ranges, nothing in between.
    files = sliced_store.StepLayout.from_bytes(bucket.objects[step][f"manifest-{step}.cbor"])
    manifest = len(bucket.objects[step][f"manifest-{step}.cbor"])
    digests = files.sizes()[f"digests-{step}.bin"]
    opened = (
        sum(len(t.data) for t in (*opening.params, *opening.opt_state, *opening.grad))
        + sum(len(t.data) for t in opening.inputs)
        + sum(r.data.nbytes for r in opening.rows)
        + sum(r.data.nbytes for r in opening.batch_rows)
    )
    assert reader.transfer.bytes == manifest + digests + opened
    total = sum(len(data) for data in bucket.objects[step].values())
    assert reader.transfer.bytes < 0.35 * total
    # The block's tensors are one span per state file; the rows of a sequence are not
    # adjacent (rows of one boundary are), so each is its own request.
    tensors = 3 + 1  # params (embeddings apart from the block), opt_state, grad
    assert reader.transfer.requests <= 1 + tensors + 1 + len(opening.rows) + len(SEQUENCES)
    print(
        f"\nstep {step} block {block}: {reader.transfer.bytes} of {total} bytes "
        f"({reader.transfer.bytes / total:.1%}) in {reader.transfer.requests} requests "
        f"for {reader.transfer.ranges} ranges"
    )


def test_ranges_coalesce_only_when_adjacent() -> None:
    ranges = [(10, 20), (0, 10), (21, 30), (25, 28), (5, 5)]
    spans = coalesce([*(ByteRange("a", *r) for r in ranges), ByteRange("b", 30, 40)])
    assert spans == [ByteRange("a", 0, 20), ByteRange("a", 21, 30), ByteRange("b", 30, 40)]


def _tamper(bucket: Bucket, name: str, at: int) -> None:
    key = f"{bucket.prefix}/{name}"
    data = bytearray(bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read())
    data[at] ^= 1
    bucket.client.put_object(Bucket=bucket.name, Key=key, Body=bytes(data))


def test_a_tampered_object_in_the_labs_bucket_is_caught(
    lab: sliced.TorchLab, bucket: Bucket
) -> None:
    challenge = sliced.SliceChallenge(1, 1, bytes([7]) * 32)
    files = sliced_store.StepLayout.from_bytes(bucket.objects[1]["manifest-1.cbor"])
    index = lab.names.index(lab.layout.names(1)[0])
    cases = [
        (files.tensor("opt_state", 3 * index + 1), "tensor_opening"),  # an Adam moment
        (files.boundary_row(1, 2, sliced.GRADIENT, 3), "row_opening"),
        (files.digests("post_params"), "update"),  # a post-state digest
    ]
    for where, reason in cases:
        _tamper(bucket, where.name, where.start + 1)
        reader = RangeReader(bucket.grant(lab), run=lab.digest())
        _, stored, _ = _verify_both(lab, reader, challenge)
        assert (stored.ok, stored.reason) == (False, reason), (where, stored.message)
        _tamper(bucket, where.name, where.start + 1)  # restore
    # A byte the slice does not open changes nothing: the bucket is not trusted, only read.
    outside = files.tensor("params", lab.names.index(lab.layout.names(0)[0]))
    _tamper(bucket, outside.name, outside.start)
    reader = RangeReader(bucket.grant(lab), run=lab.digest())
    assert _verify_both(lab, reader, challenge)[1].ok


def test_a_missing_object_fails_the_slice_with_the_lab_to_blame(
    lab: sliced.TorchLab, bucket: Bucket
) -> None:
    reader = RangeReader(bucket.grant(lab), run=lab.digest())
    bucket.client.delete_object(Bucket=bucket.name, Key=f"{bucket.prefix}/boundary-0.bin")
    _, stored, _ = _verify_both(lab, reader, sliced.SliceChallenge(0, 0, bytes([7]) * 32))
    assert (stored.ok, stored.reason) == (False, "store")
    assert "boundary-0.bin: HTTP 404, no such object" in stored.message


def test_a_lying_manifest_moves_the_ranges_and_fails_and_a_budget_caps_the_reads(
    lab: sliced.TorchLab, bucket: Bucket
) -> None:
    challenge = sliced.SliceChallenge(1, 1, bytes([7]) * 32)
    honest = sliced_store.StepLayout.from_bytes(bucket.objects[1]["manifest-1.cbor"])
    first = honest.specs["params"][0]  # the token embedding, before every block's tensors
    lie = dataclasses.replace(first, shape=(first.shape[0] - 1, *first.shape[1:]))
    specs = {**honest.specs, "params": (lie, *honest.specs["params"][1:])}
    manifest = dataclasses.replace(honest, specs=specs).to_bytes()
    bucket.client.put_object(
        Bucket=bucket.name, Key=f"{bucket.prefix}/manifest-1.cbor", Body=manifest
    )
    _, stored, _ = _verify_both(lab, RangeReader(bucket.grant(lab), run=lab.digest()), challenge)
    assert (stored.ok, stored.reason) == (False, "tensor_opening"), stored.message
    # A reader with a budget refuses to read more than it, before reading.
    reader = RangeReader(bucket.grant(lab), run=lab.digest(), budget=10_000)
    _, stored, _ = _verify_both(lab, reader, challenge)
    assert (stored.ok, stored.reason) == (False, "store")
    assert "over the budget 10000" in stored.message
    assert reader.transfer.requests == 1  # the manifest only


def test_an_expired_or_foreign_grant_is_refused(lab: sliced.TorchLab, bucket: Bucket) -> None:
    grant = bucket.grant(lab, expires_in=600)
    # Expired: moto does not enforce a pre-signed URL's expiry (S3 does), so the
    # platform's own check is what this shows.
    with pytest.raises(GrantError, match=r"the grant expired at .*ask the lab for a fresh one"):
        RangeReader(grant, run=lab.digest(), now=grant.expires + 1)
    # Another run's grant.
    with pytest.raises(GrantError, match="accepted only for the run it names"):
        RangeReader(grant, run=bytes(32))
    # A URL outside the granted prefix, or in another bucket.
    name = next(iter(grant.urls))
    for url in (
        grant.urls[name].replace(f"/{bucket.prefix}/", "/runs/other/"),
        grant.urls[name].replace(f"/{bucket.name}/", "/another-bucket/"),
        grant.urls[name].replace("http://", "file://"),
    ):
        forged = dataclasses.replace(grant, urls={**grant.urls, name: url})
        with pytest.raises(GrantError, match=f"the grant's URL for '{name}'"):
            RangeReader(forged, run=lab.digest())
    # A grant survives the round trip a lab would send it in.
    again = sliced_store.Grant.from_dict(grant.to_dict())
    assert again == grant
    with pytest.raises(ValueError, match="malformed grant"):
        sliced_store.Grant.from_dict({**grant.to_dict(), "expires": None})
