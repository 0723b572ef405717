"""The API of experiments and their spec versions.

Routes: ``experiments/`` and ``experiments/{owner}/{name}/`` with its ``specs/``
(``attestations/api/urls.py``). An experiment in an organisation the caller cannot read
answers 404; a role that may not register or change one answers 403.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from decimal import Decimal
from typing import Any, cast

from django.db import IntegrityError, transaction
from drf_spectacular.utils import (
    PolymorphicProxySerializer,
    extend_schema,
    extend_schema_field,
)
from rest_framework import generics, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from attestations.accounts.models import (
    Capability,
    Organization,
)
from attestations.certificates.models import Certificate
from attestations.core.conf import client_ip
from attestations.core.errors import ConflictError, NotFoundError
from attestations.experiments.models import (
    SPEC_FIELDS,
    Experiment,
    ExperimentQuerySet,
    ExperimentSpec,
    Framework,
    Regime,
    proof_statuses,
    summary_dict,
)
from attestations.experiments.rows import SummaryPage
from attestations.http.fields import Sha256Field, StrictCharField
from attestations.http.filters import BigInt, QueryFilters, check_known_parameters
from attestations.http.pagination import CursorPage
from attestations.http.permissions import HasCapability, authenticated_user, get_access, require
from zkdv.config import DEFAULT_TOKEN_UNIT, TOKEN_UNITS
from zkdv.environments import PLATFORM_KINDS


def _big_integer_schema(max_digits: int) -> dict[str, Any]:
    return {
        "oneOf": [
            {"type": "integer", "minimum": 0, "maximum": 10**max_digits - 1},
            {"type": "string", "pattern": f"^[0-9]{{1,{max_digits}}}$"},
        ],
        "nullable": True,
        "description": "A whole number; as a JSON integer or a string of digits.",
    }


class BigIntegerField(serializers.Field):  # type: ignore[type-arg]
    """A non-negative integer of any size (FLOPs exceed 64 bits), as a JSON integer.

    Accepts a JSON integer or a string of digits; an integral float such as ``1e25`` is
    refused because it has already lost precision by the time it reaches us.
    """

    default_error_messages = {
        "invalid": "Enter a non-negative whole number (a JSON integer or a string of digits).",
        "max_digits": "Enter at most {max_digits} digits.",
    }

    def __init__(self, *, max_digits: int = 40, **kwargs: Any) -> None:
        self.max_digits = max_digits
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> Decimal:
        if isinstance(data, bool) or not isinstance(data, (int, str)):
            self.fail("invalid")
        text = str(data)
        if not re.fullmatch(r"[0-9]+", text):
            self.fail("invalid")
        if len(text.lstrip("0")) > self.max_digits:
            self.fail("max_digits", max_digits=self.max_digits)
        return Decimal(text)

    def to_representation(self, value: Any) -> int:
        return int(value)


@extend_schema_field(_big_integer_schema(40))
class FlopsField(BigIntegerField):
    pass


@extend_schema_field(_big_integer_schema(30))
class TokensField(BigIntegerField):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_digits=30, **kwargs)


GPU_HOURS_TEXT = re.compile(r"[0-9]{1,11}(?:\.[0-9]{1,3})?")


@extend_schema_field(
    {
        "oneOf": [
            {"type": "number", "minimum": 0, "maximum": 99999999999.999, "multipleOf": 0.001},
            {"type": "string", "pattern": r"^[0-9]{1,11}(\.[0-9]{1,3})?$"},
        ],
        "nullable": True,
        "description": "Non-negative, at most 3 decimal places; a JSON number or a string.",
    }
)
class GpuHoursField(serializers.Field):  # type: ignore[type-arg]
    """GPU-hours: up to 11 integer digits and 3 decimal places, as a number or a string."""

    default_error_messages = {
        "invalid": "Enter a non-negative number with at most 3 decimal places and 11 digits "
        'before the point (a JSON number or a string such as "1200.5").',
    }

    def to_internal_value(self, data: Any) -> Decimal:
        if isinstance(data, bool) or not isinstance(data, (int, float, str)):
            self.fail("invalid")
        if isinstance(data, str):
            if not GPU_HOURS_TEXT.fullmatch(data):
                self.fail("invalid")
            return Decimal(data)
        if not 0 <= data < 100_000_000_000:
            # Before any decimal arithmetic: 1e300 cannot even be quantized (a 500 once).
            self.fail("invalid")
        if isinstance(data, float):
            if not math.isfinite(data):
                self.fail("invalid")
            # A double is the nearest one to what the client wrote (1200.5), or the product
            # of some arithmetic (227700 * 0.001 == 227.70000000000002): take the decimal
            # of 3 places it stands for, if it is within a few units of the last place.
            value = Decimal(repr(data)).quantize(Decimal("0.001"))
            if abs(float(value) - data) > 4 * math.ulp(data):
                self.fail("invalid")
        else:
            value = Decimal(data)
        if value < 0 or value >= Decimal("100000000000"):
            self.fail("invalid")
        return value.quantize(Decimal("0.001"))

    def to_representation(self, value: Any) -> float:
        return float(value)


class ParentTranscriptField(Sha256Field):
    """A declared parent run's transcript digest; none declared reads as null."""

    def to_representation(self, value: Any) -> str | None:  # type: ignore[override]  # null when none
        return str(value) if value else None


