"""Scheduler: budgets, chunking, alignment, preemption, aborts, stop rules and prefix hits on a
tiny plan, driven by the content-checking fake runner."""

from __future__ import annotations

import pytest
from core_fixtures import (
    ContentRunner,
    check_invariants,
    make_config,
    make_plan,
    make_request,
    next_token,
    reference,
    run_step,
)

from hybridserve.core.prefix_cache import chain_hashes
from hybridserve.core.request import Request, RequestStatus
from hybridserve.core.scheduler import PoolTooSmall, Scheduler


def spans(out):
    return [(c.req_id, c.start, len(c.token_ids), c.sample) for c in out.chunks]


def drain(scheduler, runner, limit=500):
    finished = []
    for _ in range(limit):
        if not scheduler.has_unfinished():
            return finished
        finished += run_step(scheduler, runner)[1]
        check_invariants(scheduler)
    raise AssertionError("did not finish")


def test_budget_chunked_prefill_and_mixed_steps():
    config = make_config(
        max_num_batched_tokens=64, max_prefill_chunk=32, enable_prefix_caching=False
    )
    s = Scheduler(make_plan("A"), 64, config)
    runner = ContentRunner(s)
    prompts = {f"r{i}": [100 * i + k for k in range(50)] for i in range(3)}
    for req_id, prompt in prompts.items():
        s.add_request(make_request(req_id, prompt, max_tokens=4))
    out, _ = run_step(s, runner)
    assert spans(out) == [("r0", 0, 32, False), ("r1", 0, 32, False)]
    assert out.chunks[1].token_ids == tuple(prompts["r1"][:32])
    assert out.chunks[0].block_tables == ((1, 2),) and out.num_scheduled_tokens == 64
    assert (s.num_running, s.num_waiting) == (2, 1)
    out, _ = run_step(s, runner)
    assert spans(out) == [("r0", 32, 18, True), ("r1", 32, 18, True), ("r2", 0, 28, False)]
    out, _ = run_step(s, runner)  # decode and prefill in one step
    assert spans(out) == [("r0", 50, 1, True), ("r1", 50, 1, True), ("r2", 28, 22, True)]
    assert out.chunks[0].token_ids == (next_token(prompts["r0"]),)
    out, _ = run_step(s, runner)
    assert spans(out) == [("r0", 51, 1, True), ("r1", 51, 1, True), ("r2", 50, 1, True)]
    finished = drain(s, runner)
    assert [r.req_id for r in finished] == ["r0", "r1", "r2"]
    for r in finished:
        assert r.output_token_ids == reference(r, config.max_model_len)[0]


def test_max_num_seqs_limits_running_requests():
    s = Scheduler(make_plan("A"), 64, make_config(max_num_seqs=2))
    runner = ContentRunner(s)
    for i in range(4):
        s.add_request(make_request(f"r{i}", [i] * 5, max_tokens=1))
    out, finished = run_step(s, runner)
    assert spans(out) == [("r0", 0, 5, True), ("r1", 0, 5, True)]
    assert [r.req_id for r in finished] == ["r0", "r1"] and s.num_waiting == 2
    out, finished = run_step(s, runner)
    assert [c.req_id for c in out.chunks] == ["r2", "r3"] and not s.has_unfinished()


@pytest.mark.parametrize(
    "kinds,caching,expected",
    [
        ("MA", True, [(0, 16), (16, 16), (32, 16), (48, 2)]),  # unit 16: chunks end on it
        ("MA", False, [(0, 24), (24, 24), (48, 2)]),
        ("A", True, [(0, 24), (24, 24), (48, 2)]),  # no Mamba groups: no need to align
    ],
)
def test_prefill_chunks_end_on_unit_boundaries_with_mamba(kinds, caching, expected):
    config = make_config(max_prefill_chunk=24, enable_prefix_caching=caching)
    s = Scheduler(make_plan(kinds), 64, config)
    runner = ContentRunner(s)
    s.add_request(make_request("r", range(50), max_tokens=1))
    outs = [run_step(s, runner)[0] for _ in expected]
    assert [(c.start, len(c.token_ids)) for o in outs for c in o.chunks] == expected
    assert not s.has_unfinished()
    if kinds == "MA" and caching:
        # state page 1 is snapshotted before each step that starts on a boundary
        assert [o.page_copies for o in outs] == [(), ((1, 4),), ((1, 6),), ((1, 8),)]
        h = chain_hashes(list(range(50)), 16, [], 3)
        assert [s.coordinator.pool.lookup((0, x)) for x in h] == [(4, 0), (6, 0), (8, 0)]
        assert s.prefix_cache_stats.num_snapshots == 3


