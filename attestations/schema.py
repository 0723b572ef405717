"""OpenAPI post-processing: every operation documents the one error body."""

from __future__ import annotations

from typing import Any

from drf_spectacular.hooks import postprocess_schema_enums

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error", "request_id"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "field", "detail"],
            "properties": {
                "code": {
                    "type": "string",
                    "description": "Stable machine code, e.g. part_digest_mismatch.",
                },
                "message": {"type": "string", "description": "One human-readable sentence."},
                "field": {
                    "type": "string",
                    "nullable": True,
                    "description": "The request field, header or transcript field at fault.",
                },
                "detail": {
                    "nullable": True,
                    "description": "Machine-readable particulars, e.g. {expected, got}.",
                },
            },
        },
        "request_id": {"type": "string", "description": "Also in the X-Request-ID header."},
    },
}


def add_error_responses(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    """Add the ``Error`` component and a ``4XX`` response to every operation."""
    # The default hook (named enum components) runs first, as it would without ours.
    result = postprocess_schema_enums(result, generator)  # type: ignore[no-untyped-call]
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    response = {
        "description": "Error, in the one format every error has.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    for path in result.get("paths", {}).values():
        for operation in path.values():
            if isinstance(operation, dict) and "responses" in operation:
                operation["responses"].setdefault("4XX", response)
    return result
