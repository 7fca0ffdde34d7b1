"""`LLM.chat` and `LLM.get_tokenizer` (vLLM's library API) on the shipped default model: the
chat prompt is the server's (the model's template, or the documented fallback), a batch of
conversations comes back in order, and a template can be given."""

from __future__ import annotations

import numpy as np
import pytest
from engine_shapes import SERVED

from hybridserve import LLM, SamplingParams
from hybridserve.chat_template import FALLBACK_TEMPLATE, ChatTemplate
from hybridserve.entrypoints import DEFAULT_MODEL

GREEDY = SamplingParams(temperature=0, max_tokens=12)
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": [{"type": "text", "text": "A function that adds"}]},
]


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, **SERVED, progress=False)


def test_chat_equals_generate_on_the_rendered_prompt(llm):
    tokenizer = llm.get_tokenizer()
    flat = [MESSAGES[0], {"role": "user", "content": "A function that adds"}]
    text = tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    assert text == ChatTemplate.load(DEFAULT_MODEL).render(flat)  # the server's rendering
    assert tokenizer.apply_chat_template(flat, add_generation_prompt=True) == tokenizer.encode(text)
    want = llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0]
    got = llm.chat(MESSAGES, GREEDY, use_tqdm=False)
    assert len(got) == 1 and got[0].outputs[0].token_ids == want.token_ids
    other = [{"role": "user", "content": "def main():"}]
    both = llm.chat([MESSAGES, other], GREEDY, use_tqdm=False)
    assert both[0].outputs[0].token_ids == want.token_ids
    alone = llm.chat(other, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert both[1].outputs[0].token_ids == alone


def test_chat_with_a_given_template(llm):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "x = 1"}], tokenize=False, chat_template=template
    )
    assert prompt == "<user>x = 1" and FALLBACK_TEMPLATE not in prompt
    got = llm.chat([{"role": "user", "content": "x = 1"}], GREEDY, chat_template=template,
                   use_tqdm=False)  # fmt: skip
    want = llm.generate("<user>x = 1", GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_n_completions_per_prompt(llm):
    """`n` > 1: one output per prompt holding n completions; the i-th is the n = 1 request
    with seed + i (so completion 0 is what the plain request gives)."""
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5, n=3)
    outs = llm.generate(["def ", "class "], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3]
    for prompt, out in zip(["def ", "class "], outs, strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for i, c in enumerate(out.outputs):
            one = SamplingParams(temperature=1.0, max_tokens=8, seed=5 + i)
            want = llm.generate(prompt, one, use_tqdm=False)[0].outputs[0]
            assert c.token_ids == want.token_ids
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "weak test: all alike"
    with pytest.raises(ValueError, match="generate_stream"):
        next(llm.generate_stream("def ", params))
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="one completion per request"):
        llm.engine.add_request("def ", params)


def test_n_completions_share_the_prompt_through_the_prefix_cache(llm):
    """The n requests of one prompt compute it once: the siblings wait for the first to cache
    it (`Scheduler._prefix_in_flight`), then read it; the tokens are what each gets alone on
    an engine without prefix caching."""
    ids = np.random.default_rng(2).integers(3, 500, size=150).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=9, n=4, ignore_eos=True)
    before = llm.stats()["prefill_tokens"]
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    computed = llm.stats()["prefill_tokens"] - before
    assert computed < 2 * len(ids), f"{computed} prompt tokens computed for n = 4"
    plain = LLM(DEFAULT_MODEL, **SERVED, progress=False, enable_prefix_caching=False)
    for i, c in enumerate(out.outputs):
        alone = SamplingParams(temperature=1.0, max_tokens=4, seed=9 + i, ignore_eos=True)
        want = plain.generate({"prompt_token_ids": ids}, alone, use_tqdm=False)[0].outputs[0]
        assert c.token_ids == want.token_ids
