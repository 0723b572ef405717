"""Fixtures for the attestations tests; the actors and helpers live in ``base.py``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.attestations.base import api, storage, world
from tests.attestations.s3 import s3, s3_direct, s3_endpoint

__all__ = ["api", "programless_transcripts", "s3", "s3_direct", "s3_endpoint", "storage", "world"]


@pytest.fixture
def programless_transcripts(settings: Any) -> None:
    """Accept transcripts that commit no program (``DVBENCH_REQUIRE_PROGRAM=false``).

    The platform rejects them by default (``no_program``: nothing could be replayed);
    tests filing ``tests.synthetic.write_synthetic_transcript`` runs, which record no
    program, opt out with this fixture. It reaches the in-process tasks and the live
    server, not a separate worker process, which reads its own environment.
    """
    settings.DVBENCH = {**settings.DVBENCH, "REQUIRE_PROGRAM": False}
