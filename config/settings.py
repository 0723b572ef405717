"""DVBench platform settings, read from the environment.

With nothing set, the platform runs on embedded defaults: SQLite and local files under
``DVBENCH_DATA_DIR`` and Celery tasks executed in-process. With ``DATABASE_URL`` and
``REDIS_URL`` set it runs on PostgreSQL with a Redis broker and real Celery workers.
Every variable is documented in the README's configuration reference; a value that
cannot be understood raises ``ImproperlyConfigured`` naming the variable.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from decimal import Decimal
from pathlib import Path
from typing import Any, TypedDict

from django.core.exceptions import ImproperlyConfigured

from config.env import (
    check_redis_url,
    envbool,
    envchoice,
    envfloat,
    envint,
    envlist,
    envrate,
    envstr,
    parse_database_url,
)

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(envstr("DVBENCH_DATA_DIR", str(BASE_DIR / ".data"))).resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)


def _secret_key() -> str:
    configured = envstr("DJANGO_SECRET_KEY")
    if configured:
        if len(configured) < 32:
            raise ImproperlyConfigured("DJANGO_SECRET_KEY must be at least 32 characters")
        return configured
    # Embedded default: a key generated once and kept, user-readable only, beside the
    # data it protects. It never lives in the repository.
    path = DATA_DIR / "secret_key"
    if not path.exists():
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_urlsafe(50))
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = envbool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = envlist("DJANGO_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = envlist("DJANGO_CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    # The platform: one app per domain noun under attestations/ (README, "Layout"), in
    # the order of their foreign keys. The `demo` command is the reports app's, the top
    # floor's.
    "attestations.audit",
    "attestations.accounts",
    "attestations.experiments",
    "attestations.uploads",
    "attestations.proofs",
    "attestations.challenges",
    "attestations.certificates",
    "attestations.reports",
    "attestations.workers",
]

MIDDLEWARE = [
    "attestations.http.middleware.RequestIDMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "attestations.http.middleware.SecurityHeadersMiddleware",
    "attestations.http.middleware.PrivateCacheMiddleware",
    "attestations.http.middleware.LoginRateLimitMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
            # The web pages' filters: attestations.web is not an app, so its library is
            # named here (the auditors' report's filters are the reports app's own).
            "libraries": {"dvbench": "attestations.web.filters"},
        },
    },
]

# --- Database -------------------------------------------------------------------------
_database_url = envstr("DATABASE_URL")
if _database_url:
    DATABASES = {"default": parse_database_url("DATABASE_URL", _database_url).as_django()}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": DATA_DIR / "db.sqlite3",
            # The in-process task runner and the web server share the file.
            "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Celery ---------------------------------------------------------------------------
_redis_url = envstr("REDIS_URL")
if _redis_url:
    check_redis_url("REDIS_URL", _redis_url)
CELERY_BROKER_URL = _redis_url or "memory://"
CELERY_RESULT_BACKEND = _redis_url or "cache+memory://"
# Without a broker every task runs in the calling process, so the embedded demo needs
# no worker. DVBENCH_EAGER_TASKS=0 forces a worker even then (for tests of the worker).
CELERY_TASK_ALWAYS_EAGER = envbool("DVBENCH_EAGER_TASKS", not _redis_url)
CELERY_TASK_EAGER_PROPAGATES = True
# The longest job is a replay; the broker must not redeliver a message to a second
# worker while the first still holds it, so the visibility timeout exceeds the hard limit.
CELERY_TASK_TIME_LIMIT = envint("DVBENCH_TASK_TIME_LIMIT", 3600, minimum=10)
# The soft limit leaves a task a quarter of its limit, at most 60 s, to record why it
# stopped. (It was the limit less 60 s, at least 5: every limit up to 65 s then gave
# 5 s, and the replay's sandbox 5 s less than that, too little for a Torch child to
# start on a loaded machine.)
CELERY_TASK_SOFT_TIME_LIMIT = CELERY_TASK_TIME_LIMIT - min(60, CELERY_TASK_TIME_LIMIT // 4)
# A message a killed worker held comes back after the visibility timeout; every worker
# sweeps for such messages every few seconds (kombu's default is ~100 s between scans).
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": CELERY_TASK_TIME_LIMIT * 2,
    "unacked_restore_interval": max(1, min(10, CELERY_TASK_TIME_LIMIT // 4)),
    "unacked_restore_throttle": 1,
}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Memory. A pool child whose resident memory is past DVBENCH_WORKER_MAX_RSS_MB once a task
# is done is replaced before the next (Celery counts KiB; 0: never). And, where set,
# DVBENCH_WORKER_MEMORY_LIMIT_MB caps each pool child's address space (RLIMIT_AS, set by
# config/celery_app.py as the child starts), so a task that would take the machine's
# memory fails with MemoryError instead. Off by default: a replay of a large block needs
# what it needs, and the operator knows the machine (docs/operators.md). The web
# workers' cap is gunicorn's (platform/gunicorn.conf.py, DVBENCH_WEB_MEMORY_LIMIT_MB).
CELERY_WORKER_MAX_MEMORY_PER_CHILD = envint("DVBENCH_WORKER_MAX_RSS_MB", 4096, minimum=0) * 1024
DVBENCH_WORKER_MEMORY_LIMIT_MB = envint("DVBENCH_WORKER_MEMORY_LIMIT_MB", 0, minimum=0)
CELERY_TASK_ACKS_LATE = False  # opted into per task, only where the task is idempotent
CELERY_TASK_REJECT_ON_WORKER_LOST = False
# On a lost broker connection a running task finishes the work it claimed; the copy the
# broker redelivers finds the claim taken and returns. (Celery 6 flips this default.)
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_TASK_DEFAULT_QUEUE = "ingest"
# A proof still pending this long after it was filed has lost its ingest message.
DVBENCH_INGEST_REQUEUE_SECONDS = envint("DVBENCH_INGEST_REQUEUE_SECONDS", 900, minimum=0)
# Replay tasks default to the CPU replay queue; a sender that knows the run's platform kind
# names its queue (attestations.challenges.routing), and an operator names it for presence.
CELERY_TASK_ROUTES = {
    "attestations.challenges.tasks.replay_*": {"queue": "replay"},
    "attestations.workers.tasks.replay_presence": {"queue": "replay"},
}
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_EXPIRES = 24 * 3600
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Periodic tasks (celery beat): expire replay challenges left unanswered past their deadline.
CELERY_BEAT_SCHEDULE = {
    "expire-challenges": {
        "task": "attestations.challenges.tasks.expire_challenges",
        "schedule": 300.0,
    },
    "expire-uploads": {"task": "attestations.uploads.tasks.expire_uploads", "schedule": 3600.0},
    # Re-send ingest for proofs whose message was lost (attestations.proofs.tasks).
    "requeue-stale-ingests": {
        "task": "attestations.proofs.tasks.requeue_stale_ingests",
        "schedule": 300.0,
    },
}

# --- Storage --------------------------------------------------------------------------
MEDIA_ROOT = DATA_DIR / "media"
MEDIA_URL = "/media/"
STATIC_ROOT = DATA_DIR / "static"
# WhiteNoise warns on every start when the folder is missing; collectstatic fills it.
STATIC_ROOT.mkdir(exist_ok=True)
STATIC_URL = "/static/"
STATICFILES_DIRS = (
    [BASE_DIR / "attestations" / "static"]
    if (BASE_DIR / "attestations" / "static").exists()
    else []
)

_s3_bucket = envstr("DVBENCH_S3_BUCKET")
if _s3_bucket:
    _default_storage: dict[str, object] = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": _s3_bucket,
            "endpoint_url": envstr("DVBENCH_S3_ENDPOINT_URL") or None,
            "region_name": envstr("DVBENCH_S3_REGION") or None,
            "default_acl": None,
            "file_overwrite": False,
        },
    }
else:
    _default_storage = {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(MEDIA_ROOT), "file_permissions_mode": 0o600},
    }
STORAGES = {
    "default": _default_storage,
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True


# --- DVBench --------------------------------------------------------------------------
#: Compute thresholds every certificate states its run against (at or below, or above).
#: The EU AI Act presumes a model general-purpose above 10^23 FLOP of training compute
#: (the Commission's guidelines, 2025) and of systemic risk above 10^25 FLOP (Art. 51(2)).
DEFAULT_REGULATORY_THRESHOLDS: list[dict[str, Any]] = [
    {
        "name": "eu-ai-act-gpai",
        "flops": 10**23,
        "description": "EU AI Act: general-purpose AI model presumption (training compute "
        "above 10^23 FLOP)",
    },
    {
        "name": "eu-ai-act-systemic-risk",
        "flops": 10**25,
        "description": "EU AI Act Art. 51(2): systemic-risk presumption (training compute "
        "above 10^25 FLOP)",
    },
    {
        "name": "us-frontier-model",
        "flops": 10**26,
        "description": "California SB 53 (signed 29 Sep 2025) and New York's RAISE Act: "
        "frontier model (more than 10^26 integer or floating-point operations, fine-tuning "
        "and reinforcement learning included; this certificate counts this run's and its "
        "declared parent runs')",
        "counts": "lineage",
    },
]


def regulatory_thresholds(name: str = "DVBENCH_REGULATORY_THRESHOLDS") -> list[dict[str, Any]]:
    """The thresholds from a JSON list of ``{"name", "flops", "description", "counts"}``,
    else the default.

    Names are lowercase slugs (the regulator API filters by them), unique; ``flops`` is a
    positive number of FLOPs (``1e25`` or ``10000000000000000000000000``); ``counts`` is
    ``run`` (the default: the certified run's compute) or ``lineage`` (the run's and its
    declared parent runs', for laws that count fine-tuning and RL toward one figure).
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return DEFAULT_REGULATORY_THRESHOLDS
    try:
        # Decimal: 1e25 must mean exactly 10**25, which no binary float is.
        items = json.loads(raw, parse_float=Decimal)
    except ValueError as error:
        raise ImproperlyConfigured(f"{name} is not JSON: {error}") from None
    if not isinstance(items, list):
        raise ImproperlyConfigured(f'{name} must be a JSON list of {{"name", "flops"}} objects')
    seen: set[str] = set()
    parsed: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"{name}[{index}]"
        if not isinstance(item, dict) or not set(item) <= {
            "name",
            "flops",
            "description",
            "counts",
        }:
            raise ImproperlyConfigured(
                f"{where} must be an object with name, flops, description, counts"
            )
        slug, flops = item.get("name"), item.get("flops")
        if not isinstance(slug, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", slug):
            raise ImproperlyConfigured(f"{where}.name={slug!r} must be a lowercase slug")
        if slug in seen:
            raise ImproperlyConfigured(f"{where}.name={slug!r} is given twice")
        seen.add(slug)
        if isinstance(flops, bool) or not isinstance(flops, int | Decimal) or not flops > 0:
            raise ImproperlyConfigured(f"{where}.flops={flops!r} must be a positive number")
        if isinstance(flops, Decimal) and (not flops.is_finite() or flops != int(flops)):
            raise ImproperlyConfigured(f"{where}.flops={flops} must be a whole number of FLOPs")
        counts = item.get("counts", "run")
        if counts not in ("run", "lineage"):
            raise ImproperlyConfigured(f'{where}.counts={counts!r} must be "run" or "lineage"')
        parsed.append(
            {
                "name": slug,
                "flops": int(flops),
                "description": str(item.get("description", "")),
                "counts": counts,
            }
        )
    return parsed


def challenge_key_text() -> str:
    """``DVBENCH_CHALLENGE_KEY``: hex of at least 32 bytes, or empty (checked at start-up)."""
    text = envstr("DVBENCH_CHALLENGE_KEY").strip()
    if text and (not re.fullmatch(r"(?:[0-9a-fA-F]{2}){32,}", text)):
        raise ImproperlyConfigured(
            f"DVBENCH_CHALLENGE_KEY must be hex of at least 32 bytes (64 hex digits), "
            f"got {len(text)} characters"
        )
    return text


def platform_kinds(name: str, default: list[str]) -> list[str]:
    """A comma-separated list of platform kinds (``zkdv.environments.PLATFORM_KINDS``)."""
    from zkdv.environments import PLATFORM_KINDS

    kinds = envlist(name, default)
    unknown = [kind for kind in kinds if kind not in PLATFORM_KINDS]
    if unknown:
        raise ImproperlyConfigured(
            f"{name}: {', '.join(map(repr, unknown))} is not a platform kind; "
            f"expected some of {', '.join(PLATFORM_KINDS)}"
        )
    return kinds


class DVBenchSettings(TypedDict):
    """The platform's own knobs, read as ``settings.DVBENCH["NAME"]`` with these types."""

    DATA_DIR: Path
    MAX_BLOB_BYTES: int
    MAX_PART_BYTES: int
    UPLOAD_TTL_SECONDS: int
    S3_DIRECT_UPLOADS: bool
    S3_PRESIGN_SECONDS: int
    S3_PUBLIC_ENDPOINT_URL: str
    S3_COPY_MAX_BYTES: int
    API_KEY_TTL_DAYS: int
    API_KEY_MAX_DAYS: int
    SUDO_SECONDS: int
    SIGNING_KEY_FILE: str
    SIGNING_KEY: str
    CHALLENGE_KEY_FILE: str
    CHALLENGE_KEY: str
    VERIFIER_ID: str
    LOG_ORIGIN: str
    DETECTION_TARGET: float
    FORGED_FRACTION: float
    CHALLENGE_TTL_SECONDS: int
    SLICED_CHALLENGES: int
    SLICED_OPENED: int
    SLICED_STORE_ENDPOINTS: list[str]
    REQUIRE_PROGRAM: bool
    REGULATORY_THRESHOLDS: list[dict[str, Any]]
    MAX_PROOFS_PER_EXPERIMENT: int
    INVITATION_TTL_DAYS: int
    REPLAY_IN_PROCESS_KINDS: list[str]
    REPLAY_CROSS_KIND: list[str]
    REPLAY_WORKER_TTL: int


DVBENCH: DVBenchSettings = {
    "DATA_DIR": DATA_DIR,
    "MAX_BLOB_BYTES": envint("DVBENCH_MAX_BLOB_BYTES", 8 * 1024**3, minimum=1024),
    "MAX_PART_BYTES": envint("DVBENCH_MAX_PART_BYTES", 64 * 1024**2, minimum=1024),
    "UPLOAD_TTL_SECONDS": envint("DVBENCH_UPLOAD_TTL_SECONDS", 7 * 24 * 3600, minimum=60),
    # With S3 storage, clients PUT parts to presigned S3 URLs and the web server never
    # proxies the bytes (attestations/uploads/s3.py); off: parts go through the API.
    "S3_DIRECT_UPLOADS": envbool("DVBENCH_S3_DIRECT_UPLOADS", True),
    # Lifetime of a presigned part URL: long enough to send one part, no longer.
    "S3_PRESIGN_SECONDS": envint("DVBENCH_S3_PRESIGN_SECONDS", 900, minimum=10),
    # The S3 endpoint as the training machines reach it, when not as the platform does
    # (compose's http://minio:9000 is not a name outside compose): presigned URLs use it.
    "S3_PUBLIC_ENDPOINT_URL": envstr("DVBENCH_S3_PUBLIC_ENDPOINT_URL"),
    # Largest object whose SHA-256 S3 computes in one server-side copy (S3's own limit is
    # 5 GiB); a larger one is streamed once from S3 and hashed by the worker.
    "S3_COPY_MAX_BYTES": envint("DVBENCH_S3_COPY_MAX_BYTES", 5 * 1024**3, minimum=1),
    "API_KEY_TTL_DAYS": envint("DVBENCH_API_KEY_TTL_DAYS", 90, minimum=1),
    # No key lives longer than this, whoever asks (a longer `days` is a 400).
    "API_KEY_MAX_DAYS": envint("DVBENCH_API_KEY_MAX_DAYS", 365, minimum=1),
    # How long a password confirmation ("sudo mode") lets a signed-in session create
    # API keys; a key itself never can (attestations/http/sudo.py).
    "SUDO_SECONDS": envint("DVBENCH_SUDO_SECONDS", 600, minimum=30),
    "SIGNING_KEY_FILE": envstr("DVBENCH_SIGNING_KEY_FILE"),
    "SIGNING_KEY": envstr("DVBENCH_SIGNING_KEY"),
    # The platform-wide key challenge seeds derive from (attestations/challenges/secret.py):
    # a file (a mounted secret) or hex text; with neither, generated under DATA_DIR/keys.
    "CHALLENGE_KEY_FILE": envstr("DVBENCH_CHALLENGE_KEY_FILE"),
    "CHALLENGE_KEY": challenge_key_text(),
    "VERIFIER_ID": envstr("DVBENCH_VERIFIER_ID", "https://dvbench.localhost"),
    "LOG_ORIGIN": envstr("DVBENCH_LOG_ORIGIN"),
    "DETECTION_TARGET": envfloat("DVBENCH_DETECTION_TARGET", 0.95, minimum=0.0, maximum=1.0),
    "FORGED_FRACTION": envfloat("DVBENCH_FORGED_FRACTION", 0.01, minimum=0.0, maximum=1.0),
    "CHALLENGE_TTL_SECONDS": envint("DVBENCH_CHALLENGE_TTL_SECONDS", 24 * 3600, minimum=60),
    # Sliced challenges (docs/scale.md): how many a run faces (0: the policy's count, for
    # the detection target at the forged fraction) and how many sequences each opens.
    "SLICED_CHALLENGES": envint("DVBENCH_SLICED_CHALLENGES", 0, minimum=0),
    "SLICED_OPENED": envint("DVBENCH_SLICED_OPENED", 4, minimum=1),
    # The labs' object stores (S3 endpoint URLs) the platform may read a slice from
    # through a lab's grant; none by default, so no lab can make the platform fetch a URL.
    "SLICED_STORE_ENDPOINTS": [
        e.rstrip("/") for e in envlist("DVBENCH_SLICED_STORE_ENDPOINTS", [])
    ],
    "REQUIRE_PROGRAM": envbool("DVBENCH_REQUIRE_PROGRAM", True),
    "REGULATORY_THRESHOLDS": regulatory_thresholds(),
    # Every transcript filed for an experiment stays on its record; past this many (not
    # counting the platform's own verifier errors) a new one is refused (docs/provers.md).
    "MAX_PROOFS_PER_EXPERIMENT": envint("DVBENCH_MAX_PROOFS_PER_EXPERIMENT", 10, minimum=1),
    "INVITATION_TTL_DAYS": envint("DVBENCH_INVITATION_TTL_DAYS", 14, minimum=1),
    # Replay routing (docs/operators.md, "Replay queues"): the platform kinds whose runs
    # the calling process replays itself when tasks run in-process (this machine's kind);
    # the kinds whose runs may be replayed on CPU workers, judged within the gradient
    # bounds, when no worker of their own kind is alive (none by default: a CPU is no
    # sound replay platform for a TPU or GPU run); and how long a worker counts as alive
    # after it was last seen (a replay may hold it for a whole task time limit).
    "REPLAY_IN_PROCESS_KINDS": platform_kinds("DVBENCH_REPLAY_IN_PROCESS_KINDS", ["cpu"]),
    "REPLAY_CROSS_KIND": platform_kinds("DVBENCH_REPLAY_CROSS_KIND", []),
    "REPLAY_WORKER_TTL": envint(
        "DVBENCH_REPLAY_WORKER_TTL", 2 * CELERY_TASK_TIME_LIMIT, minimum=60
    ),
}
if DVBENCH["API_KEY_TTL_DAYS"] > DVBENCH["API_KEY_MAX_DAYS"]:
    raise ImproperlyConfigured(
        f"DVBENCH_API_KEY_TTL_DAYS ({DVBENCH['API_KEY_TTL_DAYS']}) must not exceed "
        f"DVBENCH_API_KEY_MAX_DAYS ({DVBENCH['API_KEY_MAX_DAYS']})"
    )
# Request bodies (upload parts) are streamed, but Django still caps what it will read
# into memory for ordinary forms.
DATA_UPLOAD_MAX_MEMORY_SIZE = DVBENCH["MAX_PART_BYTES"] + 1024 * 1024
FILE_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024

# --- Auth, API ------------------------------------------------------------------------
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Personal API keys for the SDK and scripts; the browser session for the web UI
        # (which also enforces CSRF on unsafe methods).
        "attestations.http.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "attestations.http.pagination.CursorPage",
    # Every generic view's queryset goes through QueryFilters, which refuses a query
    # parameter the view does not read (400 unknown_filter): a list cannot forget it.
    "DEFAULT_FILTER_BACKENDS": ["attestations.http.filters.QueryFilters"],
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    # DRF's JSON parser with a bound on nesting (a 100,000-deep body is a 400, not a 500).
    "DEFAULT_PARSER_CLASSES": ["attestations.http.parsers.JSONParser"],
    "EXCEPTION_HANDLER": "attestations.http.exceptions.exception_handler",
    "PAGE_SIZE": 50,
    # Limits only the upload endpoints (it ignores every other view); rates below.
    "DEFAULT_THROTTLE_CLASSES": ["attestations.http.throttling.UploadRateThrottle"],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "DVBench API",
    "DESCRIPTION": (
        "Verifiable-training transcripts, replay challenges and signed attestations. "
        "Authenticate with `Authorization: Bearer <api key>`. Every error has the body "
        '`{"error": {"code", "message", "field", "detail"}, "request_id"}` and every '
        "response carries `X-Request-ID`."
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI and ReDoc assets come from drf-spectacular-sidecar, served by us: the
    # docs work on a machine with no route to a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": ["attestations.http.schema.add_error_responses"],
    "ENUM_NAME_OVERRIDES": {
        "RoleEnum": "attestations.accounts.models.Role",
        "LabRoleEnum": "attestations.accounts.models.LAB_ROLE_CHOICES",
        "ArtifactKindEnum": "attestations.uploads.models.ArtifactKind",
        "OrganizationKindEnum": "attestations.accounts.models.OrganizationKind",
    },
}

# --- Cache (rate-limit counters) -------------------------------------------------------
# Redis when configured, so every gunicorn worker and host counts against one limit.
# Without Redis, files under the data directory with an flock around every counter update
# (attestations/core/cache.py): every worker on this host shares them, so a limit is the limit
# whatever the number of workers. Several hosts need Redis.
if _redis_url:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": envstr("DVBENCH_CACHE_URL", _redis_url),
            "KEY_PREFIX": "dvbench",
        }
    }
