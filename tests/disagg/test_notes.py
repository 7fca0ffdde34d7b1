"""Notification messages between connectors: typed round trip; junk is dropped, never raised."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.disagg.notes import MAX_NOTE, Note, encode_note, parse_note


def test_round_trip_keeps_every_field():
    data = encode_note(
        "push", "req-7", dst="d-1", cap="c", tables=[[3, 4], [9]], fill=[0, 5], tokens=12
    )
    assert parse_note(data) == Note(
        "push", "req-7", dst="d-1", cap="c", tables=((3, 4), (9,)), fill=(0, 5), tokens=12
    )
    keep = parse_note(encode_note("keep", "", reqs=[["a", "s1"], ["b", ""]]))
    assert keep == Note("keep", "", reqs=(("a", "s1"), ("b", "")))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"req-7",  # a bare id (the old format)
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"op": "read"}),  # no req
        msgpack.packb({"op": "read", "req": 5}),  # req not a string
        msgpack.packb({"op": "keep", "req": "", "reqs": [[["unhashable"], "x"]]}),
        msgpack.packb({"op": "keep", "req": "", "reqs": ["old-format"]}),
        msgpack.packb({"op": "push", "req": "r", "tables": [[-1]], "fill": [0], "tokens": 1}),
        msgpack.packb({"op": "push", "req": "r", "tables": [[1]], "fill": [0], "tokens": 1.5}),
        msgpack.packb({"op": "read_ack", "req": "r", "ok": 1}),  # ok not a bool
        msgpack.packb({"op": "pushed", "req": "r", "ok": True, "part": 3, "parts": 2}),
        msgpack.packb({"op": "nope", "req": "r"}),
        msgpack.packb({1: 2}),  # a non-string key
        b"\x00" * (MAX_NOTE + 1),
    ],
)
def test_junk_is_dropped(data):
    assert parse_note(data) is None


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=2000, deadline=None)
@given(
    st.sampled_from(["read", "read_ack", "push", "pushed", "keep", "release", 7, None]),
    st.dictionaries(
        st.sampled_from(
            [
                "req",
                "dst",
                "cap",
                "ok",
                "error",
                "part",
                "parts",
                "tables",
                "fill",
                "tokens",
                "reqs",
            ]
        ),
        _json,
        max_size=8,
    ),
)
def test_any_map_parses_to_a_valid_note_or_none(op, fields):
    note = parse_note(msgpack.packb({"op": op, **fields}, use_bin_type=True))
    if note is not None:
        assert isinstance(note.req, str) and note.op == op
        assert all(isinstance(r, str) and isinstance(c, str) for r, c in note.reqs)
        assert all(type(p) is int and p >= 0 for t in note.tables for p in t)
