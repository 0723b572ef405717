"""Experiments: a registered training run (``owner/name``) and its declared spec."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dvbench._config import cache_dir
from dvbench._contracts import Api
from dvbench._exceptions import (
    ConfigurationError,
    DVBenchError,
    NotFoundError,
    PermissionDeniedError,
)
from dvbench._proof import DVBenchProof, create_proof
from dvbench.attest import canonical_json

if TYPE_CHECKING:
    from zkdv.config import ZKDVConfig

__all__ = ["Experiment", "default_spec", "spec_digest"]

log = logging.getLogger("dvbench")

NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?/[a-z0-9](?:[a-z0-9._-]{0,98}[a-z0-9])?$")
BACKENDS = ("jax", "torch")
#: The dataset commitment of a spec that declares none: 64 zeros, plainly not a digest
#: of anything, so an auditor sees at a glance that nothing was declared.
UNDECLARED_DATASET = "0" * 64
#: The schema tag inside every canonical spec document; bump it if the document changes.
SPEC_SCHEMA = "dvbench.spec/v1"
#: Roles that may upload (the platform's ``write`` capability).
UPLOAD_ROLES = ("trainer", "admin")


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(
            f"experiment name {name!r} must be 'owner/name': the organisation's slug, a "
            "slash, then 1-100 lowercase letters, digits, '.', '_' or '-'"
        )


def default_spec(framework: str) -> dict[str, Any]:
    """The spec the SDK registers when none is given: the framework, nothing else declared.

    Limits are null (undeclared, so unbounded) and the dataset commitment is
    ``UNDECLARED_DATASET``. Declare a real spec in the web UI, with
    ``dvbench experiments create --spec FILE`` or ``client.create_experiment``.
    """
    from zkdv.config import DEFAULT_TOKEN_UNIT

    if framework not in BACKENDS:
        raise ValueError(f"framework {framework!r} must be one of {', '.join(BACKENDS)}")
    return {
        "framework": framework,
        "model_description": "undeclared (registered by the dvbench SDK)",
        "optimizer": "undeclared",
        "dataset_commitment": UNDECLARED_DATASET,
        "max_flops": None,
        "max_tokens": None,
        "max_gpu_hours": None,
        "allowed_regimes": [],
        "token_unit": DEFAULT_TOKEN_UNIT,
    }


def spec_document(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical document a spec digest is computed over.

    It binds the experiment's full name, so the same limits declared for two
    experiments have two digests. Integers are exact, GPU-hours a normalised decimal
    string (no float formatting enters the digest), the dataset commitment lower-case
    hex and the allowed regimes sorted without duplicates.

    Args:
        name: the experiment's full name, ``owner/name``.
        spec: the spec fields (``framework``, ``model_description``, ``optimizer``,
            ``dataset_commitment``, ``max_flops``, ``max_tokens``, ``max_gpu_hours``,
            ``allowed_regimes``, ``token_unit``), as :func:`default_spec` returns them.
            ``token_unit`` (what ``max_tokens`` and the token claim count: ``examples``,
            the default, or ``tokens``) enters the document only when it is ``tokens``,
            and ``parent_transcript`` (the transcript digest of the run whose final
            model this one starts from) and ``platform_kind`` (``cpu``, ``gpu`` or
            ``tpu``: what the run trains on) only when declared, so the digests of specs
            declared before they existed do not change.
    """

    def integer(value: Any) -> int | None:
        return None if value is None else int(value)

    hours = spec.get("max_gpu_hours")
    parent = str(spec.get("parent_transcript") or "").lower()
    return {
        "schema": SPEC_SCHEMA,
        "experiment": name,
        "framework": spec["framework"],
        "model": spec["model_description"],
        "optimizer": spec["optimizer"],
        "dataset_commitment": str(spec["dataset_commitment"]).lower(),
        "limits": {
            "max_flops": integer(spec.get("max_flops")),
            "max_tokens": integer(spec.get("max_tokens")),
            "max_gpu_hours": None
            if hours is None
            else format(Decimal(str(hours)).normalize(), "f"),
            "allowed_regimes": sorted(set(spec.get("allowed_regimes") or [])),
            **({"token_unit": "tokens"} if spec.get("token_unit") == "tokens" else {}),
        },
        **({"parent_transcript": parent} if parent else {}),
        **({"platform_kind": str(spec["platform_kind"])} if spec.get("platform_kind") else {}),
    }


