"""The lab's files for sliced challenges, in its own object store (``zkdv-sliced-v0``).

A sliced challenge opens about 1 % of a step (``docs/scale.md``). The lab keeps each
step's files in its own bucket and grants the platform read access to them; the platform
reads only the byte ranges the slice opens (``provers/sliced_store.py``), so the lab
uploads nothing to the platform that is not opened.

Files of step ``t``, under the grant's prefix:

* ``snapshot-<t>.params.bin``, ``snapshot-<t>.opt_state.bin``, ``grad-<t>.bin``: the
  pre-state and the committed gradient in :mod:`zkdv.files`' state file format (each
  leaf's raw little-endian bytes, concatenated in committed order, no header), so a
  tensor is one range whose offset follows from the specs before it;
* ``digests-<t>.bin``: sections of 32-byte digests, in :data:`SECTIONS` order: the
  tensor digests of the pre-state, gradient and post-state trees, then every boundary
  row's leaf and every batch row's leaf. The platform builds each audit path from one
  section (``32 x count`` bytes) rather than trusting paths from the lab;
* ``boundary-<t>.bin``: every boundary row (float32, ``(length, width)``) in the leaf
  order of :class:`zkdv.sliced.StepCommitment`'s boundary root, so a row is one range;
* ``batch-<t>.bin``: every batch row, index ``micro * rows + row``;
* ``manifest-<t>.cbor``: :class:`StepLayout`, which says where all of that lies.

Nothing here needs trust in the bucket: every byte the platform reads is checked against
the step's committed roots, and a manifest that lies about a shape moves the ranges, so
the bytes read do not hash.

The grant (:class:`Grant`) is a set of pre-signed S3 ``GET`` URLs, one per object,
for one run's prefix, expiring at a stated time: read-only, scoped to the objects a
challenge may read, and revocable by deleting the objects. :func:`upload_step` and
:func:`issue_grant` take a boto3 S3 client (:func:`s3_client` makes one; boto3 is
imported only there, and ``import zkdv`` needs it nowhere).
"""

from __future__ import annotations

import datetime
import importlib
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import numpy as np

from zkdv.hashing import DIGEST_BYTES
from zkdv.merkle import LeafSpec
from zkdv.sliced import TorchLab, batch_leaves, row_leaves

__all__ = [
    "GRANT_VERSION",
    "SECTIONS",
    "STORE_VERSION",
    "ByteRange",
    "Grant",
    "GrantError",
    "StepLayout",
    "issue_grant",
    "object_names",
    "s3_client",
    "step_objects",
    "upload_step",
]

STORE_VERSION = "zkdv-sliced-store-v0"
GRANT_VERSION = "zkdv-sliced-grant-v0"
#: The sections of ``digests-<t>.bin``, in file order.
SECTIONS = ("params", "opt_state", "grad", "post_params", "post_opt_state", "rows", "batch")
#: The state files, by the tree they hold.
_STATE_FILES = ("params", "opt_state", "grad")
_KINDS = ("act", "grad")  # zkdv.sliced's ACTIVATION, GRADIENT, in leaf order


def object_names(step: int) -> dict[str, str]:
    """The object name (under the grant's prefix) of each of step ``step``'s files."""
    return {
        "params": f"snapshot-{step}.params.bin",
        "opt_state": f"snapshot-{step}.opt_state.bin",
        "grad": f"grad-{step}.bin",
        "digests": f"digests-{step}.bin",
        "boundary": f"boundary-{step}.bin",
        "batch": f"batch-{step}.bin",
        "manifest": f"manifest-{step}.cbor",
    }


