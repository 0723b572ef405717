"""Web routes for auditors' reports (HTML and PDF), included at the site root."""

from __future__ import annotations

from django.urls import URLPattern, path

from attestations.web import reports as report_views

urlpatterns: list[URLPattern] = [
    path("proofs/<int:pk>/report/", report_views.report_page, name="proof-report"),
    path("proofs/<int:pk>/report.pdf", report_views.report_pdf, name="proof-report-pdf"),
]
