"""Bad input gets a clear 4xx JSON error in the OpenAI shape, and the server keeps serving."""

from __future__ import annotations

import json
import socket
import string
import time

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

MB = 1 << 20
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# (name, path, body: a dict sent as JSON or raw bytes, status, param the error names)
CASES = [
    ("malformed json", COMPLETIONS, b'{"prompt": "def ",', 400, None),
    ("not an object", COMPLETIONS, b"[1, 2, 3]", 400, None),
    ("nan", COMPLETIONS, b'{"prompt": "a", "temperature": NaN}', 400, None),
    ("overflowing float", COMPLETIONS, b'{"prompt": "a", "temperature": 1e999}', 400, None),
    ("invalid utf-8", COMPLETIONS, b'{"prompt": "\xff\xfe abc"}', 400, None),
    ("deep nesting", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("missing prompt", COMPLETIONS, {"max_tokens": 4}, 400, "prompt"),
    ("prompt of wrong type", COMPLETIONS, {"prompt": 123}, 400, "prompt"),
    ("max_tokens as string", COMPLETIONS, {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens as float", COMPLETIONS, {"prompt": "a", "max_tokens": 5.0}, 400, "max_tokens"),
    ("stream as string", COMPLETIONS, {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("unknown nested field", COMPLETIONS, {"prompt": "a", "stream_options": {"x": 1}}, 400, None),
    ("unknown model", COMPLETIONS, {"prompt": "a", "model": "gpt-5"}, 404, "model"),
    ("negative max_tokens", COMPLETIONS, {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", COMPLETIONS, {"prompt": "a", "max_tokens": 10**12}, 400, "max_tokens"),
    ("enormous max_tokens", COMPLETIONS, {"prompt": "a", "max_tokens": 10**40}, 400, "max_tokens"),
    ("prompt over the limit", COMPLETIONS, {"prompt": [7] * 300}, 400, "prompt"),
    ("text prompt over the limit", COMPLETIONS, {"prompt": "def f(): " * 200}, 400, "prompt"),
    ("token id past the vocab", COMPLETIONS, {"prompt": [1, 4096]}, 400, "prompt"),
    ("negative token id", COMPLETIONS, {"prompt": [-1]}, 400, "prompt"),
    ("enormous token id", COMPLETIONS, {"prompt": [10**30]}, 400, "prompt"),
    ("bool token id", COMPLETIONS, {"prompt": [True, 2]}, 400, "prompt"),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("empty id list", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("streamed batch, one bad", COMPLETIONS, {"prompt": ["a", []], "stream": True}, 400, "prompt"),
    ("batch of 65", COMPLETIONS, {"prompt": ["a"] * 65}, 400, "prompt"),
    ("mixed batch", COMPLETIONS, {"prompt": ["a", 5]}, 400, "prompt"),
    ("streamed n > 1, bad", COMPLETIONS, {"prompt": [-3], "n": 2, "stream": True}, 400, "prompt"),
    ("prompt_logprobs 21", COMPLETIONS, {"prompt": "a", "prompt_logprobs": 21}, 400, None),
    (
        "streamed prompt_logprobs",
        COMPLETIONS,
        {"prompt": "a", "prompt_logprobs": 1, "stream": True},
        400,
        None,
    ),
    ("too many logprobs", COMPLETIONS, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("temperature < 0", COMPLETIONS, {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", COMPLETIONS, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top_k huge", COMPLETIONS, {"prompt": "a", "top_k": 2**40}, 400, "top_k"),
    ("seed huge", COMPLETIONS, {"prompt": "a", "seed": 2**70}, 400, "seed"),
    ("min_tokens > max", COMPLETIONS, {"prompt": "a", "max_tokens": 2, "min_tokens": 5}, 400, None),
    ("empty stop", COMPLETIONS, {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("stop ids past vocab", COMPLETIONS, {"prompt": "a", "stop_token_ids": [9999]}, 400, None),
    ("echo", COMPLETIONS, {"prompt": "a", "echo": True}, 400, "echo"),
    ("penalty past 2", COMPLETIONS, {"prompt": "a", "presence_penalty": 2.5}, 400, None),
    ("repetition penalty 0", COMPLETIONS, {"prompt": "a", "repetition_penalty": 0}, 400, None),
    (
        "kv params on a plain server",
        COMPLETIONS,
        {"prompt": "ab", "kv_transfer_params": {"do_remote_decode": True}},
        400,
        None,
    ),
    (
        "bad kv param type",
        COMPLETIONS,
        {"prompt": "a", "kv_transfer_params": {"port": "x"}},
        400,
        None,
    ),
    ("streamed bad input", COMPLETIONS, {"prompt": [5000], "stream": True}, 400, "prompt"),
    ("chat without messages", CHAT, {"messages": []}, 400, "messages"),
    ("chat bad role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ("chat content type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    (
        "chat huge max_tokens",
        CHAT,
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": 100_000},
        400,
        "max_tokens",
    ),
    (
        "chat over the limit",
        CHAT,
        {"messages": [{"role": "user", "content": "hi " * 400}]},
        400,
        "messages",
    ),
    # bodies json.loads takes but that cannot be answered or sent on (were 500s)
    ("lone surrogate", COMPLETIONS, b'{"prompt": "\\ud800 alone"}', 400, None),
    ("lone surrogate in the model", COMPLETIONS, b'{"prompt": "a", "model": "\\udfff"}', 400, None),
    ("5000-digit integer", COMPLETIONS, b'{"prompt": [' + b"7" * 5000 + b"]}", 400, None),
]


def _check_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def _healthy(server) -> bool:
    return httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_is_a_4xx_json_error(server, name, path, body, status, param):
    if isinstance(body, bytes):
        response = httpx.post(server.url + path, content=body, timeout=30)
    else:
        response = httpx.post(server.url + path, json=body, timeout=30)
    _check_error(response, status, param)
    assert _healthy(server)


def test_unknown_route_and_method(server):
    _check_error(httpx.get(server.url + "/v2/nothing"), 404)
    _check_error(httpx.get(server.url + COMPLETIONS), 405)
    assert _healthy(server)


def test_50_mb_body_is_refused_by_content_length(server):
    body = b'{"prompt": "' + b"a" * (50 * MB) + b'"}'
    start = time.monotonic()
    error = _check_error(httpx.post(server.url + COMPLETIONS, content=body, timeout=60), 413)
    assert error["code"] == "body_too_large"
    assert time.monotonic() - start < 30
    assert _healthy(server)


def test_50_mb_body_is_refused_before_it_is_sent(server):
    """Headers announcing 50 MB and no body: the answer comes without reading any of it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 52428800\r\n\r\n"
        )
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413")
    assert _healthy(server)


def test_chunked_body_is_cut_off_while_reading(server):
    """No Content-Length: the server stops at the limit, it does not buffer 50 MB."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"a" * MB
        yield b'"}'

    response = httpx.post(server.url + COMPLETIONS, content=chunks(), timeout=60)
    _check_error(response, 413)
    assert _healthy(server)


def test_errors_are_counted_and_nothing_leaks(server):
    before = server.metrics()
    for _, path, body, _, _ in CASES[:10]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(server.url + path, content=data, timeout=30)
    after = server.metrics()
    key = ("hybridserve:http_requests_total", (("endpoint", COMPLETIONS), ("status", "400")))
    assert after[key] - before.get(key, 0) == 10
    assert server.idle()


# -- fuzzing the completions schema -------------------------------------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


_VALID = {
    "model": st.just("default"),
    "prompt": st.text(string.printable, min_size=1, max_size=40)
    | st.lists(st.integers(0, 4095), min_size=1, max_size=40),
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 5000),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "n": st.just(1),
    "logprobs": st.integers(0, 5),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "stop_token_ids": st.lists(st.integers(0, 4095), max_size=3),
    "kv_transfer_params": st.none(),
}
# Edge values around every limit (max_model_len 256, vocabulary 4096, logprobs 20, ...).
_EDGES = {
    "model": st.text(max_size=8),
    "prompt": st.lists(st.integers(-5, 5000), max_size=300) | st.just("") | st.just([["a"]]),
    "max_tokens": st.integers(-3, 400) | st.just(10**30),
    "temperature": st.floats(-1, 200),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-5, 2**40),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-(2**70), 2**70),
    "stop": st.lists(st.text(max_size=2), max_size=20),
    "n": st.integers(-1, 3),
    "logprobs": st.integers(-1, 25),
    "stream": st.integers(0, 1),
    "ignore_eos": st.text(max_size=3),
    "min_tokens": st.integers(-1, 400),
    "stop_token_ids": st.lists(st.integers(-1, 5000), max_size=70),
    "kv_transfer_params": st.just({"do_remote_decode": True}) | st.just({"port": -1}),
}


def _field(name: str) -> st.SearchStrategy:
    return st.one_of(_VALID[name], _EDGES[name], _json)


_valid = st.fixed_dictionaries({}, optional=_VALID)
_fuzzed = st.fixed_dictionaries({}, optional={name: _field(name) for name in _VALID}) | (
    st.dictionaries(st.text(max_size=12), _json, max_size=5)  # arbitrary keys
)


def _send(server, body: dict) -> httpx.Response:
    body.setdefault("prompt", "def ")
    response = httpx.post(server.url + COMPLETIONS, json=body, timeout=120)
    event(f"HTTP {response.status_code}")
    if response.status_code != 200:
        _check_error(response, response.status_code)
    elif body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    return response


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_valid)
def test_fuzzed_valid_requests_succeed(server, body):
    response = _send(server, body)
    assert response.status_code == 200, response.text


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_fuzzed)
def test_fuzzed_requests_get_200_or_a_4xx(server, body):
    response = _send(server, body)
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