else:
    CACHES = {
        "default": {
            "BACKEND": "attestations.core.cache.SharedFileCache",
            "LOCATION": str(DATA_DIR / "cache"),
            "KEY_PREFIX": "dvbench",
        }
    }

# --- Security -------------------------------------------------------------------------
SECURE_SSL_REDIRECT = envbool("DVBENCH_SSL_REDIRECT", False)
SECURE_HSTS_SECONDS = envint("DVBENCH_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = envbool("DVBENCH_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = envbool("DVBENCH_HSTS_PRELOAD", False)
_behind_proxy = envbool("DVBENCH_BEHIND_PROXY", False)
if _behind_proxy:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# Cookies are Secure whenever the deployment says it is served over TLS (a TLS-terminating
# proxy, an HTTPS redirect or HSTS); DVBENCH_SECURE_COOKIES overrides either way. The
# embedded default serves plain http://localhost, where a Secure cookie would never come
# back and sign-in would fail.
_secure = envbool(
    "DVBENCH_SECURE_COOKIES", _behind_proxy or SECURE_SSL_REDIRECT or SECURE_HSTS_SECONDS > 0
)
SESSION_COOKIE_SECURE = _secure
CSRF_COOKIE_SECURE = _secure
SESSION_COOKIE_HTTPONLY = True
# Forms carry the token; no script needs to read the cookie.
CSRF_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_AGE = envint("DVBENCH_SESSION_SECONDS", 12 * 3600, minimum=300)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
# Set by attestations.http.middleware.SecurityHeadersMiddleware. Scripts come only from files
# of this origin: no page has an inline script or event handler (app.js binds behaviour
# from data- attributes; Swagger UI's start-up script is served as a file, ReDoc starts
# from its element), so an injected <script> or onclick= never runs. Styles keep
# 'unsafe-inline': progress bars set their width inline and ReDoc injects <style>
# elements; CSS cannot run script. ReDoc needs blob: workers.
DVBENCH_CONTENT_SECURITY_POLICY = envstr(
    "DVBENCH_CONTENT_SECURITY_POLICY",
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; worker-src 'self' blob:; object-src 'none'; base-uri 'self'; "
    "form-action 'self'; frame-ancestors 'none'",
)
DVBENCH_PERMISSIONS_POLICY = "camera=(), microphone=(), geolocation=(), payment=()"
# Rate limits (attestations/http/throttling.py): "<count>/<second|minute|hour|day>"; "off"
# disables one. Counters live in the cache above.
DVBENCH_RATE_LIMITS: dict[str, str | None] = {
    "uploads": envrate("DVBENCH_RATE_UPLOADS", "1200/minute"),
    "api_key_failures": envrate("DVBENCH_RATE_API_KEY_FAILURES", "60/minute"),
    "login_failures": envrate("DVBENCH_RATE_LOGIN_FAILURES", "10/minute"),
}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {
        "handlers": ["console"],
        "level": envchoice("DVBENCH_LOG_LEVEL", "INFO", _LOG_LEVELS),
    },
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
