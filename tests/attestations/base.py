"""Named actors and a small world for the attestations tests (after healthchecks' BaseTestCase).

* ``alice``: trainer in ``acme``          * ``bob``: auditor in ``acme``
* ``admin``: admin in ``acme``            * ``carol``: regulator (member of ``eu-office``)
* ``mallory``: trainer in ``evil``, an outsider to ``acme``

``world`` holds acme's experiment ``acme/run-1`` with a filed proof, a job, an open
upload, and mallory's ``evil/heist``. ``api(actor)`` returns a client authenticated with
that actor's personal API key, through the real ``Authorization: Bearer`` path;
``sudo_session(world, actor)`` a signed-in session that confirmed its password, the only
kind of client that creates API keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.utils import timezone
from rest_framework.test import APIClient

from attestations.accounts.models import ApiKey, Membership, Organization, OrganizationKind, Role
from attestations.experiments.models import Experiment
from attestations.proofs.models import Job, Proof, ProofStatus
from attestations.uploads.models import ArtifactKind, Blob, Upload

ROLES = ("alice", "bob", "carol", "mallory", "admin")
PASSWORD = "correct horse battery staple"
SPEC: dict[str, Any] = {
    "framework": "jax",
    "model_description": "TinyClassifier: one Dense(2) layer",
    "optimizer": "optax.adam(1e-2)",
    "dataset_commitment": "ab" * 32,
    "max_flops": 10**25,
    "max_tokens": 2 * 10**12,
    "max_gpu_hours": "1200.5",
    "allowed_regimes": ["pretraining"],
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class World:
    acme: Organization
    evil: Organization
    users: dict[str, User]
    experiment: Experiment
    other: Experiment
    proof: Proof
    job: Job
    upload: Upload

    def __getattr__(self, name: str) -> User:
        users = self.__dict__.get("users", {})
        if name in users:
            return users[name]  # type: ignore[no-any-return]
        raise AttributeError(name)


@pytest.fixture
def storage(settings: Any, tmp_path: Path) -> Path:
    """Point default storage and the upload temp dir at a fresh directory."""
    media = tmp_path / "media"
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(media)},
        },
    }
    settings.DVBENCH = {
        **settings.DVBENCH,
        "DATA_DIR": tmp_path,
        "MAX_PART_BYTES": 64 * 1024,
        "MAX_BLOB_BYTES": 1024 * 1024,
    }
    media.mkdir()
    return media


def part_bytes(root: Path, part: Any) -> bytes:
    """A stored part's bytes: a file of its own, or its range of the upload's data file."""
    with (root / part.storage_name).open("rb") as handle:
        handle.seek(part.offset or 0)
        return handle.read(part.size)


def stored_files(root: Path) -> list[str]:
    """Every file under a storage root, relative, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def make_user(username: str, *, superuser: bool = False) -> User:
    if superuser:
        return User.objects.create_superuser(username, f"{username}@example.org", PASSWORD)
    return User.objects.create_user(username, f"{username}@example.org", PASSWORD)


