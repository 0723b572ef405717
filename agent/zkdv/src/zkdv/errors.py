"""Semantic errors raised by the public ZKDV API.

Exception tree::

    RuntimeError
     └── ZKDVError                    base of every error ZKDV raises on purpose
          ├── ZKDVPoisonedError       the driver cannot proceed after an asynchronous failure
          ├── ZKDVVerificationError   a sampled update failed verification
          └── TranscriptError         a transcript is malformed or fails an offline check
               └── TruncatedTranscriptError   the last record is incomplete

Messages that recur live here as constants so that frontends and tests share one text.
"""

from __future__ import annotations

__all__ = [
    "TranscriptError",
    "TruncatedTranscriptError",
    "ZKDVError",
    "ZKDVPoisonedError",
    "ZKDVVerificationError",
]


class ZKDVError(RuntimeError):
    """Base error for the public ZKDV API."""


class ZKDVPoisonedError(ZKDVError):
    """The driver cannot proceed after an asynchronous failure."""


class ZKDVVerificationError(ZKDVError):
    """A sampled update failed verification."""


class TranscriptError(ZKDVError):
    """A transcript is malformed or fails a check; names the record and field.

    Attributes:
        reason: a stable machine-readable code, e.g. ``"broken_chain"``.
        record: index of the offending record in the file (0 is the root), or None.
        field: the offending field, or None.
    """

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        record: int | None = None,
        field: str | None = None,
    ) -> None:
        self.reason = reason
        self.record = record
        self.field = field
        self.detail = message
        where = "" if record is None else f"record {record}"
        if field is not None:
            where = f"{where}, field {field!r}" if where else f"field {field!r}"
        super().__init__(f"{where}: {message}" if where else message)

    def to_dict(self) -> dict[str, object]:
        return {
            "reason": self.reason,
            "record": self.record,
            "field": self.field,
            "message": self.detail,
        }


class TruncatedTranscriptError(TranscriptError):
    """The transcript ends inside a record (a crash or an interrupted copy)."""


NOT_STARTED = (
    "ZKDV driver is not started; call proof.start(rolling_window=..., probe_ratio=...) first"
)
ALREADY_STARTED = "ZKDV driver is already started"
CLOSED = "ZKDV driver is closed; create a new proof for another run"
POISONED = "ZKDV driver is poisoned by an earlier failure: {cause}"
