"""Views of claims, data-content queries and reports (web pages and API).

Who sees what:

* claims and reports (HTML, PDF): members of the proof's organisation, and regulators of
  every organisation (they read claims and certificates, never artifacts); anyone else
  gets 404, so proof ids cannot be probed;
* data-content queries: the organisation's trainers, auditors and admins
  (:attr:`~attestations.models.Capability.AUDIT`); a regulator gets 403. Every query is
  an audit event.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from attestations.accounts.models import Access, Capability
from attestations.api.permissions import HasCapability, get_access, require
from attestations.api.serializers import StrictIntegerField
from attestations.certificates.claims import compute_claims
from attestations.core.conf import client_ip
from attestations.core.errors import NotFoundError
from attestations.proofs.models import Proof
from attestations.reports import data_queries
from attestations.reports import render as reports

__all__ = [
    "ProofClaimsView",
    "ProofDataQueryView",
    "ProofReportHtmlView",
    "ProofReportPdfView",
    "report_page",
    "report_pdf",
]


def visible_proofs(access: Access) -> QuerySet[Proof]:
    """Proofs whose claims ``access`` may read, with what a report reads."""
    return Proof.objects.filter(
        access.orgs(Capability.READ, "experiment__owner_id")
    ).select_related("experiment__owner", "spec", "transcript")


def _pdf_response(proof: Proof) -> HttpResponse:
    response = HttpResponse(reports.render_report_pdf(proof), content_type="application/pdf")
    name = f"{proof.experiment.owner.slug}-{proof.experiment.name}-proof-{proof.pk}-report.pdf"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


# --- Web pages --------------------------------------------------------------------------


@login_required
@require_GET
def report_page(request: HttpRequest, pk: int) -> HttpResponse:
    proof = get_object_or_404(visible_proofs(get_access(request)), pk=pk)
    context = reports.report_context(proof)
    return render(request, "attestations/report.html", context)


@login_required
@require_GET
def report_pdf(request: HttpRequest, pk: int) -> HttpResponse:
    proof = get_object_or_404(visible_proofs(get_access(request)), pk=pk)
    return _pdf_response(proof)


# --- API --------------------------------------------------------------------------------


class _ProofView(APIView):
    permission_classes = [HasCapability]
    required_capability = Capability.READ

    def proof(self, request: Request, pk: int) -> Proof:
        proof = visible_proofs(get_access(request)).filter(pk=pk).first()
        if proof is None:
            raise NotFoundError(f"No proof {pk}.")
        return proof


_CLAIM_FIELDS: dict[str, serializers.Field[Any, Any, Any, Any]] = {
    "name": serializers.CharField(),
    "value": serializers.JSONField(),
    "evidence": serializers.ChoiceField(
        ["verified_by_replay", "committed_in_transcript", "reported_by_trainer"]
    ),
    "unit": serializers.CharField(allow_null=True),
}
_VIOLATION_FIELDS: dict[str, serializers.Field[Any, Any, Any, Any]] = {
    "limit": serializers.CharField(),
    "declared": serializers.JSONField(),
    "actual": serializers.JSONField(),
    "step": serializers.IntegerField(allow_null=True),
    "message": serializers.CharField(),
}


class ProofClaimsView(_ProofView):
    """The proof's policy claims with evidence levels, and the declared limits it broke."""

    @extend_schema(
        responses=inline_serializer(
            "ClaimSet",
            {
                "proof": serializers.IntegerField(),
                "status": serializers.CharField(),
                "schema": serializers.CharField(),
                "ok": serializers.BooleanField(),
                "claims": inline_serializer("Claim", _CLAIM_FIELDS, many=True),
                "violations": inline_serializer("Violation", _VIOLATION_FIELDS, many=True),
                "details": serializers.JSONField(),
                "series": serializers.JSONField(),
                "timeline": serializers.JSONField(),
                "transcript_error": serializers.CharField(allow_null=True),
            },
        )
    )
    def get(self, request: Request, pk: int) -> Response:
        proof = self.proof(request, pk)
        return Response(
            {"proof": proof.pk, "status": proof.status, **compute_claims(proof).to_dict()}
        )


class ProofReportHtmlView(_ProofView):
    """The auditor's report as one standalone HTML document."""

    @extend_schema(responses={(200, "text/html"): OpenApiTypes.STR})
    def get(self, request: Request, pk: int) -> HttpResponse:
        proof = self.proof(request, pk)
        html = reports.render_report_html(proof)
        return HttpResponse(html, content_type="text/html; charset=utf-8")


class ProofReportPdfView(_ProofView):
    """The auditor's report as a PDF, from the same template as the HTML."""

    @extend_schema(responses={(200, "application/pdf"): OpenApiTypes.BINARY})
    def get(self, request: Request, pk: int) -> HttpResponse:
        return _pdf_response(self.proof(request, pk))


class DataQuerySerializer(serializers.Serializer[Any]):
    window = serializers.ListField(
        child=StrictIntegerField(min_value=0, max_value=data_queries.UINT32_MAX),
        allow_empty=False,
        min_length=1,
        max_length=1 << 16,
        help_text="uint32 tokens, exactly the proof's committed rolling-window length",
    )


class ProofDataQueryView(_ProofView):
    """Whether a token window occurs in the proof's committed batches, and in which steps.

    Only step indices and counts come back, never training data. The window must have
    exactly the committed rolling-window length (``window_length`` error otherwise).
    """

    required_capability = Capability.AUDIT

    @extend_schema(
        request=DataQuerySerializer,
        responses=inline_serializer(
            "DataQueryResult",
            {
                "proof": serializers.IntegerField(),
                "window_length": serializers.IntegerField(),
                "found": serializers.BooleanField(),
                "steps": serializers.ListField(child=serializers.IntegerField()),
                "step_count": serializers.IntegerField(),
                "steps_truncated": serializers.BooleanField(),
                "steps_committed": serializers.IntegerField(),
                "steps_searched": serializers.IntegerField(),
                "steps_without_batch": serializers.IntegerField(),
                "batches_not_matching": serializers.ListField(child=serializers.IntegerField()),
                "complete": serializers.BooleanField(),
            },
        ),
    )
    def post(self, request: Request, pk: int) -> Response:
        proof = self.proof(request, pk)
        require(request, Capability.AUDIT, proof.experiment.owner_id)
        query = DataQuerySerializer(data=request.data)
        query.is_valid(raise_exception=True)
        result = data_queries.query_proof(
            proof,
            query.validated_data["window"],
            actor=request.user,
            ip=client_ip(request.META),
        )
        return Response({"proof": proof.pk, **result.to_dict()})
