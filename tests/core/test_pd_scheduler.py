"""Scheduler support for disaggregated prefill/decode: held pages and parked remote requests."""

from __future__ import annotations

import random

import pytest
from core_fixtures import (
    ContentRunner,
    check_invariants,
    make_config,
    make_plan,
    make_request,
    reference,
    run_step,
)
from test_soak import random_request

from hybridserve.core.cache_manager import CacheCoordinator
from hybridserve.core.request import RequestStatus
from hybridserve.core.scheduler import Scheduler


def _run(scheduler: Scheduler, token: int = 7) -> list:
    out = scheduler.schedule()
    sampled = {c.req_id: token for c in out.chunks if c.sample}
    return out, scheduler.update_from_output(out, sampled)


def test_prefill_side_holds_pages_until_released():
    s = Scheduler(make_plan("MA"), 32, make_config())
    req = make_request("p", range(1, 40), max_tokens=1, hold_pages=True)
    s.add_request(req)
    while s.has_unfinished():
        _run(s)
    tables = s.held_tables("p")
    assert [len(t) for t in tables] == [1, 3]  # state page; 40 tokens in pages of 16
    used = s.coordinator.pool.num_used
    assert used == 4
    assert s.release_held("p") and not s.release_held("p")
    assert s.coordinator.pool.num_used == 0


def test_parked_remote_request_runs_from_the_transferred_position():
    s = Scheduler(make_plan("MA"), 32, make_config())
    req = make_request("d", range(1, 40), max_tokens=3)
    slots = s.add_remote_request(req, 38)
    tables = slots.block_tables
    assert [len(t) for t in tables] == [1, 3]  # pages for 39 tokens: the first decode step's too
    assert slots.fill_from == (0, 0) and slots.num_tokens == 38 and slots.num_cached_tokens == 0
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert s.schedule().is_empty  # parked: nothing to run yet
    s.finish_remote_kv("d", ok=True)
    out, _ = _run(s)
    (chunk,) = out.chunks
    assert (chunk.start, chunk.token_ids, chunk.sample) == (38, (39,), True)
    assert chunk.block_tables == tables  # the first decode step needs no new page
    while s.has_unfinished():
        _run(s)
    assert req.output_token_ids == [7, 7, 7] and s.coordinator.pool.num_used == 0


def test_failed_transfer_recomputes_and_abort_frees():
    s = Scheduler(make_plan("MA"), 32, make_config())
    req = make_request("d", range(1, 20), max_tokens=1)
    s.add_remote_request(req, 18)
    s.finish_remote_kv("d", ok=False)
    out, _ = _run(s)
    assert out.chunks[0].start == 0  # recomputed from scratch
    other = make_request("e", range(1, 20), max_tokens=1)
    s.add_remote_request(other, 18)
    s.abort_request("e")
    assert "e" not in s.remote and other.status is RequestStatus.FINISHED_ABORTED
    while s.has_unfinished():
        _run(s)
    assert s.coordinator.pool.num_used == 0


def test_no_seat_no_pages_means_retry_later():
    s = Scheduler(make_plan("MA"), 6, make_config(max_num_seqs=1))
    assert s.add_remote_request(make_request("a", range(1, 20)), 18) is not None
    assert s.add_remote_request(make_request("b", range(1, 20)), 18) is None  # no seat
    s2 = Scheduler(make_plan("MA"), 4, make_config())
    assert s2.add_remote_request(make_request("c", range(1, 48)), 46) is None  # 1 + 3 pages > 3
    assert s2.coordinator.pool.num_used == 0


def colocated_tables(kinds: str, prompt: list[int], chunk: int) -> tuple[tuple[int, ...], ...]:
    """The block tables a colocated engine holds at a request's first decode step: the prompt
    but its last token prefilled in chunks, then one token."""
    coord = CacheCoordinator(make_plan(kinds), 64, enable_prefix_caching=False)
    req = make_request("c", prompt)
    n = len(prompt) - 1
    while req.num_computed_tokens < n:
        step = min(chunk, n - req.num_computed_tokens)
        assert coord.allocate_slots(req, step)
        req.num_computed_tokens += step
    assert coord.allocate_slots(req, 1)
    return coord.block_tables(req)


