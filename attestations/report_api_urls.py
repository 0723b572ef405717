"""API routes for claims, data-content queries and report downloads."""

from __future__ import annotations

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
