"""A server that speculates (`serve --speculative-config`: prompt lookup on the shipped
nemotron_h model), in process over real HTTP: its greedy completions equal the offline engine's
without speculation, streamed and not, and its drafts were both accepted and rejected."""

from __future__ import annotations

import json

import httpx
import numpy as np
from app_harness import serve_in_thread
from server_harness import OFFLINE

from hybridserve import LLM, SamplingParams
from hybridserve.server.app import ServerSettings, build_app
from hybridserve.server.async_engine import AsyncEngine
from hybridserve.server.launch import parse_speculative_config
from hybridserve.server.listener import HTTPLimits

TOKENS = 40


def test_a_speculating_server_equals_plain_decoding(offline):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(10, 4000, n).tolist() for n in (9, 21)]
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in offline.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False
    )]  # fmt: skip
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    llm = LLM(**OFFLINE, progress=False, speculative_config=spec)
    engine = AsyncEngine(llm.engine)
    with serve_in_thread(build_app(engine, ServerSettings()), HTTPLimits()) as url:
        body = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        for prompt, tokens in zip(prompts, want, strict=True):
            reply = httpx.post(
                url + "/v1/completions",
                json={**body, "prompt": prompt, "return_token_ids": True},
                timeout=120,
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"] == tokens
            text = reply.json()["choices"][0]["text"]
            streamed = []
            with httpx.stream(
                "POST", url + "/v1/completions",
                json={**body, "prompt": prompt, "stream": True}, timeout=120,
            ) as events:  # fmt: skip
                for line in events.iter_lines():
                    if line.startswith("data: {"):
                        streamed += [c["text"] for c in json.loads(line[6:])["choices"]]
            assert "".join(streamed) == text
        stats = httpx.get(url + "/v1/stats", timeout=10).json()
    assert 0 < llm.engine.stats()["spec_num_accepted"] < llm.engine.stats()["spec_num_drafts"]
    assert stats["num_pages_used"] == 0
