"""What the verifier found: :class:`VerificationReport`, and its JSON form."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any


@dataclass
class VerificationReport:
    """What the verifier found. ``ok`` is False exactly when ``reason`` is set."""

    ok: bool = False
    reason: str | None = None
    message: str | None = None
    record: int | None = None
    field: str | None = None
    root: dict[str, Any] | None = None
    steps: int = 0
    checks: int = 0
    sampled: list[int] = dataclass_field(default_factory=list)
    snapshots: list[int] = dataclass_field(default_factory=list)
    tokens: int = 0
    flops: float = 0.0
    digest: str | None = None
    final: dict[str, str] | None = None
    wall_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "message": self.message,
            "record": self.record,
            "field": self.field,
            "root": _jsonable(self.root),
            "steps": self.steps,
            "checks": self.checks,
            "sampled": list(self.sampled),
            "snapshots": list(self.snapshots),
            "tokens": self.tokens,
            "flops": self.flops,
            "digest": self.digest,
            "final": self.final,
            "wall_seconds": self.wall_seconds,
        }

    def summary(self) -> str:
        if self.ok:
            return (
                f"valid: {self.steps} steps, {self.checks} sampled checks passed, "
                f"digest {self.digest}"
            )
        where = "" if self.record is None else f"record {self.record}: "
        return f"rejected ({self.reason}): {where}{self.message}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