class PlatformKindField(serializers.ChoiceField):
    """A declared platform kind; none declared reads as null."""

    def to_representation(self, value: Any) -> str | None:  # type: ignore[override]  # null when none
        return str(value) if value else None


class SpecSerializer(serializers.ModelSerializer[ExperimentSpec]):
    """A declared spec. Limits left null are undeclared (and so unbounded)."""

    framework = serializers.ChoiceField(choices=Framework.choices)
    model_description = StrictCharField(max_length=2000)
    optimizer = StrictCharField(max_length=500)
    dataset_commitment = Sha256Field(
        help_text="SHA-256 (hex) commitment to the training dataset manifest."
    )
    max_flops = FlopsField(required=False, allow_null=True, default=None)
    max_tokens = TokensField(required=False, allow_null=True, default=None)
    max_gpu_hours = GpuHoursField(required=False, allow_null=True, default=None)
    allowed_regimes = serializers.ListField(
        child=serializers.ChoiceField(choices=Regime.choices),
        allow_empty=True,
        default=list,
        max_length=len(Regime.choices),
    )
    token_unit = serializers.ChoiceField(
        choices=list(TOKEN_UNITS),
        default=DEFAULT_TOKEN_UNIT,
        help_text="What max_tokens and the token claim count: the batch's examples (the "
        "default), or the token ids of a sequence model (zkdv's token_unit).",
    )
    parent_transcript = ParentTranscriptField(
        required=False,
        allow_null=True,
        default=None,
        help_text="The transcript digest (a certificate's transcript_digest) of the run whose "
        "final model this run starts from: a fine-tune, continued pre-training or RL run of "
        "that model. A certificate you can read must certify it. Certificates add the "
        "lineage's compute up against the thresholds that count fine-tuning.",
    )
    platform_kind = PlatformKindField(
        choices=list(PLATFORM_KINDS),
        required=False,
        allow_null=True,
        default=None,
        help_text="The platform kind the run trains on (cpu, gpu or tpu). A transcript whose "
        "root record names another is refused (platform_mismatch), and its challenged "
        "steps are replayed on the platform's workers of this kind.",
    )
    frozen = serializers.BooleanField(source="is_frozen", read_only=True)

    def validate_platform_kind(self, value: str | None) -> str:
        return value or ""

    def validate_parent_transcript(self, value: str | None) -> str:
        if not value:
            return ""
        request = self.context.get("request")
        orgs = get_access(request).orgs(Capability.READ) if request is not None else None
        if not Certificate.certifies(value, orgs):
            # A reference to nothing this caller can see: a 404, as an unknown owner is.
            raise NotFoundError(
                f"No certificate you can read certifies a run with transcript digest {value}.",
                code="unknown_parent",
                field="spec.parent_transcript" if self.parent is not None else "parent_transcript",
            )
        return value

    class Meta:
        model = ExperimentSpec
        # The model's fields, with ``frozen`` after the version's identity.
        fields = [*SPEC_FIELDS[:2], "frozen", *SPEC_FIELDS[2:]]
        read_only_fields = ["version", "digest", "created"]


