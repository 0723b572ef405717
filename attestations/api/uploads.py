"""The API of resumable uploads: open, send parts (or presign them), complete, abort.

Routes: ``uploads/`` and ``uploads/{id}/`` with its ``parts/``, ``complete/`` and
``abort/`` (``attestations/api/urls.py``). A completed transcript upload is filed as a
proof (``attestations/uploads/``: ``services``, ``parts`` and ``direct``).
"""

from __future__ import annotations

import io
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import generics, serializers, status
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from attestations.accounts.models import (
    Capability,
)
from attestations.api.experiments import FullNameField
from attestations.core.conf import api_datetime, client_ip
from attestations.core.errors import NotFoundError
from attestations.experiments.models import (
    Experiment,
)
from attestations.http.body import request_body
from attestations.http.exceptions import LengthRequiredError
from attestations.http.fields import Sha256Field, StrictCharField, StrictIntegerField
from attestations.http.filters import QueryFilters
from attestations.http.pagination import CursorPage
from attestations.http.permissions import HasCapability, get_access, require
from attestations.uploads import direct, parts
from attestations.uploads import services as uploads
from attestations.uploads.limits import MAX_PARTS, PART_DIGEST_HEADER, max_part_bytes
from attestations.uploads.models import ArtifactKind, Upload, UploadPart, UploadStatus
from attestations.uploads.s3 import MIN_PART_BYTES as S3_MIN_PART_BYTES


class UploadPartSerializer(serializers.ModelSerializer[UploadPart]):
    class Meta:
        model = UploadPart
        fields = ["number", "size", "sha256"]


class UploadPartURLRequestSerializer(serializers.Serializer[Any]):
    """A direct upload's part, declared before it is sent to object storage."""

    size = StrictIntegerField(min_value=1, help_text="The part's size in bytes.")
    sha256 = Sha256Field(help_text="SHA-256 (hex) of the part's bytes.")


class UploadSerializer(serializers.ModelSerializer[Upload]):
    experiment = FullNameField(
        source="experiment.full_name", help_text="The experiment, as owner/name."
    )
    kind = serializers.ChoiceField(choices=ArtifactKind.choices)
    size = StrictIntegerField(min_value=1, help_text="Total size of the blob in bytes.")
    sha256 = Sha256Field(help_text="SHA-256 (hex) of the whole blob.")
    name = StrictCharField(
        max_length=255,
        required=False,
        allow_blank=True,
        default="",
        help_text="The file's path in the proof directory (informational).",
    )
    parts = serializers.SerializerMethodField()
    received_bytes = serializers.SerializerMethodField()
    direct = serializers.BooleanField(
        read_only=True,
        help_text="Parts go straight to object storage: ask for each part's URL "
        "(POST uploads/{id}/parts/{n}/url/) and PUT it there.",
    )
    min_part_bytes = serializers.SerializerMethodField()
    blob_sha256 = serializers.CharField(source="blob.sha256", read_only=True, allow_null=True)
    proof = serializers.SerializerMethodField()
    max_part_bytes = serializers.SerializerMethodField()

    class Meta:
        model = Upload
        fields = [
            "id",
            "experiment",
            "kind",
            "name",
            "size",
            "sha256",
            "status",
            "reason",
            "received_bytes",
            "parts",
            "direct",
            "min_part_bytes",
            "max_part_bytes",
            "blob_sha256",
            "proof",
            "created",
            "expires",
            "completed",
        ]
        read_only_fields = ["id", "status", "reason", "created", "expires", "completed"]

    @extend_schema_field(
        serializers.IntegerField(
            allow_null=True,
            help_text="The proof a completed transcript upload filed, or the proof it repeats "
            "(a transcript already filed for the experiment is not filed twice)",
        )
    )
    def get_proof(self, upload: Upload) -> int | None:
        return upload.filed_proof_id

    def get_max_part_bytes(self, upload: Upload) -> int:
        return max_part_bytes()

    @extend_schema_field(
        serializers.IntegerField(
            help_text="The least size of any part but the last (object storage's, 5 MiB, "
            "for a direct upload; 1 otherwise)"
        )
    )
    def get_min_part_bytes(self, upload: Upload) -> int:
        return S3_MIN_PART_BYTES if upload.direct else 1

    def _parts(self, upload: Upload) -> list[dict[str, Any]]:
        held = self.context.get("direct_parts")
        if held is not None:
            return list(held)
        return [dict(UploadPartSerializer(part).data) for part in upload.parts.all()]

    @extend_schema_field(
        UploadPartSerializer(
            many=True,
            help_text="Parts received; for an open direct upload, the declared parts object "
            "storage holds",
        )
    )
    def get_parts(self, upload: Upload) -> list[dict[str, Any]]:
        return self._parts(upload)

    @extend_schema_field(serializers.IntegerField())
    def get_received_bytes(self, upload: Upload) -> int:
        return sum(int(part["size"]) for part in self._parts(upload))


