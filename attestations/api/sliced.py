"""The API of sliced runs (``docs/scale.md``): file a run, answer and open its slices.

Routes (``attestations/api/urls.py``):

* ``GET|POST experiments/{owner}/{name}/sliced-runs/``: the experiment's sliced runs;
  file one by the SHA-256 of its uploaded run file (trainers, admins);
* ``GET sliced-runs/{id}/``: a run, its slices and their verdicts;
* ``PUT sliced-runs/{id}/challenges/{index}/answer/``: a slice's projections, raw
  little-endian float64; the response names the sequences to open;
* ``POST sliced-runs/{id}/challenges/{index}/opening/``: ``{"opening": sha256}`` of the
  uploaded opening; the slice is queued for verification.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from attestations.accounts.models import Capability
from attestations.challenges import sliced
from attestations.challenges.models import SlicedChallenge, SlicedRun
from attestations.core.conf import client_ip
from attestations.core.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError
from attestations.experiments.models import Experiment
from attestations.http.fields import Sha256Field
from attestations.http.pagination import CursorPage
from attestations.http.permissions import HasCapability, authenticated_user, get_access, require


class SliceSerializer(serializers.ModelSerializer[SlicedChallenge]):
    """One slice: which step and block, what the lab must send, and its verdict."""

    sequences = serializers.JSONField(read_only=True)

    class Meta:
        model = SlicedChallenge
        fields = [
            "index",
            "step",
            "block",
            "directions",
            "projections",
            "opened",
            "status",
            "sequences",
            "answer_digest",
            "reason",
            "message",
            "margins",
            "seconds",
            "bytes_moved",
            "attempts",
            "created",
            "answered",
            "finished",
        ]
        read_only_fields = fields


class SlicedRunSerializer(serializers.ModelSerializer[SlicedRun]):
    """A sliced run: its run file, its verdict, and its slices (the seed once spent)."""

    experiment = serializers.CharField(source="experiment.full_name", read_only=True)
    seed = serializers.SerializerMethodField()
    challenges = SliceSerializer(many=True, read_only=True)

    class Meta:
        model = SlicedRun
        fields = [
            "id",
            "experiment",
            "digest",
            "steps",
            "blocks",
            "micro_batches",
            "rows",
            "status",
            "reason",
            "message",
            "seed_commitment",
            "seed",
            "deadline",
            "created",
            "settled",
            "challenges",
        ]
        read_only_fields = fields

    def get_seed(self, run: SlicedRun) -> str | None:
        """The platform's seed, once it helps nobody (null before).

        Shown once the run is settled and every slice of its run file has been answered
        in some filing (``attestations.challenges.sliced.seed_is_spent``): until then a
        later filing of the same run file could try answers against it offline.
        """
        return run.seed if sliced.seed_is_spent(run, self.context.get("answered")) else None


class SlicedRunFiling(serializers.Serializer[Any]):
    run_file = Sha256Field()


def _experiment(request: Request, owner: str, name: str) -> Experiment:
    experiment = (
        Experiment.objects.visible_to(get_access(request))
        .select_related("owner")
        .filter(owner__slug=owner, name=name)
        .first()
    )
    if experiment is None:
        raise NotFoundError(f"No experiment {owner}/{name}.")
    return experiment


def _runs(request: Request) -> QuerySet[SlicedRun]:
    access = get_access(request)
    return (
        SlicedRun.objects.filter(access.orgs(Capability.READ, "experiment__owner_id"))
        .select_related("experiment__owner")
        .prefetch_related("challenges")
    )


def _run(request: Request, pk: int) -> SlicedRun:
    run = _runs(request).filter(pk=pk).first()
    if run is None:
        raise NotFoundError(f"No sliced run {pk}.", field="id")
    return run


def _slice(request: Request, pk: int, index: int) -> SlicedChallenge:
    """A slice of a run the caller may read, for a caller who may write (else 403)."""
    run = _run(request, pk)
    require(request, Capability.WRITE, run.experiment.owner_id)
    challenge = next((c for c in run.challenges.all() if c.index == index), None)
    if challenge is None:
        raise NotFoundError(
            f"Sliced run {pk} has no challenge {index} (it has {run.challenges.count()}).",
            field="index",
        )
    challenge.run = run
    return challenge


class SlicedRunList(generics.ListAPIView[SlicedRun]):
    """The sliced runs of an experiment; file one by its uploaded run file."""

    serializer_class = SlicedRunSerializer
    permission_classes = [HasCapability]
    pagination_class = CursorPage

    def get_queryset(self) -> QuerySet[SlicedRun]:
        experiment = _experiment(self.request, self.kwargs["owner"], self.kwargs["name"])
        return _runs(self.request).filter(experiment=experiment)

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        assert page is not None
        # Whether each run's seed may be shown, for the whole page in one query.
        answered = sliced.answered_indexes({run.digest for run in page})
        data = SlicedRunSerializer(page, many=True, context={"answered": answered}).data
        return self.get_paginated_response(data)

    @extend_schema(request=SlicedRunFiling, responses={201: SlicedRunSerializer})
    def post(self, request: Request, owner: str, name: str) -> Response:
        """File a sliced run by the SHA-256 of its uploaded run file; draws its slices.

        Idempotent: the same run file again is the same run (200). The programs the run
        file names must be uploaded first.
        """
        experiment = _experiment(request, owner, name)
        require(request, Capability.WRITE, experiment.owner_id)
        body = SlicedRunFiling(data=request.data)
        body.is_valid(raise_exception=True)
        run, fresh = sliced.file_run(
            experiment,
            body.validated_data["run_file"],
            user=authenticated_user(request),
            ip=client_ip(request.META),
        )
        return Response(
            SlicedRunSerializer(_run(request, run.pk)).data,
            status=status.HTTP_201_CREATED if fresh else status.HTTP_200_OK,
        )


class SlicedRunDetail(APIView):
    permission_classes = [HasCapability]

    @extend_schema(responses=SlicedRunSerializer)
    def get(self, request: Request, pk: int) -> Response:
        """A sliced run, its slices and their verdicts."""
        return Response(SlicedRunSerializer(_run(request, int(pk))).data)


class SliceAnswerView(APIView):
    permission_classes = [HasCapability]
    # The body is the raw projections; no parser reads it.
    parser_classes: list[Any] = []

    @extend_schema(
        request={"application/octet-stream": OpenApiTypes.BINARY}, responses=SliceSerializer
    )
    def put(self, request: Request, pk: int, index: int) -> Response:
        """A slice's projections ``c[q][micro][row]``, little-endian float64.

        The response lists the ``[micro, row]`` sequences the opening must open, drawn
        from the platform's secret seed and this answer's digest.
        """
        challenge = _slice(request, int(pk), int(index))
        run = challenge.run
        expected = 8 * challenge.projections * run.micro_batches * run.rows
        length = request.META.get("CONTENT_LENGTH") or ""
        if not length.isdigit():
            raise InvalidRequestError(
                f"the answer needs a Content-Length of {expected} bytes",
                code="length_required",
                field="Content-Length",
            )
        if int(length) > expected or int(length) > settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
            raise PayloadTooLargeError(
                f"the answer of slice {challenge.index} is {expected} bytes; got a body of "
                f"{length}",
                field="body",
                detail={"expected_bytes": expected, "got_bytes": int(length)},
            )
        body = request.stream.read(int(length)) if request.stream is not None else b""
        answered = sliced.answer(
            challenge, body, user=authenticated_user(request), ip=client_ip(request.META)
        )
        return Response(SliceSerializer(answered).data)


class SliceOpeningRequest(serializers.Serializer[Any]):
    """The opening: an uploaded blob's SHA-256, or a read grant on the lab's bucket."""

    opening = Sha256Field(required=False)
    grant = serializers.DictField(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("opening" in attrs) == ("grant" in attrs):
            raise serializers.ValidationError(
                {"opening": "Give exactly one of opening (an uploaded blob) and grant."}
            )
        return attrs


class SliceOpeningView(APIView):
    permission_classes = [HasCapability]

    @extend_schema(request=SliceOpeningRequest, responses={202: SliceSerializer})
    def post(self, request: Request, pk: int, index: int) -> Response:
        """The opening of an answered slice; queues its check.

        Either ``opening``, the SHA-256 of the uploaded opening, or ``grant``, a read
        grant (``zkdv.sliced_store.Grant``) on the lab's own bucket at an endpoint the
        platform reads from (``DVBENCH_SLICED_STORE_ENDPOINTS``): the worker then reads
        only the opened byte ranges.
        """
        body = SliceOpeningRequest(data=request.data)
        body.is_valid(raise_exception=True)
        challenge = _slice(request, int(pk), int(index))
        opened = sliced.attach_opening(
            challenge,
            body.validated_data.get("opening"),
            grant=body.validated_data.get("grant"),
            user=authenticated_user(request),
            ip=client_ip(request.META),
        )
        return Response(SliceSerializer(opened).data, status=status.HTTP_202_ACCEPTED)
