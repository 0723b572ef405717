"""The DVBench client: one ``httpx.Client``, retries with backoff, errors by status."""

from __future__ import annotations

import email.utils
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from dvbench._config import DEFAULT_BASE_URL, Settings, read_credentials
from dvbench._exceptions import (
    APIError,
    ConfigurationError,
    DVBenchError,
    NetworkError,
    NotFoundError,
    PermissionDeniedError,
    error_class,
    from_response,
)
from dvbench._experiment import Experiment, check_name, default_spec
from dvbench._sync import sync_directory

if TYPE_CHECKING:
    from dvbench._result import SyncResult
    from dvbench._verdict import Verdict

__all__ = ["DEFAULT_TIMEOUT", "Client"]

log = logging.getLogger("dvbench")

#: Connect quickly or fail over to a retry; give the platform a minute to answer (a
#: transcript's completion verifies it before answering).
DEFAULT_TIMEOUT = httpx.Timeout(Settings.timeout, connect=Settings.connect_timeout)
API_PREFIX = "/api/v1"
#: 408 and 429 ask the client to come back; 5xx other than 501 (never implemented) may
#: pass on a second try: a restarting worker, an overloaded proxy.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
USER_AGENT = "dvbench-python/0.1.0"
FINAL_PROOF_STATUSES = ("valid", "rejected", "error")

_UNSET: Any = object()


def _normalise_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith(API_PREFIX):
        url = url[: -len(API_PREFIX)]
    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(
            f"base URL {url!r} must start with http:// or https:// (set DVBENCH_BASE_URL)"
        )
    return url


def _redacted(url: str) -> str:
    """A URL without its query: a presigned URL's query is its credential."""
    return url.split("?", 1)[0]


def _storage_error(response: httpx.Response) -> APIError:
    """The error of an object-storage answer (S3's XML ``<Code>`` and ``<Message>``)."""
    text = response.text[:2000]
    code = re.search(r"<Code>([^<]*)</Code>", text)
    message = re.search(r"<Message>([^<]*)</Message>", text)
    return error_class(response.status_code)(
        f"object storage refused the part: {message.group(1) if message else text[:200]} "
        f"(HTTP {response.status_code})",
        status_code=response.status_code,
        code=code.group(1) if code else None,
        response=response,
    )


