"""A randomised soak of the scheduler and cache: thousands of requests with shared prefixes,
random lengths, stop rules and aborts (also while a step is in flight), on a pool small enough
to preempt often. A fake runner tracks page contents, so every step also checks that each
request reads exactly its own context (prefix hits, copies, snapshots, sliding windows), and
the final outputs must equal a plain generation loop's. Each step also keeps the scheduling
policy: the step's budget, the prompt tokens' cap, the chunk and seat limits, and (decode
first) every running decode that was not preempted gets its token."""

from __future__ import annotations

import random

import pytest
from core_fixtures import ContentRunner, check_invariants, make_config, make_plan, reference

from hybridserve.core.request import Request, RequestStatus
from hybridserve.core.scheduler import Scheduler


def random_request(rng: random.Random, i: int, prefixes: list[list[int]], max_len: int):
    if rng.random() < 0.7:
        prompt = list(rng.choice(prefixes)) + [
            rng.randrange(1, 64) for _ in range(rng.randrange(0, 30))
        ]
    else:
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(1, 70))]
    prompt = prompt[: max_len - 1]
    max_tokens = rng.randrange(1, 40)
    return Request(
        f"q{i}",
        prompt,
        max_tokens,
        min_tokens=rng.randrange(0, max_tokens + 1) if rng.random() < 0.2 else 0,
        eos_token_ids=frozenset({0}) if rng.random() < 0.8 else frozenset(),
        stop_token_ids=frozenset(rng.sample(range(1, 64), 2))
        if rng.random() < 0.3
        else frozenset(),
        arrival_time=float(i),
    )


def check_policy(scheduler: Scheduler, out, decoding: set[str]) -> None:
    """The step's budgets and limits; with decode_first, every decode that was running before
    `schedule()` and still runs after it (not preempted) is in the step."""
    config = scheduler.config
    sizes = {c.req_id: len(c.token_ids) for c in out.chunks}
    assert len(sizes) == len(out.chunks)
    assert sum(sizes.values()) <= config.max_num_batched_tokens
    prompts = sum(n for r, n in sizes.items() if r not in decoding)
    cap = config.max_num_prefill_tokens if decoding else None  # prompts alone: the budget
    assert prompts <= (cap or config.max_num_batched_tokens)
    assert all(n <= config.max_prefill_chunk for r, n in sizes.items() if r not in decoding)
    assert len(scheduler.running) <= config.max_num_seqs
    if config.decode_first:
        still = decoding & {r.req_id for r in scheduler.running}
        assert still <= set(sizes), f"decodes left out: {sorted(still - set(sizes))}"


@pytest.mark.parametrize(
    "kinds,num_pages,unit,num_requests,min_preemptions,min_hit_rate,seed,policy",
    [
        ("MASM", 48, 4, 2000, 100, 0.02, 0, {}),  # hybrid with a sliding window, tight pool
        ("MA", 24, None, 700, 100, 0.02, 1, {}),  # unit = page (16 tokens), very tight pool
        ("AS", 30, 8, 700, 100, 0.05, 2, {}),  # attention only
        ("MASM", 400, 4, 700, 0, 0.3, 3, {}),  # roomy pool: the cache keeps what is shared
        ("MASM", 48, 4, 700, 50, 0.02, 4, {"max_num_prefill_tokens": 20}),  # prompts capped
        ("MASM", 48, 4, 700, 50, 0.02, 5, {"decode_first": False}),  # arrival order
    ],
)
def test_soak(kinds, num_pages, unit, num_requests, min_preemptions, min_hit_rate, seed, policy):
    rng = random.Random(seed)
    max_len = 128
    plan = make_plan(kinds, block_size=16, window=12)
    config = make_config(
        max_num_seqs=6,
        max_num_batched_tokens=48,
        max_prefill_chunk=24,
        max_model_len=max_len,
        prefix_unit=unit,
        **policy,
    )
    scheduler = Scheduler(plan, num_pages, config)
    runner = ContentRunner(scheduler)
    prefixes = [[rng.randrange(1, 64) for _ in range(n)] for n in (12, 20, 33, 40, 57)]
    added, done, aborted, in_flight_aborts, steps = 0, {}, set(), 0, 0
    while added < num_requests or scheduler.has_unfinished():
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            if added < num_requests:
                scheduler.add_request(random_request(rng, added, prefixes, max_len))
                added += 1
        if rng.random() < 0.02 and scheduler.requests:
            aborted.add(scheduler.abort_request(rng.choice(list(scheduler.requests))).req_id)
        decoding = {
            r.req_id for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1
        }
        out = scheduler.schedule()
        check_invariants(scheduler)
        check_policy(scheduler, out, decoding)
        if rng.random() < 0.02 and out.chunks:  # abort a request whose step is in flight
            victim = scheduler.abort_request(rng.choice(out.chunks).req_id)
            if victim is not None:
                aborted.add(victim.req_id)
                in_flight_aborts += 1
        for request in scheduler.update_from_output(out, runner.step(out)):
            assert request.status.is_finished and request.req_id not in scheduler.requests
            done[request.req_id] = request
        check_invariants(scheduler)
        steps += 1
        assert steps < 40 * num_requests, "no progress"

    stats = scheduler.prefix_cache_stats
    pool = scheduler.coordinator.pool
    preempted = sum(r.num_preemptions > 0 for r in done.values())
    print(
        f"\n{kinds}: {num_requests} requests, {steps} steps, {scheduler.num_preemptions} "
        f"preemptions ({preempted} finished requests preempted), {len(aborted)} aborts "
        f"({in_flight_aborts} in flight), hit rate {stats.hit_rate:.3f} over {stats.num_queries} "
        f"admissions, {stats.num_snapshots} snapshots, {pool.num_evicted_pages} evictions, "
        f"{runner.num_checked} chunk reads checked"
    )
    assert len(done) + len(aborted) == num_requests and not set(done) & aborted
    for request in done.values():
        outputs, reason, stop_reason = reference(request, max_len)
        assert request.output_token_ids == outputs, request.req_id
        assert (request.finish_reason, request.stop_reason) == (reason, stop_reason)
    assert all(r.status is not RequestStatus.RUNNING for r in done.values())
    assert scheduler.num_preemptions >= min_preemptions
    assert len(aborted) > 10 and in_flight_aborts > 0
    assert stats.hit_rate > min_hit_rate  # a nearly full pool keeps cached pages briefly
    assert pool.num_free == num_pages - 1 and pool.usage == 0.0
    assert scheduler.coordinator.transient_pages == []
    assert pool.clear_cache() and pool.num_cached_pages == 0
    assert sorted(pool.free_queue()) == list(range(1, num_pages))