class UploadList(generics.ListCreateAPIView[Upload]):
    """Upload sessions: artifacts, so visible to the lab's trainers and admins only."""

    serializer_class = UploadSerializer
    permission_classes = [HasCapability]
    pagination_class = CursorPage
    filter_backends = [QueryFilters]
    query_filters = {
        "status": ("status", frozenset(UploadStatus.values)),
        "kind": ("kind", frozenset(ArtifactKind.values)),
        "experiment": ("experiment__full_name", None),
        "sha256": ("sha256", None),
    }
    query_filter_help = {"sha256": "Uploads of the blob with this SHA-256 (hex)."}

    @property
    def required_capability(self) -> str:
        return Capability.ARTIFACTS if self.request.method == "GET" else Capability.WRITE

    def get_queryset(self) -> QuerySet[Upload]:
        queryset = Upload.objects.filter(get_access(self.request).orgs(Capability.ARTIFACTS))
        return queryset.select_related("experiment__owner", "blob", "proof").prefetch_related(
            "parts"
        )

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Open an upload: declare experiment, kind, total size and whole-blob SHA-256.

        An experiment that does not exist and one out of sight are one 404
        (``does_not_exist``, field ``experiment``).
        """
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        full_name = data["experiment"]["full_name"]
        experiment = (
            Experiment.objects.visible_to(get_access(request))
            .by_full_name(full_name)
            .select_related("owner", "current_spec")
            .first()
        )
        if experiment is None:
            raise NotFoundError(
                f"No experiment {full_name!r}.", code="does_not_exist", field="experiment"
            )
        require(request, Capability.WRITE, experiment.owner_id)
        upload = uploads.create(
            experiment=experiment,
            kind=data["kind"],
            size=data["size"],
            sha256=data["sha256"],
            user=request.user,  # type: ignore[arg-type]
            ip=client_ip(request.META),
            name=data.get("name") or "",
        )
        return Response(UploadSerializer(upload).data, status=status.HTTP_201_CREATED)


def _upload(request: Request, pk: Any, capability: str) -> Upload:
    """An upload the caller may read (404 otherwise) and act on with ``capability``.

    Changing an upload (parts, completion, abort) is for its creator and the lab's
    admins: another trainer of the lab sees it but may not touch it (403).
    """
    access = get_access(request)
    upload = (
        Upload.objects.filter(access.orgs(Capability.READ))
        .select_related("experiment__owner", "blob")
        .filter(pk=pk)
        .first()
    )
    if upload is None:
        raise NotFoundError(f"No upload {pk}.")
    require(request, capability, upload.organization_id)
    if capability == Capability.WRITE and not (
        upload.created_by_id == request.user.pk
        or access.can(Capability.MANAGE, upload.organization_id)
    ):
        raise PermissionDenied(
            f"Upload {pk} was opened by another member; only they and the organisation's "
            "admins may send its parts, complete or abort it."
        )
    return upload


class UploadDetail(APIView):
    permission_classes = [HasCapability]

    @extend_schema(responses=UploadSerializer)
    def get(self, request: Request, pk: Any) -> Response:
        """The upload's state and the parts received so far (to resume after a failure).

        For a direct upload (``direct``: parts go straight to object storage), ``parts``
        are the declared parts object storage holds with their declared size.
        """
        upload = _upload(request, pk, Capability.ARTIFACTS)
        context = {"direct_parts": direct.direct_parts(upload)} if upload.direct else {}
        return Response(UploadSerializer(upload, context=context).data)


class UploadAbort(APIView):
    permission_classes = [HasCapability]

    @extend_schema(request=None, responses={200: UploadSerializer})
    def post(self, request: Request, pk: Any) -> Response:
        """Abort: remove every staged part. Aborting an aborted upload is harmless.

        The upload stays readable, with status ``aborted``.
        """
        upload = _upload(request, pk, Capability.WRITE)
        uploads.abort(upload, user=request.user, ip=client_ip(request.META))  # type: ignore[arg-type]
        return Response(UploadSerializer(upload).data)


class UploadPartView(APIView):
    permission_classes = [HasCapability]
    # The body is streamed from request.stream; DRF's parsers never read it.
    parser_classes: list[Any] = []

    @extend_schema(
        request={"application/octet-stream": OpenApiTypes.BINARY},
        parameters=[
            OpenApiParameter(
                "number",
                {"type": "integer", "minimum": 1, "maximum": MAX_PARTS},
                OpenApiParameter.PATH,
                description=f"The part's number, 1 to {MAX_PARTS}.",
            ),
            OpenApiParameter(
                PART_DIGEST_HEADER,
                {"type": "string", "pattern": "^[0-9a-fA-F]{64}$"},
                OpenApiParameter.HEADER,
                required=True,
                description="SHA-256 (hex) of this part's bytes.",
            ),
        ],
        responses=inline_serializer(
            "UploadPartResult",
            {
                "number": serializers.IntegerField(),
                "size": serializers.IntegerField(),
                "sha256": serializers.CharField(),
            },
        ),
    )
    def put(self, request: Request, pk: Any, number: int) -> Response:
        """Send part ``number`` (1-based). Sending a part again replaces it."""
        upload = _upload(request, pk, Capability.WRITE)
        length = request.META.get("CONTENT_LENGTH")
        try:
            content_length = int(length) if length not in (None, "") else None
        except ValueError:
            content_length = None
        if content_length is None:
            # Django reads nothing from a body of unknown length; say so instead of
            # reporting the digest of an empty part.
            raise LengthRequiredError(field="Content-Length")
        part = parts.put_part(
            upload,
            int(number),
            # Read into reused buffers, straight from the socket under gunicorn.
            stream=request_body(
                request.META,
                content_length,
                request.stream if request.stream is not None else io.BytesIO(b""),
            ),
            declared_sha256=request.headers.get(PART_DIGEST_HEADER),
            content_length=content_length,
        )
        return Response({"number": part.number, "size": part.size, "sha256": part.sha256})


class UploadPartURL(APIView):
    permission_classes = [HasCapability]

    @extend_schema(
        request=UploadPartURLRequestSerializer,
        parameters=[
            OpenApiParameter(
                "number",
                {"type": "integer", "minimum": 1, "maximum": MAX_PARTS},
                OpenApiParameter.PATH,
                description=f"The part's number, 1 to {MAX_PARTS}.",
            )
        ],
        responses=inline_serializer(
            "UploadPartURL",
            {
                "number": serializers.IntegerField(),
                "size": serializers.IntegerField(),
                "sha256": serializers.CharField(),
                "method": serializers.CharField(),
                "url": serializers.CharField(),
                "headers": serializers.DictField(child=serializers.CharField()),
                "expires": serializers.DateTimeField(),
            },
        ),
    )
    def post(self, request: Request, pk: Any, number: int) -> Response:
        """Declare part ``number`` of a direct upload; returns where to PUT it.

        The URL is presigned for object storage: it is valid for this upload's object, this
        part number, the declared ``size`` (Content-Length) and ``sha256`` (sent as
        ``x-amz-checksum-sha256``, base64), until ``expires``. Send exactly ``headers``.
        Declaring a part again replaces its declaration (a new URL).
        """
        upload = _upload(request, pk, Capability.WRITE)
        serializer = UploadPartURLRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = direct.declare_part(
            upload,
            int(number),
            size=serializer.validated_data["size"],
            sha256=serializer.validated_data["sha256"],
        )
        return Response(
            {
                "number": issued.part.number,
                "size": issued.part.size,
                "sha256": issued.part.sha256,
                "method": "PUT",
                "url": issued.url,
                "headers": issued.headers,
                "expires": api_datetime(issued.expires),
            }
        )


class UploadComplete(APIView):
    permission_classes = [HasCapability]

    @extend_schema(request=None, responses=UploadSerializer)
    def post(self, request: Request, pk: Any) -> Response:
        """Assemble and verify the blob; a transcript is filed as a proof and verified."""
        upload = _upload(request, pk, Capability.WRITE)
        upload = uploads.complete(upload, user=request.user, ip=client_ip(request.META))  # type: ignore[arg-type]
        return Response(UploadSerializer(upload).data)
