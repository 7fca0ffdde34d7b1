"""The configuration and the report of a chaos run (`chaos_run.py`): `Plan` (the knobs),
`Report` (what happened: outcomes, faults, windows, counters, pool drain, watchdog events, log
findings) and `summary`, the compact table `pytest -s` prints."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from chaos_harness import Outcome

ENGINE_FAILED = "the engine loop failed"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The knobs of a run: the load (`n_requests` through the proxy at `concurrency`, shares
    `p_disconnect` and `p_bad_decode` of them faulty, each with a client deadline of
    `request_timeout_s`), the direct faults (`expired`, `stalled` requests), when each fault
    fires (`*_at`: the share of requests ended), and the lease the instances run with."""

    n_requests: int = 1000
    concurrency: int = 64
    max_tokens: int = 4
    p_disconnect: float = 0.08
    p_bad_decode: float = 0.05
    request_timeout_s: float = 60.0
    lease_s: float = 10.0
    expired: int = 2
    expired_at: float = 0.05  # fractions of n_requests ended
    stalled: int = 2
    stall_at: float = 0.15
    stall_timeout_s: float = 15.0  # the stalled requests' client deadline
    drip_s: float = 20.0  # how long the drip server keeps each connection stalled
    decode_kill_at: float = 0.4
    prefill_kill_at: float = 0.7
    outage_traffic_s: float = 0.3  # new requests still go this long into an outage
    load_budget_s: float = 170.0
    seed: int = 20


@dataclasses.dataclass
class Window:
    """A span of the run (time.monotonic()): an instance down ("decode down", "prefill
    down", from the kill until it is back in the proxy's rotation) or the stall."""

    name: str
    start: float
    end: float = float("inf")

    def overlaps(self, start: float, end: float) -> bool:
        return start <= self.end and end >= self.start


@dataclasses.dataclass
class Report:
    """What a run saw (see the module docstring); `notes` are harness failures."""

    plan: Plan
    results: list[Outcome] = dataclasses.field(default_factory=list)
    faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    windows: list[Window] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # what went wrong in the harness
    observations: list[str] = dataclasses.field(default_factory=list)  # worth a look
    watchdog: list[tuple[float, str, str]] = dataclasses.field(default_factory=list)
    stats: dict[str, dict[str, Any] | None] = dataclasses.field(default_factory=dict)
    totals: dict[str, int | None] = dataclasses.field(default_factory=dict)  # decode, summed
    proxy_stats_status: int | None = None
    drain: dict[str, tuple[bool, float, dict]] = dataclasses.field(default_factory=dict)
    log_findings: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    fired: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)
    t0: float = 0.0  # time.monotonic() when the load started
    wall0: float = 0.0  # time.time() then
    load_s: float = 0.0

    def of(self, kind: str | None = None, outcome: str | None = None) -> list[Outcome]:
        return [
            r
            for r in self.results
            if (kind is None or r.kind == kind) and (outcome is None or r.outcome == outcome)
        ]

    def outages(self) -> list[Window]:
        return [w for w in self.windows if w.name.endswith("down")]

    def outside_outages(self, results: list[Outcome]) -> list[Outcome]:
        """The `results` that neither started nor ended while an instance was down."""
        outages = self.outages()
        return [r for r in results if not any(w.overlaps(r.start, r.end) for w in outages)]


def findings(log: str) -> list[str]:
    """'the engine loop failed' lines with the exception that ended their traceback (its
    last unindented line), and a count of other tracebacks."""
    lines, found = log.splitlines(), []
    for i, line in enumerate(lines):
        if ENGINE_FAILED not in line:
            continue
        tail = "?"
        for after in lines[i + 2 : i + 400]:
            if after.startswith(" ") or after.startswith("Traceback") or not after.strip():
                continue
            if after.startswith(("The above exception", "During handling")):
                continue
            tail = after
            break
        found.append(f"{ENGINE_FAILED}: {tail.strip()[:300]}")
    others = log.count("Traceback") - len(found)
    if others > 0:
        found.append(f"{others} other traceback(s)")
    return found


