"""Django admin: experiments and their spec versions, read-only."""

from __future__ import annotations

from django.contrib import admin

from attestations.core.admin import ReadOnlyAdmin
from attestations.experiments.models import Experiment, ExperimentSpec


@admin.register(Experiment)
class ExperimentAdmin(ReadOnlyAdmin):
    list_display = ["__str__", "created", "created_by"]


@admin.register(ExperimentSpec)
class ExperimentSpecAdmin(ReadOnlyAdmin):
    list_display = ["experiment", "version", "digest", "framework"]
