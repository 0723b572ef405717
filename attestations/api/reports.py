"""API views of a proof's claims, data-content queries and reports (HTML, PDF).

Who sees what:

* claims and reports (HTML, PDF): members of the proof's organisation, and regulators of
  every organisation (they read claims and certificates, never artifacts); anyone else
  gets 404, so proof ids cannot be probed;
* data-content queries: the organisation's trainers, auditors and admins
  (:attr:`~attestations.accounts.models.Capability.AUDIT`); a regulator gets 403. Every query is
  an audit event.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from attestations.accounts.models import Capability
from attestations.certificates.claims import compute_claims
from attestations.core.conf import client_ip
from attestations.core.errors import NotFoundError
from attestations.http.fields import StrictIntegerField
from attestations.http.permissions import HasCapability, get_access, require
from attestations.proofs.models import Proof
from attestations.reports import data_queries
from attestations.reports import render as reports
from attestations.reports.render import pdf_response, visible_proofs

__all__ = [
    "ProofClaimsView",
    "ProofDataQueryView",
    "ProofReportHtmlView",
    "ProofReportPdfView",
]


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
        return pdf_response(self.proof(request, pk))


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
