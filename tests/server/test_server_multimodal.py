"""Chat with an image and with audio through the OpenAI server, on the tiny Inkling model (hMLP
image stem, dMel audio; saved with the default model's tokenizer and fallback template).

The reference is `LLM.generate` on token ids written out here by hand from the fallback
template (`role: content` lines, media parts as their placeholder token where they stand, text
parts joined by newlines) and on the arrays the client's files hold (8-bit pixels / 255, 16-bit
samples / 32768). The same conversation goes to:
  1. `LLM.chat` (the library path);
  2. a colocated server (in process, real HTTP);
  3. a prefill and a decode server behind the proxy: each instance decodes the media and runs
     the encoders itself; only the KV and state pages travel (NIXL over UCX on host memory).
Each gives the reference's greedy tokens. Bad media get a 400 that says what was wrong.
"""

from __future__ import annotations

import base64
import io
import wave

import httpx
import numpy as np
import pytest
from app_harness import serve_in_thread, wait_until
from engine_shapes import INKLING
from PIL import Image

from hybridserve import LLM, SamplingParams
from hybridserve.config import KVTransferConfig
from hybridserve.server.app import ServerSettings, build_app
from hybridserve.server.async_engine import AsyncEngine
from hybridserve.server.listener import HTTPLimits
from hybridserve.server.proxy import ProxyState, build_proxy
from tests.hybridserve.inkling_models import (
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    build_inkling,
    save_inkling,
    tiny_inkling,
)

TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
CHAT = "/v1/chat/completions"
LIMITS = HTTPLimits()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    cfg = tiny_inkling()
    return save_inkling(build_inkling(cfg, seed=3), cfg, tmp_path_factory.mktemp("ink") / "m")


@pytest.fixture(scope="module")
def media() -> dict:
    """A PNG (8 x 12 pixels: 6 patches of 4) and an 8 kHz 16-bit WAV (300 samples), as the
    client sends them, and the arrays they hold."""
    rng = np.random.default_rng(5)
    pixels = rng.integers(0, 256, (8, 12, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    samples = rng.integers(-(2**15), 2**15, 300, dtype=np.int16)
    wav = io.BytesIO()
    with wave.open(wav, "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(8000)
        f.writeframes(samples.tobytes())
    return {
        "png": base64.b64encode(png.getvalue()).decode(),
        "wav": base64.b64encode(wav.getvalue()).decode(),
        "image": pixels.astype(np.float32) / 255.0,
        "audio": samples.astype(np.float32) / 32768.0,
    }


def conversation(media: dict) -> list[dict]:
    url = "data:image/png;base64," + media["png"]
    parts = [
        {"type": "text", "text": "Look at this"},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "and hear this"},
        {"type": "input_audio", "input_audio": {"data": media["wav"], "format": "wav"}},
    ]
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def reference(ckpt, media) -> tuple[list[int], list[int]]:
    """(prompt ids with one placeholder per embedding, greedy tokens) from `LLM.generate`;
    also checks `LLM.chat` on the same conversation."""
    llm = LLM(ckpt, **INKLING, progress=False)
    try:
        tok = llm.get_tokenizer()
        pieces = ["system: Be brief.\nuser: Look at this\n", "\nand hear this\n", "\nassistant:"]
        ids = tok.encode(pieces[0]) + [IMAGE_TOKEN] + tok.encode(pieces[1], False)
        ids += [AUDIO_TOKEN] + tok.encode(pieces[2], False)
        data = {"image": [media["image"]], "audio": [media["audio"]]}
        (want,) = llm.generate(
            [{"prompt_token_ids": ids, "multi_modal_data": data}], GREEDY, use_tqdm=False
        )
        (text_only,) = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
        assert text_only.outputs[0].token_ids != want.outputs[0].token_ids, "weak test"
        (chat,) = llm.chat(conversation(media), GREEDY, use_tqdm=False)
        assert chat.prompt_token_ids == want.prompt_token_ids
        assert chat.outputs[0].token_ids == want.outputs[0].token_ids
    finally:
        llm.close()
    return want.prompt_token_ids, want.outputs[0].token_ids


def _ask(url: str, messages: list[dict]) -> httpx.Response:
    body = {"messages": messages, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + CHAT, json={**body, "return_token_ids": True}, timeout=120)


def _served(ckpt: str, **kv) -> AsyncEngine:
    config = KVTransferConfig(**kv) if kv else None
    llm = LLM(ckpt, **INKLING, progress=False, kv_transfer_config=config)
    return AsyncEngine(llm.engine)


def test_chat_with_image_and_audio_equals_generate(ckpt, media, reference):
    prompt_ids, want = reference
    with serve_in_thread(build_app(_served(ckpt), ServerSettings()), LIMITS) as url:
        reply = _ask(url, conversation(media))
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["prompt_token_ids"] == prompt_ids
        assert body["choices"][0]["token_ids"] == want
        assert body["usage"]["prompt_tokens"] == len(prompt_ids)
        # bad media: each a 400 naming the problem, and the server keeps serving
        bad = conversation(media)
        bad[1]["content"][1]["image_url"]["url"] = "https://example.com/cat.png"
        cases = {"does not fetch URLs": bad}
        bad = conversation(media)
        bad[1]["content"][1]["image_url"]["url"] = "data:image/png;base64,bm90IGFuIGltYWdl"
        cases["cannot be read"] = bad
        odd = io.BytesIO()
        Image.fromarray(np.zeros((7, 12, 3), np.uint8)).save(odd, format="PNG")
        bad = conversation(media)
        url7 = "data:image/png;base64," + base64.b64encode(odd.getvalue()).decode()
        bad[1]["content"][1]["image_url"]["url"] = url7
        cases["4-pixel patches"] = bad
        bad = conversation(media)
        bad[1]["content"][3]["input_audio"]["format"] = "mp3"
        cases["format 'mp3'"] = bad
        for expected, messages in cases.items():
            reply = _ask(url, messages)
            assert reply.status_code == 400, reply.text
            assert expected in reply.json()["error"]["message"]
        reply = _ask(url, conversation(media))
        assert reply.json()["choices"][0]["token_ids"] == want


def test_chat_with_media_through_prefill_and_decode_instances(ckpt, media, reference):
    prompt_ids, want = reference
    prefill = _served(ckpt, kv_role="kv_producer")
    decode = _served(ckpt, kv_role="kv_consumer")
    with (
        serve_in_thread(build_app(prefill, ServerSettings()), LIMITS) as p_url,
        serve_in_thread(build_app(decode, ServerSettings()), LIMITS) as d_url,
        serve_in_thread(build_proxy(ProxyState([p_url], [d_url])), LIMITS) as url,
    ):
        reply = _ask(url, conversation(media))
        assert reply.status_code == 200, reply.text
        assert reply.json()["prompt_token_ids"] == prompt_ids
        assert reply.json()["choices"][0]["token_ids"] == want
        for server in (p_url, d_url):  # the prefill side frees its held pages once pulled
            assert wait_until(lambda server=server: _idle(server), 30), httpx.get(
                server + "/v1/stats"
            ).json()


def _idle(url: str) -> bool:
    s = httpx.get(url + "/v1/stats", timeout=10).json()
    return s["num_pages_used"] == 0 and s.get("held_requests", 0) == 0 and not s["num_running"]