def test_preemption_evicts_the_newest_and_recomputes_prompt_and_outputs():
    config = make_config(max_model_len=128, enable_prefix_caching=False)
    s = Scheduler(make_plan("MA"), 7, config)  # 6 pages: two requests of <= 32 tokens
    runner = ContentRunner(s)
    for i in range(3):
        s.add_request(make_request(f"r{i}", [10 * i + k for k in range(20)], max_tokens=20))
    r0, r1, r2 = (s.requests[f"r{i}"] for i in range(3))
    out, _ = run_step(s, runner)
    assert [c.req_id for c in out.chunks] == ["r0", "r1"] and s.num_waiting == 1
    for _ in range(12):  # decode to 32 computed tokens: the next token needs a third page
        out, _ = run_step(s, runner)
    assert r0.num_computed_tokens == 32 and s.coordinator.num_free == 0
    out, _ = run_step(s, runner)
    assert [c.req_id for c in out.chunks] == ["r0"]
    assert r1.status is RequestStatus.PREEMPTED and r1.num_preemptions == 1
    assert r1.num_computed_tokens == 0 and len(r1.output_token_ids) == 13
    assert list(s.waiting) == [r1, r2] and s.num_preemptions == 1
    check_invariants(s)
    recompute = []
    while r1.num_computed_tokens < 33:
        out, _ = run_step(s, runner)
        recompute += [spans(out)[i] for i, c in enumerate(out.chunks) if c.req_id == "r1"]
    assert recompute == [("r1", 0, 32, False), ("r1", 32, 1, True)]
    finished = drain(s, runner)
    for r in (r0, r1, r2):
        assert r.is_finished and r.output_token_ids == reference(r, 128)[0]
    assert r0 not in finished and {r.req_id for r in finished} == {"r1", "r2"}


def test_a_request_preempts_itself_when_it_is_the_newest():
    s = Scheduler(make_plan("MA"), 10, make_config(enable_prefix_caching=False))
    runner = ContentRunner(s)
    for i, n in enumerate((20, 20, 30)):
        s.add_request(make_request(f"r{i}", [10 * i + k for k in range(n)], max_tokens=12))
    for _ in range(4):  # r2 (chunks of 24 and 6 tokens, then decodes) reaches 32 tokens
        run_step(s, runner)
    assert s.requests["r2"].num_computed_tokens == 32 and s.coordinator.num_free == 0
    out, _ = run_step(s, runner)
    assert [c.req_id for c in out.chunks] == ["r0", "r1"]
    assert s.requests["r2"].status is RequestStatus.PREEMPTED and s.waiting[0].req_id == "r2"
    for r in drain(s, runner):
        assert r.output_token_ids == reference(r, 256)[0]


def test_pool_too_small_for_one_request():
    s = Scheduler(make_plan("A"), 3, make_config(max_model_len=64))
    s.add_request(make_request("r", range(20), max_tokens=30))
    runner = ContentRunner(s)
    with pytest.raises(PoolTooSmall, match="cannot hold request 'r' on its own"):
        for _ in range(20):
            run_step(s, runner)
    s = Scheduler(make_plan("A"), 3, make_config(max_prefill_chunk=64))
    s.add_request(make_request("big", range(40)))
    with pytest.raises(PoolTooSmall, match="40 tokens need 3 pages"):
        s.schedule()


