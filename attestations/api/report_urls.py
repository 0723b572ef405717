"""API routes for claims, data-content queries and report downloads.

Mounted under ``/api/v1/`` before the catch-all; a trailing slash is optional.

======  ===============================================  =================================
GET     proofs/{id}/claims/                              claims, evidence, violations
POST    proofs/{id}/data-queries/                        is this window in the batches?
GET     proofs/{id}/report.html                          the auditor's report (HTML)
GET     proofs/{id}/report.pdf                           the same report as a PDF
======  ===============================================  =================================
"""

from __future__ import annotations

from django.urls import URLPattern, re_path

from attestations.api import reports as views

urlpatterns: list[URLPattern] = [
    re_path(
        r"^proofs/(?P<pk>[0-9]{1,18})/claims/?$",
        views.ProofClaimsView.as_view(),
        name="proof-claims",
    ),
    re_path(
        r"^proofs/(?P<pk>[0-9]{1,18})/data-queries/?$",
        views.ProofDataQueryView.as_view(),
        name="proof-data-queries",
    ),
    re_path(
        r"^proofs/(?P<pk>[0-9]{1,18})/report\.html$",
        views.ProofReportHtmlView.as_view(),
        name="proof-report-html",
    ),
    re_path(
        r"^proofs/(?P<pk>[0-9]{1,18})/report\.pdf$",
        views.ProofReportPdfView.as_view(),
        name="proof-report-pdf",
    ),
]
