"""Overlapped steps (`async_scheduling`, the default): step N+1 is scheduled and dispatched
before step N's tokens reach the host, which reads them on the device; stop rules apply one
step late and the extra token is dropped. Whatever a request sees must equal the one-step-at-
a-time engine's: the same tokens, finish and stop reasons, logprobs and text, with stop
strings, stop tokens, min_tokens, seeded sampling, prefix-cache hits, preemption in a pool too
small for every request at once, and a request aborted while its step is in flight; and no
page may leak (the pool is empty when the engine is idle).
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_shapes import SERVED, TINY

from hybridserve import LLM, SamplingParams
from hybridserve.config import CacheConfig


def _requests(vocab: int, n: int = 10) -> tuple[list[dict], list[SamplingParams]]:
    rng = np.random.default_rng(7)
    prompts = [
        {"prompt_token_ids": rng.integers(3, vocab, int(k)).tolist()}
        for k in rng.integers(3, 40, n)
    ]
    stops = [int(t) for t in range(3, vocab, 9)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=17, stop_token_ids=stops),
        SamplingParams(temperature=0.0, max_tokens=17, stop_token_ids=stops, min_tokens=6),
        SamplingParams(temperature=0.9, top_p=0.8, max_tokens=15, seed=3, logprobs=2),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=12, seed=4),
    ]
    params += [SamplingParams(temperature=0.0, max_tokens=int(m)) for m in rng.integers(2, 24, n)]
    return prompts, params[:n]


def _run(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
        + (o.outputs[0].logprobs, o.outputs[0].text)
        for o in outs
    ]


def _idle_pool(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert not llm.engine.has_unfinished()
    cached = llm.engine.scheduler.coordinator
    # pages still used are prefix-cache entries only (evictable): none is referenced
    assert all(cached.pool.ref_count(p) == 0 for p in range(1, cached.pool.num_pages))


@pytest.fixture(scope="module")
def engines(hf_checkpoint):
    path = str(hf_checkpoint("nemotron_h")[0])
    return {
        mode: LLM(path, **TINY, async_scheduling=mode, progress=False) for mode in (False, True)
    }


def test_overlapped_steps_give_the_same_outputs(engines):
    vocab = engines[True].engine.model_config.vocab_size
    prompts, params = _requests(vocab)
    sync, overlapped = (_run(engines[m], prompts, params) for m in (False, True))
    assert overlapped == sync
    reasons = {r[1] for r in sync}
    assert reasons == {"stop", "length"}, "weak test: no request stopped on a token"
    for llm in engines.values():
        _idle_pool(llm)


def test_prefix_hits_and_preemption_match(hf_checkpoint):
    """A pool of 15 pages, 5 a request (preemption by recompute), and nine prompts
    sharing a 32-token prefix (prefix-cache hits), in both modes."""
    path = str(hf_checkpoint("nemotron_h")[0])
    rng = np.random.default_rng(11)
    shared = rng.integers(3, 400, 32).tolist()
    prompts = [{"prompt_token_ids": shared + rng.integers(3, 400, 5).tolist()} for _ in range(9)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results, stats = {}, {}
    for mode in (False, True):
        llm = LLM(
            path, **TINY, cache=CacheConfig(num_pages=16), async_scheduling=mode, progress=False
        )
        results[mode] = _run(llm, prompts, params)
        stats[mode] = llm.engine.stats()
        _idle_pool(llm)
    assert results[True] == results[False]
    for s in stats.values():
        assert s["num_preemptions"] > 0 and s["prefix_cache_hit_tokens"] > 0


def test_abort_while_the_step_is_in_flight(engines):
    """Abort a request right after the step that computes it was dispatched: the others go on
    as in the one-step engine, nothing is reported for it after the abort, no page leaks."""
    vocab = engines[True].engine.model_config.vocab_size
    prompts, _ = _requests(vocab, 4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    got = {}
    for mode, llm in engines.items():
        engine = llm.engine
        ids = [engine.add_request(p["prompt_token_ids"], params) for p in prompts]
        outputs: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished():
            for o in engine.step():
                assert o.request_id != ids[1] or steps < 3, "an output after the abort"
                outputs[o.request_id] = list(o.outputs[0].token_ids)
            steps += 1
            if steps == 3:
                engine.abort_request(ids[1])
        got[mode] = [outputs[r] for r in (ids[0], ids[2], ids[3])]
        _idle_pool(llm)
    assert got[True] == got[False]
    assert all(len(t) == 20 for t in got[True])


def test_stop_strings_and_text():
    """The shipped model (it has a tokenizer): stop strings end requests one step late in the
    overlapped engine, with the same text."""
    texts = {}
    for mode in (False, True):
        llm = LLM(**SERVED, async_scheduling=mode, progress=False)
        free = _run(llm, ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=24))
        word = free[0][4][5:9]  # a stretch of the free-running text: a stop string that hits
        params = SamplingParams(temperature=0.0, max_tokens=24, stop=[word])
        texts[mode] = _run(llm, ["Once upon a time", "The cache"], params)
        assert texts[mode][0][2] == word and word not in texts[mode][0][4]
    assert texts[True] == texts[False]


def test_first_call_dispatches_and_reports_nothing(engines):
    engine = engines[True].engine
    engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.step() == [] and engine.has_unfinished()  # step 0's tokens are in flight
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert len(finished) == 1 and len(finished[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_the_pool_cannot_hold_is_failed_once(engines, overlap):
    """A schedule that finds a request can never fit the pool fails that request: its final
    output (reason "abort") is handed out exactly once, and the engine keeps serving."""
    from hybridserve.core.scheduler import PoolTooSmall

    engine = engines[overlap].engine
    params = SamplingParams(temperature=0.0, max_tokens=3)
    doomed = engine.add_request([5, 6, 7], params)
    other = engine.add_request([8, 9, 10], params)
    scheduler, real = engine.scheduler, engine.scheduler.schedule

    def refuse_once():
        scheduler.schedule = real
        raise PoolTooSmall("too big for this pool (test)", doomed)

    scheduler.schedule = refuse_once
    seen: list = []
    while engine.has_unfinished():
        seen += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in seen].count(doomed) == 1
    assert next(o for o in seen if o.request_id == doomed).outputs[0].finish_reason == "abort"
    assert [o.request_id for o in seen].count(other) == 1
    _idle_pool(engines[overlap])


def test_switching_modes_between_steps(engines):
    """`overlapped` switches one engine between the two modes (the decode benchmark compares
    them on one engine). Switching off lands the step in flight, whose outputs come with the
    next step: switched off and on again midway, every request gets the one-step engine's
    tokens, each output once, and no page leaks."""
    vocab = engines[True].engine.model_config.vocab_size
    prompts, _ = _requests(vocab, 3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = engines[True].engine
    ids = [engine.add_request(p["prompt_token_ids"], params) for p in prompts]
    outputs: dict[str, list[int]] = {r: [] for r in ids}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            new = list(o.outputs[0].token_ids)
            assert new[: len(outputs[o.request_id])] == outputs[o.request_id]
            assert len(new) > len(outputs[o.request_id]), "an output handed out twice"
            outputs[o.request_id] = new
        steps += 1
        if steps == 4:
            assert engine.in_flight
            engine.overlapped = False
            assert not engine.in_flight and not engine.overlapped
        if steps == 8:
            engine.overlapped = True
    assert engine.overlapped
    want = _run(engines[False], prompts, [params] * 3)
    assert [outputs[r] for r in ids] == [w[0] for w in want]
    _idle_pool(engines[True])
