"""The proxy's upstream instances, their health, its counters and its background tasks.

Lifecycle of an instance's place in the rotation:
  1. every instance starts in rotation;
  2. a connection it refuses (a request's or a health check's), or a `/health` answer other
     than 200 (an instance that is draining or whose engine died says so), takes it out at once;
  3. a health check that times out or fails otherwise, or a request whose connection attempt
     times out, counts one failure; `unhealthy_after` consecutive failures take it out, so that
     one slow answer under load does not make it flap;
  4. a 200 from `/health` brings it back and clears the count.
Every `health_interval_s` all instances are checked at once (asyncio.gather), each with
`health_timeout_s`.

Releases (`POST {prefill}/v1/kv_transfer/release`) run as background tasks (`spawn`): they are
sent from places that cannot wait (a stream's cleanup while its task is being cancelled);
`settle` waits for them (the app's shutdown and the tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Coroutine
from typing import Any

import httpx

from hybridserve.server.auth import bearer_header
from hybridserve.server.body import encode_json
from hybridserve.server.errors import APIError

log = logging.getLogger("hybridserve.proxy")


class NoInstance(RuntimeError):
    """No healthy instance of a role is left (or none of them answered)."""


class Instance:
    """One upstream server: whether it is in rotation and its consecutive failures."""

    def __init__(self, url: str, role: str) -> None:
        self.url = url.rstrip("/")
        self.role = role
        self.healthy = True
        self.failures = 0

    def __repr__(self) -> str:
        return f"Instance({self.url}, healthy={self.healthy}, failures={self.failures})"

    def up(self) -> None:
        """A 200 from /health: in rotation."""
        if not self.healthy:
            log.warning("%s instance %s is back in rotation", self.role, self.url)
        self.healthy, self.failures = True, 0

    def down(self, why: object) -> None:
        """Out of rotation at once (refused, or /health said so)."""
        if self.healthy:
            log.warning("%s instance %s is out of rotation: %s", self.role, self.url, why)
        self.healthy = False
        self.failures += 1

    def failed(self, why: object, limit: int) -> None:
        """One more failure; out of rotation after `limit` in a row."""
        self.failures += 1
        if self.failures >= limit:
            self.down(f"{self.failures} failures in a row, the last: {why}")
        else:
            args = (self.role, self.url, self.failures, limit, why)
            log.info("%s instance %s failed (%d of %d): %s", *args)


@dataclasses.dataclass
class ProxyStats:
    """Counters of `GET /v1/stats` on the proxy. Failures are upstream faults (5xx answers,
    errors, cut streams); an upstream's 4xx answer is the client's and passes unchanged."""

    requests: int = 0
    prefill_failures: int = 0
    decode_failures: int = 0
    client_disconnects: int = 0
    releases_sent: int = 0
    release_failures: int = 0
    no_instance: int = 0


class ProxyState:
    """Instances, round-robin cursors, counters and the shared HTTP client of one proxy.

    Args:
      prefill, decode: the instances' base URLs (at least one each).
      timeout_s: read timeout of one upstream request.
      health_interval_s / health_timeout_s / unhealthy_after: see the module docstring.
      upstream_api_key: sent to the upstreams as `Authorization: Bearer ...`.
      max_body_bytes / body_timeout_s: limits on the client's request body.
      transport: an httpx transport (tests: httpx.MockTransport).
    """

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        timeout_s: float = 600.0,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 5.0,
        unhealthy_after: int = 3,
        upstream_api_key: str | None = None,
        max_body_bytes: int = 8 << 20,
        body_timeout_s: float | None = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {unhealthy_after}")
        self.prefill = [Instance(u, "prefill") for u in prefill]
        self.decode = [Instance(u, "decode") for u in decode]
        self._cursor = {"prefill": itertools.count(), "decode": itertools.count()}
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.unhealthy_after = unhealthy_after
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.stats = ProxyStats()
        self._background: set[asyncio.Task] = set()
        # pooled connections expire well before the upstreams' 5 s keep-alive closes them, so a
        # request never goes out on a connection the upstream is closing: the pool checks the
        # expiry when it hands a connection out, and on a loaded host the request bytes can
        # leave a second or more later (seen with a 4 s expiry in a cold chaos run on the 2-core
        # machine: a decode leg got ReadError after the prefill restart's burst). Reconnecting
        # on loopback or a LAN costs well under a millisecond.
        limits = httpx.Limits(max_connections=None, keepalive_expiry=1.0)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=limits,
            headers=bearer_header(upstream_api_key),
            transport=transport,
        )

    # -- rotation ---------------------------------------------------------------------------

    def pick(self, role: str) -> list[Instance]:
        """The healthy instances of `role`, starting at the next round-robin position;
        NoInstance when none is healthy."""
        pool = self.prefill if role == "prefill" else self.decode
        healthy = [i for i in pool if i.healthy]
        if not healthy:
            raise NoInstance(f"no healthy {role} instance")
        start = next(self._cursor[role]) % len(healthy)
        return healthy[start:] + healthy[:start]

    def require(self, role: str) -> None:
        """NoInstance unless some instance of `role` is in rotation (no cursor moves)."""
        pool = self.prefill if role == "prefill" else self.decode
        if not any(i.healthy for i in pool):
            raise NoInstance(f"no healthy {role} instance")

    async def check_health(self) -> None:
        """One round of `GET /health` on every instance, all at once."""
        await asyncio.gather(*(self._check(i) for i in self.prefill + self.decode))

    async def _check(self, inst: Instance) -> None:
        try:
            reply = await self.client.get(f"{inst.url}/health", timeout=self.health_timeout_s)
        except httpx.ConnectError as err:  # refused: nothing listens there
            inst.down(err)
        except httpx.HTTPError as err:  # a timeout, a dropped connection
            inst.failed(f"/health: {type(err).__name__}", self.unhealthy_after)
        else:
            if reply.status_code == 200:
                inst.up()
            else:
                inst.down(f"/health answered {reply.status_code}")

    # -- releases and background tasks ------------------------------------------------------

    async def release(self, inst: Instance, params: dict[str, Any]) -> bool | None:
        """Ask a prefill instance to free the pages it holds for `params`; whether it freed
        any, or None when the release failed."""
        self.stats.releases_sent += 1
        try:
            content = encode_json({"kv_transfer_params": params})
            reply = await self.client.post(
                f"{inst.url}/v1/kv_transfer/release",
                content=content,
                headers={"Content-Type": "application/json"},
                timeout=10.0,
            )
            if reply.status_code != 200:
                raise ValueError(f"HTTP {reply.status_code}: {reply.text[:200]}")
            return bool(reply.json().get("released"))
        except (httpx.HTTPError, ValueError, APIError) as err:
            self.stats.release_failures += 1
            log.warning("release on %s failed: %s", inst.url, err)
            return None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run `coro` as a background task that `settle` waits for."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` s for the background tasks (releases) to end."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    def snapshot(self) -> dict[str, Any]:
        """The counters and every instance's state, for `GET /v1/stats`."""
        instances = {
            role: {i.url: {"healthy": i.healthy, "failures": i.failures} for i in pool}
            for role, pool in (("prefill", self.prefill), ("decode", self.decode))
        }
        return {**dataclasses.asdict(self.stats), "instances": instances}
