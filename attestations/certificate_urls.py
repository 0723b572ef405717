"""API routes for certificates, the transparency log, the trust root and regulator search."""

from __future__ import annotations

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
