"""One chaos run over proxy + prefill + decode: the workload and the faults (the report:
`chaos_report.py`).

`ChaosRun(deployment, plan).run()` sends `plan.n_requests` completions through the proxy at
`plan.concurrency` (streamed and not, short prompts, `max_tokens` 4) while it injects:
  - client disconnects (`disconnect`: the connection is closed after a short random delay;
    streamed: after the first event; these ask for 64 tokens, 200 streamed, so that they are
    still running then),
  - decode legs refused with 400 (`bad_decode`: max_tokens 1000 passes the prefill leg, which
    asks for 1 token, and is over what max_model_len leaves on the decode instance),
  - expired leases (`expired`, straight to the instances: a prefill answer whose lease ended
    before the decode instance read its pages: one transfer failure each),
  - a stalled peer (`stalled`, straight to the decode instance: kv_transfer_params naming a
    `DripServer`),
  - the decode instance, then the prefill instance, SIGKILLed and restarted on the same port.
Faults fire when a fraction of the requests have ended (`plan.*_at`), so the run scales with
the machine; the direct requests of earlier faults end before an instance is killed; new
requests wait while a killed instance restarts (those sent within `outage_traffic_s` of the
kill still go). The load stops taking new requests after `load_budget_s`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import time
from typing import Any

import httpx
from chaos_harness import (
    DripServer,
    FixedPortServer,
    Outcome,
    ProxyProcess,
    Watchdog,
    disconnect,
    send,
)
from chaos_report import Plan, Report, Window, findings
from server_harness import wait_until

STALL_PROMPT = "def stalled(peer):\n    "


@dataclasses.dataclass
class Deployment:
    prefill: FixedPortServer
    decode: FixedPortServer
    proxy: ProxyProcess

    def named(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode, "proxy": self.proxy}


def _prompt(rng: random.Random, i: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "theta", "kappa"]
    return f"def {rng.choice(words)}_{i}({rng.choice(words)}):\n    "


class ChaosRun:
    """See the module docstring."""

    def __init__(self, deployment: Deployment, plan: Plan) -> None:
        self.dep, self.plan = deployment, plan
        self.report = Report(plan)
        self.gate: asyncio.Event | None = None
        self.completed = 0
        self.watchdog = Watchdog(deployment.named())

    # -- workload -------------------------------------------------------------------------

    def _specs(self) -> list[tuple[Outcome, dict, float]]:
        """(result to fill, body, disconnect delay) per proxy request, reproducibly."""
        plan, specs = self.plan, []
        rng = random.Random(plan.seed)
        for i in range(plan.n_requests):
            draw, stream = rng.random(), rng.random() < 0.5
            body = {"prompt": _prompt(rng, i), "max_tokens": plan.max_tokens, "temperature": 0}
            body.update(ignore_eos=True, stream=stream)
            kind, delay = "normal", 0.0
            if draw < plan.p_disconnect:
                # long enough to be running when the client leaves, even with the proxy a
                # second behind the decode instance on a loaded machine (streamed)
                kind, body["max_tokens"] = "disconnect", 200 if stream else 64
                delay = rng.uniform(0.0, 0.2) if stream else rng.uniform(0.05, 0.5)
            elif draw < plan.p_disconnect + plan.p_bad_decode:
                kind, body["max_tokens"] = "bad_decode", 1000
            specs.append((Outcome(i, kind, stream), body, delay))
        return specs

    async def _worker(self, client: httpx.AsyncClient, queue: collections.deque) -> None:
        url, path, plan = self.dep.proxy.url, "/v1/completions", self.plan
        while queue:
            await self.gate.wait()
            if time.monotonic() - self.report.t0 > plan.load_budget_s or not queue:
                return
            result, body, delay = queue.popleft()
            self.report.results.append(result)
            if result.kind == "disconnect":
                await disconnect(url, path, body, result, delay, plan.request_timeout_s)
            else:
                await send(client, url + path, body, result, plan.request_timeout_s)
            self.completed += 1

    async def _reached(self, fraction: float, workers: list[asyncio.Task]) -> bool:
        while self.completed < fraction * self.plan.n_requests:
            if all(w.done() for w in workers):
                return False
            await asyncio.sleep(0.1)
        return True

    # -- faults ---------------------------------------------------------------------------

    async def _prefill_leg(
        self, client: httpx.AsyncClient, body: dict, result: Outcome
    ) -> dict | None:
        """What the proxy's first leg does, straight to the prefill instance: the transfer
        parameters (None, with `result` marked not_sent, when it fails)."""
        first = {**body, "max_tokens": 1, "stream": False}
        first["kv_transfer_params"] = {"do_remote_decode": True}
        try:
            reply = await client.post(self.dep.prefill.fixed_url + "/v1/completions", json=first)
            return dict(reply.json()["kv_transfer_params"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
            result.outcome, result.detail = "not_sent", f"prefill leg failed: {err!r}"[:200]
            return None

    def _direct(self, i: int, kind: str, stream: bool, prompt: str = "") -> tuple[dict, Outcome]:
        body = {"prompt": prompt or _prompt(random.Random(i), i), "max_tokens": 4}
        body.update(temperature=0, ignore_eos=True, stream=stream)
        result = Outcome(i, kind, stream)
        self.report.results.append(result)
        return body, result

    async def _warm_local_prefill(self, client: httpx.AsyncClient) -> None:
        """Compile the decode instance's local prefill programs (1, 2 and 4 rows of a short
        prompt) before the load: a transfer that fails is recomputed there, and the first
        recompute of each shape would otherwise compile on the engine thread in the middle of
        a fault window (once 6.6 s on a loaded 2-core CI host, which no request of the stall
        window could outlast). A request that fails here is a harness note."""
        url = self.dep.decode.fixed_url + "/v1/completions"
        for n in (1, 2, 4):
            probes = [Outcome(-1, "setup", False) for _ in range(n)]
            bodies = [
                {"prompt": _prompt(random.Random(i), 30_000 + i), "max_tokens": 2}
                | {"temperature": 0, "ignore_eos": True}
                for i in range(n)
            ]
            timeout = self.plan.request_timeout_s
            await asyncio.gather(
                *(send(client, url, b, r, timeout) for b, r in zip(bodies, probes, strict=True))
            )
            self.report.notes += [
                f"a warm-up request failed: {r.detail}" for r in probes if r.outcome != "ok"
            ]

    async def _prepare(self, client: httpx.AsyncClient) -> None:
        """Before the load: the decode instance's local prefill programs compiled, the prefill
        legs of the expired-lease requests, and real transfer parameters of the stall prompt
        (whose side channel the stall fault replaces)."""
        await self._warm_local_prefill(client)
        self._expired_legs = []
        for i in range(self.plan.expired):
            body, result = self._direct(10_000 + i, "expired", False)
            params = await self._prefill_leg(client, body, result)
            if params is not None:
                self._expired_legs.append((body, result, params, time.monotonic()))
        probe = Outcome(-1, "setup", False)
        self._stall_params = await self._prefill_leg(client, {"prompt": STALL_PROMPT}, probe)
        if len(self._expired_legs) < self.plan.expired or self._stall_params is None:
            self.report.notes.append(f"a setup prefill leg failed: {probe.detail}")

    async def _expired(self, client: httpx.AsyncClient) -> None:
        """Prefill answers used after their lease: each decode-side transfer must fail."""

        timeout = self.plan.request_timeout_s

        async def one(body: dict, result: Outcome, params: dict, since: float) -> None:
            await asyncio.sleep(max(0.0, since + self.plan.lease_s + 3 - time.monotonic()))
            url = self.dep.decode.fixed_url + "/v1/completions"
            await send(client, url, {**body, "kv_transfer_params": params}, result, timeout)

        self.report.faults["expired_leases"] += len(self._expired_legs)
        await asyncio.gather(*(one(*leg) for leg in self._expired_legs))

    async def _stall(self, client: httpx.AsyncClient) -> DripServer | None:
        """The stall prompt's transfer parameters with a drip server as the side channel,
        straight to the decode instance."""
        if self._stall_params is None:
            return None
        plan = self.plan
        drip = DripServer(interval_s=2.0, duration_s=plan.drip_s)
        window = Window("stall", time.monotonic())
        self.report.windows.append(window)
        tasks, url = [], self.dep.decode.fixed_url + "/v1/completions"
        for i in range(plan.stalled):
            body, result = self._direct(20_000 + i, "stalled", bool(i % 2), STALL_PROMPT)
            params = {**self._stall_params, "host": "127.0.0.1", "port": drip.port}
            params["req_id"] = f"{params.get('req_id')}-stall-{i}"
            body["kv_transfer_params"] = params
            tasks.append(send(client, url, body, result, plan.stall_timeout_s))
        self.report.faults["stalled_peer_requests"] += len(tasks)
        ends = await asyncio.gather(*tasks)
        window.end = max((r.end for r in ends), default=window.start)
        self.report.faults["stalled_handshakes_accepted"] += drip.accepted
        return drip

    def _proxy_healthy(self) -> bool:
        try:
            return httpx.get(self.dep.proxy.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    async def _kill_restart(self, name: str) -> None:
        """SIGKILL the `name` instance, let requests hit the outage for a moment, then hold
        new requests until it is back and in the proxy's rotation."""
        server: FixedPortServer = self.dep.named()[name]
        window = Window(f"{name} down", time.monotonic())
        self.report.windows.append(window)
        self.watchdog.down.add(name)
        self.watchdog.quiet.add("proxy")  # its /health is 503 while a role has no instance
        await asyncio.to_thread(server.sigkill)
        self.report.faults[f"{name}_kills"] += 1
        await asyncio.sleep(self.plan.outage_traffic_s)
        self.gate.clear()
        try:
            await asyncio.to_thread(server.restart)
            if not await asyncio.to_thread(wait_until, self._proxy_healthy, 10, 0.2):
                self.report.observations.append(
                    f"the proxy's /health was not 200 within 10 s of {name}'s restart"
                )
        except RuntimeError as err:
            self.report.notes.append(f"{name} did not restart: {str(err)[-2000:]}")
        finally:
            window.end = time.monotonic()
            self.watchdog.down.discard(name)
            self.watchdog.quiet.discard("proxy")
            self.gate.set()

    async def _chaos(self, client: httpx.AsyncClient, workers: list[asyncio.Task]) -> None:
        """The faults, each when its share of the requests has ended; `report.fired` says
        when (seconds into the run, requests ended) so that a fault that came after the load
        is visible."""
        plan, background = self.plan, []
        schedule = [
            ("expired", plan.expired_at, self._expired),
            ("stall", plan.stall_at, self._stall),
            ("decode kill", plan.decode_kill_at, lambda _: self._kill_restart("decode")),
            ("prefill kill", plan.prefill_kill_at, lambda _: self._kill_restart("prefill")),
        ]
        drips = []
        for name, at, fault in schedule:
            if not await self._reached(at, workers):
                continue
            if name.endswith("kill"):  # the direct requests end first: they count on both
                drips += [d for d in await asyncio.gather(*background) if d is not None]
                background = []
            self.report.fired[name] = (time.monotonic() - self.report.t0, self.completed)
            background.append(asyncio.ensure_future(fault(client)))
        drips += [d for d in await asyncio.gather(*background) if d is not None]
        for drip in drips:
            await asyncio.to_thread(drip.close)

    # -- the run --------------------------------------------------------------------------

    async def _main(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        queue = collections.deque(self._specs())
        # one connection per request: a request sent on a kept-alive connection that the proxy
        # is closing meets a reset (the HTTP keep-alive race). Expiring idle connections early
        # is not enough: on a loaded machine the proxy's loop can lag seconds behind, so its
        # keep-alive timer fires after a request that arrived in time (seen in CI)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=0)
        timeout = httpx.Timeout(self.plan.request_timeout_s + 10, connect=10)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            await self._prepare(client)
            self.report.t0 = time.monotonic()
            self.report.wall0 = time.time()
            workers = [
                asyncio.ensure_future(self._worker(client, queue))
                for _ in range(self.plan.concurrency)
            ]
            chaos = asyncio.ensure_future(self._chaos(client, workers))
            await asyncio.gather(*workers)
            self.report.load_s = time.monotonic() - self.report.t0
            await chaos
        for result, _, _ in queue:  # left over when the budget ran out
            self.report.results.append(result)

    def _drain(self) -> None:
        """Poll both instances until no page is used or held, up to one lease (+5 s)."""
        start, pending = time.monotonic(), {"prefill": self.dep.prefill, "decode": self.dep.decode}
        last: dict[str, dict] = {}
        while pending and time.monotonic() - start < self.plan.lease_s + 5:
            for name, server in list(pending.items()):
                try:
                    s = last[name] = server.stats()
                except (httpx.HTTPError, ValueError):
                    continue
                keys = ("num_pages_used", "held_requests", "num_running", "num_waiting")
                if all(s.get(k, 0) == 0 for k in keys):
                    self.report.drain[name] = (True, time.monotonic() - start, s)
                    del pending[name]
            time.sleep(0.5)
        for name in pending:
            self.report.drain[name] = (False, time.monotonic() - start, last.get(name, {}))

    def _collect(self) -> None:
        r = self.report
        for name in ("prefill", "decode"):
            try:
                r.stats[name] = self.dep.named()[name].stats()
            except (httpx.HTTPError, ValueError):
                r.stats[name] = None
        final = r.stats["decode"] or {}
        for key in ("transfer_failures", "handshake_failures"):
            r.totals[key] = self.dep.decode.total(key, final)
        try:
            reply = httpx.get(self.dep.proxy.url + "/v1/stats", timeout=10)
            r.proxy_stats_status = reply.status_code
            r.stats["proxy"] = reply.json() if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            r.stats["proxy"] = None
        for name, proc in self.dep.named().items():
            r.log_findings[name] = findings(proc.all_logs())

    def run(self) -> Report:
        self.report.t0 = time.monotonic()
        self.watchdog.start()
        try:
            asyncio.run(self._main())
            self._drain()
            self._collect()
        finally:
            self.watchdog.stop()
            self.report.watchdog = list(self.watchdog.events)
        return self.report
