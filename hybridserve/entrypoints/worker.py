"""An engine in its own process, driven over a pipe with msgpack messages (never pickle).

Lifecycle:
  1. `spawn_workers(specs)` starts one process (spawn) per `WorkerSpec`, all at once; each sets
     its JAX devices, builds an `LLMEngine` (with its kv_transfer role, or none) and replies
     {"ready": ...} or {"error": ...}.
  2. The parent sends {"op": "add", "req_id", "prompt_token_ids", "params", "kv", "timing"?},
     {"op": "abort", "req_id"}, {"op": "stats"} or {"op": "stop"}.
  3. The worker loop steps the engine whenever it has work (P/D bookkeeping included) and sends
     {"output": ...} for every finished request (with "token_times", the wall-clock time of each
     output token, when added with "timing"), {"stats": ...} when asked.
  4. On "stop" (or when the parent's end of the pipe closes) the worker closes its connector
     and exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import time
from typing import Any

import msgpack

from hybridserve.config import EngineConfig


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    message = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(message, dict):
        raise ValueError("worker messages are maps")
    return message


def output_to_dict(out: Any) -> dict[str, Any]:
    c = out.outputs[0]
    return {
        "req_id": out.request_id,
        "token_ids": list(c.token_ids),
        "text": c.text,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "kv": out.kv_transfer_params,
        "ttft": out.metrics.time_to_first_token,
    }


def _serve(
    conn: Any,
    engine_kwargs: dict[str, Any],
    kv: dict[str, Any] | None,
    devices: int,
    env: dict[str, str] | None,
) -> None:
    # this worker's host devices; the parent's other XLA flags stay
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])
    os.environ.update(env or {})  # e.g. JAX_PLATFORMS=cuda, CUDA_VISIBLE_DEVICES=1
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from hybridserve.engine import LLMEngine
    from hybridserve.sampling_params import SamplingParams

    try:
        config = EngineConfig.from_kwargs(**engine_kwargs, kv_transfer_config=kv or None)
        engine = LLMEngine(config, progress=False)
    except Exception as err:  # report any start-up failure to the parent
        conn.send_bytes(pack({"error": f"{type(err).__name__}: {err}"}))
        return
    conn.send_bytes(pack({"ready": engine.engine_id or "colocated"}))
    times: dict[str, list[float]] = {}  # token times of requests added with "timing"
    try:
        while True:
            busy = engine.has_unfinished() or engine.num_held > 0
            if conn.poll(0 if busy else 0.01):
                message = unpack(conn.recv_bytes())
                op = message.get("op")
                if op == "stop":
                    break
                if op == "add":
                    if message.get("timing"):
                        times[message["req_id"]] = []
                    try:
                        engine.add_request(
                            message["prompt_token_ids"],
                            SamplingParams(**message["params"]),
                            req_id=message["req_id"],
                            kv_transfer_params=message.get("kv"),
                        )
                    except ValueError as err:
                        conn.send_bytes(
                            pack({"output": {"req_id": message["req_id"], "error": str(err)}})
                        )
                elif op == "abort":
                    engine.abort_request(message["req_id"])
                elif op == "stats":
                    stats = engine.stats()
                    stats["held"] = engine.num_held
                    stats["pages_used"] = stats["num_pages_used"]
                    conn.send_bytes(pack({"stats": stats}))
                continue
            if engine.has_unfinished():
                outs = engine.step()
                now = time.time()
                for out in outs:
                    if out.request_id in times:
                        times[out.request_id] += [now] * len(out.new_token_ids)
                    if out.finished:
                        result = output_to_dict(out)
                        if out.request_id in times:
                            result["token_times"] = times.pop(out.request_id)
                        conn.send_bytes(pack({"output": result}))
            else:
                engine.poll_transfers()
                time.sleep(0.001)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent went away
    finally:
        engine.close()


@dataclasses.dataclass
class WorkerHandle:
    """The parent's end of one worker process."""

    process: mp.Process
    conn: Any
    engine_id: str

    def send(self, message: dict[str, Any]) -> None:
        self.conn.send_bytes(pack(message))

    def recv(self, timeout: float | None = None) -> dict[str, Any] | None:
        if not self.conn.poll(timeout):
            return None
        return unpack(self.conn.recv_bytes())

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.send({"op": "stop"})
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One worker process: its engine's settings (`EngineConfig.from_kwargs` keywords, "model"
    included; checked by `check`), its kv_transfer role (`KVTransferConfig` fields; None: a
    plain, colocated engine), its JAX device count and the variables set in it before JAX
    loads (on GPUs: `JAX_PLATFORMS=cuda` and the worker's `CUDA_VISIBLE_DEVICES`)."""

    engine_kwargs: dict[str, Any]
    kv: dict[str, Any] | None
    devices: int
    env: dict[str, str] | None = None

    def check(self) -> EngineConfig:
        """The worker's `EngineConfig`, built here: a bad setting raises in the parent."""
        return EngineConfig.from_kwargs(**self.engine_kwargs, kv_transfer_config=self.kv or None)


def spawn_workers(specs: list[WorkerSpec], start_timeout: float = 600.0) -> list[WorkerHandle]:
    """Start every worker at once (they import JAX, load and compile side by side), then wait
    for each to be ready; if one fails or is not ready within `start_timeout` seconds, the
    others are stopped too and the error is raised."""
    ctx = mp.get_context("spawn")
    started: list[tuple[mp.Process, Any]] = []
    handles: list[WorkerHandle] = []
    for spec in specs:
        spec.check()  # before any process starts
    try:
        for spec in specs:
            parent, child = ctx.Pipe()
            args = (child, spec.engine_kwargs, spec.kv, spec.devices, spec.env)
            process = ctx.Process(target=_serve, args=args, daemon=True)
            process.start()
            child.close()
            started.append((process, parent))
        deadline = time.monotonic() + start_timeout
        for process, parent in started:
            if not parent.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError("the worker did not start in time")
            reply = unpack(parent.recv_bytes())
            if "error" in reply:
                raise RuntimeError(f"the worker failed to start: {reply['error']}")
            handles.append(WorkerHandle(process, parent, reply["ready"]))
    except BaseException:
        for process, parent in started:
            WorkerHandle(process, parent, "").stop(timeout=5)
        raise
    return handles
