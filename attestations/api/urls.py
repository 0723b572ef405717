"""Routes of the REST API, mounted at ``/api/v1/``. A trailing slash is optional.

Authenticate with ``Authorization: Bearer <api key>`` (``Api-Key <key>`` works too) or a
browser session. Lists are cursor-paginated (``?page_size=`` up to 200, ``next`` and
``previous`` links) and take the filters listed in the schema. Every error has the body
``{"error": {"code", "message", "field", "detail"}, "request_id"}``.

======  ===============================================  =================================
GET     me/                                              who am I, my roles
GET     organizations/                                   visible organisations
GET     organizations/{slug}/members/                    members (trainer, auditor, admin)
POST    organizations/{slug}/members/                    change a member's role (admin)
DELETE  organizations/{slug}/members/{username}/         remove a member (admin), or leave
GET     organizations/{slug}/invitations/                pending invitations (admin)
POST    organizations/{slug}/invitations/                invite a user with a role (admin)
DELETE  organizations/{slug}/invitations/{id}/           revoke an invitation (admin)
GET     invitations/                                     invitations waiting for me
POST    invitations/{id}/accept/ · …/decline/            join, or say no
GET     keys/ · POST keys/                               my API keys; create (shown once;
                                                         a signed-in session in sudo mode,
                                                         never an API key)
POST    keys/confirm-password/                           sudo mode for this session
GET     keys/{id}/ · POST keys/{id}/revoke/              one key; revoke it (kept, revoked)
GET     experiments/ · POST experiments/                 list; register (trainer, admin)
GET     experiments/{owner}/{name}/                      one experiment, spec, spec_digest
GET     experiments/{owner}/{name}/specs/                spec versions
POST    experiments/{owner}/{name}/specs/                change the spec (new version once
                                                         a proof names it)
GET     experiments/{owner}/{name}/specs/{version}/      one version and its canonical doc
GET     proofs/ · GET proofs/{id}/                       filed transcripts and verdicts
GET     proofs/{id}/transcript/                          the transcript bytes (artifacts)
GET     proofs/{id}/challenges/                          the platform's challenges, their
                                                         needed files, progress, verdicts
GET     proofs/{id}/artifacts/                           files attached for replay
POST    proofs/{id}/artifacts/                           attach uploaded files (answers)
GET     experiments/{owner}/{name}/sliced-runs/      sliced runs (docs/scale.md)
POST    experiments/{owner}/{name}/sliced-runs/      file one by its uploaded run file
GET     sliced-runs/{id}/                            a sliced run, its slices, verdicts
PUT     sliced-runs/{id}/challenges/{i}/answer/      a slice's projections (float64)
POST    sliced-runs/{id}/challenges/{i}/opening/     its uploaded opening; verified
GET     jobs/ · GET jobs/{id}/                           background jobs and progress
GET     audit-events/                                    the audit trail (not regulators)
GET     uploads/ · POST uploads/                         upload sessions; open one
GET     uploads/{id}/                                    state and parts received (resume)
PUT     uploads/{id}/parts/{n}/                          part n, header X-Part-SHA256
POST    uploads/{id}/parts/{n}/url/                      direct (S3): part n's presigned URL
POST    uploads/{id}/complete/                           verify, store, file a transcript
POST    uploads/{id}/abort/                              abort (kept, aborted)
GET     schema/ · docs/ · redoc/                         OpenAPI document, Swagger, ReDoc
======  ===============================================  =================================
"""

from __future__ import annotations

from typing import Any

from django.urls import include, path, re_path
from drf_spectacular.views import (
    SpectacularAPIView,
    SpectacularRedocView,
    SpectacularSwaggerSplitView,
)
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from attestations.api import accounts, audit, challenges, experiments, proofs, sliced, uploads
from attestations.core.errors import NotFoundError

app_name = "api"

NAME = r"(?P<owner>[a-z0-9-]+)/(?P<name>[a-z0-9._-]+)"
UUID = r"(?P<pk>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
SLUG = r"(?P<slug>[a-z0-9-]+)"