@pytest.mark.parametrize("n", [5, 8, 15, 16, 17, 41, 58, 63])
def test_window_groups_take_only_their_window(n):
    # window 8, pages of 16, kernel blocks of 4: the decode side holds, group by group, the
    # same pages as a colocated engine at its first decode step (whatever its chunking), and
    # the transfer fills a window group only from the kernel block holding token n - 8
    prompt = list(range(1, n + 2))
    s = Scheduler(make_plan("MAS"), 64, make_config(max_model_len=512))
    slots = s.add_remote_request(make_request("d", prompt), n)
    for chunk in (4, 16, n):
        colocated = colocated_tables("MAS", prompt, chunk)
        assert [len(t) for t in slots.block_tables] == [len(t) for t in colocated]
        assert [t.count(0) for t in slots.block_tables] == [t.count(0) for t in colocated]
    assert slots.fill_from == (0, 0, max(0, n - 8) // 4 * 4)
    assert s.coordinator.pool.num_used == sum(len(t) - t.count(0) for t in slots.block_tables)


def test_decode_side_prefix_hit_shares_whole_pages_and_fills_the_rest():
    # A transferred prompt's valid units become prefix-cache units (the full group: all; the
    # window group: from its first transferred token, 40 - 8 = 32). A second request sharing
    # 2 pages of it (no Mamba snapshot needed: its state comes from the transfer) shares them
    # and fills from token 32 on.
    s = Scheduler(make_plan("MAS"), 64, make_config(max_model_len=512))
    runner = ContentRunner(s)
    a = list(range(1, 42))
    first = s.add_remote_request(make_request("a", a, max_tokens=12), 40)
    runner.transfer(first, a)
    s.finish_remote_kv("a", ok=True)
    while s.has_unfinished():
        run_step(s, runner)
    b = a[:35] + [60, 61, 62, 63, 1, 2]
    slots = s.add_remote_request(make_request("b", b, max_tokens=4), 40)
    assert slots.num_cached_tokens == 32 and slots.fill_from == (0, 32, 32)
    assert slots.block_tables[1][:2] == first.block_tables[1][:2]  # shared, not copied
    assert slots.block_tables[2][:2] == (0, 0)
    runner.transfer(slots, b)
    s.finish_remote_kv("b", ok=True)
    out, finished = run_step(s, runner)
    assert out.page_copies == () and runner.num_checked  # read its context without a copy
    while s.has_unfinished():
        _, finished = run_step(s, runner)
    assert finished[0].output_token_ids == reference(finished[0], 512)[0]
    assert s.prefix_cache_stats.hit_tokens == 32
    assert s.coordinator.pool.num_used == 0


def test_units_the_transfer_did_not_fill_are_never_registered():
    # Units of 4 tokens, window 8, 44 tokens transferred: the window group is filled from
    # token 36 on, in its page 2 (tokens 32..47), whose tokens 32..35 keep an earlier owner's
    # bytes. Units 9 and 10 are registered there, unit 8 is not, so a later local request over
    # the first 40 tokens finds no window for a hit (it would read unit 8's garbage).
    s = Scheduler(make_plan("AS"), 64, make_config(max_model_len=512, prefix_unit=4))
    runner = ContentRunner(s)
    a = list(range(1, 46))
    slots = s.add_remote_request(make_request("a", a, max_tokens=1), 44)
    assert slots.fill_from == (0, 36) and slots.block_tables[1][:2] == (0, 0)
    runner.tokens[slots.block_tables[1][2]] = [-1] * 16  # an earlier owner's bytes
    runner.transfer(slots, a)
    s.finish_remote_kv("a", ok=True)
    coord, hashes = s.coordinator, s.coordinator._hashes["a"]
    assert all(coord.pool.lookup((0, h)) is not None for h in hashes)
    assert [k for k, h in enumerate(hashes) if coord.pool.lookup((1, h))] == [9, 10]
    while s.has_unfinished():
        run_step(s, runner)
    s.add_request(make_request("b", a[:40] + [9, 9, 9], max_tokens=3))
    while s.has_unfinished():
        _, finished = run_step(s, runner)
    assert finished[0].num_cached_tokens == 0
    assert finished[0].output_token_ids == reference(finished[0], 512)[0]


def test_aborting_a_parked_request_registers_nothing():
    # its pages may still be being written: no state page becomes a snapshot on the way out
    s = Scheduler(make_plan("MA"), 32, make_config())
    req = make_request("d", range(1, 40))
    s.add_remote_request(req, 32)
    req.num_computed_tokens = 32  # as if on a unit boundary
    s.abort_request("d")
    assert s.prefix_cache_stats.num_snapshots == 0 and s.coordinator.pool.num_cached_pages == 0
    assert s.coordinator.pool.num_used == 0


@pytest.mark.parametrize("kinds,num_pages,seed", [("MASM", 40, 0), ("AS", 30, 1), ("MA", 24, 2)])
def test_pd_soak(kinds, num_pages, seed):
    """Local and P/D requests mixed on one decode-side scheduler with a tight pool: remote
    requests wait for pages and seats, their transfers fill what `fill_from` asks (the rest of a
    page keeps an earlier owner's bytes), some fail and recompute, some are aborted while
    parked. The content runner checks every read (prefix hits on transferred units included)
    and the outputs equal a plain generation loop's."""
    rng = random.Random(seed)
    max_len = 128
    s = Scheduler(
        make_plan(kinds, block_size=16, window=12),
        num_pages,
        make_config(
            max_num_seqs=5, max_num_batched_tokens=48, max_prefill_chunk=24, max_model_len=max_len
        ),
    )
    runner = ContentRunner(s)
    prefixes = [[rng.randrange(1, 64) for _ in range(n)] for n in (17, 33, 40, 57)]
    deferred: list = []
    in_transfer: dict[str, tuple] = {}
    done, aborted, remote_done = {}, set(), 0
    for i in range(400):
        request = random_request(rng, i, prefixes, max_len)
        if rng.random() < 0.5 and request.num_prompt_tokens >= 2:
            deferred.append(request)
        else:
            s.add_request(request)
        for _ in range(rng.choice((0, 1, 1, 2))):
            for request in list(deferred):
                slots = s.add_remote_request(request, request.num_prompt_tokens - 1)
                if slots is not None:
                    deferred.remove(request)
                    in_transfer[request.req_id] = (slots, request, rng.randrange(0, 3))
            for req_id, (slots, request, wait) in list(in_transfer.items()):
                if wait:
                    in_transfer[req_id] = (slots, request, wait - 1)
                    continue
                del in_transfer[req_id]
                fate = rng.random()
                if fate < 0.05:
                    aborted.add(s.abort_request(req_id).req_id)
                elif fate < 0.15:
                    s.finish_remote_kv(req_id, ok=False)  # recomputes locally
                else:
                    runner.transfer(slots, list(request.prompt_token_ids))
                    s.finish_remote_kv(req_id, ok=True)
                    remote_done += 1
            check_invariants(s)
            _, finished = run_step(s, runner)
            done.update((r.req_id, r) for r in finished)
    while s.has_unfinished() or deferred or in_transfer:
        for request in list(deferred):
            if (slots := s.add_remote_request(request, request.num_prompt_tokens - 1)) is not None:
                deferred.remove(request)
                runner.transfer(slots, list(request.prompt_token_ids))
                s.finish_remote_kv(request.req_id, ok=True)
        for req_id, (slots, request, _) in list(in_transfer.items()):
            del in_transfer[req_id]
            runner.transfer(slots, list(request.prompt_token_ids))
            s.finish_remote_kv(req_id, ok=True)
        check_invariants(s)
        _, finished = run_step(s, runner)
        done.update((r.req_id, r) for r in finished)
    assert len(done) + len(aborted) == 400 and remote_done > 100
    for request in done.values():
        assert request.output_token_ids == reference(request, max_len)[0], request.req_id
    assert s.prefix_cache_stats.hit_tokens > 0
    assert s.coordinator.pool.num_used == 0 and s.coordinator.transient_pages == []


def _hold(s: Scheduler, req_id: str, first: int) -> None:
    """A finished prefill-for-decode request of 39 tokens (4 pages) whose pages are held."""
    s.add_request(make_request(req_id, range(first, first + 39), max_tokens=1, hold_pages=True))
    while req_id not in s.held:
        _run(s)


def test_a_request_that_does_not_fit_beside_held_pages_waits_instead_of_failing():
    # 11 usable pages; two held prompts take 8, so a third (4 pages) cannot fit now but will
    # once the held pages come back: it waits, and a running request that outgrows the free
    # pages is preempted (not PoolTooSmall) and finishes after the release.
    s = Scheduler(make_plan("MA"), 12, make_config(max_held_fraction=1.0))
    _hold(s, "h1", 100)
    _hold(s, "h2", 200)
    assert s.held_pages == 8 == s.coordinator.pool.num_used
    grower = make_request("g", range(1, 10), max_tokens=60)
    s.add_request(grower)
    for _ in range(30):
        _run(s)
    assert grower.num_preemptions >= 1 and grower.status is not RequestStatus.RUNNING
    s.add_request(make_request("w", range(1, 40), max_tokens=2))
    out, _ = _run(s)
    assert not any(c.req_id == "w" for c in out.chunks)  # waits, nothing raised
    assert s.release_held("h1") and s.release_held("h2") and s.held_pages == 0
    while s.has_unfinished():
        _run(s)
    assert len(grower.output_token_ids) == 60 and s.coordinator.pool.num_used == 0


def test_held_pages_are_capped():
    s = Scheduler(make_plan("MA"), 33, make_config(max_held_fraction=0.25))  # cap: 8 pages
    _hold(s, "h1", 100)
    _hold(s, "h2", 200)
    s.add_request(make_request("h3", range(300, 339), max_tokens=1, hold_pages=True))
    for _ in range(5):
        out, _ = _run(s)
        assert not out.chunks  # past the cap: the next prefill-for-decode request waits
    s.release_held("h1")
    while "h3" not in s.held:
        _run(s)
    assert s.held_pages == 8