PROXY_KEYS = (
    "requests",
    "prefill_failures",
    "decode_failures",
    "client_disconnects",
    "releases_sent",
    "no_instance",
)


def summary(r: Report) -> str:
    """A compact table: outcomes by kind, faults, windows, counters, drain, watchdog, logs."""
    kinds = ["normal", "bad_decode", "disconnect", "stalled", "expired"]
    outcomes = sorted({x.outcome for x in r.results}, key=lambda o: (o not in _ORDER, o))
    out = [f"=== P/D chaos run: {len(r.results)} requests, load {r.load_s:.1f} s ==="]
    out.append(f"{'kind':<12}" + "".join(f"{o:>13}" for o in outcomes) + f"{'total':>8}")
    for kind in kinds:
        row = r.of(kind)
        if row:
            counts = collections.Counter(x.outcome for x in row)
            out.append(
                f"{kind:<12}" + "".join(f"{counts[o]:>13}" for o in outcomes) + f"{len(row):>8}"
            )
    outside = {id(x) for x in r.outside_outages(r.results)}
    for inside in (False, True):
        row = [x for x in r.of("normal") if (id(x) not in outside) is inside]
        counts = ", ".join(
            f"{o}={n}" for o, n in collections.Counter(x.outcome for x in row).items()
        )
        out.append(f"  normal {'overlapping' if inside else 'outside'} outages: {counts or '-'}")
    for x in r.of("stalled") + r.of("expired"):
        took = x.end - x.start
        out.append(
            f"  {x.kind} #{x.index}: {x.outcome} {x.status} in {took:.1f} s {x.detail[:100]}"
        )
    out.append("faults injected: " + ", ".join(f"{k}={v}" for k, v in sorted(r.faults.items())))
    fired = (f"{k} at {t:.1f} s ({n} ended)" for k, (t, n) in r.fired.items())
    out.append("fired: " + ", ".join(fired))
    for w in r.windows:
        out.append(f"window {w.name}: t={w.start - r.t0:.1f}..{w.end - r.t0:.1f} s")
    for name in ("prefill", "decode"):
        s = r.stats.get(name) or {}
        keys = ("transfer_failures", "handshake_failures", "transfer_bytes", "held_requests")
        out.append(f"{name} stats: " + ", ".join(f"{k}={s.get(k, '-')}" for k in keys))
    out.append("decode totals over incarnations: " + str(r.totals))
    proxy = r.stats.get("proxy")
    if proxy is None:
        out.append(f"proxy /v1/stats: unavailable (HTTP {r.proxy_stats_status})")
    else:
        out.append("proxy stats: " + ", ".join(f"{k}={proxy.get(k, '-')}" for k in PROXY_KEYS))
    for name, (ok, seconds, s) in r.drain.items():
        state = f"drained in {seconds:.1f} s" if ok else f"NOT drained after {seconds:.1f} s"
        keys = ("num_pages_used", "held_requests", "num_running", "num_waiting")
        out.append(f"{name} pool: {state} ({', '.join(f'{k}={s.get(k)}' for k in keys)})")
    events = r.watchdog
    out.append(f"watchdog: {len(events)} event(s)" + (":" if events else ""))
    for t, name, what in events[:8]:
        out.append(f"  t={t:.1f} s {name}: {what}")
    for name, found in r.log_findings.items():
        for line in found[:3]:
            out.append(f"log {name}: {line}")
    out.extend(f"harness: {note[:500]}" for note in r.notes)
    out.extend(f"observed: {note}" for note in r.observations)
    bad = [x for x in r.results if not x.clear and x.outcome != "not_sent"]
    for x in bad[:5]:
        out.append(f"  e.g. #{x.index} {x.kind} stream={x.stream}: {x.outcome} {x.detail[:150]}")
    return "\n".join(out)


_ORDER = {"ok", "error_4xx", "error_5xx", "sse_error", "aborted", "disconnected", "late"}
