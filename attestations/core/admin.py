"""What every app's admin shares: typed base classes and the read-only admin.

The admin site is the operator's (staff accounts). Records the platform writes itself
(experiments, proofs, challenges, uploads, the audit trail) are shown read-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.http import HttpRequest

# django-stubs makes ModelAdmin generic; at runtime (without django_stubs_ext) it is not
# subscriptable, so only the type checker sees the parameters.
if TYPE_CHECKING:
    ModelAdmin = admin.ModelAdmin[Any]
    TabularInline = admin.TabularInline[Any, Any]
else:
    ModelAdmin = admin.ModelAdmin
    TabularInline = admin.TabularInline


class ReadOnlyAdmin(ModelAdmin):
    """Records written by the platform itself: an operator may look, never edit."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
