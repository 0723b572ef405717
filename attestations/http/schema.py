"""OpenAPI post-processing: every operation documents the one error body."""

from __future__ import annotations

from typing import Any

from drf_spectacular.hooks import postprocess_schema_enums
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse

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


#: What every free-text input string is held to: PostgreSQL text cannot hold NUL, and DRF
#: refuses it everywhere; the schema says so, so that a client's validator agrees.
NO_NUL = "^[^\\u0000]*$"

#: How the URL patterns match a numeric id (``attestations/api/urls.py``), and its range.
ID_PATTERN = "^[0-9]{1,18}$"
ID_MAX = 10**18 - 1

#: Certificate filters that take the name of a configured regulatory threshold.
THRESHOLD_FILTERS = ("below_threshold", "above_threshold")

#: Request bodies that take no other properties than their own: registration by id
#: (``owner/name``) must not also name an ``owner`` it could contradict.
CLOSED_REQUESTS = ("ExperimentByIdRequest",)


def error_response(description: str) -> OpenApiResponse:
    """An error status an operation documents in words; its body is the ``Error`` schema.

    ``@extend_schema(responses={403: error_response("...")})``: :func:`add_error_responses`
    puts the one error body in place of the placeholder object.
    """
    return OpenApiResponse(OpenApiTypes.OBJECT, description=description)


def _error_bodies(operation: dict[str, Any], reference: dict[str, Any]) -> None:
    for code, response in operation.get("responses", {}).items():
        if not str(code).startswith(("4", "5")) or not isinstance(response, dict):
            continue
        media = response.get("content", {}).get("application/json")
        if media is not None and media.get("schema", {}).get("type") == "object":
            media["schema"] = dict(reference)


def _hold_free_strings(schema: Any) -> None:
    """Give every free string (no pattern, enum or format) in ``schema`` the NO_NUL pattern."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        free = not ({"pattern", "enum", "format", "readOnly"} & set(item))
        if item.get("type") == "string" and free:
            item["pattern"] = NO_NUL
        stack.extend(value for key, value in item.items() if key != "example")


def add_error_responses(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    """Add the ``Error`` component and a ``4XX`` response to every operation.

    Also: free input strings refuse NUL (:data:`NO_NUL`), and :data:`CLOSED_REQUESTS`
    take no additional properties.
    """
    # The default hook (named enum components) runs first, as it would without ours.
    result = postprocess_schema_enums(result, generator)  # type: ignore[no-untyped-call]
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    upload = schemas.get("UploadRequest", {}).get("properties", {}).get("size")
    if upload is not None:
        # The configured limit, as this server enforces it (400 blob_too_large past it).
        from attestations.uploads.limits import max_blob_bytes

        upload["maximum"] = max_blob_bytes()
    for name, component in schemas.items():
        if name.endswith("Request"):
            _hold_free_strings(component)
        if name in CLOSED_REQUESTS:
            component["additionalProperties"] = False
    for path in result.get("paths", {}).values():
        for operation in path.values():
            if not isinstance(operation, dict):
                continue
            for parameter in operation.get("parameters", []):
                if parameter.get("name") in THRESHOLD_FILTERS and parameter.get("in") == "query":
                    # The names configured now (DVBENCH_REGULATORY_THRESHOLDS): anything else
                    # is a 400 invalid_filter.
                    from attestations.certificates.subjects import thresholds

                    names = sorted(threshold.name for threshold in thresholds())
                    if names:
                        parameter["schema"] = {"type": "string", "enum": names}
                if parameter.get("schema") == {"type": "string", "pattern": ID_PATTERN}:
                    # A numeric id in a path routes only with 1-18 digits (below 2**63).
                    parameter["schema"] = {"type": "integer", "minimum": 0, "maximum": ID_MAX}
                _hold_free_strings(parameter.get("schema"))
            body = operation.get("requestBody")
            if body is not None:
                # Every body this API takes is required (an empty one is a 400).
                body["required"] = True
                binary = body.get("content", {}).get("application/octet-stream")
                if binary is not None:
                    from attestations.uploads.limits import max_part_bytes

                    # An upload part: 1 byte to the configured part limit (413 beyond).
                    binary["schema"] = {
                        "type": "string",
                        "format": "binary",
                        "minLength": 1,
                        "maxLength": max_part_bytes(),
                    }
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    response = {
        "description": "Error, in the one format every error has.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    for path in result.get("paths", {}).values():
        for operation in path.values():
            if isinstance(operation, dict) and "responses" in operation:
                _error_bodies(operation, {"$ref": "#/components/schemas/Error"})
                operation["responses"].setdefault("4XX", response)
    return result