def test_abort_in_every_state():
    s = Scheduler(make_plan("MA"), 7, make_config(enable_prefix_caching=False))
    runner = ContentRunner(s)
    for i in range(4):
        s.add_request(make_request(f"r{i}", [10 * i + k for k in range(20)], max_tokens=20))
    waiting = s.abort_request("r3")
    assert waiting.status is RequestStatus.FINISHED_ABORTED and waiting.finish_reason == "abort"
    assert [r.req_id for r in s.waiting] == ["r0", "r1", "r2"] and s.abort_request("r3") is None
    for _ in range(14):  # r1 is preempted at 32 tokens, as in the preemption test
        run_step(s, runner)
    assert s.requests["r1"].status is RequestStatus.PREEMPTED
    free = s.coordinator.num_free
    assert s.abort_request("r1").status is RequestStatus.FINISHED_ABORTED
    assert s.coordinator.num_free == free and [r.req_id for r in s.waiting] == ["r2"]
    out = s.schedule()  # r0 decodes, r2 waits for pages
    assert [c.req_id for c in out.chunks] == ["r0"]
    r0 = s.abort_request("r0")  # while its step is in flight
    assert s.coordinator.num_free == 6 - len(s.coordinator.transient_pages)
    outputs = list(r0.output_token_ids)
    assert s.update_from_output(out, runner.step(out)) == []
    assert r0.output_token_ids == outputs and r0.num_computed_tokens == 33
    check_invariants(s)
    out, _ = run_step(s, runner)
    assert [c.req_id for c in out.chunks] == ["r2"]
    done = s.finish_request("r2", "stop", stop_reason="a stop string")
    assert (done.status, done.finish_reason, done.stop_reason) == (
        RequestStatus.FINISHED_STOPPED,
        "stop",
        "a stop string",
    )
    assert not s.has_unfinished() and s.coordinator.num_free == 6
    s.add_request(make_request("x", [1]))
    with pytest.raises(ValueError, match="finish reason"):
        s.finish_request("x", "bored")
    assert s.requests["x"].status is RequestStatus.WAITING


def test_add_request_checks_and_max_model_len_stop():
    s = Scheduler(make_plan("A"), 32, make_config(max_model_len=64))
    with pytest.raises(ValueError, match="max_model_len is 64"):
        s.add_request(make_request("long", range(64)))
    s.add_request(make_request("r", range(60), max_tokens=100))
    with pytest.raises(ValueError, match="already queued"):
        s.add_request(make_request("r", range(3)))
    (done,) = drain(s, ContentRunner(s))
    assert (len(done.output_token_ids), done.num_tokens, done.finish_reason) == (4, 64, "length")


def test_stop_rules():
    r = Request("r", [1, 2], max_tokens=5, min_tokens=2, eos_token_ids={7}, stop_token_ids={9})
    r.output_token_ids.append(7)
    assert not r.check_stop(100)  # EOS before min_tokens is ignored
    r.output_token_ids.append(9)
    assert r.check_stop(100) and (r.finish_reason, r.stop_reason) == ("stop", 9)
    r = Request("r", [1, 2], max_tokens=5, eos_token_ids={7})
    r.output_token_ids.append(7)
    assert r.check_stop(100) and (r.status, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, None)
    r = Request("r", [1, 2], max_tokens=2)
    r.output_token_ids += [7]
    assert not r.check_stop(100)
    r.output_token_ids += [7]
    assert r.check_stop(100) and r.status is RequestStatus.FINISHED_LENGTH
    r = Request("r", [1, 2], max_tokens=10)
    r.output_token_ids += [3]
    assert r.check_stop(3) and r.finish_reason == "length"  # max_model_len
    with pytest.raises(ValueError, match="empty"):
        Request("r", [], max_tokens=1)


def test_prefix_hit_with_mamba_groups_shares_pages_and_copies_state():
    config = make_config(max_prefill_chunk=12, prefix_unit=4)
    s = Scheduler(make_plan("MA"), 64, config)
    runner = ContentRunner(s)
    a_prompt = list(range(1, 46))
    s.add_request(make_request("a", a_prompt, max_tokens=3))
    a_spans = [spans(run_step(s, runner)[0]) for _ in range(5)]
    assert [x[0][1:3] for x in a_spans] == [(0, 12), (12, 12), (24, 12), (36, 8), (44, 1)]
    a_tables = s.coordinator.block_tables(s.requests["a"])
    drain(s, runner)
    h = chain_hashes(a_prompt, 4, [], 11)
    snaps = {k: s.coordinator.pool.lookup((0, h[k])) for k in range(11)}
    assert {k for k, v in snaps.items() if v} == {2, 5, 8, 10}  # states at 12, 24, 36, 44

    # b shares 40 tokens (10 units); the last snapshot inside them is at 36 (unit 8)
    for name in ("b", "c"):
        s.add_request(make_request(name, a_prompt[:40] + [200 + k for k in range(6)]))
    out, _ = run_step(s, runner)
    b, c = s.requests["b"], s.requests["c"]
    assert b.num_cached_tokens == c.num_cached_tokens == 36
    assert spans(out) == [("b", 36, 8, False), ("c", 36, 8, False)]  # ends on unit 11
    b_tables, c_tables = out.chunks[0].block_tables, out.chunks[1].block_tables
    assert b_tables[1][:2] == c_tables[1][:2] == a_tables[1][:2]  # whole pages: shared
    assert [s.coordinator.pool.ref_count(p) for p in a_tables[1][:2]] == [2, 2]
    snap36 = snaps[8][0]
    assert set(out.page_copies) == {
        (a_tables[1][2], b_tables[1][2]),  # the page holding 36, copied
        (snap36, b_tables[0][0]),  # the state at 36, copied into b's running state page
        (a_tables[1][2], c_tables[1][2]),
        (snap36, c_tables[0][0]),
    }
    check_invariants(s)
    finished = drain(s, runner)
    assert sorted(r.req_id for r in finished) == ["b", "c"]
    for r in finished:
        assert r.output_token_ids == reference(r, config.max_model_len)[0]
    stats = s.prefix_cache_stats
    assert (stats.hit_tokens, stats.queried_tokens) == (72, 45 + 46 + 46)
    assert stats.hit_rate == pytest.approx(72 / 137)


