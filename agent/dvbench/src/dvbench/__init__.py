"""dvbench: the DVBench platform's Python client and CLI.

Three lines in a training script::

    from dvbench import Client

    client = Client()                      # DVBENCH_BASE_URL, DVBENCH_API_KEY
    experiment = client.experiment("acme/run-7")
    proof = experiment.proof(backend="jax")  # a zkdv.jax.ZKDV driver
    proof.start(rolling_window=4, probe_ratio=0.01)
    ...                                      # train with proof.jit
    proof.save_model(state.params)           # optional: signed weights the certificate binds
    proof.finish()                           # close, upload, clean up; says the verdict
                                             # (finish(wait=True): FAILED raises)

Errors are documented in ``dvbench._exceptions`` and exported here. The platform uses
the same spec digest (:func:`spec_digest`) and model-file checks
(:func:`check_final_parameters`) as the SDK, through these names. This package never
imports Django, and imports JAX or torch only when a proof of that backend is made.
"""

from __future__ import annotations

from dvbench._client import DEFAULT_TIMEOUT, Client
from dvbench._exceptions import (
    APIError,
    AuthenticationError,
    BadRequestError,
    CertificateFailedError,
    ConfigurationError,
    ConflictError,
    DVBenchError,
    NetworkError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    ServerError,
    UploadError,
)
from dvbench._experiment import SPEC_SCHEMA, Experiment, default_spec, spec_digest, spec_document
from dvbench._model import (
    MODEL_DIR,
    MODEL_FILE,
    PUBLIC_KEY_FILE,
    SIGNATURE_FILE,
    ModelMismatchError,
    SafetensorsError,
    SavedModel,
    check_final_parameters,
)
from dvbench._proof import DVBenchProof
from dvbench._result import SyncResult
from dvbench._verdict import Verdict

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "MODEL_DIR",
    "MODEL_FILE",
    "PUBLIC_KEY_FILE",
    "SIGNATURE_FILE",
    "SPEC_SCHEMA",
    "APIError",
    "AuthenticationError",
    "BadRequestError",
    "CertificateFailedError",
    "Client",
    "ConfigurationError",
    "ConflictError",
    "DVBenchError",
    "DVBenchProof",
    "Experiment",
    "ModelMismatchError",
    "NetworkError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "SafetensorsError",
    "SavedModel",
    "ServerError",
    "SyncResult",
    "UploadError",
    "Verdict",
    "__version__",
    "check_final_parameters",
    "default_spec",
    "spec_digest",
    "spec_document",
]
