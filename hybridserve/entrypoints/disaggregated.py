"""DisaggregatedLLM: the `LLM.generate` API over a prefill worker and a decode worker, each in
its own process, moving KV pages and Mamba states between them over NIXL.

    from hybridserve.entrypoints.disaggregated import DisaggregatedLLM
    with DisaggregatedLLM(model_dir, prefill_tp=1, decode_tp=1) as llm:
        outs = llm.generate(["def "], SamplingParams(temperature=0.0, max_tokens=32))

Lifecycle: the constructor spawns both workers (each with its own JAX devices) and waits until
they are ready; `generate` sends each prompt to the prefill worker, forwards its transfer
parameters to the decode worker and collects the decode worker's outputs; `close` stops both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.entrypoints.worker import WorkerHandle, WorkerSpec, spawn_workers
from hybridserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import Tokenizer


class DisaggregatedLLM:
    """`LLM` with prefill and decode on separate worker processes (see the module docstring).

    Args: `model` as `LLM`; `prefill_tp` / `decode_tp` (tensor parallel sizes of the two
    workers); the `KVTransferConfig` fields `lease_s` (how long the prefill worker holds pages
    for the decode worker, renewed by the decode worker's heartbeats), `failure_policy`
    ("recompute" locally or "fail" when a transfer fails) and `transfer_mode` ("pull": the
    decode worker READs; "push": the prefill worker WRITEs), None keeping its default; and
    the engine settings of both workers as `LLM` takes them (`EngineConfig.from_kwargs`
    keywords but `tensor_parallel_size` and `kv_transfer_config`, which the roles set; a bad
    one raises before any worker starts).
    """

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        lease_s: float | None = None,
        failure_policy: str | None = None,
        transfer_mode: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if not Path(model).is_dir():
            raise FileNotFoundError(f"model directory {model} does not exist")
        for key in ("tensor_parallel_size", "kv_transfer_config", "kv_transfer"):
            if key in engine_kwargs:
                raise TypeError(f"DisaggregatedLLM sets {key} itself (prefill_tp, decode_tp)")
        common = {"model": str(model), **engine_kwargs}
        producer = {"kv_role": "kv_producer", "lease_s": lease_s}
        consumer = {
            "kv_role": "kv_consumer",
            "failure_policy": failure_policy,
            "transfer_mode": transfer_mode,
        }
        specs = [
            WorkerSpec({**common, "tensor_parallel_size": tp}, _set(kv), tp)
            for tp, kv in ((prefill_tp, producer), (decode_tp, consumer))
        ]
        self.tokenizer = Tokenizer.maybe_load(model)
        self.prefill, self.decode = spawn_workers(specs)
        self._counter = 0

    def __enter__(self) -> DisaggregatedLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop both workers."""
        for worker in (getattr(self, "decode", None), getattr(self, "prefill", None)):
            if worker is not None:
                worker.stop()

    def _ids(self, prompt: str | dict) -> list[int]:
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise ValueError(
                "DisaggregatedLLM does not carry multimodal inputs to its workers yet: run "
                "them on LLM engines with a kv_transfer_config (prefill, then decode)"
            )
        if isinstance(prompt, dict):
            return [int(t) for t in prompt["prompt_token_ids"]]
        if self.tokenizer is None:
            raise ValueError("the model has no tokenizer.json: pass prompt_token_ids")
        return self.tokenizer.encode(prompt)

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        timeout: float = 600.0,
    ) -> list[RequestOutput]:
        """Generate for each prompt through prefill then decode; outputs in prompt order.

        Each output's `metrics` count from the call: `first_token_time` is when the prefill
        worker's first token reached this process, `finished_time` when the decode worker's
        output did (so the decode rate includes the KV transfer)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = dataclasses.asdict(sampling_params or SamplingParams())
        pending: dict[str, tuple[Any, list[int]]] = {}
        first_token: dict[str, float] = {}  # req_id -> when the prefill's token arrived
        every_ids = [self._ids(prompt) for prompt in prompts]  # all checked before any is sent
        start = time.perf_counter()
        for prompt, ids in zip(prompts, every_ids, strict=True):
            req_id = f"pd-{self._counter}"
            self._counter += 1
            pending[req_id] = (prompt, ids)
            self.prefill.send(
                {
                    "op": "add",
                    "req_id": req_id,
                    "prompt_token_ids": ids,
                    "params": params,
                    "kv": {"do_remote_decode": True},
                }
            )
        done: dict[str, RequestOutput] = {}
        deadline = time.monotonic() + timeout
        with tqdm(total=len(pending), desc="generating", disable=not use_tqdm) as bar:
            while len(done) < len(pending):
                if time.monotonic() > deadline:
                    late = [r for r in pending if r not in done]
                    for req_id in late:  # both workers free what they hold of them
                        self.prefill.send({"op": "abort", "req_id": req_id})
                        self.decode.send({"op": "abort", "req_id": req_id})
                    raise TimeoutError(
                        f"{len(late)} requests unfinished after {timeout:g} s (aborted)"
                    )
                for worker, forward in ((self.prefill, True), (self.decode, False)):
                    self._pump(worker, pending, first_token, params, done, start, bar, forward)
        return [done[r] for r in pending]

    def _pump(
        self,
        worker: WorkerHandle,
        pending: dict,
        first_token: dict[str, float],
        params: dict,
        done: dict,
        start: float,
        bar: Any,
        forward: bool,
    ) -> None:
        if not worker.process.is_alive() and not worker.conn.poll():
            role = "prefill" if forward else "decode"
            raise RuntimeError(f"the {role} worker died (exit code {worker.process.exitcode})")
        message = worker.recv(0.001)
        if message is None or "output" not in message:
            return
        out = message["output"]
        if out["req_id"] not in pending or out["req_id"] in done:
            return  # a request of an earlier call that timed out
        prompt, ids = pending[out["req_id"]]
        if forward and "error" not in out:
            first_token[out["req_id"]] = time.perf_counter()
            self.decode.send(
                {
                    "op": "add",
                    "req_id": out["req_id"],
                    "prompt_token_ids": ids,
                    "params": params,
                    "kv": out["kv"],
                }
            )
            return
        text = out.get("text", "")
        completion = CompletionOutput(
            0,
            text,
            out.get("token_ids", []),
            out.get("finish_reason") or "abort",
            out.get("stop_reason") or out.get("error"),
        )
        metrics = RequestMetrics(
            arrival_time=start,
            first_token_time=first_token.get(out["req_id"]),
            finished_time=time.perf_counter(),
            num_generated_tokens=len(completion.token_ids),
        )
        done[out["req_id"]] = RequestOutput(
            out["req_id"],
            prompt if isinstance(prompt, str) else None,
            ids,
            [completion],
            True,
            metrics,
        )
        bar.update(1)

    def stats(self) -> dict[str, dict]:
        """Each worker's engine statistics (plus held pages and pages in use)."""
        result = {}
        for name, worker in (("prefill", self.prefill), ("decode", self.decode)):
            if not worker.process.is_alive():
                result[name] = {"dead": worker.process.exitcode}
                continue
            worker.send({"op": "stats"})
            while (message := worker.recv(10)) is not None and "stats" not in message:
                pass
            result[name] = message["stats"] if message else {}
        return result


def _set(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` without those that are None (they keep `KVTransferConfig`'s defaults)."""
    return {k: v for k, v in fields.items() if v is not None}