#: An organisation slug and an experiment name (``models.SLUG``, ``EXPERIMENT_NAME``).
SLUG_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$"
NAME_PATTERN = r"^[a-z0-9](?:[a-z0-9._-]{0,98}[a-z0-9])?$"
FULL_NAME_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?/[a-z0-9](?:[a-z0-9._-]{0,98}[a-z0-9])?$"


def _patterned(pattern: str, what: str) -> type[StrictCharField]:
    @extend_schema_field({"type": "string", "pattern": pattern})
    class Patterned(StrictCharField):
        def to_internal_value(self, data: Any) -> str:
            value = super().to_internal_value(data)
            if not re.fullmatch(pattern, value):
                raise serializers.ValidationError(f"Enter {what}.", code="invalid")
            return value

    Patterned.__name__ = f"Patterned{what.title().replace(' ', '')}"
    return Patterned


SlugField = _patterned(
    SLUG_PATTERN, "an organisation slug: 1-50 lowercase letters, digits or hyphens"
)


ExperimentNameField = _patterned(
    NAME_PATTERN, "an experiment name: 1-100 lowercase letters, digits, '.', '_' or '-'"
)


FullNameField = _patterned(FULL_NAME_PATTERN, "an experiment id of the form owner/name")


def visible_organization(request: Any, slug: str, capability: str) -> Organization:
    """The organisation ``slug`` where the caller holds ``capability``.

    One that does not exist and one the caller cannot see are the same 404
    (``does_not_exist``, field ``owner``): a body names nothing an id could not.

    Raises:
        NotFoundError: no such organisation, or out of sight.
        PermissionDenied: visible, but the role lacks ``capability`` (403).
    """
    from attestations.core.errors import NotFoundError
    from attestations.http.permissions import get_access

    organization = Organization.objects.filter(slug=slug).first()
    if organization is None or not get_access(request).can_see(organization.pk):
        raise NotFoundError(f"No organisation {slug!r}.", code="does_not_exist", field="owner")
    require(request, capability, organization.pk)
    return organization


class ExperimentSerializer(serializers.ModelSerializer[Experiment]):
    """An experiment with its current spec.

    To register, send ``owner`` and ``name``, or ``name`` as ``owner/name`` (and no
    ``owner``), and ``spec``.
    """

    id = serializers.CharField(source="full_name", read_only=True, help_text="owner/name")
    owner = serializers.CharField(source="owner.slug", required=False)
    name = serializers.CharField(max_length=151)
    spec = SpecSerializer(source="current_spec")
    spec_digest = serializers.CharField(source="current_spec.digest", read_only=True)
    created_by: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    proofs = serializers.SerializerMethodField()
    certificates = serializers.SerializerMethodField()

    class Meta:
        model = Experiment
        fields = [
            "id",
            "owner",
            "name",
            "spec_digest",
            "spec",
            "created",
            "created_by",
            "proofs",
            "certificates",
        ]
        read_only_fields = ["created"]
        # Uniqueness of owner/name is checked in validate(), after scope, and with
        # "owner/name" accepted in `name`; DRF's generated validator would demand both.
        validators: list[Any] = []

    @extend_schema_field(
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "description": "How many proofs were filed, by status (statuses with none left out).",
        }
    )
    def get_proofs(self, experiment: Experiment) -> dict[str, int]:
        return experiment.proof_counts()

    @extend_schema_field(
        {
            "type": "object",
            "properties": {
                "PASSED": {"type": "integer", "minimum": 1},
                "FAILED": {"type": "integer", "minimum": 1},
            },
            "additionalProperties": False,
            "description": "How many of its proofs' certificates record PASSED and FAILED "
            "(results with none left out): the verdicts, where proofs counts transcript "
            "verification only.",
        }
    )
    def get_certificates(self, experiment: Experiment) -> dict[str, int]:
        return experiment.certificate_counts()

    def to_representation(self, instance: Experiment) -> dict[str, Any]:
        frozen = getattr(instance, "spec_frozen", None)
        if frozen is not None and instance.current_spec is not None:
            instance.current_spec._frozen = frozen  # type: ignore[attr-defined]
        return super().to_representation(instance)