@dataclass(frozen=True, order=True)
class ByteRange:
    """Bytes ``[start, stop)`` of one object, named relative to the grant's prefix."""

    name: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def _dtype_bytes(dtype: str, shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class StepLayout:
    """Where every piece a slice can open lies in one step's files (the manifest).

    ``specs`` are the leaves of each state file in committed order; ``counts`` the
    number of digests in each section of :data:`SECTIONS`; ``row`` and ``batch_row``
    the dtype and shape of one boundary row and one batch row; ``shape`` the step's
    ``(micro_batches, boundaries, rows)``.
    """

    step: int
    specs: dict[str, tuple[LeafSpec, ...]]
    counts: tuple[int, ...]
    row: tuple[str, tuple[int, ...]]
    batch_row: tuple[str, tuple[int, ...]]
    shape: tuple[int, int, int]

    @property
    def names(self) -> dict[str, str]:
        return object_names(self.step)

    def tensor(self, tree: str, index: int) -> ByteRange:
        """Leaf ``index`` of state file ``tree`` (``params``, ``opt_state`` or ``grad``)."""
        specs = self.specs[tree]
        start = sum(spec.nbytes for spec in specs[:index])
        return ByteRange(self.names[tree], start, start + specs[index].nbytes)

    def digests(self, section: str) -> ByteRange:
        """All digests of one section of ``digests-<t>.bin``."""
        at = SECTIONS.index(section)
        start = DIGEST_BYTES * sum(self.counts[:at])
        return ByteRange(self.names["digests"], start, start + DIGEST_BYTES * self.counts[at])

    def boundary_row(self, micro: int, boundary: int, kind: str, row: int) -> ByteRange:
        """One boundary row: the leaf order of the boundary root, one row per leaf."""
        _, boundaries, rows = self.shape
        index = ((micro * boundaries + boundary) * 2 + _KINDS.index(kind)) * rows + row
        size = _dtype_bytes(*self.row)
        return ByteRange(self.names["boundary"], index * size, (index + 1) * size)

    def batch(self, micro: int, row: int) -> ByteRange:
        size = _dtype_bytes(*self.batch_row)
        index = micro * self.shape[2] + row
        return ByteRange(self.names["batch"], index * size, (index + 1) * size)

    def sizes(self) -> dict[str, int]:
        """The size of every file but the manifest, in bytes."""
        micro_batches, boundaries, rows = self.shape
        out = {tree: sum(s.nbytes for s in self.specs[tree]) for tree in _STATE_FILES}
        out["digests"] = DIGEST_BYTES * sum(self.counts)
        out["boundary"] = micro_batches * boundaries * 2 * rows * _dtype_bytes(*self.row)
        out["batch"] = micro_batches * rows * _dtype_bytes(*self.batch_row)
        return {self.names[key]: size for key, size in out.items()}

    def to_bytes(self) -> bytes:
        return cbor2.dumps(
            {
                "v": STORE_VERSION,
                "step": self.step,
                "specs": {k: [s.to_dict() for s in v] for k, v in self.specs.items()},
                "counts": list(self.counts),
                "row": [self.row[0], list(self.row[1])],
                "batch_row": [self.batch_row[0], list(self.batch_row[1])],
                "shape": list(self.shape),
            },
            canonical=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> StepLayout:
        """Parse a manifest. Raises ``ValueError`` on anything malformed (the lab's fault)."""
        try:
            body = cbor2.loads(data)
            if body["v"] != STORE_VERSION:
                raise ValueError(f"manifest version {body['v']!r}, expected {STORE_VERSION!r}")
            layout = cls(
                step=int(body["step"]),
                specs={
                    tree: tuple(LeafSpec.from_dict(s) for s in body["specs"][tree])
                    for tree in _STATE_FILES
                },
                counts=tuple(int(c) for c in body["counts"]),
                row=(str(body["row"][0]), tuple(int(d) for d in body["row"][1])),
                batch_row=(str(body["batch_row"][0]), tuple(int(d) for d in body["batch_row"][1])),
                shape=(int(body["shape"][0]), int(body["shape"][1]), int(body["shape"][2])),
            )
            if len(layout.counts) != len(SECTIONS) or min(layout.counts) < 0:
                raise ValueError("the manifest's digest sections are not the protocol's")
            dtypes = [layout.row[0], layout.batch_row[0]]
            dtypes += [spec.dtype for specs in layout.specs.values() for spec in specs]
            if any(np.dtype(d).hasobject for d in dtypes):
                raise ValueError("the manifest names an object dtype")
            shapes = [layout.row[1], layout.batch_row[1], layout.shape]
            shapes += [spec.shape for specs in layout.specs.values() for spec in specs]
            if any(d < 0 for shape in shapes for d in shape):
                raise ValueError("the manifest names a negative dimension")
            return layout
        except ValueError:
            raise
        except Exception as error:  # cbor2, KeyError, TypeError, IndexError: all malformed
            raise ValueError(f"malformed manifest: {type(error).__name__}: {error}") from error


def _little(array: np.ndarray) -> bytes:
    array = np.ascontiguousarray(array)
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


def step_objects(lab: TorchLab, step: int) -> dict[str, bytes]:
    """Every file of one recorded step, by object name (the module docstring's layout)."""
    record = lab.steps[step]
    names = object_names(step)
    trees = (record.pre[0], record.pre[1], record.grad_tree, record.post[0], record.post[1])
    boundary_rows = row_leaves(record.boundaries)
    batch_rows = batch_leaves(record.batch)
    sections = [list(t.tensor_digests) for t in trees] + [boundary_rows, batch_rows]
    first_row = record.boundaries[0][0]["act"][0]
    layout = StepLayout(
        step=step,
        specs={
            "params": tuple(record.pre[0].specs),
            "opt_state": tuple(record.pre[1].specs),
            "grad": tuple(record.grad_tree.specs),
        },
        counts=tuple(len(s) for s in sections),
        row=(str(first_row.dtype), tuple(int(d) for d in first_row.shape)),
        batch_row=(str(record.batch.dtype), tuple(int(d) for d in record.batch.shape[2:])),
        shape=record.commitment.shape,
    )
    boundary = b"".join(
        _little(kinds[kind])
        for per_micro in record.boundaries
        for kinds in per_micro
        for kind in _KINDS
    )
    return {
        names["params"]: b"".join(_little(a) for _, a in record.params),
        names["opt_state"]: b"".join(_little(a) for _, a in record.opt_state),
        names["grad"]: b"".join(_little(a) for _, a in record.grad),
        names["digests"]: b"".join(d for section in sections for d in section),
        names["boundary"]: boundary,
        names["batch"]: _little(record.batch),
        names["manifest"]: layout.to_bytes(),
    }


def _key(prefix: str, name: str) -> str:
    return f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name


def upload_step(client: Any, bucket: str, prefix: str, objects: dict[str, bytes]) -> int:
    """Put one step's files into the lab's own bucket; returns the bytes uploaded.

    ``client`` is a boto3 S3 client with write access (the lab's own credentials).
    """
    total = 0
    for name, data in objects.items():
        client.put_object(Bucket=bucket, Key=_key(prefix, name), Body=data)
        total += len(data)
    return total


class GrantError(Exception):
    """The lab's grant cannot be used: expired, another run's, or beyond its scope."""


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Grant:
    """The lab's read grant for one run: pre-signed ``GET`` URLs, one per object.

    ``run`` is the run's :func:`zkdv.sliced.side_file_digest`, so a grant cannot be
    presented for another run; ``expires`` is Unix time, the URLs' own expiry.
    """

    run: bytes
    endpoint: str
    bucket: str
    prefix: str
    expires: int
    urls: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": GRANT_VERSION,
            "run": self.run.hex(),
            "endpoint": self.endpoint,
            "bucket": self.bucket,
            "prefix": self.prefix,
            "expires": self.expires,
            "urls": dict(self.urls),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Grant:
        """Parse a grant. Raises ``ValueError`` on a malformed one."""
        try:
            if data["v"] != GRANT_VERSION:
                raise ValueError(f"grant version {data['v']!r}, expected {GRANT_VERSION!r}")
            return cls(
                run=bytes.fromhex(str(data["run"])),
                endpoint=str(data["endpoint"]),
                bucket=str(data["bucket"]),
                prefix=str(data["prefix"]),
                expires=int(data["expires"]),
                urls={str(k): str(v) for k, v in dict(data["urls"]).items()},
            )
        except ValueError:
            raise
        except Exception as error:
            raise ValueError(f"malformed grant: {type(error).__name__}: {error}") from error

    def key(self, name: str) -> str:
        return _key(self.prefix, name)

    def check(self, run: bytes, *, now: float | None = None) -> None:
        """Refuse the grant unless it is ``run``'s, unexpired at ``now``, and every URL is
        an ``http(s)`` URL of an object under its prefix of its bucket at its endpoint.

        What the platform checks before it reads anything (``provers.sliced_store``).

        Raises:
            GrantError: saying which.
        """
        if self.run != run:
            raise GrantError(
                f"the grant is for run {self.run.hex()[:16]}..., not this run "
                f"{run.hex()[:16]}...: a grant is accepted only for the run it names"
            )
        now = time.time() if now is None else now
        if now >= self.expires:
            raise GrantError(
                f"the grant expired at {_utc(self.expires)} (now {_utc(now)}): "
                "ask the lab for a fresh one"
            )
        for name, url in self.urls.items():
            self._check_url(name, url)

    def _check_url(self, name: str, url: str) -> None:
        """One URL: the named object, path-style at exactly the endpoint, signed and no more.

        The platform fetches these URLs from its own network, so a URL may reach nothing
        but the object it names: no dot-segment or encoded separator the server could
        resolve to another path (``..``, ``%2e``, ``%2f``, ``%5c``, a backslash), no host
        but the endpoint's own (a bucket's subdomain of it is another host, which the
        lab could name), no query but the pre-signature's, no fragment or user.
        """
        if not name or "/" in name or name in (".", ".."):
            raise GrantError(f"the grant names an object {name!r} that is not a plain file name")
        parts = urllib.parse.urlsplit(url)
        endpoint = urllib.parse.urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or parts.scheme != endpoint.scheme:
            raise GrantError(f"the grant's URL for {name!r} is not http(s) at {self.endpoint}")
        if parts.netloc != endpoint.netloc or "@" in parts.netloc:
            raise GrantError(
                f"the grant's URL for {name!r} is on host {parts.netloc!r}, not the endpoint's "
                f"{endpoint.netloc!r}: URLs are path-style at the endpoint itself (a bucket's "
                "subdomain is another host)"
            )
        _check_path(name, parts.path)
        _check_query(name, parts.query, parts.fragment)
        key = self.key(name)
        if urllib.parse.unquote(parts.path) != f"/{self.bucket}/{key}":
            raise GrantError(
                f"the grant's URL for {name!r} is not object {key!r} of bucket {self.bucket!r} "
                f"at {self.endpoint}"
            )


#: The query parameters of a pre-signed S3 ``GET`` (query signatures v2 and v4),
#: lower-cased; a grant's URL may carry these and no other.
_PRESIGN_PARAMETERS = frozenset(
    {
        "awsaccesskeyid",
        "signature",
        "expires",
        "x-amz-algorithm",
        "x-amz-credential",
        "x-amz-date",
        "x-amz-expires",
        "x-amz-signedheaders",
        "x-amz-signature",
        "x-amz-security-token",
    }
)
#: Percent-encodings of ``.``, ``/`` and ``\``, which a server may decode into a path.
_ENCODED_SEPARATORS = ("%2e", "%2f", "%5c")


def _check_path(name: str, path: str) -> None:
    lowered = path.lower()
    if "\\" in path or any(code in lowered for code in _ENCODED_SEPARATORS):
        raise GrantError(
            f"the grant's URL for {name!r} has a backslash or an encoded '.', '/' or '\\' "
            f"in its path ({path!r})"
        )
    if any(segment in (".", "..") for segment in path.split("/")):
        raise GrantError(
            f"the grant's URL for {name!r} has a '.' or '..' segment in its path ({path!r})"
        )


def _check_query(name: str, query: str, fragment: str) -> None:
    if fragment:
        raise GrantError(f"the grant's URL for {name!r} has a fragment")
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise GrantError(f"the grant's URL for {name!r} has a malformed query") from None
    seen: set[str] = set()
    for key, _ in pairs:
        lowered = key.lower()
        if lowered not in _PRESIGN_PARAMETERS or lowered in seen:
            raise GrantError(
                f"the grant's URL for {name!r} carries the query parameter {key[:64]!r}; "
                "only a pre-signature's parameters, each once, are accepted"
            )
        seen.add(lowered)


def issue_grant(
    client: Any,
    *,
    run: bytes,
    bucket: str,
    prefix: str,
    names: Iterable[str],
    expires_in: int,
    now: float | None = None,
) -> Grant:
    """Pre-sign a ``GET`` of each named object under ``prefix`` for ``expires_in`` seconds.

    ``client`` is the lab's boto3 S3 client; S3 checks each signature and expiry, the
    platform checks the run, the expiry and that every URL names an object under the
    prefix of this bucket. S3 caps pre-signed URLs at seven days; a grant that must last
    longer is re-issued.
    """
    issued = time.time() if now is None else now
    urls = {
        name: str(
            client.generate_presigned_url(
                "get_object",
                Params={"Bucket": bucket, "Key": _key(prefix, name)},
                ExpiresIn=expires_in,
                HttpMethod="GET",
            )
        )
        for name in names
    }
    return Grant(
        run=run,
        endpoint=str(client.meta.endpoint_url).rstrip("/"),
        bucket=bucket,
        prefix=prefix.strip("/"),
        expires=int(issued) + expires_in,
        urls=urls,
    )


def s3_client(**options: Any) -> Any:
    """A boto3 S3 client (``boto3.client("s3", **options)``); boto3 is imported here only.

    Path-style addressing unless ``config`` says otherwise: the platform accepts a
    grant's URLs only at its endpoint's own host, never a bucket's subdomain of it.
    """
    try:
        boto3 = importlib.import_module("boto3")
        config = importlib.import_module("botocore.config")
    except ImportError as error:  # pragma: no cover - boto3 is in the dev environment
        raise ImportError("the lab's object store needs boto3: pip install boto3") from error
    options.setdefault("config", config.Config(s3={"addressing_style": "path"}))
    return boto3.client("s3", **options)
