"""The messages two connectors exchange over NIXL notifications: msgpack maps, never pickle,
parsed into typed notes at the boundary (`parse_note`).

    {"op": "read",     "req": prefill req_id, "dst": decode req_id, "cap": str}  decode -> prefill
    {"op": "read_ack", "req": decode req_id, "ok": bool, "error": str | None}
    {"op": "push",     "req": prefill req_id, "dst": decode req_id, "cap": str,  decode -> prefill
                       "tables": [[page, ...], ...], "fill": [token, ...], "tokens": int}
    {"op": "pushed",   "req": decode req_id, "ok": bool, "error": str | None,
                       "part": int, "parts": int}    carried by WRITE `part` of `parts` when ok
    {"op": "keep",     "req": "", "reqs": [[prefill req_id, cap], ...]}      decode -> prefill
    {"op": "release",  "req": prefill req_id, "cap": str}   decode -> prefill: given up

`cap` is the signature of the request's transfer parameters (empty without a shared secret):
the producer acts on a note only when it matches the request it holds, so a peer can only
touch requests whose signed parameters it was given.

A message that is not one of these, with every field of the right type and within bounds, is
dropped by `parse_note` (returns None): a peer cannot crash a worker with a notification.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

MAX_NOTE = 16 * 2**20
MAX_ITEMS = 1 << 20  # pages or requests in one note
MAX_STR = 1024


def encode_note(op: str, req_id: str, **fields: Any) -> bytes:
    """One notification message."""
    return msgpack.packb({"op": op, "req": req_id, **fields}, use_bin_type=True)


@dataclasses.dataclass(frozen=True)
class Note:
    """A parsed notification: `op`, the request it is about, and the op's fields."""

    op: str
    req: str
    dst: str = ""
    cap: str = ""
    ok: bool = False
    error: str | None = None
    part: int = 0
    parts: int = 0
    tables: tuple[tuple[int, ...], ...] = ()
    fill: tuple[int, ...] = ()
    tokens: int = 0
    reqs: tuple[tuple[str, str], ...] = ()


def _is_str(x: Any) -> bool:
    return isinstance(x, str) and len(x) <= MAX_STR


def _ints(x: Any, low: int = 0) -> bool:
    return (
        isinstance(x, list)
        and len(x) <= MAX_ITEMS
        and all(type(i) is int and low <= i < 2**31 for i in x)
    )


def _parse(note: dict[str, Any]) -> Note | None:
    op, req = note.get("op"), note.get("req")
    if not _is_str(req):
        return None
    dst, cap = note.get("dst", ""), note.get("cap", "")
    if not (_is_str(dst) and _is_str(cap)):
        return None
    if op in ("read", "release"):
        return Note(op, req, dst=dst, cap=cap)
    if op in ("read_ack", "pushed"):
        ok, error = note.get("ok"), note.get("error")
        part, parts = note.get("part", 0), note.get("parts", 0)
        if type(ok) is not bool or not (error is None or _is_str(error)):
            return None
        if type(part) is not int or type(parts) is not int or not 0 <= part <= max(parts, 0):
            return None
        return Note(op, req, ok=ok, error=error, part=part, parts=parts)
    if op == "push":
        tables, fill, tokens = note.get("tables"), note.get("fill"), note.get("tokens")
        if not (isinstance(tables, list) and len(tables) <= 64 and all(_ints(t) for t in tables)):
            return None
        if not _ints(fill) or type(tokens) is not int or not 0 <= tokens < 2**31:
            return None
        return Note(
            op,
            req,
            dst=dst,
            cap=cap,
            tables=tuple(tuple(t) for t in tables),
            fill=tuple(fill),
            tokens=tokens,
        )
    if op == "keep":
        reqs = note.get("reqs")
        if not isinstance(reqs, list) or len(reqs) > MAX_ITEMS:
            return None
        pairs = []
        for item in reqs:
            if not (isinstance(item, list) and len(item) == 2 and all(map(_is_str, item))):
                return None
            pairs.append((item[0], item[1]))
        return Note(op, req, reqs=tuple(pairs))
    return None


def parse_note(data: Any) -> Note | None:
    """The typed note, or None when the message is not a valid one of ours (never raises)."""
    if not isinstance(data, bytes | bytearray) or len(data) > MAX_NOTE:
        return None
    try:
        note = msgpack.unpackb(
            data, raw=False, max_bin_len=MAX_NOTE, max_str_len=MAX_NOTE, strict_map_key=True
        )
    except Exception:  # malformed msgpack of any kind
        return None
    if not isinstance(note, dict):
        return None
    return _parse(note)
