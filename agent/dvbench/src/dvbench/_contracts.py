"""What the SDK's parts need from each other, stated as protocols.

The SDK imports in one direction: ``_transfer`` < ``_sync`` < ``_proof`` < ``_experiment``
< ``_client``. A part that talks to the platform through the client, or that a proof
binds to, is typed with these protocols, never with the classes above it:

* :class:`Api`: the platform's API as the uploaders, the proof and the experiment use
  it; :class:`~dvbench.Client` is one;
* :class:`Registered`: what registering an experiment returns (its platform record);
* :class:`Bound`: the experiment a proof is bound to; :class:`~dvbench.Experiment` is one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import httpx

from dvbench._config import Settings
from dvbench._verdict import Verdict

__all__ = ["Api", "Bound", "Registered"]


class Registered(Protocol):
    """An experiment as the platform registered it."""

    data: dict[str, Any]


class Api(Protocol):
    """The platform's API, as the parts below :class:`~dvbench.Client` call it."""

    settings: Settings
    base_url: str

    @property
    def offline(self) -> bool: ...

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
    ) -> httpx.Response: ...

    def put_presigned(
        self, url: str, *, content: Iterable[bytes], headers: Mapping[str, str]
    ) -> httpx.Response: ...

    def get(self, path: str, **kwargs: Any) -> Any: ...

    def post(self, path: str, json: Any = None, **kwargs: Any) -> Any: ...

    def paginate(self, path: str, params: Mapping[str, Any] | None = None) -> Iterator[Any]: ...

    def me(self) -> dict[str, Any]: ...

    def create_experiment(
        self, name: str, spec: Mapping[str, Any] | None = None, *, framework: str = "jax"
    ) -> Registered: ...

    def get_proof(self, proof_id: int) -> dict[str, Any]: ...

    def verdict(self, proof_id: int) -> Verdict: ...

    def wait_for_verdict(
        self,
        proof_id: int,
        *,
        timeout: float = 1800.0,
        interval: float = 5.0,
        raise_on_failure: bool = False,
        poll: Callable[[], None] | None = None,
    ) -> Verdict: ...


class Bound(Protocol):
    """The experiment a proof is bound to: its name, its spec, the API it talks to."""

    name: str
    pending_spec: dict[str, Any] | None

    @property
    def spec_digest(self) -> str | None: ...

    @property
    def client(self) -> Api: ...
