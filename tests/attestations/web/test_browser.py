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
from tests.synthetic import write_synthetic_transcript

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = (
    Path(__file__).resolve().parents[3] / "docs" / "screenshots"
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


def confirm_password(page: Any) -> None:
    """On ``/keys/``: confirm the password (sudo mode), after which the create form shows."""
    page.fill("#id_password", PASSWORD)
    page.click("button:has-text('Confirm password')")
    page.locator("#sudo-mode").wait_for()


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

    # Create an API key: the password first (sudo mode), then the key, shown once.
    page.click("nav >> text=API keys")
    confirm_password(page)
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


def test_admin_invites_and_the_invitee_accepts(page: Any, world: World) -> None:
    page.on("dialog", lambda dialog: dialog.accept())
    sign_in(page, "admin")
    page.click("a.chip:has-text('Acme Labs')")
    page.wait_for_url("**/orgs/acme/")
    # The regulator role is not on offer: only the operator grants it, in an agency.
    assert page.locator("#id_role option[value=regulator]").count() == 0
    page.fill("#id_username", "mallory")
    page.select_option("#id_role", "auditor")
    page.click("button:has-text('Invite')")
    page.locator("text=Invited mallory as auditor").wait_for()
    assert page.locator("table.invitations").inner_text().count("mallory") == 1
    # A role changes as soon as another is chosen (data-autosubmit, no inline script).
    page.select_option("select[aria-label='Role of bob']", "trainer")
    page.locator("text=bob is now trainer in acme").wait_for()
    shot(page, "11-organisation-members")
    page.click("form[action='/logout/'] button")
    sign_in(page, "mallory")
    page.click("section.invitations button:has-text('Accept')")
    page.locator("text=You joined acme as auditor").wait_for()
    page.goto("/experiments/")
    assert "acme/run-1" in page.content()


def test_confirmations_still_guard_destructive_buttons(page: Any, world: World) -> None:
    """A Revoke button asks first (data-confirm); declining keeps the key."""
    answers = iter([False, True])
    asked: list[str] = []

    def answer(dialog: Any) -> None:
        asked.append(dialog.message)
        dialog.accept() if next(answers) else dialog.dismiss()

    page.on("dialog", answer)
    sign_in(page, "alice")
    page.goto("/keys/")
    confirm_password(page)
    page.fill("#id_name", "laptop")
    page.click("button:has-text('Create key')")
    page.locator("#new-key").click()  # selects the key for copying (data-select-on-focus)
    assert page.evaluate(
        "document.getSelection().toString() || "
        "document.activeElement.value.slice("
        "document.activeElement.selectionStart, "
        "document.activeElement.selectionEnd)"
    ).startswith("dvb_")
    page.click("form[data-confirm] button:has-text('Revoke')")
    assert asked and asked[0].startswith("Revoke dvb_")
    assert page.locator("form[data-confirm] button:has-text('Revoke')").count() == 1
    page.click("form[data-confirm] button:has-text('Revoke')")
    page.locator("text=Revoked").first.wait_for()
    assert len(asked) == 2


CSP_LISTENER = """
window.__csp = [];
document.addEventListener('securitypolicyviolation', function (e) {
  window.__csp.push(e.violatedDirective + ' ' + (e.blockedURI || 'inline') + ' at ' + e.sourceFile + ':' + e.lineNumber);
});
"""


def test_no_page_needs_inline_script(page: Any, live_server: Any, world: World) -> None:
    """Every page works under a CSP whose script-src is 'self' only, with no violation.

    Playwright's init script and evaluate() run outside the page's CSP, so they can
    listen for violations the page itself would report.
    """
    from django.contrib.auth.models import User

    User.objects.create_superuser("root", "root@example.org", PASSWORD)
    page.add_init_script(CSP_LISTENER)
    console: list[str] = []
    page.on(
        "console",
        lambda message: console.append(message.text) if message.type == "error" else None,
    )
    violations: dict[str, list[str]] = {}

    def visit(path: str, ready: str | None = None) -> None:
        response = page.goto(path)
        assert response is not None and response.status < 400, (path, response and response.status)
        policy = response.headers.get("content-security-policy", "")
        assert "'unsafe-inline'" not in policy.split("script-src", 1)[1].split(";", 1)[0], policy
        if ready:
            page.locator(ready).first.wait_for()
        found = [
            violation
            for violation in page.evaluate("window.__csp || []")
            # ReDoc's attribution logo comes from its CDN: blocked on purpose (nothing
            # is fetched from another origin), and the logo hides itself.
            if not violation.startswith("img-src https://cdn.redoc.ly/")
        ]
        if found:
            violations[path] = found

    visit("/login/")
    sign_in(page, "admin")
    proof = world.proof.pk
    for path in [
        "/",
        "/experiments/",
        "/experiments/new/",
        "/experiments/acme/run-1/",
        "/experiments/acme/run-1/spec/",
        f"/proofs/{proof}/",
        f"/proofs/{proof}/report/",
        "/keys/",
        "/audit/",
        "/orgs/acme/",
    ]:
        visit(path)
    visit("/api/v1/docs/", ".swagger-ui .opblock")
    visit("/api/v1/redoc/", "h1")
    visit("/api/v1/experiments/?format=api", "pre")
    page.context.clear_cookies()
    # The operator's side: the Django admin.
    visit("/admin/login/")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    for path in ["/admin/", "/admin/accounts/organization/", "/admin/proofs/proof/"]:
        visit(path)
    visit(f"/admin/accounts/organization/{world.acme.pk}/change/")
    assert violations == {}, violations
    refused = [
        text
        for text in console
        if "Content Security Policy" in text and "cdn.redoc.ly/redoc/logo-mini.svg" not in text
    ]
    assert refused == [], refused


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


#: Every visible control a user clicks or types into, checked two ways: no two overlap
#: by more than a pixel (one inside the other, as an input in its label, aside), and
#: nothing covers it (scrolled into view, the element at its centre is the control).
OVERLAPS = """
() => {
  const selector = 'a[href], button, input:not([type=hidden]), select, textarea, summary, [role=button]';
  const controls = [...document.querySelectorAll(selector)].filter((element) => {
    const style = getComputedStyle(element);
    const box = element.getBoundingClientRect();
    return style.visibility !== 'hidden' && style.display !== 'none' && box.width > 0 && box.height > 0;
  });
  const name = (element) => {
    const text = (element.innerText || element.value || element.name || element.id || element.className || '').toString().trim();
    return `${element.tagName.toLowerCase()} "${text.slice(0, 30)}"`;
  };
  const found = [];
  for (let i = 0; i < controls.length; i++) {
    for (let j = i + 1; j < controls.length; j++) {
      const a = controls[i], b = controls[j];
      if (a.contains(b) || b.contains(a)) continue;
      const p = a.getBoundingClientRect(), q = b.getBoundingClientRect();
      const width = Math.min(p.right, q.right) - Math.max(p.left, q.left);
      const height = Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top);
      if (width > 1 && height > 1) found.push(`${name(a)} and ${name(b)} overlap (${Math.round(width)} x ${Math.round(height)} px)`);
    }
  }
  for (const control of controls) {
    control.scrollIntoView({block: 'center', inline: 'center'});
    const box = control.getBoundingClientRect();
    const top = document.elementFromPoint(box.left + box.width / 2, box.top + box.height / 2);
    const label = top && top.tagName === 'LABEL' && top.control === control;
    if (top && top !== control && !control.contains(top) && !label) {
      found.push(`${name(control)} is covered by ${name(top)}`);
    }
  }
  window.scrollTo(0, 0);
  return found;
}
"""


@pytest.mark.parametrize("width", [1280, 1600])
def test_no_clickable_control_lies_over_another(
    chromium: Any, live_server: Any, world: World, width: int
) -> None:
    """The guides' browser steps at common laptop and desktop widths: register an
    experiment, create and revoke keys; no control covers another on any page."""
    context = chromium.new_context(
        viewport={"width": width, "height": 900}, base_url=live_server.url
    )
    page = context.new_page()
    page.set_default_timeout(15_000)
    page.on("dialog", lambda dialog: dialog.accept())

    def check(where: str) -> None:
        assert page.evaluate(OVERLAPS) == [], f"{where} at {width} px"

    try:
        sign_in(page, "alice")
        page.goto("/experiments/new/")
        check("/experiments/new/")
        page.fill("#id_name", f"wide-{width}")
        page.check("input[name=framework][value=jax]")
        page.fill("#id_model_description", "a classifier")
        page.fill("#id_optimizer", "adam")
        page.fill("#id_dataset_commitment", "ab" * 32)
        page.click("button:has-text('Register experiment')")
        page.wait_for_url(f"**/experiments/acme/wide-{width}/")
        check("/experiments/acme/<name>/")
        page.goto("/keys/")
        check("/keys/ (confirm password)")
        confirm_password(page)
        for name in ("laptop", "training-cluster-with-a-long-name"):
            page.fill("#id_name", name)
            page.click("button:has-text('Create key')")
            page.locator("#new-key").wait_for()
            # A key in use: its "last used" column shows a date and time.
            key = page.locator("#new-key").input_value()
            httpx.get(
                f"{live_server.url}/api/v1/me/", headers={"Authorization": f"Bearer {key}"}
            ).raise_for_status()
        page.goto("/keys/")
        check("/keys/ (keys listed)")
        shot(page, f"13-api-keys-{width}")
        page.click("form[data-confirm] button:has-text('Revoke')")
        page.locator("text=Revoked").first.wait_for()
        check("/keys/ (after revoking)")
        for path in ["/", "/experiments/", f"/proofs/{world.proof.pk}/", "/audit/", "/orgs/acme/"]:
            page.goto(path)
            check(path)
    finally:
        context.close()
