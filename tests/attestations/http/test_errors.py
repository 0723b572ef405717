"""One error format and a request id on every response."""

from __future__ import annotations

from collections.abc import Callable

from rest_framework.test import APIClient

from tests.attestations.base import World, error_of

Api = Callable[[str | None], APIClient]


def test_every_response_has_a_request_id(world: World, api: Api) -> None:
    response = api("alice").get("/api/v1/me/")
    assert len(response["X-Request-ID"]) == 32
    assert APIClient().get("/health")["X-Request-ID"]


def test_a_caller_request_id_is_echoed(world: World, api: Api) -> None:
    response = api("alice").get(
        "/api/v1/experiments/acme/nope/", HTTP_X_REQUEST_ID="client-1234567"
    )
    assert response.status_code == 404
    assert response["X-Request-ID"] == "client-1234567"
    assert error_of(response)["code"] == "not_found"


def test_an_unsafe_request_id_is_replaced(world: World, api: Api) -> None:
    response = api("alice").get("/api/v1/me/", HTTP_X_REQUEST_ID="<script>")
    assert response["X-Request-ID"] != "<script>"


def test_anonymous_is_401_in_the_same_format(world: World) -> None:
    response = APIClient().get("/api/v1/experiments/")
    assert response.status_code == 401
    assert error_of(response)["code"] == "not_authenticated"


def test_a_wrong_method_is_405_in_the_same_format(world: World, api: Api) -> None:
    response = api("alice").patch("/api/v1/proofs/")
    assert response.status_code == 405
    assert error_of(response)["code"] == "method_not_allowed"


def test_an_unknown_filter_value_names_the_parameter(world: World, api: Api) -> None:
    response = api("alice").get("/api/v1/proofs/?status=great")
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["field"]) == ("invalid_filter", "status")
    assert "valid" in error["detail"]["allowed"]


def test_malformed_json_is_a_parse_error(world: World, api: Api) -> None:
    response = api("alice").post("/api/v1/experiments/", data=b"{", content_type="application/json")
    assert response.status_code == 400
    assert error_of(response)["code"] == "parse_error"


def test_an_unknown_api_path_is_a_json_404(world: World, api: Api) -> None:
    response = api("alice").get("/api/v1/nothing/here/")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"
    assert APIClient().post("/api/v1/nope").status_code == 404


def test_a_non_numeric_id_filter_is_a_400(world: World, api: Api) -> None:
    response = api("alice").get("/api/v1/jobs/?proof=abc")
    assert response.status_code == 400
    assert error_of(response)["field"] == "proof"


def test_filters_are_in_the_schema(world: World) -> None:
    schema = APIClient().get("/api/v1/schema/?format=json").json()
    parameters = {p["name"]: p for p in schema["paths"]["/api/v1/proofs/"]["get"]["parameters"]}
    assert "valid" in parameters["status"]["schema"]["enum"]
    assert {"experiment", "owner", "cursor", "page_size"} <= set(parameters)


def test_the_error_format_is_in_the_schema(world: World) -> None:
    schema = APIClient().get("/api/v1/schema/?format=json").json()
    assert "Error" in schema["components"]["schemas"]
    put = schema["paths"]["/api/v1/uploads/{id}/parts/{number}/"]["put"]
    assert put["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/Error"
    )


def test_errors_are_json_whatever_the_client_accepts(world: World, api: Api) -> None:
    """The browsable API renders successes as HTML on request; never an error."""
    client = api("alice")
    for path, headers in [
        ("/api/v1/experiments/acme/nope/", {"HTTP_ACCEPT": "text/html"}),
        ("/api/v1/experiments/acme/nope/?format=api", {}),
        ("/api/v1/proofs/?status=great&format=api", {"HTTP_ACCEPT": "text/html"}),
        ("/api/v1/sliced-runs/999/?format=api", {"HTTP_ACCEPT": "text/html,*/*;q=0.8"}),
    ]:
        response = client.get(path, **headers)
        assert response.status_code in (400, 404), path
        assert response["Content-Type"] == "application/json", path
        assert error_of(response)["code"] in ("not_found", "invalid_filter"), path
    anonymous = APIClient().get("/api/v1/experiments/?format=api", HTTP_ACCEPT="text/html")
    assert anonymous.status_code == 401 and anonymous["Content-Type"] == "application/json"
    assert error_of(anonymous)["code"] == "not_authenticated"
    # An Accept the API cannot serve is a 406, in JSON all the same.
    refused = client.get("/api/v1/experiments/", HTTP_ACCEPT="application/xml")
    assert refused.status_code == 406 and refused["Content-Type"] == "application/json"
    assert error_of(refused)["code"] == "not_acceptable"
    # A format nobody renders is a 404 in the same JSON.
    unknown = client.get("/api/v1/experiments/?format=xml")
    assert unknown.status_code == 404 and unknown["Content-Type"] == "application/json"
    # Successes still honour the browsable API.
    assert client.get("/api/v1/me/?format=api")["Content-Type"].startswith("text/html")
