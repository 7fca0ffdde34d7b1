"""Scheduler support for disaggregated prefill/decode: held pages and parked remote requests."""

from __future__ import annotations

from core_fixtures import make_config, make_plan, make_request

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
    tables = s.add_remote_request(req, 38)
    assert [len(t) for t in tables] == [1, 3]
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert s.schedule().is_empty  # parked: nothing to run yet
    s.finish_remote_kv("d", ok=True)
    out, _ = _run(s)
    (chunk,) = out.chunks
    assert (chunk.start, chunk.token_ids, chunk.sample) == (38, (39,), True)
    assert chunk.block_tables == tables
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
    s2 = Scheduler(make_plan("MA"), 3, make_config())
    assert s2.add_remote_request(make_request("c", range(1, 60)), 58) is None  # no pages
    assert s2.coordinator.pool.num_used == 0
