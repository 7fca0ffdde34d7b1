"""The tiny Inkling model through the engine: continuous batching, chunked prefill, prefix
caching (its sliding-window and sconv groups), multimodal prompts. The reference for every run
is one-pass prompt logits of the same weights (`runner.sequence_logits`, itself checked against
numpy in test_inkling.py), greedy-decoded token by token."""

from __future__ import annotations

import numpy as np
import pytest
from engine_shapes import INKLING, pool_of

from hybridserve import LLM, SamplingParams
from tests.hybridserve.inkling_models import (
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    build_inkling,
    one_pass_greedy,
    save_inkling,
    tiny_inkling,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    cfg = tiny_inkling()
    return save_inkling(build_inkling(cfg, seed=1), cfg, tmp_path_factory.mktemp("ink") / "m")


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    """The engine of the tests that need no settings of their own."""
    return LLM(ckpt, **INKLING, progress=False)


def _greedy(llm: LLM, ids: list[int], n: int, mm=None) -> list[int]:
    return one_pass_greedy(llm.engine.runner, ids, n, mm)


def _tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def test_continuous_batching_and_chunked_prefill_equal_one_pass(ckpt):
    # 5 requests of different lengths, 3 running at once, prefill in chunks of 16 tokens mixed
    # with decodes: every request's greedy tokens equal the one-pass reference.
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 4000, n).tolist() for n in (7, 23, 40, 17, 33)]
    settings = {**INKLING, "max_num_seqs": 3, "max_num_batched_tokens": 32}
    llm = LLM(ckpt, **settings, max_prefill_chunk=16, enable_prefix_caching=False,
              cache=pool_of(ckpt, INKLING), progress=False)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert _tokens(out) == _greedy(llm, p, GREEDY.max_tokens)


def test_prefix_cache_hits_reuse_sliding_and_sconv_pages(llm):
    # A second prompt sharing the first 48 tokens hits the cache; its output equals a run
    # without the cache. Units are 16 tokens: the sliding (window 6) and sconv (window 3)
    # groups must restore the pages of the last unit before the hit point.
    rng = np.random.default_rng(1)
    shared = rng.integers(10, 4000, 48).tolist()
    a, b = shared + rng.integers(10, 4000, 9).tolist(), shared + rng.integers(10, 4000, 5).tolist()
    llm.generate([{"prompt_token_ids": a}], GREEDY, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": b}], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 48
    assert _tokens(out) == _greedy(llm, b, GREEDY.max_tokens)


def test_multimodal_prompt_through_the_engine(ckpt):
    # An image (6 patches) and a waveform (9 frames) given once each in the prompt; chunked
    # prefill (chunks of 16) splits the image's placeholders across chunks. The tokens equal
    # the one-pass reference with the same embeddings, and differ from a text-only run.
    rng = np.random.default_rng(2)
    img = rng.normal(size=(8, 12, 3)).astype(np.float32)
    wave = rng.normal(size=300).astype(np.float32)
    ids = rng.integers(10, 4000, 12).tolist() + [IMAGE_TOKEN, 21, 22, AUDIO_TOKEN, 23]
    data = {"image": [img], "audio": wave}
    llm = LLM(ckpt, **{**INKLING, "max_num_batched_tokens": 16}, max_prefill_chunk=16,
              progress=False)  # fmt: skip
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": data}], GREEDY,
                       use_tqdm=False)[0]  # fmt: skip
    full, mm = llm.engine.prepare_multimodal(ids, data)
    # 6 patches of 4 px; ceil((300 - 64) / 32) + 1 = 9 frames
    assert len(full) == len(ids) - 2 + 6 + 9 and mm.embeds.shape == (15, 48)
    assert _tokens(out) == _greedy(llm, full, GREEDY.max_tokens, mm)
    # The same tokens with another image: not served from the first one's cached pages.
    img2 = rng.normal(size=(8, 12, 3)).astype(np.float32)
    data2 = {"image": [img2], "audio": wave}
    out2 = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": data2}], GREEDY,
                        use_tqdm=False)[0]  # fmt: skip
    _, mm2 = llm.engine.prepare_multimodal(ids, data2)
    assert out2.metrics.num_cached_tokens == 0
    assert _tokens(out2) == _greedy(llm, full, GREEDY.max_tokens, mm2)


def test_multimodal_prompt_errors(llm):
    img = np.zeros((8, 8, 3), np.float32)
    with pytest.raises(ValueError, match="image placeholder tokens"):
        llm.generate([{"prompt_token_ids": [11, 12], "multi_modal_data": {"image": img}}])
    with pytest.raises(ValueError, match="4-pixel patches"):
        bad = {"image": np.zeros((6, 8, 3), np.float32)}
        llm.generate([{"prompt_token_ids": [IMAGE_TOKEN], "multi_modal_data": bad}])
    with pytest.raises(ValueError, match="unknown multi_modal_data keys"):
        llm.generate([{"prompt_token_ids": [IMAGE_TOKEN], "multi_modal_data": {"video": img}}])
