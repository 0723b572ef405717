"""Filing a sliced run is bounded work: each limit of the run file is a 400 that names it.

The run file is read inside the request (``attestations.challenges.sliced.file_run``).
Its size, its lists' lengths and each element's size are checked from the CBOR headers
before anything is decoded (``zkdv.sliced._bounded``); a refusal names the field, the
limit and what it found, and files nothing.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import cbor2
import pytest

from attestations.audit.models import AuditEvent
from attestations.challenges import sliced as platform_sliced
from attestations.challenges.models import SlicedChallenge, SlicedRun
from tests.agent.zkdv.test_sliced_wire_limits import replace, run_file
from tests.attestations.base import World, error_of, upload_blob
from zkdv.sliced import MAX_NAMES

RUNS = "/api/v1/experiments/acme/run-1/sliced-runs/"


def file(client: Any, data: bytes) -> Any:
    response = upload_blob(client, data, part_size=64 * 1024)
    assert response.status_code in (200, 201), response.content
    return client.post(RUNS, {"run_file": hashlib.sha256(data).hexdigest()}, format="json")


def refused(client: Any, data: bytes) -> dict[str, Any]:
    response = file(client, data)
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["code"] == "invalid_run_file"
    assert SlicedRun.objects.count() == 0 and SlicedChallenge.objects.count() == 0
    assert not AuditEvent.objects.filter(action__startswith="sliced_run.").exists()
    return error


def test_a_list_longer_than_its_limit_is_refused_from_its_header(world: World, api: Any) -> None:
    error = refused(
        api("alice"), replace(run_file(), "names", b"\x9a" + struct.pack(">I", 1 << 21))
    )
    assert error["field"] == "run_file.names"
    assert error["detail"] == {"limit": MAX_NAMES, "got": 1 << 21}
    assert f"a list of {1 << 21} items is over the {MAX_NAMES}" in error["message"]


def test_a_step_over_its_item_budget_is_refused(world: World, api: Any) -> None:
    step = cbor2.loads(run_file())["steps"][0]
    step["pad"] = [[] for _ in range(50_000)]
    error = refused(api("alice"), replace(run_file(), "steps", b"\x81" + cbor2.dumps(step)))
    assert error["field"] == "run_file.steps[0]"
    assert error["detail"] == {"limit": 40, "got": None}
    assert "more than 40 CBOR data items" in error["message"]


def test_a_string_over_its_limit_is_refused(world: World, api: Any) -> None:
    error = refused(api("alice"), replace(run_file(), "names", b"\x81" + cbor2.dumps("n" * 9000)))
    assert error["field"] == "run_file.names[0]"
    assert error["detail"] == {"limit": 4096, "got": 9000}


def test_nesting_past_its_limit_is_refused(world: World, api: Any) -> None:
    error = refused(api("alice"), replace(run_file(), "blocks", b"\x81" + b"\x81" * 50 + b"\x80"))
    assert error["field"] == "run_file.blocks[0]"
    assert error["detail"] == {"limit": 2, "got": None}


def test_a_run_file_over_the_size_limit_is_refused_before_it_is_read(
    world: World, api: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = run_file(steps=8)
    monkeypatch.setattr(platform_sliced, "MAX_RUN_FILE_BYTES", len(data) - 1)
    error = refused(api("alice"), data)
    assert error["field"] == "run_file"
    assert error["detail"] == {"size": len(data), "limit": len(data) - 1}
    assert f"{len(data)} bytes is over the {len(data) - 1}" in error["message"]
