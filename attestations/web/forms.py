"""Forms of the web UI. They mirror the API serializers' rules, field by field."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django import forms
from django.core.validators import MaxValueValidator, MinValueValidator

from attestations.accounts.models import LAB_ROLE_CHOICES, Access, Capability, Organization
from attestations.certificates.models import Certificate
from attestations.core.conf import dvbench_int
from attestations.core.validators import sha256_validator
from attestations.experiments.models import Experiment, Framework, Regime, experiment_name_validator
from zkdv.config import DEFAULT_TOKEN_UNIT, TOKEN_UNITS

#: How the spec form names each unit of ``zkdv.config.TOKEN_UNITS``.
_TOKEN_UNIT_LABELS = {
    "examples": "examples (a classifier's images, rows)",
    "tokens": "token ids (a language model)",
}

DIGITS = r"[0-9]*"


class BigIntegerInput(forms.CharField):
    """A whole number of any size (FLOPs exceed 64 bits); blank means undeclared."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("required", False)
        super().__init__(**kwargs)
        self.widget.attrs.update({"inputmode": "numeric", "pattern": DIGITS})

    def to_python(self, value: Any) -> Decimal | None:  # type: ignore[override]
        text = str(value or "").replace("_", "").replace(",", "").strip()
        if not text:
            return None
        if not text.isdigit():
            raise forms.ValidationError(
                "Enter a whole number of digits (no exponent: 1e25 loses precision).",
                code="invalid",
            )
        return Decimal(text)


class SpecForm(forms.Form):
    """The declared spec: what the run is and the limits it promises to stay within."""

    framework = forms.ChoiceField(choices=Framework.choices, widget=forms.RadioSelect)
    model_description = forms.CharField(
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="Architecture and size, e.g. 'decoder-only transformer, 1.3B parameters'.",
    )
    optimizer = forms.CharField(max_length=500, help_text="e.g. 'optax.adamw(3e-4, b2=0.95)'.")
    dataset_commitment = forms.CharField(
        max_length=64,
        min_length=64,
        validators=[sha256_validator],
        help_text="SHA-256 (hex) of the dataset manifest.",
        widget=forms.TextInput(
            attrs={"pattern": "[0-9a-fA-F]{64}", "spellcheck": "false", "class": "mono"}
        ),
    )
    max_flops = BigIntegerInput(label="Max FLOPs", help_text="Blank: undeclared.")
    max_tokens = BigIntegerInput(label="Max tokens", help_text="Blank: undeclared.")
    token_unit = forms.ChoiceField(
        label="Tokens count",
        choices=[(unit, _TOKEN_UNIT_LABELS[unit]) for unit in TOKEN_UNITS],
        initial=DEFAULT_TOKEN_UNIT,
        required=False,  # an older form, or a client that leaves it out: examples
        help_text="What max tokens and the token claim count.",
    )

    def clean_token_unit(self) -> str:
        return str(self.cleaned_data.get("token_unit") or DEFAULT_TOKEN_UNIT)

    max_gpu_hours = forms.DecimalField(
        label="Max GPU-hours",
        required=False,
        max_digits=14,
        decimal_places=3,
        validators=[MinValueValidator(Decimal(0))],
    )
    allowed_regimes = forms.MultipleChoiceField(
        choices=Regime.choices, required=False, widget=forms.CheckboxSelectMultiple
    )

    parent_transcript = forms.CharField(
        label="Parent run",
        max_length=64,
        required=False,
        help_text="A fine-tune, continued pre-training or RL run: the transcript digest of "
        "the certified run whose final model it starts from. Its compute then counts with "
        "this run's against thresholds that include fine-tuning. Blank: none.",
        widget=forms.TextInput(
            attrs={"pattern": "[0-9a-fA-F]{64}", "spellcheck": "false", "class": "mono"}
        ),
    )

    platform_kind = forms.ChoiceField(
        label="Trains on",
        choices=[("", "not declared"), ("cpu", "CPU"), ("gpu", "GPU"), ("tpu", "TPU")],
        required=False,
        help_text="The platform kind the run trains on. A transcript from another is "
        "refused, and its challenged steps are replayed on workers of this kind.",
    )

    def clean_platform_kind(self) -> str:
        return str(self.cleaned_data.get("platform_kind") or "")

    def __init__(self, *args: Any, access: Access | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.access = access

    def clean_dataset_commitment(self) -> str:
        return str(self.cleaned_data["dataset_commitment"]).lower()

    def clean_parent_transcript(self) -> str:
        value = str(self.cleaned_data.get("parent_transcript") or "").strip().lower()
        if not value:
            return ""
        sha256_validator(value)
        orgs = self.access.orgs(Capability.READ) if self.access is not None else None
        if not Certificate.certifies(value, orgs):
            raise forms.ValidationError(
                f"No certificate you can read certifies a run with transcript digest {value}."
            )
        return value

    def spec(self) -> dict[str, Any]:
        return {key: self.cleaned_data.get(key) for key in SpecForm.base_fields}


class ExperimentForm(SpecForm):
    """Registration: an owner organisation (where the user may write) and a name."""

    owner = forms.ModelChoiceField(queryset=Organization.objects.none(), to_field_name="slug")
    name = forms.CharField(
        max_length=100,
        validators=[experiment_name_validator],
        help_text="Lowercase letters, digits, '.', '_' or '-'. The id becomes owner/name.",
        widget=forms.TextInput(
            attrs={"pattern": r"[a-z0-9]([a-z0-9._\-]{0,98}[a-z0-9])?", "autocomplete": "off"}
        ),
    )

    field_order = ["owner", "name"]

    def __init__(self, *args: Any, owners: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["owner"].queryset = owners  # type: ignore[attr-defined]
        if owners.count() == 1:
            self.fields["owner"].initial = owners.first()

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        owner, name = data.get("owner"), data.get("name")
        if owner and name and Experiment.objects.filter(owner=owner, name=name).exists():
            self.add_error("name", f"{owner.slug}/{name} is already registered.")
        return data


class InviteForm(forms.Form):
    """Invite a user to the lab with a role; they join when they accept.

    The regulator role is not offered: it exists only in agencies, and only the
    platform's operator grants it.
    """

    username = forms.CharField(max_length=150)
    role = forms.ChoiceField(choices=LAB_ROLE_CHOICES)

    def clean_username(self) -> str:
        # Whether anyone holds the name is not checked here, nor ever shown: the invitation
        # is made (and shown pending) all the same (Invitation.offer).
        return str(self.cleaned_data["username"]).strip()


class RoleForm(forms.Form):
    """Change an existing member's role."""

    role = forms.ChoiceField(choices=LAB_ROLE_CHOICES)


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="Where the key will live, e.g. 'cluster-a'.")
    days = forms.IntegerField(min_value=1, label="Valid for (days)", required=True)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        longest = dvbench_int("API_KEY_MAX_DAYS")
        days = self.fields["days"]
        days.initial = dvbench_int("API_KEY_TTL_DAYS")
        days.help_text = f"1 to {longest}."
        # The policy's maximum as configured (a longer lifetime is refused, not clamped).
        days.max_value = longest  # type: ignore[attr-defined]
        days.validators.append(MaxValueValidator(longest))
        days.widget.attrs["max"] = str(longest)


class ConfirmPasswordForm(forms.Form):
    """Sudo mode: the signed-in user's password, before a key can be created."""

    password = forms.CharField(
        strip=False,
        max_length=4096,
        widget=forms.PasswordInput(attrs={"autocomplete": "current-password"}),
        help_text="Confirm it to create keys for the next few minutes.",
    )
