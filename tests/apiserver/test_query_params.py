"""Integer query parameters are read as the Go API server reads them (strconv.ParseInt, base 10): anything
else is a 400 naming the parameter, and the request changes nothing; a good value still works."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.test_http_semantics import Http

CMS = "/api/v1/namespaces/default/configmaps"


@pytest.fixture
async def http(api: RunningApiServer):  # noqa: ANN201
    async with aiohttp.ClientSession() as session:
        yield Http(api, session)


def _refused(status: int, body: dict, name: str) -> bool:
    return status == 400 and body["reason"] == "BadRequest" and f"query parameter {name}" in body["message"]


# Python's int() takes all of these; Go's ParseInt none: `_`, spaces, a newline, another script's digit, a fraction
BAD = ["1_0", " 1", "1%0A", "%EF%BC%91", "1.5", "abc"]


@pytest.mark.parametrize("value", BAD)
async def test_a_list_limit_that_is_not_an_integer_is_refused(http: Http, value: str) -> None:
    for name in ("a", "b"):
        assert (await http("POST", CMS, {"metadata": {"name": name}}))[0] == 201
    status, body, _ = await http("GET", f"{CMS}?limit={value}")
    assert _refused(status, body, "limit"), (status, body)
    status, body, _ = await http("GET", f"{CMS}?limit=1")
    assert status == 200 and len(body["items"]) == 1 and body["metadata"]["continue"]


@pytest.mark.parametrize("value", ["abc", "1_0", "%EF%BC%91"])
async def test_a_delete_with_a_bad_grace_period_is_refused_and_deletes_nothing(http: Http, value: str) -> None:
    assert (await http("POST", CMS, {"metadata": {"name": "kept"}}))[0] == 201
    status, body, _ = await http("DELETE", f"{CMS}/kept?gracePeriodSeconds={value}")
    assert _refused(status, body, "gracePeriodSeconds"), (status, body)
    assert (await http("GET", f"{CMS}/kept"))[0] == 200
    assert (await http("DELETE", f"{CMS}/kept?gracePeriodSeconds=0"))[0] == 200
    assert (await http("GET", f"{CMS}/kept"))[0] == 404


async def test_a_watch_with_a_bad_timeout_is_refused_and_a_good_one_ends_the_stream(http: Http) -> None:
    status, body, _ = await http("GET", f"{CMS}?watch=true&timeoutSeconds=1.5")
    assert _refused(status, body, "timeoutSeconds"), (status, body)
    headers = {"Authorization": f"Bearer {http.api.token}"}
    url = f"{http.api.url}{CMS}?watch=true&timeoutSeconds=1"
    async with http.session.get(url, headers=headers, ssl=False) as resp:
        assert resp.status == 200
        await asyncio.wait_for(resp.read(), 10)  # the server ends the stream at its timeout


@pytest.mark.parametrize("value", ["1_0", "%D9%A1"])
async def test_a_watch_from_a_resource_version_that_is_not_an_integer_is_refused(http: Http, value: str) -> None:
    status, body, _ = await http("GET", f"{CMS}?watch=true&resourceVersion={value}")
    assert status == 400 and body["reason"] == "BadRequest" and "invalid resourceVersion" in body["message"]
