"""A lab's read grant names its objects and nothing else the platform could be sent to.

The platform fetches a grant's URLs from its own network once an operator allows the
grant's endpoint (``DVBENCH_SLICED_STORE_ENDPOINTS``). Each URL must be the named object,
path-style at exactly that endpoint, carrying only a pre-signature's query (issue 59,
item 7). These are checked without a store: a grant is data until it is used.
"""

from __future__ import annotations

import time

import pytest

from zkdv import sliced_store
from zkdv.sliced_store import Grant, GrantError

RUN = b"\x07" * 32
ENDPOINT = "http://s3.lab.example:9000"
SIGNED = "AWSAccessKeyId=AKIA&Signature=c2ln%3D&Expires=1796515836"
V4 = (
    "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F20261205%2Fus-east-1%2Fs3%2F"
    "aws4_request&X-Amz-Date=20261205T000000Z&X-Amz-Expires=600&X-Amz-SignedHeaders=host"
    "&X-Amz-Signature=abcd&X-Amz-Security-Token=tok"
)


def grant(url: str, *, name: str = "manifest", prefix: str = "runs/ab") -> Grant:
    return Grant(
        run=RUN,
        endpoint=ENDPOINT,
        bucket="lab",
        prefix=prefix,
        expires=int(time.time()) + 600,
        urls={name: url},
    )


def test_path_style_presigned_urls_pass() -> None:
    grant(f"{ENDPOINT}/lab/runs/ab/manifest?{SIGNED}").check(RUN)
    grant(f"{ENDPOINT}/lab/runs/ab/manifest?{V4}").check(RUN)
    grant(f"{ENDPOINT}/lab/runs/ab/manifest").check(RUN)  # a public object needs none


@pytest.mark.parametrize(
    "path",
    [
        "/lab/runs/ab/../ab/manifest",
        "/lab/runs/./ab/manifest",
        "/lab/runs/ab/%2e%2e/ab/manifest",
        "/lab/runs/ab/%2E/manifest",
        "/lab/runs%2Fab/manifest",
        "/lab/runs/ab%5cmanifest",
        "/lab/runs\\ab/manifest",
    ],
)
def test_dot_segments_and_encoded_separators_are_refused(path: str) -> None:
    with pytest.raises(GrantError, match=r"(segment|backslash or an encoded)"):
        grant(f"{ENDPOINT}{path}?{SIGNED}").check(RUN)


def test_a_prefix_that_climbs_out_is_refused_even_when_the_url_matches_it() -> None:
    with pytest.raises(GrantError, match=r"'\.\.' segment"):
        grant(f"{ENDPOINT}/lab/runs/../other/manifest", prefix="runs/../other").check(RUN)


@pytest.mark.parametrize(
    "url",
    [
        "http://lab.s3.lab.example:9000/runs/ab/manifest",  # virtual-hosted: a subdomain
        "http://metadata.s3.lab.example:9000/lab/runs/ab/manifest",
        "http://s3.lab.example:9001/lab/runs/ab/manifest",
        "http://user@s3.lab.example:9000/lab/runs/ab/manifest",
    ],
)
def test_hosts_other_than_the_endpoints_own_are_refused(url: str) -> None:
    with pytest.raises(GrantError, match="not the endpoint's"):
        grant(f"{url}?{SIGNED}").check(RUN)


@pytest.mark.parametrize(
    ("query", "refused"),
    [
        (f"{SIGNED}&response-content-type=text/html", "response-content-type"),
        (f"{SIGNED}&versionId=3", "versionId"),
        (f"{SIGNED}&Signature=again", "Signature"),
        ("x-id=GetObject", "x-id"),
    ],
)
def test_query_parameters_other_than_the_presignatures_are_refused(
    query: str, refused: str
) -> None:
    with pytest.raises(GrantError, match=f"query parameter '{refused}'"):
        grant(f"{ENDPOINT}/lab/runs/ab/manifest?{query}").check(RUN)
    with pytest.raises(GrantError, match="fragment"):
        grant(f"{ENDPOINT}/lab/runs/ab/manifest?{SIGNED}#x").check(RUN)


def test_the_labs_client_presigns_path_style_urls_the_platform_accepts() -> None:
    client = sliced_store.s3_client(
        region_name="us-east-1", aws_access_key_id="AKIA", aws_secret_access_key="secret"
    )
    issued = sliced_store.issue_grant(
        client, run=RUN, bucket="lab", prefix="runs/ab", names=["manifest"], expires_in=600
    )
    url = issued.urls["manifest"]
    assert url.startswith(f"{issued.endpoint}/lab/runs/ab/manifest?"), url
    issued.check(RUN)
