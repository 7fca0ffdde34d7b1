"""Repetition, frequency and presence penalties (`SamplingParams`) against numpy: the device
function on random logits, and the engine's greedy tokens against a numpy loop over the model's
own logits (one full-sequence forward: each step's logits are its row)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_shapes import SERVED

from hybridserve import LLM, SamplingParams
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.runner.sampler import _padded, penalize


def np_penalize(logits, prompt, output, rep, freq, pres):
    """vLLM's order: repetition over prompt and output tokens, then frequency and presence over
    the output's counts."""
    out = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output, int), minlength=len(out))
    seen = counts > 0
    seen[np.asarray(prompt, int)] = True
    out[seen] = np.where(out[seen] > 0, out[seen] / rep, out[seen] * rep)
    return out - freq * counts - pres * (counts > 0)


def test_penalize_matches_numpy():
    rng = np.random.default_rng(0)
    rows, vocab = 5, 97
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 4
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in (7, 0, 30, 3, 12)]
    outputs = [rng.integers(0, 20, size=int(n)).tolist() for n in (9, 4, 0, 17, 1)]  # repeats
    settings = [(1.3, 0.5, 0.2), (0.7, -1.0, 2.0), (2.0, 0.0, 0.0), (1.0, 1.5, -0.5), (1, 0, 0)]
    rep, freq, pres = (np.asarray(c, np.float32) for c in zip(*settings, strict=True))
    got = penalize(
        logits, _padded(prompts, vocab), _padded(outputs, vocab), rep, freq, pres
    )  # fmt: skip
    for i in range(rows):
        want = np_penalize(logits[i], prompts[i], outputs[i], *settings[i])
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-6, atol=1e-5)
    assert not np.allclose(np.asarray(got[0]), logits[0])  # it did something


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, **SERVED, progress=False)


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.2, "presence_penalty": 0.7},
        {"repetition_penalty": 1.3, "frequency_penalty": -0.5, "presence_penalty": 1.5},
    ],
)
def test_greedy_with_penalties_matches_a_numpy_loop(llm, penalties):
    """Each generated token is the argmax of numpy's penalties over that step's logits (the
    model's, from one forward over the final sequence), with a margin over the runner-up (no
    near-ties); the logprobs are the model's before the penalties. The engine overlaps steps
    by default: with penalties it steps one at a time, and gives the same tokens either way."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 4000, size=12)]
    params = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0, **penalties
    )
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    llm.engine.overlapped = False
    one_at_a_time = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    llm.engine.overlapped = True
    assert list(one_at_a_time[0].outputs[0].token_ids) == tokens
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    unpenalised = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)
    assert list(unpenalised[0].outputs[0].token_ids) != tokens, "weak test: nothing changed"

    rows = np.asarray(llm.engine.runner.sequence_logits(prompt + tokens[:-1]))
    rows = rows[len(prompt) - 1 :]
    checked = 0
    for t, token in enumerate(tokens):
        want = np_penalize(rows[t], prompt, tokens[:t], **_np_args(penalties))
        order = np.argsort(want)[::-1]
        if want[order[0]] - want[order[1]] > 1e-3:  # skip near-ties (float32 order)
            assert token == order[0], f"step {t}"
            checked += 1
        raw = rows[t] - np.logaddexp.reduce(rows[t].astype(np.float64))
        assert out.logprobs[t][token].logprob == pytest.approx(raw[token], abs=2e-3)
    assert checked >= 20


def _np_args(penalties: dict) -> dict:
    return {
        "rep": penalties.get("repetition_penalty", 1.0),
        "freq": penalties.get("frequency_penalty", 0.0),
        "pres": penalties.get("presence_penalty", 0.0),
    }


def test_penalties_are_validated():
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
