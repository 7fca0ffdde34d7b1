"""`--api-key`: a bearer token on every route but /health, for the server and the proxy; the
proxy's upstream key; the flags, the environment variable and their help."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from app_harness import Upstreams, stub_app

from hybridserve.cli import build_parser
from hybridserve.server.listener import HTTPLimits
from hybridserve.server.proxy import ProxyState, build_proxy, proxy_state

KEY = "s3cret-key"
BODY = {"prompt": "def ", "max_tokens": 2}


def _requests(app, calls: list[tuple[str, str, dict]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return [
                await client.request(
                    method, path, headers=headers, json=BODY if method == "POST" else None
                )
                for method, path, headers in calls
            ]

    return asyncio.run(go())


def _refused(reply: httpx.Response) -> None:
    assert reply.status_code == 401, reply.text
    assert reply.headers["www-authenticate"] == "Bearer"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"


BAD_HEADERS = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": KEY},
]


def test_the_server_needs_the_key_on_every_route_but_health():
    app, _ = stub_app(api_key=KEY)
    paths = [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/stats")]
    paths += [("POST", "/v1/completions"), ("POST", "/v1/kv_transfer/release"), ("GET", "/nope")]
    calls = [(m, p, h) for m, p in paths for h in BAD_HEADERS]
    for reply in _requests(app, calls):
        _refused(reply)
    good = {"Authorization": f"Bearer {KEY}"}
    health, models, lower = _requests(
        app,
        [
            ("GET", "/health", {}),
            ("GET", "/v1/models", good),
            ("GET", "/v1/models", {"Authorization": f"bearer {KEY}"}),
        ],
    )
    # /health answers without a key (503: the stub engine never started)
    assert health.status_code == 503 and health.json() == {"status": "shutting down"}
    assert models.status_code == 200 and lower.status_code == 200
    metrics = _requests(app, [("GET", "/metrics", good)])[0].text
    labels = 'endpoint="/v1/models",model_name="default",status="401"'
    assert f"hybridserve:http_requests_total{{{labels}}} 5.0" in metrics


def test_the_server_without_a_key_needs_none():
    app, _ = stub_app()
    assert _requests(app, [("GET", "/v1/models", {})])[0].status_code == 200


def test_the_proxy_needs_its_key_and_sends_the_upstream_key():
    up = Upstreams()
    state = ProxyState(
        ["http://p1:1"], ["http://d1:1"], upstream_api_key="up-key", transport=up.transport()
    )
    app = build_proxy(state, api_key=KEY)
    for path in ("/v1/completions", "/v1/chat/completions"):
        for reply in _requests(app, [("POST", path, h) for h in BAD_HEADERS]):
            _refused(reply)
    for reply in _requests(app, [("GET", "/v1/stats", h) for h in BAD_HEADERS]):
        _refused(reply)
    assert up.seen == []
    good = {"Authorization": f"Bearer {KEY}"}
    health, reply = _requests(app, [("GET", "/health", {}), ("POST", "/v1/completions", good)])
    assert health.status_code == 200 and reply.status_code == 200, reply.text
    assert up.headers == [("/v1/completions", "Bearer up-key")] * 2


def test_the_upstream_key_defaults_to_the_proxys_key():
    def key_of(state: ProxyState) -> str | None:
        return state.client.headers.get("authorization")

    args = (["http://p:1"], ["http://d:1"], 60.0)
    assert key_of(proxy_state(*args, KEY, None, HTTPLimits(), 1024)) == f"Bearer {KEY}"
    assert key_of(proxy_state(*args, KEY, "other", HTTPLimits(), 1024)) == "Bearer other"
    assert key_of(proxy_state(*args, None, None, HTTPLimits(), 1024)) is None


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_the_flag_its_variable_and_the_help(command, monkeypatch, capsys):
    urls = ["--prefill", "http://p:1", "--decode", "http://d:1"] if command == "proxy" else []
    monkeypatch.delenv("HYBRIDSERVE_API_KEY", raising=False)
    assert build_parser().parse_args([command, *urls]).api_key is None
    monkeypatch.setenv("HYBRIDSERVE_API_KEY", "from-env")
    assert build_parser().parse_args([command, *urls]).api_key == "from-env"
    flagged = build_parser().parse_args([command, *urls, "--api-key", "flag"])
    assert flagged.api_key == "flag"
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    for word in ("--api-key", "HYBRIDSERVE_API_KEY", "/health", "--header-timeout"):
        assert word in text, word
    if command == "proxy":
        assert "--upstream-api-key" in text
