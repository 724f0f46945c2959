"""The embedded API server's size limits, as a real one answers them: 413 over 3 MiB of request body, 422
over 1 MiB of ConfigMap data, and 413 for an object over etcd's request limit (nothing stored)."""

from __future__ import annotations

from embedded.apiserver.testing import RunningApiServer
from tests.apiserver.auth.conftest import _http


async def test_size_limits(api: RunningApiServer) -> None:
    big = {"metadata": {"name": "big"}, "data": {"blob": "x" * (1024 * 1024 + 1)}}
    status, body = await _http(api, "POST", "/api/v1/namespaces/default/configmaps", api.token, big)
    assert status == 422 and body["reason"] == "Invalid"
    assert body["message"] == 'ConfigMap "big" is invalid: []: Too long: must have at most 1048576 bytes'
    status, body = await _http(
        api,
        "POST",
        "/api/v1/namespaces/default/configmaps",
        api.token,
        raw=b'{"metadata":{"name":"huge"},"data":{"a":"' + b"x" * (3 * 1024 * 1024) + b'"}}',
    )
    assert status == 413 and body["reason"] == "RequestEntityTooLarge"
    assert body["message"] == "Request entity too large: limit is 3145728"
    assert (await _http(api, "GET", "/api/v1/namespaces/default/configmaps/big", api.token))[0] == 404
    ok = {"metadata": {"name": "ok"}, "data": {"blob": "x" * (1024 * 1024 - 10)}}
    assert (await _http(api, "POST", "/api/v1/namespaces/default/configmaps", api.token, ok))[0] == 201


async def test_an_object_over_the_etcd_limit_is_refused_and_not_stored(api: RunningApiServer) -> None:
    event = {
        "metadata": {"name": "loud"},
        "involvedObject": {"kind": "Node", "name": "n"},
        "reason": "Loud",
        "message": "x" * (1536 * 1024 + 1),
    }
    status, body = await _http(api, "POST", "/api/v1/namespaces/default/events", api.token, event)
    assert status == 413 and body["message"] == "etcdserver: request is too large"
    assert (await _http(api, "GET", "/api/v1/namespaces/default/events/loud", api.token))[0] == 404
