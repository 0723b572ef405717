"""Auditors' report pages: a proof's report as an HTML page and as a PDF download.

Who sees them: members of the proof's organisation, and regulators of every organisation;
anyone else gets 404, so proof ids cannot be probed. The API serves the same documents
(``attestations.api.reports``).
"""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from attestations.http.permissions import get_access
from attestations.reports.render import pdf_response, report_context, visible_proofs

__all__ = ["report_page", "report_pdf"]


@login_required
@require_GET
def report_page(request: HttpRequest, pk: int) -> HttpResponse:
    proof = get_object_or_404(visible_proofs(get_access(request)), pk=pk)
    context = report_context(proof)
    return render(request, "attestations/report.html", context)


@login_required
@require_GET
def report_pdf(request: HttpRequest, pk: int) -> HttpResponse:
    proof = get_object_or_404(visible_proofs(get_access(request)), pk=pk)
    return pdf_response(proof)
