"""Settings read from the environment, and the credentials file of ``dvbench login``.

Every knob has an environment variable (documented in ``docs/sdk.md``); a value that
cannot be parsed raises :class:`~dvbench.ConfigurationError` naming the variable, rather
than silently falling back to a default.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from dvbench._exceptions import ConfigurationError

__all__ = [
    "Settings",
    "cache_dir",
    "config_dir",
    "credentials_path",
    "read_credentials",
    "write_credentials",
]

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
MODES = ("online", "offline")


def _env_float(name: str, default: float, *, minimum: float = 0.0) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not a number") from None
    if value < minimum:
        raise ConfigurationError(f"{name}={raw!r} must be at least {minimum:g}")
    return value


def _env_int(name: str, default: int, *, minimum: int = 0) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not a whole number") from None
    if value < minimum:
        raise ConfigurationError(f"{name}={raw!r} must be at least {minimum}")
    return value


@dataclass(frozen=True)
class Settings:
    """Network and upload settings, from ``DVBENCH_*`` variables or their defaults.

    Attributes:
        timeout: seconds to wait for the platform to answer a request (``DVBENCH_TIMEOUT``).
        connect_timeout: seconds to open a connection (``DVBENCH_CONNECT_TIMEOUT``).
        max_retries: retries of a failed request (``DVBENCH_MAX_RETRIES``); 0 disables.
        backoff: first retry delay in seconds, doubled each retry (``DVBENCH_RETRY_BACKOFF``).
        max_backoff: ceiling on one retry delay, Retry-After included
            (``DVBENCH_RETRY_MAX_DELAY``).
        part_size: bytes per upload part (``DVBENCH_PART_SIZE``), capped by the platform.
        scan_interval: seconds between scans for new snapshot and batch files while
            training (``DVBENCH_UPLOAD_INTERVAL``).
        concurrency: files uploaded at once (``DVBENCH_UPLOAD_CONCURRENCY``).
        parallel: parts of one file in flight at once (``DVBENCH_UPLOAD_PARALLEL``).
            Unset, it follows where the parts go: 1 to the platform, which writes parts
            sent in order into place and completes the file by a rename (and a killed
            process has sent parts 1..k and lost at most one); 4 straight to object
            storage (a direct upload), which joins the parts itself and whose rate per
            connection is what bounds a large file. Parts are streamed from the file, so
            memory grows with neither the part size nor the file size.
        mode: ``online`` or ``offline`` (``DVBENCH_MODE``).
        upload_files: which snapshot and batch files leave the lab
            (``DVBENCH_UPLOAD_FILES``): ``challenged`` (default) sends only those the
            platform's challenges ask for, after the transcript is filed; ``all`` sends
            every one, in the background while training.
        challenge_wait: seconds to wait for the platform to verify the transcript and
            draw its challenges before answering them (``DVBENCH_CHALLENGE_WAIT``).
    """

    timeout: float = 60.0
    connect_timeout: float = 10.0
    max_retries: int = 5
    backoff: float = 0.5
    max_backoff: float = 30.0
    part_size: int = 8 * 1024 * 1024
    scan_interval: float = 5.0
    concurrency: int = 4
    parallel: int | None = None
    mode: str = "online"
    upload_files: str = "challenged"
    challenge_wait: float = 600.0

    @classmethod
    def from_env(cls) -> Settings:
        mode = os.environ.get("DVBENCH_MODE", "online").strip().lower() or "online"
        if mode not in MODES:
            raise ConfigurationError(f"DVBENCH_MODE={mode!r} must be one of {', '.join(MODES)}")
        return cls(
            timeout=_env_float("DVBENCH_TIMEOUT", cls.timeout, minimum=0.001),
            connect_timeout=_env_float(
                "DVBENCH_CONNECT_TIMEOUT", cls.connect_timeout, minimum=0.001
            ),
            max_retries=_env_int("DVBENCH_MAX_RETRIES", cls.max_retries),
            backoff=_env_float("DVBENCH_RETRY_BACKOFF", cls.backoff),
            max_backoff=_env_float("DVBENCH_RETRY_MAX_DELAY", cls.max_backoff),
            part_size=_env_int("DVBENCH_PART_SIZE", cls.part_size, minimum=1024),
            scan_interval=_env_float("DVBENCH_UPLOAD_INTERVAL", cls.scan_interval, minimum=0.01),
            concurrency=_env_int("DVBENCH_UPLOAD_CONCURRENCY", cls.concurrency, minimum=1),
            parallel=_env_int("DVBENCH_UPLOAD_PARALLEL", 0, minimum=1) or None,
            mode=mode,
            upload_files=_upload_files(),
            challenge_wait=_env_float("DVBENCH_CHALLENGE_WAIT", cls.challenge_wait, minimum=0.0),
        )

    @property
    def offline(self) -> bool:
        return self.mode == "offline"


UPLOAD_FILES = ("challenged", "all")


def _upload_files() -> str:
    value = os.environ.get("DVBENCH_UPLOAD_FILES", "challenged").strip().lower() or "challenged"
    if value not in UPLOAD_FILES:
        raise ConfigurationError(
            f"DVBENCH_UPLOAD_FILES={value!r} must be one of {', '.join(UPLOAD_FILES)}"
        )
    return value


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/dvbench``, else ``~/.config/dvbench``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dvbench"


def cache_dir() -> Path:
    """Where proofs wait for upload: ``$DVBENCH_CACHE_DIR``, ``$XDG_CACHE_HOME/dvbench``
    or ``~/.cache/dvbench``."""
    explicit = os.environ.get("DVBENCH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dvbench"


def credentials_path() -> Path:
    return config_dir() / "credentials"


def read_credentials() -> dict[str, str]:
    """The stored ``{"api_key", "base_url"}`` of ``dvbench login`` (empty if none)."""
    path = credentials_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise ConfigurationError(
            f"cannot read {path}: {error}; run `dvbench login` again"
        ) from None
    if not isinstance(data, dict):
        raise ConfigurationError(f"{path} is not a JSON object; run `dvbench login` again")
    return {str(k): str(v) for k, v in data.items() if isinstance(v, str)}


def write_credentials(api_key: str, base_url: str | None) -> Path:
    """Store the key (and base URL) readable by the user only (mode 0600)."""
    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = {"api_key": api_key}
    if base_url:
        data["base_url"] = base_url
    temporary = path.with_name(path.name + ".tmp")
    # Created 0600 from the start: the key is never readable by others, not even briefly.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(data, handle)
    os.chmod(temporary, stat.S_IRUSR | stat.S_IWUSR)
    os.replace(temporary, path)
    return path