class ExperimentByOwnerSerializer(serializers.Serializer[Any]):
    """Register an experiment: the owner's slug and the experiment's name."""

    owner = SlugField(help_text="The organisation's slug.")
    name = ExperimentNameField()
    spec = SpecSerializer()


class ExperimentByIdSerializer(serializers.Serializer[Any]):
    """Register an experiment by its id, ``owner/name`` (no separate ``owner``)."""

    name = FullNameField(help_text="owner/name")
    spec = SpecSerializer()


class ExperimentRegistration(serializers.Serializer[Any]):
    """A registration in either form; checks scope and uniqueness after the shape."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if isinstance(data, dict) and "owner" not in data and "/" in str(data.get("name", "")):
            form: serializers.Serializer[Any] = ExperimentByIdSerializer(
                data=data, context=self.context
            )
        else:
            form = ExperimentByOwnerSerializer(data=data, context=self.context)
        form.is_valid(raise_exception=True)
        attrs = dict(form.validated_data)
        if "owner" not in attrs:
            attrs["owner"], _, attrs["name"] = attrs["name"].partition("/")
        request = self.context["request"]
        # Scope before existence: an outsider learns nothing about the owner's names, and
        # an organisation out of sight is the same 404 as one that does not exist.
        attrs["owner"] = visible_organization(request, attrs["owner"], Capability.WRITE)
        if Experiment.objects.filter(owner=attrs["owner"], name=attrs["name"]).exists():
            from attestations.core.errors import ConflictError

            raise ConflictError(
                f"{attrs['owner'].slug}/{attrs['name']} is already registered.",
                code="exists",
                field="name",
            )
        return attrs


class ExperimentList(generics.ListCreateAPIView[Experiment]):
    """Experiments the caller can read; trainers and admins register new ones."""

    serializer_class = ExperimentSerializer
    permission_classes = [HasCapability]
    pagination_class = CursorPage
    filter_backends = [QueryFilters]
    query_filters = {
        "owner": ("owner__slug", None),
        "framework": ("current_spec__framework", frozenset(Framework.values)),
        "declared_flops_at_least": ("current_spec__max_flops__gte", BigInt),
        "created_after": ("created__gte", datetime),
        "created_before": ("created__lt", datetime),
    }
    query_filter_help = {
        "declared_flops_at_least": "Experiments whose current spec declares max_flops >= this.",
        "created_after": "Registered at or after this ISO 8601 date or date-time.",
        "created_before": "Registered before this ISO 8601 date or date-time.",
    }

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        # A page is plain rows read by SQL compiled once per query shape (SummaryPage, in
        # place of a queryset for the filters and the paginator) plus one grouped query of
        # proof counts, turned into the same document as Experiment.to_dict without
        # building model instances.
        visible = SummaryPage.visible_to(get_access(request))
        page = cast(
            "list[dict[str, Any]] | None",
            self.paginate_queryset(self.filter_queryset(visible)),  # type: ignore[arg-type]
        )
        assert page is not None
        statuses = proof_statuses()
        return self.get_paginated_response([summary_dict(row, statuses) for row in page])

    def get_queryset(self) -> ExperimentQuerySet:
        return Experiment.objects.visible_to(get_access(self.request))

    @extend_schema(
        request=PolymorphicProxySerializer(
            component_name="ExperimentRegistration",
            serializers=[ExperimentByOwnerSerializer, ExperimentByIdSerializer],
            resource_type_field_name=None,
        ),
        responses={201: ExperimentSerializer},
    )
    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Register an experiment (trainers and admins of its owner).

        An owner that does not exist or is out of sight is one 404 (``does_not_exist``);
        a name already registered is 409 ``exists``.
        """
        registration = ExperimentRegistration(data=request.data, context={"request": request})
        registration.is_valid(raise_exception=True)
        data = registration.validated_data
        try:
            with transaction.atomic():
                experiment = Experiment.register(
                    data["owner"],
                    data["name"],
                    data["spec"],
                    user=authenticated_user(request),
                    ip=client_ip(request.META),
                )
        except IntegrityError:
            # Lost a race with a concurrent registration of the same name.
            raise ConflictError(
                f"{data['owner'].slug}/{data['name']} is already registered.",
                code="exists",
                field="name",
            ) from None
        Experiment.summarize([experiment])
        return Response(experiment.to_dict(), status=status.HTTP_201_CREATED)


