from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import include, path

from attestations.web import health, views

NAME = "<slug:owner>/<str:name>"

urlpatterns = [
    path("health", health.health, name="health"),
    path(
        "login/",
        auth_views.LoginView.as_view(redirect_authenticated_user=True),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.dashboard, name="dashboard"),
    path("experiments/", views.experiment_list, name="experiments"),
    path("experiments/new/", views.experiment_new, name="experiment-new"),
    path(f"experiments/{NAME}/", views.experiment_detail, name="experiment"),
    path(f"experiments/{NAME}/spec/", views.experiment_spec, name="experiment-spec"),
    path("proofs/<int:pk>/", views.proof_detail, name="proof"),
    path("", include("attestations.web.report_urls")),
    path("keys/", views.api_keys, name="api-keys"),
    path("keys/<int:pk>/revoke/", views.api_key_revoke, name="api-key-revoke"),
    path("audit/", views.audit_log, name="audit"),
    path("orgs/<slug:slug>/", views.organization, name="organization"),
    path(
        "orgs/<slug:slug>/members/<str:username>/remove/",
        views.organization_remove,
        name="organization-remove",
    ),
    path(
        "orgs/<slug:slug>/members/<str:username>/role/",
        views.organization_role,
        name="organization-role",
    ),
    path(
        "orgs/<slug:slug>/invitations/<uuid:pk>/revoke/",
        views.invitation_revoke,
        name="invitation-revoke",
    ),
    path(
        "invitations/<uuid:pk>/<str:answer>/",
        views.invitation_answer,
        name="invitation-answer",
    ),
]
