"""The OpenAI-compatible endpoints of a real server against offline `LLM.generate`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from hybridserve import SamplingParams
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.server.chat import ChatTemplate

PROMPTS = ["def ", "class Stack:\n    def push(self, item):\n", "import os\n\n"]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _events(response: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent event stream, which must end with [DONE]."""
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_matches_offline(server, offline, prompt):
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    got = _post(server, "/v1/completions", body)
    assert got.status_code == 200, got.text
    got = got.json()
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    want = want[0]
    choice = got["choices"][0]
    assert choice["token_ids"] == want.outputs[0].token_ids
    assert choice["text"] == want.outputs[0].text
    assert choice["finish_reason"] == want.outputs[0].finish_reason
    assert got["prompt_token_ids"] == want.prompt_token_ids
    n_prompt, n_out = len(want.prompt_token_ids), len(want.outputs[0].token_ids)
    assert got["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
    }
    assert got["object"] == "text_completion" and got["model"] == "default"


def test_token_id_prompts_and_one_element_lists(server, offline):
    ids = offline.tokenizer.encode(PROMPTS[1])
    want = offline.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )[0].outputs[0]
    for prompt in (ids, [ids], [PROMPTS[1]]):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        got = _post(server, "/v1/completions", body).json()["choices"][0]
        assert got["token_ids"] == want.token_ids and got["text"] == want.text


def test_streamed_completion_concatenates_to_the_full_text(server, offline):
    body = {"prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=32), False)[0]
    chunks = [e for e in events if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in chunks) == want.outputs[0].text
    assert [e["choices"][0]["finish_reason"] for e in chunks][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 32


def test_stop_strings_cut_streamed_and_full_text_alike(server, offline):
    greedy = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40), False)
    text = greedy[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string the greedy output contains
    params = SamplingParams(temperature=0, max_tokens=40, stop=(stop,))
    want = offline.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and stop not in want.text
    body = {"prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "stop": [stop]}
    full = _post(server, "/v1/completions", body).json()["choices"][0]
    assert (full["text"], full["finish_reason"], full["stop_reason"]) == (want.text, "stop", stop)
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        streamed = "".join(e["choices"][0]["text"] for e in _events(r))
    assert streamed == want.text


def test_logprobs_match_offline(server, offline):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    want = offline.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
    body = {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "logprobs": 3}
    got = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert len(got["tokens"]) == len(got["token_logprobs"]) == len(got["top_logprobs"]) == 6
    tok = offline.tokenizer
    for i, token_id in enumerate(want.token_ids):
        assert got["tokens"][i] == tok.decode([token_id], skip_special_tokens=False)
        want_lp = want.logprobs[i][token_id].logprob
        assert got["token_logprobs"][i] == pytest.approx(want_lp, abs=1e-4)
        assert len(got["top_logprobs"][i]) <= 3
        assert max(got["top_logprobs"][i].values()) >= got["token_logprobs"][i] - 1e-4


def test_seeded_sampling_matches_offline(server, offline):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    want = offline.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    body = {
        "prompt": PROMPTS[0],
        "temperature": 0.9,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 1234,
        "max_tokens": 16,
        "return_token_ids": True,
    }
    for _ in range(2):
        got = _post(server, "/v1/completions", body).json()["choices"][0]
        assert got["token_ids"] == want.token_ids


def test_openai_client_completion(server, offline):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    models = client.models.list()
    assert [m.id for m in models.data] == ["default"]
    got = client.completions.create(
        model="default", prompt=PROMPTS[0], max_tokens=16, temperature=0
    )
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16), False)
    assert got.choices[0].text == want[0].outputs[0].text
    assert got.usage.completion_tokens == 16


def test_openai_client_streamed_chat(server, offline):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "A function that adds two numbers."},
    ]
    stream = client.chat.completions.create(
        model="default", messages=messages, max_tokens=20, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    prompt = ChatTemplate.load(DEFAULT_MODEL).render(messages)  # no template: the fallback
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=20), False)[0]
    assert text == want.outputs[0].text
    full = client.chat.completions.create(
        model="default", messages=messages, max_tokens=20, temperature=0
    )
    assert full.choices[0].message.content == text
    assert full.usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_defaults_to_the_rest_of_the_context(server):
    body = {"messages": [{"role": "user", "content": "x " * 100}], "temperature": 0}
    body["ignore_eos"] = True
    got = _post(server, "/v1/chat/completions", body).json()
    assert got["usage"]["total_tokens"] == 256 and got["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs(server):
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
    }
    got = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    content = got["logprobs"]["content"]
    assert len(content) == 4
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)


def test_models_health_stats_metrics(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "default" and models["data"][0]["max_model_len"] == 256
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert server.idle()
    stats = server.stats()
    assert stats["num_pages_total"] > 0 and stats["max_queue"] == 64
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "hybridserve:http_requests_total",
        "hybridserve:time_to_first_token_seconds_bucket",
        "hybridserve:inter_token_latency_seconds_bucket",
        "hybridserve:generation_tokens_total",
        "hybridserve:prompt_tokens_total",
        "hybridserve:queue_depth",
        "hybridserve:num_requests_running",
        "hybridserve:num_requests_waiting",
        "hybridserve:kv_cache_usage_perc",
        "hybridserve:prefix_cache_hit_rate",
        "hybridserve:prefix_cache_queries_total",
        "hybridserve:request_success_total",
    ):
        assert name in text, name
    # vLLM's names under our prefix, each series labelled with the served model, no _created
    series = [line for line in text.splitlines() if line.startswith("hybridserve:")]
    assert series and all('model_name="default"' in line for line in series)
    assert "_created" not in text


