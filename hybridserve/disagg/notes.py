"""The messages two connectors exchange over NIXL notifications: msgpack maps, never pickle.

    {"op": "read",     "req": prefill req_id, "dst": decode req_id}   decode -> prefill
    {"op": "read_ack", "req": decode req_id, "ok": bool, "error": str | None}
    {"op": "push",     "req": prefill req_id, "dst": decode req_id,   decode -> prefill
                       "tables": [[page, ...], ...], "fill": [token, ...], "tokens": int}
    {"op": "pushed",   "req": decode req_id, "ok": bool, "error": str | None,
                       "part": int, "parts": int}    carried by WRITE `part` of `parts` when ok
    {"op": "keep",     "req": "", "reqs": [prefill req_id, ...]}       decode -> prefill
    {"op": "release",  "req": prefill req_id}   decode -> prefill: the request was given up

A message that is not a msgpack map with a string "req", or is over `MAX_NOTE` bytes, is
ignored by `decode_note` (a peer cannot crash a worker with a notification).
"""

from __future__ import annotations

from typing import Any

import msgpack

MAX_NOTE = 16 * 2**20


def encode_note(op: str, req_id: str, **fields: Any) -> bytes:
    """One notification message."""
    return msgpack.packb({"op": op, "req": req_id, **fields}, use_bin_type=True)


def decode_note(data: bytes) -> dict[str, Any] | None:
    """The message, or None when it is not one of ours (never raises)."""
    if len(data) > MAX_NOTE:
        return None
    try:
        note = msgpack.unpackb(data, raw=False, max_bin_len=MAX_NOTE, max_str_len=MAX_NOTE)
    except (msgpack.UnpackException, ValueError, TypeError):
        return None
    if not isinstance(note, dict) or not isinstance(note.get("req"), str):
        return None
    return note
