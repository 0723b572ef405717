"""Web routes for auditors' reports (HTML and PDF)."""

from __future__ import annotations

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
