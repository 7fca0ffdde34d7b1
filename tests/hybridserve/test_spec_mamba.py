"""Speculative decoding on a Mamba hybrid (the shipped nemotron_h model: Mamba2, attention, MLP
and MoE layers), float32.

A Mamba state cannot be rewound past a rejected draft, so a verifying step keeps the state from
before its drafts and the next step computes the accepted drafts again (`StepInput.commit`,
`Scheduler.recurrent`). The drafts come from an oracle that replays the plain greedy output
with some tokens replaced by wrong ones, so that steps accept none, some or all of their drafts.
The reference is the same engine settings without speculation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_shapes import TINY

from hybridserve import LLM, SamplingParams

K = 3
SETTINGS = {**TINY, "max_num_seqs": 3, "max_prefill_chunk": 16, "prefix_unit": 16}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(10, 4000, 24).tolist()
    return [rng.integers(10, 4000, n).tolist() for n in (5, 19, 33)] + [
        shared + rng.integers(10, 4000, 6).tolist(),
        shared + rng.integers(10, 4000, 2).tolist(),
    ]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=1 + 4 * (K + 1), ignore_eos=True)


@pytest.fixture(scope="module")
def plain_llm():
    """The engine without speculation: the reference."""
    with LLM(**SETTINGS, progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain(plain_llm) -> list[list[int]]:
    return _run(plain_llm, _prompts(), GREEDY)


def _oracle(plain: list[list[int]], wrong_every: int):
    replay = {tuple(p): out for p, out in zip(_prompts(), plain, strict=True)}

    def oracle(ids: list[int], k: int) -> list[int]:
        prompt = next(p for p in replay if tuple(ids[: len(p)]) == p)
        n = len(ids) - len(prompt)
        drafts = list(replay[prompt][n : n + k])
        for j in range(len(drafts)):  # some drafts wrong: a rejection at varying places
            if wrong_every and (n + j) % wrong_every == 0:
                drafts[j] = (drafts[j] + 1) % 4096
        return drafts + [0] * (k - len(drafts))

    return oracle


@pytest.mark.parametrize("wrong_every", [0, 2])
def test_greedy_speculation_on_a_mamba_hybrid_equals_plain(plain, wrong_every):
    spec = {"method": "oracle", "num_speculative_tokens": K, "oracle": _oracle(plain, wrong_every)}
    llm = LLM(**SETTINGS, progress=False, speculative_config=spec)
    try:
        assert _run(llm, _prompts(), GREEDY) == plain
        s = llm.engine.stats()
        assert s["spec_num_drafts"] > 0
        if wrong_every == 0:  # perfect drafts: every verifying step emits k + 1
            assert s["spec_num_accepted"] == s["spec_num_drafts"]
            assert s["spec_tokens_per_step"] == K + 1
        else:  # rejections, and acceptances before them
            assert 0 < s["spec_num_accepted"] < s["spec_num_drafts"]
        assert s["prefix_cache_hit_tokens"] > 0  # the shared 24 tokens
        assert llm.engine.scheduler.coordinator.pool.num_used == 0
    finally:
        llm.close()


def _lookup_reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup by brute force: longest n first, the latest earlier match."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == tail:
                return tokens[i + n : i + n + k]
    return []


def test_ngram_drafts_match_a_brute_force_lookup():
    from hybridserve.runner.ngram import ngram_drafts

    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, int(rng.integers(1, 30))).tolist()
        k, n_min = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        n_max = n_min + int(rng.integers(0, 3))
        want = _lookup_reference(tokens, k, n_min, n_max)
        assert ngram_drafts(tokens, k, n_min, n_max) == want, (tokens, k, n_min, n_max)


def test_ngram_speculation_on_a_mamba_hybrid_equals_plain(plain_llm):
    """Prompt lookup drafts (no draft model) on the Mamba hybrid, 48 tokens: the random
    model's greedy output falls into loops after a while, so lookups hit and are accepted
    there, and are rejected before."""
    prompts, params = _prompts()[1:4], dataclasses.replace(GREEDY, max_tokens=48)
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}
    want = _run(plain_llm, prompts, params)
    with LLM(**SETTINGS, progress=False, speculative_config=spec) as llm:
        assert _run(llm, prompts, params) == want
        s = llm.engine.stats()
        assert 0 < s["spec_num_accepted"] < s["spec_num_drafts"]
        assert s["spec_tokens_per_step"] > 1.5


# --- MTP layers of a Mamba hybrid (Nemotron-H's `mtp.layers.*`) ------------------------------

MTP_SETTINGS = {**SETTINGS, "max_num_seqs": 8}
TOP_K, PROMPT, ALPHA = 4, list(range(100, 111)), 1e-3


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory) -> str:
    """The shipped model's weights plus one MTP step (`nemotron_mtp`)."""
    from tests.hybridserve.nemotron_mtp import write_nemotron_mtp

    return write_nemotron_mtp(tmp_path_factory.mktemp("nmtp") / "m", mimic=0.95)