def _experiment(request: Request, owner: str, name: str) -> Experiment:
    experiment = (
        Experiment.objects.visible_to(get_access(request))
        .with_summary()
        .filter(owner__slug=owner, name=name)
        .first()
    )
    if experiment is None:
        raise NotFoundError(f"No experiment {owner}/{name}.")
    return experiment


class ExperimentDetail(APIView):
    permission_classes = [HasCapability]

    @extend_schema(responses=ExperimentSerializer)
    def get(self, request: Request, owner: str, name: str) -> Response:
        """An experiment and its current spec (``spec_digest`` goes into the transcript)."""
        # The list's row path (cached SQL, no model instances); the same document as
        # Experiment.to_dict.
        visible = SummaryPage.visible_to(get_access(request))
        rows = visible.filter(owner__slug=owner, name=name)[:1]
        if not rows:
            raise NotFoundError(f"No experiment {owner}/{name}.")
        return Response(summary_dict(rows[0], proof_statuses()))


class SpecList(APIView):
    permission_classes = [HasCapability]

    @extend_schema(responses=SpecSerializer(many=True))
    def get(self, request: Request, owner: str, name: str) -> Response:
        """Every version of the experiment's spec, newest first."""
        # Not a generic view, so no filter backend: refuse unknown parameters here.
        check_known_parameters(request, self)
        experiment = _experiment(request, owner, name)
        return Response(SpecSerializer(experiment.specs.all(), many=True).data)

    @extend_schema(request=SpecSerializer, responses={200: SpecSerializer, 201: SpecSerializer})
    def post(self, request: Request, owner: str, name: str) -> Response:
        """Change the spec: in place while no proof names it, else as a new version (201)."""
        experiment = _experiment(request, owner, name)
        require(request, Capability.WRITE, experiment.owner_id)
        serializer = SpecSerializer(data=request.data, context={"request": request})
        serializer.is_valid(raise_exception=True)
        before = experiment.current_spec_id
        spec, _ = experiment.revise_spec(
            serializer.validated_data, user=authenticated_user(request), ip=client_ip(request.META)
        )
        created = spec.pk != before
        return Response(
            SpecSerializer(spec).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class SpecDetail(APIView):
    permission_classes = [HasCapability]

    @extend_schema(responses=SpecSerializer)
    def get(self, request: Request, owner: str, name: str, version: int) -> Response:
        """One spec version, with the canonical document its digest is computed over."""
        experiment = _experiment(request, owner, name)
        spec = ExperimentSpec.objects.filter(experiment=experiment, version=version).first()
        if spec is None:
            raise NotFoundError(f"{experiment.full_name} has no spec version {version}.")
        data = dict(SpecSerializer(spec).data)
        data["canonical"] = spec.canonical_document()
        return Response(data)