@pytest.fixture
def world(db: None, storage: Path, settings: Any) -> World:
    # PBKDF2 at its production cost would dominate the suite's run time.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    acme = Organization.objects.create(slug="acme", name="Acme Labs")
    evil = Organization.objects.create(slug="evil", name="Evil Corp")
    office = Organization.objects.create(
        slug="eu-office", name="EU AI Office", kind=OrganizationKind.AGENCY
    )
    users = {name: make_user(name) for name in ROLES}
    Membership.objects.create(user=users["alice"], organization=acme, role=Role.TRAINER)
    Membership.objects.create(user=users["bob"], organization=acme, role=Role.AUDITOR)
    Membership.objects.create(user=users["admin"], organization=acme, role=Role.ADMIN)
    Membership.objects.create(user=users["carol"], organization=office, role=Role.REGULATOR)
    Membership.objects.create(user=users["mallory"], organization=evil, role=Role.TRAINER)
    experiment = Experiment.register(acme, "run-1", SPEC, user=users["alice"])
    other = Experiment.register(evil, "heist", SPEC, user=users["mallory"])
    data = b"not really a transcript"
    digest = sha256(data)
    name = default_storage.save(Blob.address(digest), ContentFile(data))
    blob = Blob.objects.create(sha256=digest, size=len(data), storage_name=name)
    assert experiment.current_spec is not None
    proof = Proof.objects.create(
        experiment=experiment,
        spec=experiment.current_spec,
        transcript=blob,
        status=ProofStatus.VALID,
        steps=4,
        checks=1,
    )
    job = Job.objects.create(kind="ingest", organization=acme, proof=proof, status="succeeded")
    upload = Upload.objects.create(
        organization=acme,
        experiment=experiment,
        kind=ArtifactKind.ARTIFACT,
        size=5,
        sha256=sha256(b"hello"),
        created_by=users["alice"],
        expires=timezone.now() + timezone.timedelta(days=1),
    )
    return World(acme, evil, users, experiment, other, proof, job, upload)


@pytest.fixture
def api(world: World) -> Iterator[Callable[[str | None], APIClient]]:
    """``api("alice")``: a client sending alice's API key; ``api(None)``: anonymous."""
    keys: dict[str, str] = {}

    def client(actor: str | None) -> APIClient:
        c = APIClient()
        if actor is not None:
            if actor not in keys:
                _, keys[actor] = ApiKey.issue(world.users[actor], "tests")
            c.credentials(HTTP_AUTHORIZATION=f"Bearer {keys[actor]}")
        return c

    yield client


def sudo_session(world: World, actor: str) -> APIClient:
    """A signed-in browser session of ``actor`` that confirmed its password (sudo mode).

    What creating an API key needs (``attestations/http/sudo.py``); an API key never can.
    """
    client = APIClient()
    client.force_login(world.users[actor])
    response = client.post("/api/v1/keys/confirm-password/", {"password": PASSWORD}, format="json")
    assert response.status_code == 200, response.content
    return client


def error_of(response: Any) -> dict[str, Any]:
    """The ``error`` object of an error response, checking the envelope on the way."""
    body = response.json()
    assert set(body) == {"error", "request_id"}, body
    assert body["request_id"] == response["X-Request-ID"]
    assert set(body["error"]) == {"code", "message", "field", "detail"}
    return body["error"]  # type: ignore[no-any-return]


def put_parts(client: APIClient, upload_id: str, data: bytes, part_size: int) -> list[Any]:
    """PUT ``data`` as consecutive parts of ``part_size`` bytes; returns the responses."""
    responses = []
    for number, start in enumerate(range(0, len(data), part_size), start=1):
        chunk = data[start : start + part_size]
        responses.append(
            client.put(
                f"/api/v1/uploads/{upload_id}/parts/{number}/",
                data=chunk,
                content_type="application/octet-stream",
                HTTP_X_PART_SHA256=sha256(chunk),
            )
        )
    return responses


def open_upload(
    client: APIClient,
    data: bytes,
    *,
    kind: str = "artifact",
    experiment: str = "acme/run-1",
    digest: str | None = None,
) -> Any:
    response = client.post(
        "/api/v1/uploads/",
        {
            "experiment": experiment,
            "kind": kind,
            "size": len(data),
            "sha256": digest or sha256(data),
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    return response.json()


def upload_blob(
    client: APIClient,
    data: bytes,
    *,
    kind: str = "artifact",
    experiment: str = "acme/run-1",
    part_size: int = 1000,
) -> Any:
    """Create, send and complete an upload; returns the completion response."""
    created = open_upload(client, data, kind=kind, experiment=experiment)
    for response in put_parts(client, created["id"], data, part_size):
        assert response.status_code == 200, response.content
    return client.post(f"/api/v1/uploads/{created['id']}/complete/")
