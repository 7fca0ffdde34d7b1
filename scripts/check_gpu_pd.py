#!/usr/bin/env python
"""P/D engines on one GPU over real NIXL: shareable regions, fixed addresses, colocated tokens.

Builds a colocated engine and a prefill + decode pair (both in this process, on GPU 0, each
with its own NIXL agent) on the shipped default model, then checks, for pull and push:
  1. the P/D engines' regions come from cudaMalloc (torch owners present, addresses equal to
     the torch pointers) and `cudaIpcGetMemHandle` accepts them;
  2. every region keeps its address through all the steps (donation in place);
  3. greedy tokens of 16 prompts equal the colocated engine's; both pools end empty.
The engines run the model in float32. Greedy tokens can still differ from the colocated engine
on GPU through numerics alone (float32 matmuls run in TF32 by default, and P/D batches differ);
`--highest` computes them in full precision, and the script prints the colocated engine against
itself (batched vs one prompt at a time) as the baseline. UCX_PROTO_INFO=y shows the transports.

    python scripts/check_gpu_pd.py [--highest]
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import jax

from hybridserve import LLM, SamplingParams
from hybridserve.config import KVTransferConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [f"def function_{i}(x):\n    " for i in range(16)]


def _llm(role: str | None = None, mode: str = "pull") -> LLM:
    kv = KVTransferConfig(kv_role=role, transfer_mode=mode) if role else None
    return LLM(
        dtype="float32", max_model_len=256, max_num_seqs=16, progress=False, kv_transfer_config=kv
    )


def _ipc_ok(ptr: int) -> bool:
    rt = ctypes.CDLL("libcudart.so") if _has("libcudart.so") else None
    if rt is None:
        import torch

        return torch.cuda.is_available()  # torch allocations are cudaMalloc
    handle = (ctypes.c_byte * 64)()
    return rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)) == 0


def _has(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


def _serve(prefill: LLM, stop: threading.Event) -> None:
    """The prefill engine's loop while idle: writes pushes, frees pages on notifications."""
    while not stop.is_set():
        prefill.engine.poll_transfers()
        time.sleep(0.0002)


def _agree(a: list[list[int]], b: list[list[int]]) -> str:
    """How far two sets of greedy outputs agree: equal outputs, mean common prefix."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = [
        next((k for k, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), len(x))
        for x, y in zip(a, b, strict=True)
    ]
    return f"{same}/{len(a)} equal, mean common prefix {sum(prefix) / len(prefix):.1f}"


def main() -> None:
    if "--highest" in sys.argv:  # float32 matmuls in full precision (GPU default: TF32)
        jax.config.update("jax_default_matmul_precision", "highest")
    base = _llm()
    ids = [base.engine.tokenizer.encode(p) for p in PROMPTS]
    plain = [{"prompt_token_ids": i} for i in ids]
    colocated = [o.outputs[0].token_ids for o in base.generate(plain, GREEDY, use_tqdm=False)]
    alone = [base.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in plain]
    print("colocated batched vs one at a time (numerics alone):", _agree(colocated, alone))
    for mode in ("pull", "push"):
        prefill, decode = _llm("kv_producer"), _llm("kv_consumer", mode)
        for name, llm in (("prefill", prefill), ("decode", decode)):
            runner = llm.engine.runner
            owners = runner._region_owners
            addrs = [a for r in runner.region_addresses() for a in r]
            if next(iter(runner.regions[0].devices())).platform != "gpu":
                print(f"{mode}/{name}: CPU regions (XLA allocation)")
                continue
            assert owners and sorted(addrs) == sorted(t.data_ptr() for t in owners), name
            print(
                f"{mode}/{name}: {len(owners)} cudaMalloc'd region shards, IPC export ok:",
                all(_ipc_ok(a) for a in addrs),
            )
        before = [llm.engine.runner.region_addresses() for llm in (prefill, decode)]
        outs = prefill.generate(
            [
                {"prompt_token_ids": i, "kv_transfer_params": {"do_remote_decode": True}}
                for i in ids
            ],
            GREEDY,
            use_tqdm=False,
        )
        stop = threading.Event()

        thread = threading.Thread(target=_serve, args=(prefill, stop), daemon=True)
        thread.start()
        start = time.perf_counter()
        got = decode.generate(
            [
                {"prompt_token_ids": i, "kv_transfer_params": o.kv_transfer_params}
                for i, o in zip(ids, outs, strict=True)
            ],
            GREEDY,
            use_tqdm=False,
        )
        elapsed = time.perf_counter() - start
        deadline = time.monotonic() + 10
        while prefill.engine.scheduler.held and time.monotonic() < deadline:
            time.sleep(0.001)
        stop.set()
        thread.join()
        after = [llm.engine.runner.region_addresses() for llm in (prefill, decode)]
        tokens = [o.outputs[0].token_ids for o in got]
        stats = decode.engine.stats()
        print(
            f"{mode}: vs colocated {_agree(tokens, colocated)}; addresses fixed: "
            f"{before == after}; failures {stats['transfer_failures']}; "
            f"bytes moved {stats['transfer_bytes'] + prefill.engine.stats()['transfer_bytes']}; "
            f"pools empty: {prefill.engine.stats()['num_pages_used'] == 0} / "
            f"{decode.engine.stats()['num_pages_used'] == 0}; decode {elapsed:.2f} s"
        )
        for llm in (prefill, decode):
            llm.close()


if __name__ == "__main__":
    main()
