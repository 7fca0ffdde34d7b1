"""Notification messages between connectors: round trip, and junk is ignored, never raised."""

from __future__ import annotations

import msgpack
import pytest

from hybridserve.disagg.notes import MAX_NOTE, decode_note, encode_note


def test_round_trip_keeps_every_field():
    data = encode_note("push", "req-7", dst="d-1", tables=[[3, 4], [9]])
    assert decode_note(data) == {
        "op": "push",
        "req": "req-7",
        "dst": "d-1",
        "tables": [[3, 4], [9]],
    }


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"req-7",  # a bare id (the old format)
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"op": "read"}),  # no req
        msgpack.packb({"op": "read", "req": 5}),  # req not a string
        b"\x00" * (MAX_NOTE + 1),
    ],
)
def test_junk_is_ignored(data):
    assert decode_note(data) is None
