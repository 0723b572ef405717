"""Browser tests: Playwright driving Debian's Chromium against a live server.

Sign in, register an experiment (meeting inline validation on the way), create an API
key, ingest a real transcript through the API with that key, and read the verdict.
Screenshots of the main pages are taken on every run; with DVBENCH_UPDATE_SCREENSHOTS=1
they replace the ones kept in docs/screenshots/ (otherwise they go to a temporary
directory, so a test run leaves the working tree clean).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.attestations.base import PASSWORD, World
from zkdv.testing import write_synthetic_transcript

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = (
    Path(__file__).resolve().parents[2] / "docs" / "screenshots"
    if os.environ.get("DVBENCH_UPDATE_SCREENSHOTS") == "1"
    else Path(tempfile.gettempdir()) / "dvbench-screenshots"
)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's Chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
]


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    # Playwright's sync API runs an event loop; Django's async-unsafe guard must not fire
    # on the test's own ORM calls made around it.
    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(chromium: Any, live_server: Any, world: World) -> Iterator[Any]:
    context = chromium.new_context(
        viewport={"width": 1440, "height": 900}, base_url=live_server.url
    )
    page = context.new_page()
    page.set_default_timeout(15_000)
    try:
        yield page
    finally:
        context.close()


def shot(page: Any, name: str, *, full_page: bool = True) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=full_page)


def sign_in(page: Any, username: str) -> None:
    page.goto("/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/")


def upload_transcript(base_url: str, key: str, experiment: str, tmp_path: Path) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
        described = client.get(f"/api/v1/experiments/{experiment}/")
        described.raise_for_status()
        proof_dir = write_synthetic_transcript(
            tmp_path / "proof",
            steps=6,
            experiment=experiment,
            spec_digest=described.json()["spec_digest"],
            prover=f"whitebox-{described.json()['spec']['framework']}",
        )
        data = (Path(proof_dir) / "records.cborl").read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        created = client.post(
            "/api/v1/uploads/",
            json={
                "experiment": experiment,
                "kind": "transcript",
                "size": len(data),
                "sha256": digest,
            },
        )
        created.raise_for_status()
        upload_id = created.json()["id"]
        part = client.put(
            f"/api/v1/uploads/{upload_id}/parts/1",
            content=data,
            headers={"X-Part-SHA256": digest, "Content-Type": "application/octet-stream"},
        )
        part.raise_for_status()
        done = client.post(f"/api/v1/uploads/{upload_id}/complete")
        assert done.status_code == 200, done.text
        return done.json()  # type: ignore[no-any-return]


def test_trainer_journey(
    page: Any, live_server: Any, tmp_path: Path, programless_transcripts: None
) -> None:
    page.goto("/")
    page.wait_for_url("**/login/?next=/")
    shot(page, "01-sign-in")
    sign_in(page, "alice")
    assert page.locator("h1").inner_text() == "Dashboard"

    # Register an experiment; the form checks fields as they are left.
    page.click("text=Register experiment")
    page.fill("#id_name", "Browser Run")
    page.fill("#id_dataset_commitment", "not-a-digest")
    page.click("#id_optimizer")
    assert "64 hexadecimal" in page.locator("#id_dataset_commitment_error").inner_text()
    assert "lowercase" in page.locator("#id_name_error").inner_text()
    shot(page, "03-register-inline-validation")
    page.fill("#id_name", "browser-run")
    page.check("input[name=framework][value=torch]")
    page.fill("#id_model_description", "decoder-only transformer, 125M parameters")
    page.fill("#id_optimizer", "torch.optim.AdamW(lr=3e-4)")
    page.fill("#id_dataset_commitment", hashlib.sha256(b"manifest").hexdigest())
    page.fill("#id_max_flops", "300000000000000000000000")
    page.fill("#id_max_tokens", "2000000000000")
    page.fill("#id_max_gpu_hours", "5000")
    page.check("input[name=allowed_regimes][value=pretraining]")
    page.click("button:has-text('Register experiment')")
    page.wait_for_url("**/experiments/acme/browser-run/")
    assert "acme/browser-run" in page.locator("h1").inner_text()

    # Create an API key: shown once.
    page.click("nav >> text=API keys")
    page.fill("#id_name", "training-cluster")
    page.click("button:has-text('Create key')")
    key = page.locator("#new-key").input_value()
    assert key.startswith("dvb_")
    shot(page, "06-api-key-created")

    # The SDK's part, done with the key: upload a real transcript; ingest runs.
    completed = upload_transcript(live_server.url, key, "acme/browser-run", tmp_path)
    assert completed["status"] == "complete" and completed["proof"]

    page.goto("/experiments/acme/browser-run/")
    row = page.locator("table.proofs tbody tr").first
    row.locator(".status-valid").wait_for()
    assert "valid" in row.inner_text().lower()
    shot(page, "04-experiment-detail")
    row.locator("a").first.click()
    page.locator(".verdict-valid").wait_for()
    assert "6 steps" in page.locator(".verdict").inner_text()
    shot(page, "05-proof-valid")

    page.goto("/")
    shot(page, "02-dashboard")
    page.goto("/experiments/")
    shot(page, "07-experiment-list")
    page.goto("/audit/")
    assert "proof.valid" in page.content()
    shot(page, "08-audit-trail")


def test_auditor_and_regulator_views(page: Any, world: World) -> None:
    sign_in(page, "bob")
    page.goto("/experiments/acme/run-1/")
    assert page.locator("text=Change spec").count() == 0
    shot(page, "09-auditor-experiment")
    page.click("form[action='/logout/'] button")
    sign_in(page, "carol")
    page.goto("/experiments/")
    assert "evil/heist" in page.content() and "acme/run-1" in page.content()
    page.goto(f"/proofs/{world.proof.pk}/")
    assert page.locator("text=Download transcript").count() == 0
    shot(page, "10-regulator-proof")


def test_admin_manages_members(page: Any, world: World) -> None:
    sign_in(page, "admin")
    page.click("a.chip:has-text('Acme Labs')")
    page.wait_for_url("**/orgs/acme/")
    page.fill("#id_username", "carol")
    page.select_option("#id_role", "auditor")
    page.click("button:has-text('Save')")
    page.locator("text=carol is now auditor in acme").wait_for()
    shot(page, "11-organisation-members")


def test_api_docs_are_served_locally(page: Any, live_server: Any) -> None:
    """Swagger UI renders from the platform's own static files: no CDN is needed."""
    external: list[str] = []
    page.on(
        "request",
        lambda request: (
            None if request.url.startswith(live_server.url) else external.append(request.url)
        ),
    )
    page.goto("/api/v1/docs/")
    page.locator(".swagger-ui .opblock").first.wait_for()
    assert "/static/drf_spectacular_sidecar/" in page.content()
    assert external == []
    shot(page, "12-api-docs", full_page=False)
