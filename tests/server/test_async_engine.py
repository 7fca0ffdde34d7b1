"""AsyncEngine in-process: outputs equal the engine's own, closing aborts, admission limits."""

from __future__ import annotations

import asyncio

import pytest
from server_harness import OFFLINE, wait_until

from hybridserve import SamplingParams
from hybridserve.config import EngineConfig
from hybridserve.engine import LLMEngine
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.server.async_engine import (
    AsyncEngine,
    NotAccepting,
    QueueFull,
    RequestTimeout,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig.from_kwargs(DEFAULT_MODEL, **OFFLINE), progress=False)


def _pages_used(engine: LLMEngine) -> int:
    return engine.scheduler.coordinator.pool.num_used


async def _run(engine: LLMEngine, body, max_queue: int = 8):
    """Start an AsyncEngine, run `body(async_engine)`, always shut it down."""
    front = AsyncEngine(engine, max_queue=max_queue)
    front.start()
    try:
        return await body(front)
    finally:
        await front.shutdown(timeout=10)


def test_outputs_match_the_engine_and_requests_run_concurrently(engine, offline):
    prompts = [[5, 6, 7], [100, 200], [9] * 20]
    want = [
        o.outputs[0].token_ids
        for o in offline.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, False)
    ]

    async def body(front: AsyncEngine):
        async def one(i: int) -> list[int]:
            tokens = []
            async for out in front.generate(prompts[i], GREEDY, f"r{i}"):
                tokens += out.new_token_ids
            return tokens

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    assert asyncio.run(_run(engine, body)) == want
    assert _pages_used(engine) == 0


def test_closing_a_stream_aborts_the_request_and_frees_its_pages(engine):
    async def body(front: AsyncEngine):
        stream = await front.add_request([1, 2, 3], LONG, "leaver")
        out = await anext(stream)
        assert len(out.new_token_ids) == 1 and not out.finished
        stream.close()
        assert front.num_live == 0
        await asyncio.to_thread(wait_until, lambda: front.stats()["num_pages_used"] == 0, 120)
        return front.stats()

    stats = asyncio.run(_run(engine, body))
    assert stats["num_pages_used"] == 0 and stats["num_running"] == 0
    assert _pages_used(engine) == 0


def test_a_stream_nobody_reads_gives_its_queue_slot_back(engine):
    async def body(front: AsyncEngine):
        await front.add_request([1, 2, 3], GREEDY, "unread")
        assert front.num_live == 1
        for _ in range(3000):  # the engine finishes it; the slot is free without a reader
            if front.num_live == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(_run(engine, body, max_queue=1))
    assert _pages_used(engine) == 0


def test_bad_requests_raise_value_error_and_leave_nothing_behind(engine):
    async def body(front: AsyncEngine):
        for prompt in ([], [10**6], [1] * 300):
            with pytest.raises(ValueError):
                await front.add_request(prompt, GREEDY, "bad")
        with pytest.raises(ValueError, match="kv_transfer"):
            await front.add_request([1, 2], GREEDY, "kv", {"do_remote_decode": True})
        assert front.num_live == 0
        outs = [o async for o in front.generate([1, 2], GREEDY, "bad")]  # the id is free again
        return outs[-1]

    last = asyncio.run(_run(engine, body))
    assert last.finished and len(last.outputs[0].token_ids) == 12


def test_queue_bound_timeout_and_shutdown(engine):
    async def body(front: AsyncEngine):
        first = await front.add_request([1, 2], LONG, "a")
        second = await front.add_request([3, 4], LONG, "b")
        with pytest.raises(QueueFull):
            await front.add_request([5, 6], GREEDY, "c")
        first.close()
        second.close()
        slow = await front.add_request([7, 8], LONG, "slow", timeout_s=0.05)
        with pytest.raises(RequestTimeout):
            async for _ in slow:
                pass
        front.stop_accepting()
        with pytest.raises(NotAccepting):
            await front.add_request([1, 2], GREEDY, "late")

    asyncio.run(_run(engine, body, max_queue=2))
    assert _pages_used(engine) == 0


def test_shutdown_waits_for_requests_in_flight(engine):
    async def body(front: AsyncEngine):
        outs = []

        async def consume():
            async for out in front.generate([1, 2, 3], GREEDY, "inflight"):
                outs.append(out)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)  # admitted before the shutdown starts
        while front.num_live == 0:
            await asyncio.sleep(0.001)
        await front.shutdown(timeout=60)
        await task
        return outs

    front_outs = asyncio.run(_run(engine, body))
    assert front_outs[-1].finished and front_outs[-1].outputs[0].finish_reason == "length"
