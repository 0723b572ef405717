from __future__ import annotations

from django.urls import path

from attestations import health

urlpatterns = [
    path("health", health.health, name="health"),
]