def test_a_prompt_waits_for_the_prefix_a_running_prompt_computes():
    """n > 1 (the same prompt several times) and prompts that start alike: a request whose
    next prefix unit a running prompt is computing stays queued until it is cached (others
    pass it), then reads it; without prefix caching nothing waits."""
    for caching, kinds in ((True, "MA"), (True, "A"), (False, "MA")):
        config = make_config(max_prefill_chunk=16, prefix_unit=4, enable_prefix_caching=caching)
        s = Scheduler(make_plan(kinds), 64, config)
        runner = ContentRunner(s)
        prompt = list(range(1, 35))
        for name in ("a", "b"):
            s.add_request(make_request(name, prompt, max_tokens=2))
        s.add_request(make_request("other", [60] * 9, max_tokens=2))
        out, _ = run_step(s, runner)
        if not caching:
            assert [c.req_id for c in out.chunks] == ["a", "b", "other"]
            drain(s, runner)
            continue
        assert [c.req_id for c in out.chunks] == ["a", "other"]  # b waits, other passes it
        assert [r.req_id for r in s.waiting] == ["b"]
        while s.requests["b"].status is RequestStatus.WAITING:
            run_step(s, runner)
            check_invariants(s)
        assert s.requests["b"].num_cached_tokens == 32  # a's prompt up to its last unit
        finished = drain(s, runner)
        for r in finished:
            assert r.output_token_ids == reference(r, config.max_model_len)[0]


def test_no_hit_without_a_snapshot():
    config = make_config(max_prefill_chunk=32, prefix_unit=4)
    s = Scheduler(make_plan("MA"), 64, config)
    runner = ContentRunner(s)
    a_prompt = list(range(1, 41))
    s.add_request(make_request("a", a_prompt, max_tokens=2))
    run_step(s, runner)  # a computes [0, 32): attention units 0..7 are now cached
    s.add_request(make_request("c", a_prompt[:36] + [99] * 4))
    out, _ = run_step(s, runner)  # the snapshot at 32 is taken in this very step
    a_state = out.chunks[0].block_tables[0][0]
    assert [src for src, _ in out.page_copies] == [a_state]
    # so c has no hit yet: it waits for a (which computes what c would read), then reads 32
    assert spans(out) == [("a", 32, 8, True)] and s.requests["c"].status is RequestStatus.WAITING
    out, _ = run_step(s, runner)
    assert ("c", 32, 8, True) in spans(out) and s.requests["c"].num_cached_tokens == 32
    drain(s, runner)
    s.add_request(make_request("b", a_prompt[:20] + [98] * 10))  # units 0..4: no state there
    out, _ = run_step(s, runner)
    assert s.requests["b"].num_cached_tokens == 0 and out.page_copies == ()
    drain(s, runner)
    # the same without Mamba groups hits at unit granularity
    s = Scheduler(make_plan("A"), 64, config)
    runner = ContentRunner(s)
    s.add_request(make_request("a", a_prompt, max_tokens=2))
    drain(s, runner)
    s.add_request(make_request("b", a_prompt[:20] + [98] * 10))
    out, _ = run_step(s, runner)
    assert s.requests["b"].num_cached_tokens == 20 and len(out.page_copies) == 1
    drain(s, runner)


