"""Real NIXL (UCX on host memory) between two agents over JAX buffers, in one process."""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridserve.disagg.transport import NixlTransport


def _buffer(seed: int, rows: int = 16, width: int = 256) -> jax.Array:
    rng = np.random.default_rng(seed)
    arr = jnp.asarray(rng.integers(0, 256, (1, rows, width), dtype=np.uint8))
    return jax.block_until_ready(arr)


def _addr(arr: jax.Array) -> int:
    return arr.addressable_shards[0].data.unsafe_buffer_pointer()


def _wait(transport: NixlTransport, xfer) -> None:
    deadline = time.monotonic() + 10
    while transport.poll(xfer) != "DONE":
        assert time.monotonic() < deadline, "transfer did not finish"
        time.sleep(0.001)


@pytest.fixture
def pair():
    src, dst = _buffer(1), _buffer(2)
    p = NixlTransport("test-prefill", [(_addr(src), src.size, 0)])
    d = NixlTransport("test-decode", [(_addr(dst), dst.size, 0)])
    assert d.add_peer(p.metadata()) == "test-prefill"
    assert p.add_peer(d.metadata()) == "test-decode"
    yield p, d, src, dst
    d.close()
    p.close()


def _rows(arr: jax.Array, width: int = 256) -> list[tuple[int, int, int]]:
    base = _addr(arr)
    return [(base + i * width, width, 0) for i in range(arr.shape[1])]


def test_read_moves_the_chosen_rows_with_a_notification(pair):
    p, d, src, dst = pair
    before_src, before_dst = np.asarray(src).copy(), np.asarray(dst).copy()
    local, remote = d.prepare(_rows(dst)), d.prepare(_rows(src), peer="test-prefill")
    xfer = d.start("READ", local, [3, 5], remote, [7, 9], notif=b"req-1")
    _wait(d, xfer)
    assert d.backend_of(xfer) == "UCX"
    d.release(xfer)
    after = np.asarray(dst)
    np.testing.assert_array_equal(after[0, [3, 5]], before_src[0, [7, 9]])
    untouched = [i for i in range(16) if i not in (3, 5)]
    np.testing.assert_array_equal(after[0, untouched], before_dst[0, untouched])
    deadline = time.monotonic() + 5
    notes: dict = {}
    while not notes and time.monotonic() < deadline:
        notes = p.notifications()
    assert notes == {"test-decode": [b"req-1"]}


def test_write_pushes_rows(pair):
    p, d, src, dst = pair
    before_src = np.asarray(src).copy()
    local, remote = p.prepare(_rows(src)), p.prepare(_rows(dst), peer="test-decode")
    xfer = p.start("WRITE", local, [0, 1, 2], remote, [10, 11, 12])
    _wait(p, xfer)
    p.release(xfer)
    np.testing.assert_array_equal(np.asarray(dst)[0, 10:13], before_src[0, 0:3])


def test_mismatched_lists_are_refused(pair):
    p, d, src, dst = pair
    local, remote = d.prepare(_rows(dst)), d.prepare(_rows(src), peer="test-prefill")
    with pytest.raises(ValueError, match="2 local descriptors but 1 remote"):
        d.start("READ", local, [1, 2], remote, [3])
    with pytest.raises(ValueError, match="READ or WRITE"):
        d.start("COPY", local, [1], remote, [3])


def test_a_paused_progress_thread_leaves_the_cpu_idle_and_still_moves_data():
    # The bindings' own config spins the progress thread (a whole core per agent); with a
    # pause of 200 us two idle agents take a few percent of one core, and a READ still lands
    src, dst = _buffer(3), _buffer(4)
    agents = [
        NixlTransport("paused-p", [(_addr(src), src.size, 0)], progress_delay_us=200),
        NixlTransport("paused-d", [(_addr(dst), dst.size, 0)], progress_delay_us=200),
    ]
    try:
        p, d = agents
        d.add_peer(p.metadata())
        p.add_peer(d.metadata())
        before = os.times()
        time.sleep(1.0)
        after = os.times()
        busy = (after.user - before.user) + (after.system - before.system)
        assert busy < 0.5, f"two idle agents took {busy:.2f} s of CPU in 1 s"
        local, remote = d.prepare(_rows(dst)), d.prepare(_rows(src), peer="paused-p")
        xfer = d.start("READ", local, [0, 1], remote, [2, 3])
        _wait(d, xfer)
        d.release(xfer)
        np.testing.assert_array_equal(np.asarray(dst)[0, [0, 1]], np.asarray(src)[0, [2, 3]])
    finally:
        for agent in agents:
            agent.close()
