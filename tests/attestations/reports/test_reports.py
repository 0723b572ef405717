"""Auditors' reports: the HTML page, the PDF from the same template, the claims API, access.

Readers: members of the proof's organisation and regulators (claims and certificates of
every organisation); anyone else gets 404. The PDF must carry the compute chart, which
xhtml2pdf draws from the SVG as vector graphics, so its labels are text in the PDF.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest
from django.test import Client
from pypdf import PdfReader
from rest_framework.test import APIClient

from attestations.certificates.claims import Series
from attestations.challenges.models import Challenge, ChallengeOrigin, ChallengeStatus
from attestations.proofs.models import Proof, ProofStatus
from attestations.reports.render import compute_chart_svg, human_number, render_report_pdf
from tests.attestations.base import PASSWORD, World, error_of
from tests.attestations.certificates.test_claims import FLOPS_PER_STEP, STEPS, filed_proof

Api = Callable[[str | None], APIClient]
READERS = ("alice", "bob", "admin", "carol")


def browser(world: World, actor: str | None) -> Client:
    client = Client()
    if actor is not None:
        assert client.login(username=actor, password=PASSWORD)
    return client


def pdf_text(data: bytes) -> str:
    return "\n".join(page.extract_text() for page in PdfReader(io.BytesIO(data)).pages)


@pytest.fixture
def proof(world: World, tmp_path: Path) -> Proof:
    filed, _ = filed_proof(world, tmp_path)
    return filed


# --- The web page and the PDF -----------------------------------------------------------


@pytest.mark.parametrize("actor", READERS)
def test_the_report_page_renders_for_every_reader(world: World, proof: Proof, actor: str) -> None:
    response = browser(world, actor).get(f"/proofs/{proof.pk}/report/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "Training attestation report" in html
    assert "Compute (FLOPs)" in html and "Committed in transcript" in html
    assert "<svg" in html and "Cumulative FLOPs" in html  # the chart, inline
    assert "Declared budget" in html  # acme/run-1 declares max_flops
    assert f"/proofs/{proof.pk}/report.pdf" in html


@pytest.mark.parametrize("actor", ["mallory", None])
def test_outsiders_never_see_a_report(world: World, proof: Proof, actor: str | None) -> None:
    client = browser(world, actor)
    for path in (f"/proofs/{proof.pk}/report/", f"/proofs/{proof.pk}/report.pdf"):
        response = client.get(path)
        if actor is None:
            assert response.status_code == 302 and "/login/" in response["Location"]
        else:
            assert response.status_code == 404


def test_the_pdf_starts_with_the_magic_and_shows_the_chart(world: World, proof: Proof) -> None:
    response = browser(world, "bob").get(f"/proofs/{proof.pk}/report.pdf")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/pdf"
    assert "attachment" in response["Content-Disposition"]
    data = response.content
    assert data.startswith(b"%PDF")
    text = pdf_text(data)
    # The chart's own labels (drawn from the SVG), the claims table and the verdict.
    assert "Cumulative FLOPs" in text
    assert "Declared budget" in text
    assert f"Total {human_number(STEPS * FLOPS_PER_STEP)} FLOP" in text
    assert "Compute (FLOPs)" in text and "Reported by trainer" in text
    assert "acme/run-1" in text


def test_a_broken_budget_is_marked_on_the_chart_and_listed(world: World, proof: Proof) -> None:
    spec = proof.spec
    spec.max_flops = Decimal(700)  # cumulative 288, 576, 864: over at step 2
    spec.digest = "e" * 64  # a new cache key for the changed limits (in memory only)
    data = render_report_pdf(proof)
    text = pdf_text(data)
    assert "Over budget at step 2" in text
    assert "max_flops" in text
    html = browser(world, "bob").get(f"/proofs/{proof.pk}/report/").content.decode()
    # The page reloads the spec from the database, where the budget is still 1e25.
    assert "Over budget" not in html


def test_challenges_appear_in_the_timeline(world: World, proof: Proof) -> None:
    Challenge.objects.create(
        proof=proof, step=0, origin=ChallengeOrigin.GENESIS, status=ChallengeStatus.PASSED
    )
    Challenge.objects.create(
        proof=proof,
        step=3,
        origin=ChallengeOrigin.RANDOM,
        status=ChallengeStatus.FAILED,
        reason="replay_mismatch",
    )
    html = browser(world, "carol").get(f"/proofs/{proof.pk}/report/").content.decode()
    assert "Genesis (step 0)" in html and "replay_mismatch" in html
    assert "Timeline of steps, self-checks and challenges" in html


def test_a_report_renders_when_the_transcript_is_unreadable(world: World) -> None:
    # world.proof's blob is not a transcript: the report says so instead of failing.
    response = browser(world, "bob").get(f"/proofs/{world.proof.pk}/report/")
    assert response.status_code == 200
    assert "could not be read to its end" in response.content.decode()


# --- The API ----------------------------------------------------------------------------

API_PATHS = ("claims/", "report.html", "report.pdf")


@pytest.mark.parametrize("path", API_PATHS)
@pytest.mark.parametrize(
    ("actor", "status"),
    [("alice", 200), ("bob", 200), ("admin", 200), ("carol", 200), ("mallory", 404)],
)
def test_api_access_matrix(api: Api, proof: Proof, path: str, actor: str, status: int) -> None:
    response = api(actor).get(f"/api/v1/proofs/{proof.pk}/{path}")
    assert response.status_code == status, response.content
    if status == 404:
        assert error_of(response)["code"] == "not_found"


@pytest.mark.parametrize("path", API_PATHS)
def test_api_refuses_anonymous_callers(api: Api, proof: Proof, path: str) -> None:
    assert api(None).get(f"/api/v1/proofs/{proof.pk}/{path}").status_code in (401, 403)


def test_api_claims(api: Api, proof: Proof) -> None:
    body = api("carol").get(f"/api/v1/proofs/{proof.pk}/claims/").json()
    assert (body["proof"], body["status"], body["schema"]) == (
        proof.pk,
        "valid",
        "dvbench.claims/v1",
    )
    claims = {claim["name"]: claim for claim in body["claims"]}
    assert claims["flops"] == {
        "name": "flops",
        "value": STEPS * FLOPS_PER_STEP,
        "evidence": "committed_in_transcript",
        "unit": "FLOP",
    }
    assert [v["limit"] for v in body["violations"]] == ["optimizer"]


def test_api_report_formats(api: Api, proof: Proof) -> None:
    html = api("bob").get(f"/api/v1/proofs/{proof.pk}/report.html")
    assert html["Content-Type"].startswith("text/html")
    assert b"<svg" in html.content and b"Training attestation report" in html.content
    pdf = api("carol").get(f"/api/v1/proofs/{proof.pk}/report.pdf")
    assert pdf["Content-Type"] == "application/pdf" and pdf.content.startswith(b"%PDF")
    assert "Cumulative FLOPs" in pdf_text(pdf.content)


def test_the_schema_documents_the_report_endpoints(api: Api) -> None:
    schema = api("bob").get("/api/v1/schema/", HTTP_ACCEPT="application/json").json()
    for path in ("claims/", "data-queries/", "report.html", "report.pdf"):
        assert any(p.endswith(path) for p in schema["paths"]), path


# --- The proof page's panel -------------------------------------------------------------


@pytest.mark.parametrize(
    "status",
    [ProofStatus.PENDING, ProofStatus.CHALLENGED, ProofStatus.VALID, ProofStatus.REJECTED],
)
def test_the_proof_page_panel_renders_without_a_certificate(world: World, status: str) -> None:
    Proof.objects.filter(pk=world.proof.pk).update(status=status)
    response = browser(world, "bob").get(f"/proofs/{world.proof.pk}/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="report-panel"' in html
    assert f"/proofs/{world.proof.pk}/report/" in html
    assert f"/proofs/{world.proof.pk}/report.pdf" in html
    final = status in (ProofStatus.VALID, ProofStatus.REJECTED)
    expected = "No certificate" if final else "once the verdict is final"
    assert expected in html
    report = browser(world, "bob").get(f"/proofs/{world.proof.pk}/report/")
    assert report.status_code == 200


# --- Chart drawing ----------------------------------------------------------------------


def test_the_chart_scales_to_the_budget_and_marks_the_crossing() -> None:
    series = Series(
        steps=(0, 1, 2), flops=(10.0, 20.0, 30.0), tokens=(1, 2, 3), gpu_hours=(0, 0, 0)
    )
    svg = compute_chart_svg(series, Decimal(25), violation_step=2)
    assert "Declared budget 25 FLOP" in svg and "Over budget at step 2" in svg
    assert compute_chart_svg(series, None).count("No FLOP budget declared") == 1
    # Labels are escaped text: nothing from the data can inject markup.
    assert "<script" not in compute_chart_svg(Series(), None)


# --- With a certificate -----------------------------------------------------------------


@pytest.fixture
def certified(world: World, tmp_path: Path, programless_transcripts: None) -> Proof:
    """A proof verified by the real verifier, with the certificate the platform issues."""
    from attestations.certificates.issuance import issue_certificate
    from attestations.proofs.ingest import ingest

    filed, _ = filed_proof(world, tmp_path)
    Proof.objects.filter(pk=filed.pk).update(status=ProofStatus.VERIFYING)
    filed.refresh_from_db()
    ingest(filed)
    assert filed.status == ProofStatus.VALID, filed.message
    issue_certificate(filed.pk)
    return Proof.objects.select_related("certificate").get(pk=filed.pk)


def test_the_report_and_panel_show_the_certificate(world: World, certified: Proof) -> None:
    certificate = certified.certificate
    client = browser(world, "carol")
    page = client.get(f"/proofs/{certified.pk}/report/").content.decode()
    assert certificate.keyid in page and certificate.result in page
    assert "dvbench verify-report" in page
    assert f"/api/v1/proofs/{certified.pk}/bundle" in page
    panel = browser(world, "bob").get(f"/proofs/{certified.pk}/").content.decode()
    assert f"/api/v1/proofs/{certified.pk}/bundle" in panel
    assert f"transparency log entry {certificate.log_index}" in panel
    text = pdf_text(client.get(f"/proofs/{certified.pk}/report.pdf").content)
    assert "verify-report" in text and certificate.result in text


def test_html_and_pdf_state_the_same_certificate_facts(world: World, certified: Proof) -> None:
    """Seed, tolerance, guarantee, thresholds, sha256 subjects and the Replayed column's
    meaning, in the HTML page and the PDF alike; digests grouped in the PDF only."""
    certificate = certified.certificate
    statement = certificate.statement()
    tolerance = statement["predicate"]["replay"]["tolerance"]
    client = browser(world, "carol")
    page = client.get(f"/proofs/{certified.pk}/report/").content.decode()
    text = pdf_text(client.get(f"/proofs/{certified.pk}/report.pdf").content)
    flat = " ".join(text.split())
    for phrase in (
        "Challenges and what they guarantee",
        "Comparison tolerance",
        "abs = ",
        f"rel = {tolerance['rel']}",
        "Detection probability",
        "Regulatory compute thresholds",
        "eu-ai-act-systemic-risk",
        "Transitions replayed k/n",
        "SHA-256 of records.cborl",
    ):
        assert phrase in page, phrase
        assert phrase in flat, phrase
    transcript_sha = certified.transcript.sha256
    assert transcript_sha in page  # one token to copy in HTML
    grouped = " ".join(transcript_sha[i : i + 16] for i in range(0, 64, 16))
    assert grouped in flat  # wraps only between groups in the PDF
    assert f"/api/v1/proofs/{certified.pk}/sigstore-bundle" in page


def test_a_budget_far_above_the_run_gets_a_log_axis() -> None:
    series = Series(
        steps=(0, 1, 2, 3), flops=(1e6, 2e6, 3e6, 4e6), tokens=(1, 2, 3, 4), gpu_hours=(0, 0, 0, 0)
    )
    svg = compute_chart_svg(series, Decimal(400_000_000))
    assert "(log scale)" in svg and "1% of the declared budget" in svg
    linear = compute_chart_svg(series, Decimal(8_000_000))
    assert "(log scale)" not in linear and "50% of the declared budget" in linear


def test_hexgroups_groups_only_digests() -> None:
    from attestations.reports.templatetags.report_format import hexgroups

    digest = "ab" * 32
    assert hexgroups(f"batch {digest} (matches)") == (
        f"batch {digest[:16]} {digest[16:32]} {digest[32:48]} {digest[48:]} (matches)"
    )
    assert hexgroups("pretraining; 1 program phase(s)") == "pretraining; 1 program phase(s)"
    assert hexgroups(digest, False) == digest
