"""`PeerDirectory` without NIXL: handshakes that stall or fail, with the side channel replaced
by a function the test controls (no agent is loaded: only a successful handshake does that)."""

from __future__ import annotations

import threading
import time

import pytest

from hybridserve.disagg import peer_directory
from hybridserve.disagg.handshake import HandshakeError
from hybridserve.disagg.params import TransferParams
from hybridserve.disagg.peer_directory import PeerDirectory

TIMEOUT_S = 0.3


def _params(req_id: str, port: int = 4000) -> TransferParams:
    return TransferParams(
        req_id=req_id,
        engine_id="engine-a",
        epoch="e1",
        host="127.0.0.1",
        port=port,
        block_tables=((1,),),
        num_tokens=4,
        lease_s=10.0,
        prompt_hash="h",
        expires=time.time() + 10,
    )


@pytest.fixture
def handshakes(monkeypatch):
    """Replace the side channel: each handshake blocks until `release` is set, then fails
    (as the drip server's stalled peer does); `started` counts the handshakes begun."""
    state = {"started": 0, "release": threading.Event()}

    def fetch(host, port, request, timeout_s, secret):
        state["started"] += 1
        state["release"].wait(5)
        raise HandshakeError(f"cannot reach {host}:{port}: refused")

    monkeypatch.setattr(peer_directory, "fetch_peer", fetch)
    directory = PeerDirectory(None, [], dict, TIMEOUT_S, None)  # type: ignore[arg-type]
    yield directory, state
    state["release"].set()
    directory.close()


def _until_raises(directory: PeerDirectory, params: TransferParams, limit_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            assert directory.lookup(params) is None
        except HandshakeError:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"no HandshakeError within {limit_s} s")


def test_requests_waiting_on_a_timed_out_handshake_fail_together(handshakes):
    """Two requests naming one stalled producer: one handshake, and both fail at its deadline
    (before, the second started a handshake of its own and waited out a second deadline)."""
    directory, state = handshakes
    first, second = _params("a"), _params("b")
    assert directory.lookup(first) is None
    assert directory.lookup(second) is None
    waited = _until_raises(directory, first, 3 * TIMEOUT_S)
    assert waited <= TIMEOUT_S + 0.2
    with pytest.raises(HandshakeError, match="timed out"):
        directory.lookup(second)  # at once: it waited on the same handshake
    assert directory.failures == 1
    assert not directory.failed and not directory.pending  # nothing kept for heard waiters


def test_a_request_after_the_failure_tries_again(handshakes):
    """A request that arrives once a handshake has failed starts a new one (the producer may
    be back); one still waiting on the old one hears its failure."""
    directory, state = handshakes
    old, waiting = _params("a"), _params("b")
    assert directory.lookup(old) is None and directory.lookup(waiting) is None
    _until_raises(directory, old, 3 * TIMEOUT_S)
    late = _params("c")
    assert directory.lookup(late) is None  # a new handshake
    assert ("127.0.0.1", 4000) in directory.pending
    with pytest.raises(HandshakeError):
        directory.lookup(waiting)
    assert directory.lookup(late) is None  # still waiting on the new one


def test_a_failed_handshake_fails_its_waiters_with_its_reason(handshakes):
    """A handshake that ends with an error (not a timeout): every waiter gets that reason."""
    directory, state = handshakes
    waiters = [_params(f"r{i}") for i in range(3)]
    assert all(directory.lookup(p) is None for p in waiters)
    state["release"].set()
    deadline = time.monotonic() + 2
    while not directory.pending[("127.0.0.1", 4000)].future.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for p in waiters:
        with pytest.raises(HandshakeError, match="refused"):
            directory.lookup(p)
    assert state["started"] == 1 and directory.failures == 1
    other = _params("x", port=4001)  # another producer is not affected
    assert directory.lookup(other) is None and ("127.0.0.1", 4001) in directory.pending
