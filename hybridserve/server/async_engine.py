"""AsyncEngine: an asyncio front for one `LLMEngine`, whose loop runs in one background thread.

JAX and the engine are not thread-safe, so only the engine thread touches the engine. The
event loop and the engine thread talk through two channels: a thread-safe command queue
(event loop -> engine) and, per request, an asyncio queue fed by `loop.call_soon_threadsafe`
(engine -> event loop).

Lifecycle:
  1. `start()`, on the event loop, starts the engine thread.
  2. `add_request(...)` (event loop) admits the request, or raises `NotAccepting` (shutting
     down or the engine died: 503) or `QueueFull` (`max_queue` requests are live: 429). It puts
     an ADD command and awaits the engine thread's verdict: the request is in the engine and a
     `RequestStream` comes back, or `engine.add_request` raised and the error is re-raised here
     as a ValueError (a 400).
  3. The engine thread drains the commands (ADD, ABORT, STOP), aborts requests past their
     deadline (their stream raises `RequestTimeout`), runs `engine.step()` while the engine has
     work and hands every `RequestOutput` to its request's queue. Idle, it blocks on the command
     queue; with a kv-transfer config it calls `engine.poll_transfers()` about every
     `poll_interval_s` instead, since a prefill instance must keep answering the decode side's
     notifications (and pushing) while no request of its own runs. After each turn it publishes
     a snapshot of `engine.stats()` for /metrics and /v1/stats.
  4. A `RequestStream` yields outputs up to the finished one. Closing it before that (client
     disconnect, cancellation) puts an ABORT command, and the engine frees the request's pages.
     A request holds its queue slot until its stream ends or is closed, or the engine is done
     with it (finished, aborted, timed out), whichever comes first: a stream nobody reads
     cannot hold a slot forever.
  5. `shutdown(timeout)`: stop accepting (503), wait up to `timeout` seconds for the live
     requests, then STOP: the thread aborts what is left, ends every stream with `EngineStopped`
     and exits; `shutdown` joins it, then closes the engine (a P/D engine's NIXL agent and
     handshake server).
If the engine raises inside the loop, every live stream fails with `EngineDead`, `dead` is set
(/health answers 503, /v1/stats says why) and the thread exits. A bad request or peer never
gets there: the engine validates requests at `add_request` and the connector fails the request
or drops the peer involved.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from hybridserve.engine import LLMEngine
from hybridserve.outputs import RequestOutput
from hybridserve.sampling_params import SamplingParams
from hybridserve.server.engine_commands import (
    Abort,
    Add,
    EngineDead,
    EngineStopped,
    NotAccepting,
    QueueFull,
    Release,
    RequestStream,
    RequestTimeout,
    Stop,
)

log = logging.getLogger(__name__)


class AsyncEngine:
    """Serves one `LLMEngine` to asyncio code (see the module docstring).

    Args:
      engine: the engine; from `start()` on, only the engine thread may touch it.
      max_queue: most live (waiting + running) requests; beyond, `add_request` raises QueueFull.
      poll_interval_s: polling period of a P/D engine (`engine.config.kv_transfer` set) with
        transfers in flight.
      idle_poll_s: its polling period with no P/D work in flight.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_queue: int = 256,
        poll_interval_s: float = 0.001,
        idle_poll_s: float = 0.1,
    ):
        self.engine = engine
        self.max_queue = max_queue
        self.poll_interval_s = poll_interval_s
        self.idle_poll_s = idle_poll_s
        self._polls = engine.config.kv_transfer is not None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()  # event-loop side: admitted, not yet ended or closed
        self._streams: dict[str, tuple[asyncio.Queue, float | None]] = {}  # engine-thread side
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        self.dead: BaseException | None = None
        self._stats: dict[str, Any] = {}
        self._rate: collections.deque[tuple[float, float]] = collections.deque()
        self._publish()

    # -- event-loop side ------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (call on the event loop that will consume the outputs)."""
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.dead is None

    @property
    def num_live(self) -> int:
        """Requests admitted and not yet ended (the queue depth that `max_queue` bounds)."""
        return len(self._live)

    def stop_accepting(self) -> None:
        """New requests get NotAccepting from now on (signal-handler safe)."""
        self._accepting = False

    def stats(self) -> dict[str, Any]:
        """The latest snapshot: `engine.stats()` plus pages in use, queue depth, transfer GB/s,
        and `engine_dead` (why the engine loop ended, or None)."""
        dead = None if self.dead is None else f"{type(self.dead).__name__}: {self.dead}"
        return {
            **self._stats,
            "queue_depth": self.num_live,
            "max_queue": self.max_queue,
            "engine_dead": dead,
        }

    async def release_kv(self, params: dict[str, Any]) -> bool:
        """Prefill side: free the held pages named by transfer parameters this engine
        returned (`LLMEngine.release_kv`); False when nothing was released."""
        if self._loop is None or self.dead is not None or self._thread is None:
            return False
        verdict = self._loop.create_future()
        self._commands.put(Release(params, verdict))
        return bool(await verdict)

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        req_id: str,
        kv_transfer_params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        multi_modal_data: dict | None = None,
    ) -> RequestStream:
        """Admit a request and queue it in the engine (see steps 2 and 4 of the lifecycle).
        `multi_modal_data`: images / audio for the prompt's placeholders (the engine thread
        runs the encoders, `LLMEngine.prepare_multimodal`)."""
        if not self.accepting or self._loop is None:
            raise NotAccepting(
                "the server is shutting down" if self.dead is None else "the engine died"
            )
        if len(self._live) >= self.max_queue:
            raise QueueFull(f"{len(self._live)} requests are queued (--max-queue {self.max_queue})")
        if req_id in self._live:
            raise ValueError(f"request id {req_id!r} is already in use")
        outputs: asyncio.Queue = asyncio.Queue()
        verdict = self._loop.create_future()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._live.add(req_id)
        stream = RequestStream(self, req_id, outputs)
        self._commands.put(
            Add(req_id, prompt, params, kv_transfer_params, deadline, outputs, verdict,
                multi_modal_data)
        )  # fmt: skip
        if self.dead is not None:  # the thread died after our check: nobody will answer
            self._drain_adds(EngineDead("the engine failed"))
        try:
            await verdict
        except asyncio.CancelledError:
            stream.close()
            raise
        except BaseException:
            self._live.discard(req_id)
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        req_id: str,
        kv_transfer_params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`add_request` and iterate; leaving the iteration early aborts the request."""
        stream = await self.add_request(prompt, params, req_id, kv_transfer_params, timeout_s)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, drain the live requests for up to `timeout` seconds, stop the thread."""
        self._accepting = False
        end = time.monotonic() + timeout
        while self._live and time.monotonic() < end and self.dead is None:
            await asyncio.sleep(0.02)
        if self._thread is not None:
            self._commands.put(Stop())
            await asyncio.to_thread(self._thread.join)
        self.engine.close()  # the engine thread is gone: only this thread touches it now

    # -- engine-thread side ---------------------------------------------------------------

    def _send(self, target: asyncio.Queue, item: RequestOutput | BaseException) -> None:
        self._loop.call_soon_threadsafe(target.put_nowait, item)

    def _settle(self, verdict: asyncio.Future, error: BaseException | None) -> None:
        def settle() -> None:
            if verdict.done():  # the caller was cancelled meanwhile
                return
            if error is None:
                verdict.set_result(None)
            else:
                verdict.set_exception(error)

        self._loop.call_soon_threadsafe(settle)

    def _settle_value(self, verdict: asyncio.Future, value: Any) -> None:
        def settle() -> None:
            if not verdict.done():
                verdict.set_result(value)

        self._loop.call_soon_threadsafe(settle)

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as err:  # the engine is in an unknown state: fail everything
            log.exception("the engine loop failed")
            self.dead = err
            self._end_all(EngineDead(f"the engine failed: {type(err).__name__}: {err}"))
            self._drain_adds(EngineDead("the engine failed"))

    def _loop_forever(self) -> None:
        engine = self.engine
        wait: float | None = None
        while True:
            if not self._take_commands(wait):
                self._end_all(EngineStopped("the server shut down"), abort=True)
                self._drain_adds(EngineStopped("the server shut down"))
                return
            self._expire()
            worked = False
            if engine.has_unfinished():
                outputs = engine.step()
                worked = bool(outputs) or engine.in_flight  # a dispatched step: step again
                for out in outputs:
                    self._deliver(out)
            elif self._polls:
                engine.poll_transfers()
            self._publish()
            busy = engine.has_unfinished()
            if worked:
                wait = 0.0
            elif busy or (self._polls and not engine.transfers_idle):
                wait = self.poll_interval_s
            elif self._polls:
                wait = self.idle_poll_s  # late notes of released requests can wait that long
            else:
                wait = None  # nothing to do until a command arrives

    def _take_commands(self, wait: float | None) -> bool:
        """Run the queued commands, blocking up to `wait` s for the first; False on STOP."""
        try:
            command = (
                self._commands.get(timeout=wait) if wait != 0.0 else self._commands.get_nowait()
            )
        except queue.Empty:
            return True
        while True:
            if isinstance(command, Stop):
                return False
            if isinstance(command, Add):
                self._add(command)
            elif isinstance(command, Abort) and command.req_id in self._streams:
                self._forget(command.req_id)
                self.engine.abort_request(command.req_id)
            elif isinstance(command, Release):
                try:
                    released = self.engine.release_kv(command.params)
                except Exception:  # parameters of any shape: just not released
                    released = False
                self._settle_value(command.verdict, released)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: Add) -> None:
        try:
            prompt, mm = command.prompt, None
            if command.multi_modal_data:
                prompt, mm = self.engine.prepare_multimodal(prompt, command.multi_modal_data)
            self.engine.add_request(
                prompt, command.params, command.req_id, command.kv_transfer_params, mm
            )
        except Exception as err:  # a bad request: the engine must not keep any of it
            self.engine.abort_request(command.req_id)
            if not isinstance(err, ValueError):  # (Forbidden, a ValueError, keeps its type)
                err = ValueError(f"{type(err).__name__}: {err}")
            self._settle(command.verdict, err)
            return
        self._streams[command.req_id] = (command.outputs, command.deadline)
        self._settle(command.verdict, None)

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return  # aborted meanwhile
        if out.finished:
            self._forget(out.request_id)
        self._send(entry[0], out)

    def _expire(self) -> None:
        now = time.monotonic()
        for req_id, (outputs, deadline) in list(self._streams.items()):
            if deadline is not None and deadline < now:
                self._forget(req_id)
                self.engine.abort_request(req_id)
                self._send(outputs, RequestTimeout(f"request {req_id} timed out"))

    def _end_all(self, error: BaseException, abort: bool = False) -> None:
        for req_id, (outputs, _) in list(self._streams.items()):
            if abort:
                self.engine.abort_request(req_id)
            self._send(outputs, error)
            self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        """The request left the engine: free its queue slot even if no one reads its stream."""
        del self._streams[req_id]
        self._loop.call_soon_threadsafe(self._live.discard, req_id)

    def _drain_adds(self, error: BaseException) -> None:
        """Refuse the ADD commands still queued (after STOP or a failure)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Add):
                self._settle(command.verdict, error)
            elif isinstance(command, Release):
                self._settle_value(command.verdict, False)

    def _publish(self) -> None:
        """Snapshot the engine's statistics (read by the event loop without locking)."""
        engine = self.engine
        stats: dict[str, Any] = dict(engine.stats())
        if "transfer_bytes" in stats:
            stats["transfer_gbps"] = self._transfer_rate(float(stats["transfer_bytes"]))
        self._stats = stats

    def _transfer_rate(self, total_bytes: float, window_s: float = 10.0) -> float:
        """KV transfer rate over the last `window_s` seconds, in GB/s."""
        now = time.monotonic()
        samples = self._rate
        if not samples or now - samples[-1][0] >= 0.25:
            samples.append((now, total_bytes))
        while len(samples) > 2 and now - samples[0][0] > window_s:
            samples.popleft()
        t0, b0 = samples[0]
        return (total_bytes - b0) / (now - t0) / 1e9 if now > t0 else 0.0


__all__ = [
    "AsyncEngine",
    "EngineDead",
    "EngineStopped",
    "NotAccepting",
    "QueueFull",
    "RequestStream",
    "RequestTimeout",
]