@pytest.fixture(scope="module")
def mtp_llm(mtp_path):
    """Drafting one token a step with the MTP layers."""
    path = mtp_path
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with LLM(path, **MTP_SETTINGS, progress=False, speculative_config=spec) as llm:
        yield llm


def test_mtp_layers_of_a_mamba_hybrid_draft_and_greedy_equals_plain(mtp_llm, plain):
    cfg = mtp_llm.engine.runner.cfg
    assert cfg.mtp is not None and cfg.mtp.num_heads == 1 and cfg.mtp.ffn == "moe"
    before = mtp_llm.engine.stats()["spec_num_drafts"]
    assert _run(mtp_llm, _prompts(), GREEDY) == plain  # the base weights are the shipped ones
    s = mtp_llm.engine.stats()
    assert s["spec_num_drafts"] > before
    assert mtp_llm.engine.scheduler.coordinator.pool.num_used == 0


def test_mtp_sampling_on_a_mamba_hybrid_is_exact(mtp_llm, plain_llm):
    """The joint distribution of the first two output tokens at temperature 1, top-k 4 (the
    second always drafted by the MTP step, which the verifier accepts at times and rejects at
    others; the third, a bonus or residual token, not counted) equals the exact one from the
    plain engine's one-pass logits (chi-square; test_mtp.py sizes such a test by power)."""
    from chi_square import p_value

    from tests.hybridserve.exact_joint import exact_joint

    joint = exact_joint(plain_llm.engine.runner, PROMPT, 2, TOP_K)
    cells = list(joint)
    exact = np.array([joint[c] for c in cells])
    n = 200
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True)
    before = mtp_llm.engine.stats()
    got = _run(mtp_llm, [PROMPT] * n, params)
    s = mtp_llm.engine.stats()
    drafts = s["spec_num_drafts"] - before["spec_num_drafts"]
    accepted = s["spec_num_accepted"] - before["spec_num_accepted"]
    assert 0 < accepted < drafts  # both branches of the verifier ran
    index = {c: i for i, c in enumerate(cells)}
    assert all(tuple(g[:2]) in index for g in got)  # nothing outside the support
    counts = np.bincount([index[tuple(g[:2])] for g in got], minlength=len(cells)).astype(float)
    assert p_value(counts, exact) > ALPHA
    # the test tells a verifier that accepts every draft apart (its second token: the draft's)
    assert accepted / drafts < 0.9


def test_mtp_tensors_load_into_the_heads(mtp_llm, mtp_path):
    # Every MTP tensor of the checkpoint is the head's parameter it names (`hf_names`): the
    # norms as they are, eh_proj transposed with its halves swapped (ours: [hidden; embedding]
    # rows, NVIDIA's: [embedding, hidden] columns), the attention projections transposed.
    from safetensors.torch import load_file

    ckpt = load_file(f"{mtp_path}/model.safetensors")
    head = mtp_llm.engine.runner.params["mtp"][0]

    def ours(x) -> np.ndarray:
        return np.asarray(x[...], np.float32)

    def theirs(name: str) -> np.ndarray:
        return ckpt[name].float().numpy()

    d = theirs("mtp.layers.0.enorm.weight").shape[0]
    eh = theirs("mtp.layers.0.eh_proj.weight")  # [D, 2D]: inputs [embedding, hidden]
    np.testing.assert_array_equal(ours(head["proj"]), np.concatenate([eh[:, d:].T, eh[:, :d].T]))
    pairs = {
        "norm_e": "mtp.layers.0.enorm",
        "norm_h": "mtp.layers.0.hnorm",
        "norm_o": "mtp.layers.1.final_layernorm",
    }
    for name, hf in pairs.items():
        np.testing.assert_array_equal(ours(head[name]["weight"]), theirs(f"{hf}.weight"))
    block = head["block"]
    np.testing.assert_array_equal(ours(block["norm"]["weight"]), theirs("mtp.layers.0.norm.weight"))
    np.testing.assert_array_equal(
        ours(block["ffn_norm"]["weight"]), theirs("mtp.layers.1.norm.weight")
    )
    np.testing.assert_array_equal(
        ours(block["mixer"]["q_proj"]["kernel"]).reshape(d, -1),
        theirs("mtp.layers.0.mixer.q_proj.weight").T,
    )