def test_schedule_and_update_alternate():
    s = Scheduler(make_plan("A"), 16, make_config())
    assert s.schedule().is_empty and s.update_from_output(s.schedule(), {}) == []
    s.add_request(make_request("r", range(5), max_tokens=1))
    out = s.schedule()
    with pytest.raises(RuntimeError, match="before update_from_output"):
        s.schedule()
    with pytest.raises(KeyError, match="no sampled token"):
        s.update_from_output(out, {})
    assert s.requests["r"].num_computed_tokens == 0  # nothing applied: the update can be retried
    (done,) = s.update_from_output(out, {"r": 3})
    assert done.output_token_ids == [3] and done.num_computed_tokens == 5


def test_request_tokens_and_status():
    r = Request("r", [1, 2, 3], max_tokens=4)
    r.output_token_ids += [4, 5]
    assert r.all_token_ids == [1, 2, 3, 4, 5] and (r.num_tokens, r.num_prompt_tokens) == (5, 3)
    for start in range(6):
        for stop in range(start, 6):
            assert r.token_slice(start, stop) == tuple([1, 2, 3, 4, 5][start:stop])
    finished = {s for s in RequestStatus if s.is_finished}
    assert {s.name for s in finished} == {"FINISHED_STOPPED", "FINISHED_LENGTH", "FINISHED_ABORTED"}
    assert not r.is_finished and r.status is RequestStatus.WAITING


def test_abort_a_running_request_between_steps():
    s = Scheduler(make_plan("MA"), 16, make_config(prefix_unit=4))
    runner = ContentRunner(s)
    s.add_request(make_request("a", range(1, 30), max_tokens=5))
    s.add_request(make_request("b", range(100, 110), max_tokens=5))
    run_step(s, runner)
    assert s.coordinator.num_free == 15 - 3 - 2  # a: state + 2 pages, b: state + 1 page
    aborted = s.abort_request("a")
    assert aborted.status is RequestStatus.FINISHED_ABORTED and s.coordinator.num_free == 13
    assert not s.coordinator.has_pages("a") and s.coordinator.pool.is_cached(1)  # state at 28
    out, _ = run_step(s, runner)
    assert [c.req_id for c in out.chunks] == ["b"]
    check_invariants(s)


@pytest.mark.parametrize("decode_first", [True, False])
def test_decodes_first_and_the_prompt_tokens_cap(decode_first):
    """Decode first: the running decodes lead the step and the prompts share what is left,
    at most max_num_prefill_tokens while anything decodes (a step of prompts alone takes the
    whole budget); in arrival order the same step leads with the prompts."""
    config = make_config(
        max_num_batched_tokens=40,
        max_prefill_chunk=16,
        max_num_prefill_tokens=20,
        enable_prefix_caching=False,
        decode_first=decode_first,
    )
    s = Scheduler(make_plan("MA"), 64, config)
    runner = ContentRunner(s)
    prompts = {"r0": list(range(1, 41)), "r1": list(range(2, 42)), "r2": [5, 6, 7, 8]}
    for req_id, prompt in prompts.items():
        s.add_request(make_request(req_id, prompt, max_tokens=30))
    out, _ = run_step(s, runner)  # nothing decodes yet: prompts alone, the whole budget
    assert spans(out) == [("r0", 0, 16, False), ("r1", 0, 16, False), ("r2", 0, 4, True)]
    out, _ = run_step(s, runner)  # r2 decodes: r0 takes 16 of the 20 prompt tokens, r1 4
    decodes = [c.req_id for c in out.chunks if len(c.token_ids) == 1]
    assert decodes == ["r2"]
    prompt_spans = [span for span in spans(out) if span[0] != "r2"]
    assert prompt_spans == [("r0", 16, 16, False), ("r1", 16, 4, False)]
    if decode_first:
        assert out.chunks[0].req_id == "r2"
    else:
        assert out.chunks[-1].req_id == "r2"
    while any(len(c.token_ids) > 1 for c in out.chunks):  # until the prompts are read
        out, _ = run_step(s, runner)
        assert sum(len(c.token_ids) for c in out.chunks) <= 40
        assert sum(len(c.token_ids) for c in out.chunks if len(c.token_ids) > 1) <= 20
    finished = drain(s, runner)
    assert sorted(r.req_id for r in finished) == ["r0", "r1", "r2"]
    for r in finished:
        assert r.output_token_ids == reference(r, config.max_model_len)[0]


def test_prompt_tokens_cap_is_checked():
    with pytest.raises(ValueError, match="max_num_prefill_tokens"):
        make_config(max_num_prefill_tokens=0)