def test_metrics_count_what_was_sent(server):
    before = server.metrics()
    body = {"prompt": "def ", "max_tokens": 5, "ignore_eos": True}
    for _ in range(3):
        assert _post(server, "/v1/completions", body).status_code == 200
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0}).status_code == 400
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    requests = "hybridserve:http_requests_total"
    assert delta(requests, endpoint="/v1/completions", status="200") == 3
    assert delta(requests, endpoint="/v1/completions", status="400") == 1
    assert delta("hybridserve:request_success_total", finished_reason="length") == 3
    assert delta("hybridserve:generation_tokens_total") == 15
    assert delta("hybridserve:time_to_first_token_seconds_count") == 3
    assert delta("hybridserve:inter_token_latency_seconds_count") == 12
    assert delta("hybridserve:e2e_request_latency_seconds_count") == 3


def test_openai_client_with_penalties_and_extra_body(server, offline):
    """Penalties (presence, frequency, and vLLM's repetition_penalty through `extra_body`) give
    the offline engine's tokens; an unknown field is ignored (with a warning), not refused."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    got = client.completions.create(
        model="default", prompt=PROMPTS[1], max_tokens=16, temperature=0,
        presence_penalty=0.8, frequency_penalty=0.4,
        extra_body={"repetition_penalty": 1.1, "return_token_ids": True, "some_extension": 1},
    )  # fmt: skip
    params = SamplingParams(
        temperature=0, max_tokens=16, presence_penalty=0.8, frequency_penalty=0.4,
        repetition_penalty=1.1,
    )  # fmt: skip
    want = offline.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert got.choices[0].token_ids == want.token_ids
    plain = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16), False)
    assert plain[0].outputs[0].token_ids != want.token_ids, "weak test: the penalties did nothing"


def test_openai_client_n_and_batched_prompts(server, offline):
    """A batch of prompts with n = 2: choices indexed prompt by prompt, choice j of a prompt
    the offline request with seed + j; chat with n = 2 alike; usage summed."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    got = client.completions.create(
        model="default", prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=1.0, seed=11
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    completion = 0
    for i, prompt in enumerate(PROMPTS[:2]):
        for j in range(2):
            params = SamplingParams(temperature=1.0, max_tokens=6, seed=11 + j)
            want = offline.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            assert got.choices[2 * i + j].text == want.text
            completion += len(want.token_ids)
    prompt_tokens = sum(len(offline.tokenizer.encode(p)) for p in PROMPTS[:2])
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (prompt_tokens, completion)
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5,
        temperature=1.0, seed=3,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 10


def test_streamed_choices_interleave_and_sum_usage(server, offline):
    """n = 2 over a batch of two prompts, streamed: each index's deltas concatenate to the
    offline text of its seed; one id; the usage chunk sums the choices."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    stream = client.completions.create(
        model="default", prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=1.0, seed=5,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    texts, finish, ids, usage = {}, {}, set(), None
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert len(ids) == 1 and sorted(texts) == [0, 1, 2, 3]
    completion = 0
    for i, prompt in enumerate(PROMPTS[:2]):
        for j in range(2):
            params = SamplingParams(temperature=1.0, max_tokens=6, seed=5 + j)
            want = offline.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            assert texts[2 * i + j] == want.text and finish[2 * i + j] == want.finish_reason
            completion += len(want.token_ids)
    prompt_tokens = sum(len(offline.tokenizer.encode(p)) for p in PROMPTS[:2])
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, completion)
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4,
        temperature=1.0, seed=3, stream=True,
    )  # fmt: skip
    roles = [c.index for chunk in chat for c in chunk.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


def test_prompt_logprobs_match_offline(server, offline):
    """vLLM's `prompt_logprobs` extension: completions put them on each choice, chat on the
    response; the offline engine's values; refused when streamed (as vLLM)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    got = client.completions.create(
        model="default", prompt=PROMPTS[1], max_tokens=2, temperature=0, n=2,
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    want = offline.generate(PROMPTS[1], params, use_tqdm=False)[0].prompt_logprobs
    for choice in got.model_dump()["choices"]:
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(want) and entries[0] is None
        for mine, theirs in zip(entries[1:], want[1:], strict=True):
            assert mine.keys() == {str(t) for t in theirs}
            for t, lp in theirs.items():
                assert mine[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
                assert mine[str(t)]["rank"] == lp.rank
                assert mine[str(t)]["decoded_token"] == lp.decoded_token
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    chat = _post(server, "/v1/chat/completions", body).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 2
    body = {"prompt": "x", "prompt_logprobs": 1, "stream": True}
    streamed = _post(server, "/v1/completions", body)
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.text