class UnknownEndpoint(APIView):
    """Any other path under /api/v1/: a 404 in the API's error format, not an HTML page."""

    permission_classes: list[Any] = []
    schema = None

    def _missing(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        raise NotFoundError(f"No API endpoint {request.path}; see /api/v1/docs/.", field="path")

    get = post = put = patch = delete = head = options = _missing


urlpatterns = [
    re_path(r"^me/?$", accounts.MeView.as_view(), name="me"),
    re_path(r"^organizations/?$", accounts.OrganizationList.as_view(), name="organizations"),
    re_path(rf"^organizations/{SLUG}/members/?$", accounts.MemberList.as_view(), name="members"),
    re_path(
        rf"^organizations/{SLUG}/members/(?P<username>[\w.@+-]+)/?$",
        accounts.MemberDetail.as_view(),
        name="member",
    ),
    re_path(
        rf"^organizations/{SLUG}/invitations/?$",
        accounts.OrganizationInvitationList.as_view(),
        name="org-invitations",
    ),
    re_path(
        rf"^organizations/{SLUG}/invitations/{UUID}/?$",
        accounts.OrganizationInvitationDetail.as_view(),
        name="org-invitation",
    ),
    re_path(r"^invitations/?$", accounts.MyInvitationList.as_view(), name="invitations"),
    re_path(rf"^invitations/{UUID}/accept/?$", accounts.InvitationAccept.as_view(), name="accept"),
    re_path(
        rf"^invitations/{UUID}/decline/?$", accounts.InvitationDecline.as_view(), name="decline"
    ),
    re_path(r"^keys/?$", accounts.ApiKeyList.as_view(), name="keys"),
    re_path(r"^keys/confirm-password/?$", accounts.ApiKeyConfirmPassword.as_view(), name="sudo"),
    re_path(r"^keys/(?P<pk>[0-9]{1,18})/?$", accounts.ApiKeyDetail.as_view(), name="key"),
    re_path(r"^keys/(?P<pk>[0-9]{1,18})/revoke/?$", accounts.ApiKeyRevoke.as_view(), name="revoke"),
    re_path(r"^experiments/?$", experiments.ExperimentList.as_view(), name="experiments"),
    re_path(rf"^experiments/{NAME}/?$", experiments.ExperimentDetail.as_view(), name="experiment"),
    re_path(rf"^experiments/{NAME}/specs/?$", experiments.SpecList.as_view(), name="specs"),
    re_path(
        rf"^experiments/{NAME}/specs/(?P<version>[0-9]{{1,18}})/?$",
        experiments.SpecDetail.as_view(),
        name="spec",
    ),
    re_path(
        rf"^experiments/{NAME}/sliced-runs/?$", sliced.SlicedRunList.as_view(), name="sliced-runs"
    ),
    re_path(
        r"^sliced-runs/(?P<pk>[0-9]{1,18})/?$", sliced.SlicedRunDetail.as_view(), name="sliced-run"
    ),
    re_path(
        r"^sliced-runs/(?P<pk>[0-9]{1,18})/challenges/(?P<index>[0-9]{1,9})/answer/?$",
        sliced.SliceAnswerView.as_view(),
        name="slice-answer",
    ),
    re_path(
        r"^sliced-runs/(?P<pk>[0-9]{1,18})/challenges/(?P<index>[0-9]{1,9})/opening/?$",
        sliced.SliceOpeningView.as_view(),
        name="slice-opening",
    ),
    re_path(r"^proofs/?$", proofs.ProofList.as_view(), name="proofs"),
    re_path(r"^proofs/(?P<pk>[0-9]{1,18})/?$", proofs.ProofDetail.as_view(), name="proof"),
    re_path(
        r"^proofs/(?P<pk>[0-9]{1,18})/transcript/?$",
        proofs.ProofTranscript.as_view(),
        name="transcript",
    ),
    re_path(
        r"^proofs/(?P<pk>[0-9]{1,18})/challenges/?$",
        challenges.ChallengeList.as_view(),
        name="challenges",
    ),
    re_path(
        r"^proofs/(?P<pk>[0-9]{1,18})/artifacts/?$",
        proofs.ProofArtifacts.as_view(),
        name="artifacts",
    ),
    re_path(r"^jobs/?$", proofs.JobList.as_view(), name="jobs"),
    re_path(rf"^jobs/{UUID}/?$", proofs.JobDetail.as_view(), name="job"),
    re_path(r"^audit-events/?$", audit.AuditEventList.as_view(), name="audit-events"),
    re_path(r"^uploads/?$", uploads.UploadList.as_view(), name="uploads"),
    re_path(rf"^uploads/{UUID}/?$", uploads.UploadDetail.as_view(), name="upload"),
    re_path(
        rf"^uploads/{UUID}/parts/(?P<number>[0-9]{{1,18}})/?$",
        uploads.UploadPartView.as_view(),
        name="part",
    ),
    re_path(
        rf"^uploads/{UUID}/parts/(?P<number>[0-9]{{1,18}})/url/?$",
        uploads.UploadPartURL.as_view(),
        name="part-url",
    ),
    re_path(rf"^uploads/{UUID}/complete/?$", uploads.UploadComplete.as_view(), name="complete"),
    re_path(rf"^uploads/{UUID}/abort/?$", uploads.UploadAbort.as_view(), name="abort"),
    path("", include("attestations.api.certificate_urls")),
    path("", include("attestations.api.report_urls")),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    # The split view serves Swagger UI's start-up script as a file (docs/?script): the
    # Content-Security-Policy allows no inline script.
    path("docs/", SpectacularSwaggerSplitView.as_view(url_name="api:schema"), name="docs"),
    path("redoc/", SpectacularRedocView.as_view(url_name="api:schema"), name="redoc"),
    re_path(r"^.*$", UnknownEndpoint.as_view(), name="unknown"),
]