def spec_digest(name: str, spec: Mapping[str, Any]) -> str:
    """The platform's digest of ``spec`` for experiment ``name``, computed locally.

    SHA-256 (hex) of the canonical JSON (:func:`dvbench.attest.canonical_json`) of
    :func:`spec_document`: the digest the platform computes and a transcript binds.
    Offline, where the platform cannot be asked, the SDK binds this one; ``dvbench
    sync`` checks it against the platform's digest.
    """
    return hashlib.sha256(canonical_json(spec_document(name, spec))).hexdigest()


def _cache_path(name: str) -> Path:
    owner, _, short = name.partition("/")
    return cache_dir() / "experiments" / owner / f"{short}.json"


class Experiment:
    """A registered experiment, as returned by :meth:`Client.experiment`.

    Attributes:
        name: ``owner/name``.
        spec_digest: the digest of the current declared spec; it is written into the
            transcript's root record, binding the proof to what was declared.
        spec: the current declared spec.
        registered: False for an experiment the SDK will register at :meth:`proof`.
    """

    def __init__(self, client: Api, data: Mapping[str, Any], *, registered: bool = True) -> None:
        self._client = client
        self.data = dict(data)
        self.name: str = str(data["id"])
        self.registered = registered
        # Set when this run registers the experiment only at sync time (offline).
        self.pending_spec: dict[str, Any] | None = None
        self._lookup_error: DVBenchError | None = None

    # --- constructors -------------------------------------------------------------------
    @classmethod
    def unregistered(
        cls,
        client: Api,
        name: str,
        spec: Mapping[str, Any] | None,
        error: DVBenchError | None = None,
    ) -> Experiment:
        experiment = cls(
            client,
            {"id": name, "spec": dict(spec) if spec else None, "spec_digest": None},
            registered=False,
        )
        experiment._lookup_error = error
        return experiment

    @classmethod
    def offline(cls, client: Api, name: str, spec: Mapping[str, Any] | None) -> Experiment:
        """Describe ``name`` without asking the platform: from the cache, else from ``spec``."""
        if spec is None:
            try:
                data = json.loads(_cache_path(name).read_text())
            except (OSError, ValueError):
                data = None
            if isinstance(data, dict) and data.get("spec_digest"):
                return cls(client, data)
        experiment = cls.unregistered(client, name, spec)
        if spec is not None:
            experiment._declare_offline(dict(spec))
        return experiment

    def _declare_offline(self, spec: dict[str, Any]) -> None:
        self.pending_spec = spec
        self.data["spec"] = spec
        self.data["spec_digest"] = spec_digest(self.name, spec)

    # --- properties ---------------------------------------------------------------------
    @property
    def client(self) -> Api:
        """The client this experiment talks to the platform through."""
        return self._client

    @property
    def owner(self) -> str:
        return self.name.partition("/")[0]

    @property
    def spec_digest(self) -> str | None:
        value = self.data.get("spec_digest")
        return str(value) if value else None

    @property
    def spec(self) -> dict[str, Any] | None:
        value = self.data.get("spec")
        return dict(value) if isinstance(value, Mapping) else None

    @property
    def framework(self) -> str | None:
        spec = self.spec
        return str(spec["framework"]) if spec and spec.get("framework") else None

    def __repr__(self) -> str:
        state = "" if self.registered else " (not registered yet)"
        return f"<dvbench.Experiment {self.name} spec={str(self.spec_digest)[:12]}{state}>"

    # --- platform -----------------------------------------------------------------------
    def remember(self) -> None:
        """Cache this experiment's record so an offline run can bind to its spec digest."""
        path = _cache_path(self.name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(self.data, default=str))
            os.replace(temporary, path)
        except OSError:  # a read-only home: the cache is a convenience, never a failure
            pass

    def register(self, framework: str | None = None) -> None:
        """Register this experiment with its spec (or the default spec for ``framework``).

        Raises:
            NotFoundError: the owning organisation does not exist or is not visible.
            PermissionDeniedError: this key's role may not register experiments there.
        """
        if self.registered:
            return
        spec = self.spec or default_spec(framework or "jax")
        if self._client.offline:
            if self.spec is None:
                log.warning(
                    "dvbench: offline, and %s is not in the cache: the proof is bound to the "
                    "default spec. If %s is registered with another spec, `dvbench sync` will "
                    "refuse it; run once online first (the SDK caches the spec) or pass spec=",
                    self.name,
                    self.name,
                )
            self._declare_offline(spec)
            return
        try:
            created = self._client.create_experiment(self.name, spec)
        except DVBenchError as error:
            # The platform answers one way for an organisation that does not exist and one
            # this key cannot see (404 does_not_exist; a 400 from older platforms).
            if getattr(error, "code", None) == "does_not_exist":
                raise NotFoundError(
                    f"no organisation {self.owner!r}: create it on the platform first, or "
                    "use the slug of one you belong to (`dvbench status` lists them)",
                    status_code=404,
                    code="does_not_exist",
                    field="owner",
                    request_id=getattr(error, "request_id", None),
                ) from error
            if not isinstance(error, NotFoundError | PermissionDeniedError):
                raise
            error.message = (
                f"{self.name} is not registered, or not visible to this key, and the key may "
                f"not register it in {self.owner!r} ({error.message}). Check the name; ask an "
                f"admin of {self.owner!r} to register it or to give you the trainer role; "
                "or use a key of a member of that organisation."
            )
            error.args = (f"{error.status_code} {error.code}: {error.message}",)
            raise
        self.data = created.data
        self.registered = True

    def refresh(self) -> None:
        """Read the experiment again (its spec may have gained a version)."""
        self.data = self._client.get(f"experiments/{self.name}/")
        self.registered = True
        self.remember()

    def proofs(self) -> list[dict[str, Any]]:
        """The proofs filed for this experiment, newest first, with their verdicts."""
        return list(self._client.paginate("proofs/", {"experiment": self.name}))

    def _check_role(self) -> None:
        """Fail before training, not at upload, when the key's role cannot upload here."""
        try:
            me = self._client.me()
        except DVBenchError:
            return  # the upload will say what is wrong; never block training on this
        for org in me.get("organizations", []):
            role = org.get("role")
            if org.get("slug") == self.owner and role not in UPLOAD_ROLES:
                raise PermissionDeniedError(
                    f"{me.get('username')} is {role!r} in {self.owner!r}, which may read "
                    f"{self.name} but not upload proofs to it; ask an admin of "
                    f"{self.owner!r} for the trainer role, or use a trainer's key",
                    status_code=403,
                    code="role_cannot_upload",
                )

    # --- the training-side proof --------------------------------------------------------
    def proof(
        self,
        backend: str = "jax",
        config: ZKDVConfig | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
        progress: bool | None = None,
        **driver_options: Any,
    ) -> DVBenchProof:
        """Create the ZKDV driver for a training run of this experiment.

        The result *is* a ``zkdv.jax.ZKDV`` (or ``zkdv.torch.ZKDV``): ``start``, ``jit``,
        ``attest``, ``prepare``, ``transaction`` and the rest work as documented. DVBench
        adds: the transcript is bound to this experiment and its spec digest; snapshot
        and batch files upload in the background while training runs; and
        :meth:`~dvbench.DVBenchProof.finish` closes the driver, uploads what is left,
        and releases the temporary proof directory. An experiment that is not
        registered yet is registered first, declaring ``backend`` as its framework.

        Args:
            backend: ``"jax"`` or ``"torch"``.
            config: the run's :class:`zkdv.ZKDVConfig` (sampling policy, tolerance, ...);
                its ``token_unit`` is the spec's (what ``max_tokens`` counts).
            path: the proof directory; by default a new directory under the user cache
                (``$DVBENCH_CACHE_DIR``, ``$XDG_CACHE_HOME/dvbench`` or
                ``~/.cache/dvbench``), removed once uploaded.
            progress: show the upload progress bar (default: when stderr is a terminal).
            **driver_options: passed to the backend driver (``max_in_flight``,
                ``replay_snapshot_interval``, ...).

        Raises:
            ValueError: an unknown backend.
            ImportError: the backend's framework is not installed.
            DVBenchError: the experiment declares another framework.
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {', '.join(BACKENDS)}")
        if not self.registered:
            self.register(framework=backend)
        if self.framework is not None and self.framework != backend:
            raise DVBenchError(
                f"{self.name} declares framework {self.framework!r}, but backend={backend!r}; "
                "use the declared framework, or declare a new spec version"
            )
        if not self._client.offline:
            self._check_role()
        if not self.spec_digest:
            raise ConfigurationError(
                f"the spec digest of {self.name} is unknown offline: run once online (the "
                "SDK caches it), or pass spec= to client.experiment()"
            )
        from zkdv.config import DEFAULT_TOKEN_UNIT, ZKDVConfig

        unit = (self.spec or {}).get("token_unit") or DEFAULT_TOKEN_UNIT
        if config is None:
            config = ZKDVConfig(token_unit=unit)
        elif config.token_unit != unit:
            # The spec declares what max_tokens counts; the run counts the same.
            config = dataclasses.replace(config, token_unit=unit)
        return create_proof(
            self, backend, config, path=path, progress=progress, options=driver_options
        )
