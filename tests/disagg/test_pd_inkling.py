"""The tiny Inkling model disaggregated (real NIXL over UCX on host memory): full-attention,
sliding-window (window 6) and sconv (virtual windows of 3 tokens) groups, pages of 16 tokens.

The matrix runs {pull, push} x {TP 1/1, 2/1, 1/2} x {prompts prefilled in one chunk, prompts
prefilled in many chunks of 32}. In the second case the prefill engine's held tables carry null
pages for its freed window pages; in both the decode engine holds only its window (null pages
before it) and the transfer fills only the window. Each case checks, against a colocated engine
without prefix caching (the cold run):
  1. the P/D greedy tokens;
  2. (many chunks) a second P/D round whose prompts share 2 units (32 tokens) with the first:
     the decode engine serves them from its own prefix cache, receives fewer bytes, and still
     gives the cold tokens;
  3. plain requests on the decode engine that share a prefix with each transferred prompt
     (half of it: a hit there would read never-written window bytes; or all of it plus some
     of the output: a hit on transferred and decoded units) give the cold tokens;
  4. both pools end with no page in use and nothing held.
Engines are built once per module (same shapes everywhere, so compiled programs are reused),
and every engine, the cold one too, prefills in chunks of 32 (chunked prefill equals one pass:
test_inkling_engine), so that every prefill program has 16 or 32 tokens per row.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from engine_shapes import INKLING
from pd_polling import polling

from hybridserve import LLM
from hybridserve.config import KVTransferConfig, MtpConfig
from tests.disagg.test_pd_engines import GREEDY, _pd_generate
from tests.hybridserve.inkling_models import (
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    build_inkling,
    save_inkling,
    tiny_inkling,
)

CHUNK = 32  # every engine's max_prefill_chunk
COMMON = dict(**INKLING, progress=False)
SEATS = INKLING["max_num_seqs"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    cfg = tiny_inkling()
    return save_inkling(build_inkling(cfg, seed=3), cfg, tmp_path_factory.mktemp("ink") / "m")


@pytest.fixture(scope="module")
def engines(ckpt):
    """`engines(name, tp=1, **kv)`: one engine per distinct request, kept for the module."""
    made: dict[tuple, LLM] = {}

    def get(name: str, tp: int = 1, **kv) -> LLM:
        key = (name, tp, tuple(sorted(kv.items())))
        if key not in made:
            if name == "cold":
                made[key] = LLM(
                    ckpt, enable_prefix_caching=False, max_prefill_chunk=CHUNK, **COMMON
                )
            else:
                role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
                config = KVTransferConfig(kv_role=role[name], **{"lease_s": 600.0, **kv})
                made[key] = LLM(
                    ckpt,
                    tensor_parallel_size=tp,
                    max_prefill_chunk=CHUNK,
                    kv_transfer_config=config,
                    **COMMON,
                )
        return made[key]

    yield get
    for llm in made.values():
        llm.close()


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("chunks", ["one", "many"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_inkling_pd_matrix(engines, mode, prefill_tp, decode_tp, chunks):
    seed = ["pull", "push"].index(mode) * 100 + prefill_tp * 10 + decode_tp + (chunks == "many")
    rng = np.random.default_rng(seed)
    lo, hi = (12, CHUNK + 2) if chunks == "one" else (60, 96)  # n = len - 1 tokens prefilled
    prompts = [rng.integers(10, 4000, int(n)).tolist() for n in rng.integers(lo, hi, 4)]
    cold, prefill = engines("cold"), engines("prefill", prefill_tp)
    decode = engines("decode", decode_tp, transfer_mode=mode)
    stats = decode.engine.stats

    expected = greedy(cold, prompts)
    received, failures = stats()["transfer_bytes_received"], stats()["transfer_failures"]
    assert _pd_generate(prefill, decode, prompts, GREEDY) == expected  # 1.
    first_round = stats()["transfer_bytes_received"] - received
    assert first_round > 0

    if chunks == "many":  # 2. the same lengths, 32 tokens shared with the first round
        again = [p[:32] + rng.integers(10, 4000, len(p) - 32).tolist() for p in prompts]
        hits = stats()["prefix_cache_hit_tokens"]
        received = stats()["transfer_bytes_received"]
        assert _pd_generate(prefill, decode, again, GREEDY) == greedy(cold, again)
        assert stats()["prefix_cache_hit_tokens"] - hits == 32 * len(again)
        assert stats()["transfer_bytes_received"] - received < first_round

    # 3. plain requests sharing half of a transferred prompt, or all of it and 8 output tokens
    plain = [p[: len(p) // 2] + rng.integers(10, 4000, 5).tolist() for p in prompts]
    plain += [p + out[:8] + [11, 12] for p, out in zip(prompts, expected, strict=True)]
    outs = decode.generate([{"prompt_token_ids": p} for p in plain], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy(cold, plain)
    if chunks == "many":  # the transferred-and-decoded units were hit (valid bytes)
        assert sum(o.metrics.num_cached_tokens for o in outs[len(prompts) :]) > 0

    for engine in (prefill.engine, decode.engine):  # 4.
        assert engine.scheduler.coordinator.pool.num_used == 0
        assert not engine.scheduler.held and not engine.scheduler.requests
    assert stats()["transfer_failures"] == failures


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_request_waiting_past_its_deadline_is_given_up_on_both_sides(engines, policy):
    # SEATS local requests take every seat of the decode engine; a P/D request then waits for a
    # seat past its 0.5 s deadline: it fails with the reason (or recomputes locally, giving the
    # cold tokens), and the prefill engine frees its pages at once (its lease is 600 s). A
    # second waiting request aborted by the client frees the prefill pages the same way.
    prefill, cold = engines("prefill"), engines("cold")
    decode = engines("decode", wait_timeout_s=0.5, failure_policy=policy)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(10, 4000, 70).tolist() for _ in range(2)]
    outs = prefill.generate(
        [
            {"prompt_token_ids": p, "kv_transfer_params": {"do_remote_decode": True}}
            for p in prompts
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert len(prefill.engine.scheduler.held) == 2
    engine = decode.engine
    busy = dataclasses.replace(GREEDY, max_tokens=100)
    for i in range(SEATS):
        engine.add_request([20 + i, 30], busy, req_id=f"busy-{i}")
    engine.step()
    assert engine.scheduler.num_running == SEATS
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        engine.add_request(p, GREEDY, req_id=f"pd-{i}", kv_transfer_params=o.kv_transfer_params)
    assert len(engine.kv.waiting) == 2
    engine.abort_request("pd-1")
    time.sleep(0.6)
    finished = {o.request_id: o for o in engine.step() if o.finished}
    deadline = time.monotonic() + 10
    while prefill.engine.scheduler.held and time.monotonic() < deadline:
        prefill.engine.poll_transfers()
        time.sleep(0.001)
    assert not prefill.engine.scheduler.held
    assert prefill.engine.scheduler.coordinator.pool.num_used == 0
    if policy == "fail":
        out = finished["pd-0"].outputs[0]
        assert out.finish_reason == "abort" and "wait_timeout_s" in out.stop_reason
    else:
        assert "pd-0" not in finished and "pd-0" in engine.scheduler.requests
    for i in range(SEATS):
        engine.abort_request(f"busy-{i}")
    result = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                result[o.request_id] = o.outputs[0].token_ids
    if policy == "recompute":
        assert result["pd-0"] == greedy(cold, prompts[:1])[0]
    assert engine.scheduler.coordinator.pool.num_used == 0
    assert not engine.kv.waiting and not engine.scheduler.requests


def test_kv_both_engines_and_a_failed_transfer_register_only_valid_units(engines):
    # Two kv_both engines, one prefilling (chunks of 32) and one decoding. The second transfer
    # fails (its lease ended before the read: the prefill engine refuses it), so the decode
    # engine recomputes that prompt locally. Afterwards plain requests on the decode engine that
    # share prefixes of both prompts give the cold tokens.
    a, b = engines("both", engine_id="both-a"), engines("both", engine_id="both-b")
    cold = engines("cold")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(10, 4000, n).tolist() for n in (75, 88)]
    expected = greedy(cold, prompts)
    assert _pd_generate(a, b, prompts[:1], GREEDY) == expected[:1]
    (out,) = a.generate(
        [{"prompt_token_ids": prompts[1], "kv_transfer_params": {"do_remote_decode": True}}],
        GREEDY,
        use_tqdm=False,
    )
    a.engine.connector.producer.held[out.kv_transfer_params["req_id"]].deadline = 0.0  # ended
    a.engine.poll_transfers()
    assert not a.engine.scheduler.held
    failures = b.engine.stats()["transfer_failures"]
    handed = [{"prompt_token_ids": prompts[1], "kv_transfer_params": out.kv_transfer_params}]
    with polling(a):
        (result,) = b.generate(handed, GREEDY, use_tqdm=False)
    assert result.outputs[0].token_ids == expected[1]  # recomputed locally
    assert b.engine.stats()["transfer_failures"] == failures + 1
    plain = [p[: len(p) // 2] + [7, 8, 9] for p in prompts]
    plain += [p + out[:8] + [11, 12] for p, out in zip(prompts, expected, strict=True)]
    assert greedy(b, plain) == greedy(cold, plain)
    for engine in (a.engine, b.engine):
        assert engine.scheduler.coordinator.pool.num_used == 0


def test_multimodal_prompts_run_disaggregated(engines):
    """An image and a waveform in the prompt, through prefill then decode: both engines run the
    encoders on the same inputs (the decode side's computed tokens may hold placeholders: here
    the last prompt token is one, and its embedding comes from the decode side's encoder); the
    tokens equal a colocated engine's, and a text-only prompt's differ."""
    prefill, decode, cold = engines("prefill"), engines("decode"), engines("cold")
    rng = np.random.default_rng(9)
    data = {"image": [rng.normal(size=(8, 12, 3)).astype(np.float32)]}
    data["audio"] = rng.normal(size=300).astype(np.float32)
    ids = rng.integers(10, 4000, 20).tolist() + [IMAGE_TOKEN, 21, 22, AUDIO_TOKEN]
    prompt = {"prompt_token_ids": ids, "multi_modal_data": data}
    (want,) = cold.generate([prompt], GREEDY, use_tqdm=False)
    (out,) = prefill.generate(
        [{**prompt, "kv_transfer_params": {"do_remote_decode": True}}], GREEDY, use_tqdm=False
    )
    handed = {**prompt, "kv_transfer_params": out.kv_transfer_params}
    with polling(prefill):
        (got,) = decode.generate([handed], GREEDY, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_token_ids == want.prompt_token_ids  # the placeholders expanded alike
    text_only = greedy(cold, [ids])[0]
    assert text_only != want.outputs[0].token_ids, "weak test: the inputs changed nothing"
    for engine in (prefill.engine, decode.engine):
        assert engine.scheduler.coordinator.pool.num_used == 0


def test_inkling_pd_with_mtp_speculation_matches_colocated(tmp_path):
    # Both engines speculate with 2 MTP heads; the heads' KV caches are two more full-attention
    # entries that travel with the rest. The decode side computes the last prompt token, drafts
    # and verifies: its greedy tokens equal a colocated run without speculation.
    cfg = dataclasses.replace(tiny_inkling(), mtp=MtpConfig(num_heads=2))
    ckpt = save_inkling(build_inkling(cfg, seed=6), cfg, tmp_path / "m")
    rng = np.random.default_rng(6)
    prompts = [rng.integers(10, 4000, int(n)).tolist() for n in rng.integers(2, 60, 8)]
    colocated = greedy(LLM(ckpt, **COMMON), prompts)
    spec = {"method": "mtp", "num_speculative_tokens": 2}

    def role(kv_role: str) -> KVTransferConfig:
        return KVTransferConfig(kv_role=kv_role, lease_s=600.0)

    prefill = LLM(ckpt, kv_transfer_config=role("kv_producer"), speculative_config=spec, **COMMON)
    decode = LLM(ckpt, kv_transfer_config=role("kv_consumer"), speculative_config=spec, **COMMON)
    with prefill, decode:
        assert _pd_generate(prefill, decode, prompts, GREEDY) == colocated
        assert decode.engine.stats()["spec_num_drafts"] > 0
        for engine in (prefill.engine, decode.engine):
            assert engine.scheduler.coordinator.pool.num_used == 0