def retry_after_seconds(response: httpx.Response) -> float | None:
    """The delay a ``Retry-After`` header asks for (seconds or an HTTP date), if any."""
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class Client:
    """A connection to a DVBench platform.

    Args:
        api_url: the platform's base URL (``https://dvbench.example.org``; an
            ``/api/v1`` suffix is accepted). Defaults to ``DVBENCH_BASE_URL``, then the
            URL stored by ``dvbench login``, then ``http://127.0.0.1:8000``.
        api_key: a personal API key (``dvb_…``). Defaults to ``DVBENCH_API_KEY``, then
            the key stored by ``dvbench login``.
        timeout: seconds (or an :class:`httpx.Timeout`) per request. Defaults to
            ``DVBENCH_TIMEOUT`` (60 s to answer) and ``DVBENCH_CONNECT_TIMEOUT`` (10 s).
        max_retries: retries of a request that failed to connect, timed out, or got 408,
            429 or 5xx. Defaults to ``DVBENCH_MAX_RETRIES`` (5).
        transport: an :class:`httpx.BaseTransport` to send requests through (tests of
            retry behaviour use :class:`httpx.MockTransport`).
        http_client: a ready :class:`httpx.Client` to use instead; the caller closes it.

    Use it as a context manager, or call :meth:`close`::

        with dvbench.Client() as client:
            experiment = client.experiment("acme/run-7")

    In offline mode (``DVBENCH_MODE=offline``) no request is ever sent; proofs stay on
    disk until ``dvbench sync``.
    """

    def __init__(
        self,
        api_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = None,
        max_retries: int | None = None,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        self.settings = Settings.from_env()
        stored: dict[str, str] | None = None

        def credentials() -> dict[str, str]:
            nonlocal stored
            if stored is None:
                stored = read_credentials()
            return stored

        url = api_url or os.environ.get("DVBENCH_BASE_URL") or credentials().get("base_url")
        self.base_url = _normalise_base_url(url or DEFAULT_BASE_URL)
        self._api_key = api_key or os.environ.get("DVBENCH_API_KEY") or credentials().get("api_key")
        if timeout is None:
            timeout = httpx.Timeout(self.settings.timeout, connect=self.settings.connect_timeout)
        elif not isinstance(timeout, httpx.Timeout):
            timeout = httpx.Timeout(float(timeout))
        self.timeout = timeout
        self.max_retries = self.settings.max_retries if max_retries is None else max_retries
        if self.max_retries < 0:
            raise ValueError(f"max_retries={max_retries!r} must be 0 or more")
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        self._owns_http = http_client is None
        if http_client is None:
            http_client = httpx.Client(
                base_url=self.base_url, timeout=timeout, transport=transport, headers=headers
            )
        else:
            http_client.headers.update(headers)
        self._http = http_client
        self._sleep: Callable[[float], None] = time.sleep
        # Presigned object-storage URLs of direct uploads: no API key, no base URL.
        self._storage_http: httpx.Client | None = None
        self._closed = False
        self._lock = threading.Lock()

    # --- lifecycle ----------------------------------------------------------------------
    @property
    def offline(self) -> bool:
        """Whether ``DVBENCH_MODE=offline``: nothing is sent, proofs wait for ``dvbench sync``."""
        return self.settings.offline

    @property
    def has_api_key(self) -> bool:
        return bool(self._api_key)

    def close(self) -> None:
        """Close the connection pool (a client passed in as ``http_client`` stays open)."""
        if not self._closed:
            self._closed = True
            if self._owns_http:
                self._http.close()
            if self._storage_http is not None:
                self._storage_http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = " offline" if self.offline else ""
        return f"<dvbench.Client {self.base_url}{mode}>"

    # --- HTTP ---------------------------------------------------------------------------
    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        if response is not None:
            asked = retry_after_seconds(response)
            if asked is not None:
                return min(asked, self.settings.max_backoff)
        # Exponential backoff with "equal jitter": never less than half the nominal
        # delay, so clients that failed together spread out without hammering again.
        nominal = min(float(self.settings.max_backoff), self.settings.backoff * 2.0**attempt)
        return nominal / 2 + random.uniform(0, nominal / 2)  # noqa: S311 - jitter, not crypto

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | Iterable[bytes] | None = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        retry: bool = True,
    ) -> httpx.Response:
        """Send a request under ``/api/v1`` (or an absolute path), retrying transient failures.

        Retries, with exponential backoff and jitter (honouring ``Retry-After``): failed
        connections, timeouts, dropped connections, and statuses 408, 429, 500, 502, 503
        and 504. Only idempotent requests should be sent with ``retry=True``; every
        request of this SDK is (uploads are content-addressed and parts replaceable).

        Returns:
            The successful response.

        Raises:
            APIError: a subclass by status (:class:`NotFoundError`, ...).
            NetworkError: no answer after every retry.
            DVBenchError: the client is offline or closed.
        """
        if self.offline:
            raise DVBenchError(
                "DVBENCH_MODE=offline: this client sends no requests; unset DVBENCH_MODE "
                "and run `dvbench sync DIR` to upload"
            )
        if self._closed:
            raise DVBenchError("this dvbench.Client is closed")
        # "experiments/" is under /api/v1; "/health" and the API's own absolute "next"
        # links are used as they are.
        url = path if path.startswith(("/", "http://", "https://")) else f"{API_PREFIX}/{path}"
        attempts = self.max_retries + 1 if retry else 1

        def send() -> httpx.Response:
            return self._http.request(
                method,
                url,
                json=json,
                content=content,
                params=params,
                headers=headers,
                timeout=timeout if timeout is not None else self.timeout,
            )

        return self._retrying(send, method, url, attempts, from_response, self.base_url)

    def _retrying(
        self,
        send: Callable[[], httpx.Response],
        method: str,
        url: str,
        attempts: int,
        error: Callable[[httpx.Response], APIError],
        where: str,
    ) -> httpx.Response:
        last_error: Exception | None = None
        for attempt in range(attempts):
            response: httpx.Response | None = None
            try:
                response = send()
            except httpx.TransportError as failure:
                # Connect and read timeouts, refused and reset connections, a proxy that
                # dropped the body half-way: all worth another try.
                last_error = failure
                reason = (
                    f"{type(failure).__name__}: {failure}"
                    if str(failure)
                    else type(failure).__name__
                )
            else:
                if response.status_code < 400:
                    return response
                if response.status_code not in RETRY_STATUSES:
                    raise error(response)
                last_error = error(response)
                reason = f"HTTP {response.status_code}"
            if attempt + 1 >= attempts:
                break
            delay = self._delay(attempt, response)
            log.warning(
                "dvbench: %s %s failed (%s); retry %d of %d in %.1f s",
                method,
                _redacted(url),
                reason,
                attempt + 1,
                attempts - 1,
                delay,
            )
            self._sleep(delay)
        if isinstance(last_error, APIError):
            raise last_error
        raise NetworkError(
            f"could not reach {where} ({method} {_redacted(url)}) after {attempts} attempt(s): "
            f"{last_error}; check DVBENCH_BASE_URL and your network, or set "
            "DVBENCH_MODE=offline and run `dvbench sync` later",
            attempts=attempts,
        ) from last_error

    def put_presigned(
        self, url: str, *, content: Iterable[bytes], headers: Mapping[str, str]
    ) -> httpx.Response:
        """PUT a body to a presigned object-storage URL (a part of a direct upload).

        Sent without the API key (the URL is the credential) on a connection pool of its
        own, and retried like :meth:`request`: ``content`` must be iterable again for
        each attempt.

        Raises:
            APIError: object storage refused it; ``code`` is its error code
                (``AccessDenied`` for a URL that expired, ``BadDigest``, ...).
            NetworkError: no answer after every retry.
        """
        with self._lock:
            if self._storage_http is None:
                self._storage_http = httpx.Client(
                    timeout=self.timeout, headers={"User-Agent": USER_AGENT}
                )
            storage = self._storage_http

        def send() -> httpx.Response:
            return storage.put(url, content=content, headers=dict(headers))

        host = httpx.URL(url).host
        return self._retrying(
            send, "PUT", url, self.max_retries + 1, _storage_error, f"object storage {host}"
        )

    def get(self, path: str, **kwargs: Any) -> Any:
        """GET and decode JSON (see :meth:`request`)."""
        return self.request("GET", path, **kwargs).json()

    def post(self, path: str, json: Any = None, **kwargs: Any) -> Any:
        """POST JSON and decode the JSON answer (see :meth:`request`)."""
        response = self.request("POST", path, json=json, **kwargs)
        return response.json() if response.content else None

    def paginate(self, path: str, params: Mapping[str, Any] | None = None) -> Iterator[Any]:
        """Every item of a cursor-paginated list, following ``next`` links."""
        query: dict[str, Any] = {"page_size": 200, **(params or {})}
        url: str | None = path
        while url is not None:
            page = self.get(url, params=query)
            query = {}  # the next link carries the query
            if isinstance(page, list):
                yield from page
                return
            yield from page.get("results", [])
            url = page.get("next")

    # --- identity -----------------------------------------------------------------------
    def me(self) -> dict[str, Any]:
        """Who the key belongs to, and its role in each organisation."""
        data: dict[str, Any] = self.get("me/")
        return data

    def health(self) -> dict[str, Any]:
        """The platform's ``/health`` report (it needs no key)."""
        if self.offline:
            raise DVBenchError("DVBENCH_MODE=offline: this client sends no requests")
        response = self._http.get("/health", timeout=self.timeout)
        try:
            data: dict[str, Any] = response.json()
        except ValueError:
            data = {"status": f"HTTP {response.status_code}"}
        data.setdefault("status_code", response.status_code)
        return data

    # --- experiments --------------------------------------------------------------------
    def experiments(self, *, owner: str | None = None) -> list[Experiment]:
        """The experiments this key can read (optionally of one organisation)."""

        params = {"owner": owner} if owner else None
        return [Experiment(self, item) for item in self.paginate("experiments/", params)]

    def experiment(
        self,
        name: str,
        *,
        spec: Mapping[str, Any] | None = None,
        framework: str | None = None,
        create: bool = True,
    ) -> Experiment:
        """The experiment ``owner/name``, registered if it does not exist yet.

        An experiment that is not registered is registered with ``spec`` (see
        :meth:`create_experiment`), or with the default spec of ``framework``; given
        neither, registration waits for :meth:`Experiment.proof`, which declares its
        backend as the framework and the rest of the spec as undeclared. Registering
        needs the trainer or admin role in the owning organisation.

        In offline mode nothing is asked: the experiment is described from the cache of
        a previous online lookup, or from ``spec``, and registered by ``dvbench sync``.

        Args:
            name: ``owner/name`` (owner is the organisation's slug).
            spec: the declared spec used if the experiment must be registered.
            framework: ``"jax"`` or ``"torch"``: register at once with the default spec.
            create: register a missing experiment; with False, a missing one raises.

        Raises:
            NotFoundError: the experiment does not exist (``create=False``) or belongs
                to an organisation this key cannot see.
            PermissionDeniedError: it does not exist and this key may not register it.
        """

        check_name(name)
        if spec is None and framework is not None:
            spec = default_spec(framework)
        if self.offline:
            return Experiment.offline(self, name, spec)
        try:
            data = self.get(f"experiments/{name}/")
        except NotFoundError as error:
            if not create:
                raise
            experiment = Experiment.unregistered(self, name, spec, error)
            if spec is not None:
                experiment.register()
            return experiment
        experiment = Experiment(self, data)
        experiment.remember()
        return experiment

    def create_experiment(
        self, name: str, spec: Mapping[str, Any] | None = None, *, framework: str = "jax"
    ) -> Experiment:
        """Register ``owner/name`` with ``spec`` (the default spec for ``framework`` if None).

        Raises:
            BadRequestError: the spec is invalid (``field`` says which part).
            ConflictError: already registered (``exists``).
            NotFoundError: no organisation by that slug that this key can see.
            PermissionDeniedError: this key's role may not register experiments there.
        """

        check_name(name)
        body = {"name": name, "spec": dict(spec) if spec is not None else default_spec(framework)}
        try:
            data = self.post("experiments/", body)
        except PermissionDeniedError as error:
            owner = name.partition("/")[0]
            error.message += (
                f" Registering {name} needs the trainer or admin role in {owner!r}: ask an "
                "admin to register it, or to give your account that role."
            )
            error.args = (f"{error.status_code} {error.code}: {error.message}",)
            raise
        experiment = Experiment(self, data)
        experiment.remember()
        return experiment

    def revise_spec(self, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Declare ``spec`` for ``owner/name``: a new version once a proof names the current
        one, else the current version changed in place. Returns the version (``version``,
        ``digest``, ``frozen`` and the declared fields); runs started afterwards name it.

        Raises:
            BadRequestError: the spec is invalid (``field`` says which part).
            NotFoundError: no such experiment visible to this key.
            PermissionDeniedError: this key's role may not change it.
        """

        check_name(name)
        data: dict[str, Any] = self.post(f"experiments/{name}/specs/", dict(spec))
        return data

    # --- proofs and sync ----------------------------------------------------------------
    def get_proof(self, proof_id: int) -> dict[str, Any]:
        """A filed proof and its verdict (``status``: pending, verifying, valid, ...)."""
        data: dict[str, Any] = self.get(f"proofs/{int(proof_id)}/")
        return data

    def wait_for_proof(
        self, proof_id: int, *, timeout: float = 600.0, interval: float = 2.0
    ) -> dict[str, Any]:
        """Poll a filed proof until its verdict is in (``valid``, ``rejected`` or ``error``).

        Raises:
            TimeoutError: no verdict after ``timeout`` seconds (the proof is still queued
                or verifying; ask again later).
        """
        deadline = time.monotonic() + timeout
        while True:
            proof = self.get_proof(proof_id)
            if proof.get("status") in FINAL_PROOF_STATUSES:
                return proof
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"proof {proof_id} is still {proof.get('status')!r} after {timeout:g} s"
                )
            self._sleep(interval)

    def certificate(self, proof_id: int) -> dict[str, Any] | None:
        """The proof's certificate as the platform reports it (None: not signed yet).

        What the platform says, unverified: ``dvbench verify-report`` checks the signed
        bundle offline.
        """
        try:
            data: dict[str, Any] = self.get(f"proofs/{int(proof_id)}/certificate/")
        except NotFoundError as error:
            if error.code == "no_certificate":
                return None
            raise
        return data

    def verdict(self, proof_id: int) -> Verdict:
        """Where a filed proof stands: PASSED, FAILED with the failed claims, pending, error."""
        from dvbench._verdict import Verdict

        proof = self.get_proof(proof_id)
        certificate = None
        if proof.get("status") in FINAL_PROOF_STATUSES and proof.get("status") != "error":
            certificate = self.certificate(proof_id)
        return Verdict.from_api(proof, certificate, url=f"{self.base_url}/proofs/{int(proof_id)}/")

    def wait_for_verdict(
        self,
        proof_id: int,
        *,
        timeout: float = 1800.0,
        interval: float = 5.0,
        raise_on_failure: bool = False,
        poll: Callable[[], None] | None = None,
    ) -> Verdict:
        """Poll until the proof's certificate is signed (or the verifier failed).

        Args:
            timeout: seconds to wait; then the verdict is returned still ``pending``.
            interval: seconds between polls.
            raise_on_failure: raise :class:`CertificateFailedError` unless PASSED (FAILED,
                verifier error, or still pending after ``timeout``).
            poll: called before each poll (``finish(wait=True)`` answers challenges drawn
                meanwhile with it).

        Returns:
            The verdict (``state`` PASSED, FAILED, error, or pending after ``timeout``).
        """
        from dvbench._exceptions import CertificateFailedError

        deadline = time.monotonic() + timeout
        while True:
            if poll is not None:
                poll()
            verdict = self.verdict(proof_id)
            if verdict.final or time.monotonic() >= deadline:
                break
            self._sleep(min(interval, max(0.0, deadline - time.monotonic())))
        if raise_on_failure and not verdict.passed:
            message = verdict.summary()
            if not verdict.final:
                message = f"no verdict after {timeout:g} s: {message}"
            raise CertificateFailedError(message, verdict=verdict)
        return verdict

    # --- certificates -------------------------------------------------------------------
    def download_report(self, proof_id: int) -> bytes:
        """The offline report bundle of a proof's certificate, as the platform sent it.

        Verify it with ``dvbench verify-report`` (:func:`dvbench.attest.verify_bundle`)
        against a trust root obtained out of band; the bundle is JSON bytes.

        Raises:
            NotFoundError: no such proof visible to this key, or it has no certificate yet
                (code ``no_certificate``).
        """
        return self.request("GET", f"proofs/{int(proof_id)}/bundle/").content

    def download_sigstore_bundle(self, proof_id: int) -> bytes:
        """The same certificate as a Sigstore bundle v0.3 (JSON bytes).

        ``dvbench verify-report`` verifies it too; see ``docs/certificates.md`` for what
        Sigstore's own tools can check of it.

        Raises:
            NotFoundError: as :meth:`download_report`.
        """
        return self.request("GET", f"proofs/{int(proof_id)}/sigstore-bundle/").content

    def trust_root(self, version: int | None = None) -> bytes:
        """The platform's published trust root (JSON bytes), latest or a given ``version``.

        Fetching it from the platform you are auditing only proves what the platform
        says today; pin it once and compare, or get it from a second channel.
        """
        params = None if version is None else {"version": int(version)}
        return self.request("GET", "trust-root/", params=params).content

    def trusted_root(self) -> bytes:
        """The platform's trust root in Sigstore's TrustedRoot v0.1 format (JSON bytes).

        What Sigstore's verifiers take (``trusted_root.json``): the platform's keys as the
        log's keys with their validity windows, and its timestamp authority. Pin it as
        you pin the trust root.
        """
        return self.request("GET", "trusted-root/").content

    def sync(
        self, directory: str | os.PathLike[str], *, progress: bool | None = None
    ) -> SyncResult:
        """Upload a proof directory left on disk (offline mode, or an interrupted upload).

        Incremental and idempotent: what the directory's ``dvbench-sync.json`` marks as
        done is not sent again, and an interrupted part resumes from the platform's
        record of the upload.
        """
        return sync_directory(self, Path(directory), progress=progress)
