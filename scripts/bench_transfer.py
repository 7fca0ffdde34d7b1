#!/usr/bin/env python
"""Transfer of one request's hybrid state over NIXL, against raw NIXL and a plain device copy.

Two processes on this machine play the prefill side (serves its region buffers) and the decode
side (reads them). Both build the cache layout of the Nemotron-3-Nano-30B shape (6 regions,
4 Mamba groups + 1 attention group; TP 1; fp8 KV; bf16 conv; fp32 ssm), allocate their regions
with JAX on their device (CPU, or GPU i), register them with NIXL once, and the decode side:
  1. reads one request's pages through the connector's read plan (scattered pages, the real
     descriptor sizes: per region and kernel block K and V; per region and state x, B, C, ssm),
     with READ and with WRITE (push towards the prefill side),
  2. moves the same number of bytes with raw NIXL as one contiguous range,
  3. copies the same number of bytes with a plain device copy (JAX),
  4. times the per-request control plane (descriptor ids + handle creation) for a 64-page
     request,
and prints a table (GB/s, ratio to raw NIXL) plus the NIXL backend and UCX transports used.

    python scripts/bench_transfer.py                  # CPU memory (UCX over the host)
    python scripts/bench_transfer.py --gpu 0 1        # GPU 0 (prefill) -> GPU 1 (decode)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

MODEL = dict(pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", hidden=2688)


def _nano_plan():
    from hybridserve.cache.plan import plan_cache
    from hybridserve.cache.spec import layer_specs
    from hybridserve.config import AttentionConfig, MambaConfig, ModelConfig, MoeConfig

    kinds = {"M": "mamba", "E": "moe", "*": "attention"}
    cfg = ModelConfig(
        "nemotron_h",
        131072,
        MODEL["hidden"],
        tuple(kinds[c] for c in MODEL["pattern"]),
        1e-5,
        attention=AttentionConfig(32, 2, 128),
        mamba=MambaConfig(64, 64, 128, 8, 4, 128),
        moe=MoeConfig(128, 6, 1856, shared_intermediate_size=3712),
    )
    return cfg, plan_cache(layer_specs(cfg, 1, "fp8", "bfloat16"), 1)


def _regions(num_pages: int, page_bytes: int, count: int, device, fill: int):
    import jax
    import jax.numpy as jnp

    if os.environ.get("BENCH_ALLOC") == "torch" and device.platform == "gpu":
        # torch's caching allocator (cudaMalloc), to compare with XLA's allocator under UCX
        import torch

        torch.cuda.set_device(device.id)
        size = num_pages * page_bytes
        bufs = [
            torch.full((size,), fill + i, dtype=torch.uint8, device="cuda") for i in range(count)
        ]
        torch.cuda.synchronize()
        return [jnp.from_dlpack(b) for b in bufs], bufs
    with jax.default_device(device):
        regions = [jnp.full((num_pages * page_bytes,), fill + i, jnp.uint8) for i in range(count)]
    return jax.block_until_ready(regions), None


def _addr(x) -> int:
    return x.addressable_shards[0].data.unsafe_buffer_pointer()


def _device(index: int | None):
    import jax

    return jax.devices("gpu")[index] if index is not None else jax.devices("cpu")[0]


def _side(name: str, gpu: int | None, num_pages: int, fill: int, threads: int = 0):
    """One side's regions (allocated on its device), its NIXL agent over them and its layout."""
    from hybridserve.disagg.descriptors import RankLayout
    from hybridserve.disagg.transport import NixlTransport

    cfg, plan = _nano_plan()
    regions, keep = _regions(num_pages, plan.page_size_bytes, plan.num_regions, _device(gpu), fill)
    dev = gpu or 0
    mem = "VRAM" if gpu is not None else "DRAM"
    transport = NixlTransport(name, [(_addr(r), r.nbytes, dev) for r in regions], mem, threads)
    layout = RankLayout.from_plan(
        plan,
        cfg,
        tp_rank=0,
        region_bases=[_addr(r) for r in regions],
        num_pages=num_pages,
        device_id=dev,
    )
    return regions, keep, transport, layout, plan


def _prefill(conn, gpu: int | None, num_pages: int, threads: int) -> None:
    from hybridserve.disagg.handshake import HandshakeServer

    _regions_, _keep, transport, layout, _plan = _side("bench-prefill", gpu, num_pages, 1, threads)
    server = HandshakeServer(
        {"agent_metadata": transport.metadata(), "layouts": [layout.to_dict()]},
        lambda request: None,
    )
    conn.send((server.host, server.port))
    conn.recv()  # until the decode side is done
    server.close()
    transport.close()


def _wait(transport, xfer) -> None:
    while transport.poll(xfer) != "DONE":
        pass


def _timed(transport, op, local, lids, remote, rids, repeats: int) -> float:
    """Median seconds of one transfer (post to DONE), each timed alone, after 2 warm-ups."""
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        xfer = transport.start(op, local, lids, remote, rids)
        _wait(transport, xfer)
        if i >= 2:
            times.append(time.perf_counter() - start)
        transport.release(xfer)
    return statistics.median(times)


def _decode(args, host: str, port: int) -> dict:
    import jax
    import jax.numpy as jnp

    from hybridserve.disagg.descriptors import RankLayout
    from hybridserve.disagg.handshake import fetch_peer
    from hybridserve.disagg.tp_mapping import plan_reads

    gpu = args.gpu[1] if args.gpu else None
    regions, _keep, transport, local, plan = _side(
        "bench-decode", gpu, args.num_pages, 100, args.threads
    )
    dev = gpu or 0
    info = fetch_peer(host, port, {})
    remote = RankLayout.from_dict(info["layouts"][0])
    agent = transport.add_peer(info["agent_metadata"])
    (read,) = plan_reads(local, {0: remote}).reads
    t0 = time.perf_counter()
    local_h = transport.prepare(read.local_descriptors())
    remote_h = transport.prepare(read.remote_descriptors(), peer=agent)
    prep_s = time.perf_counter() - t0
    # One request: `pages` attention pages and one state page per Mamba group, scattered
    # (every other page) or, with --contiguous, consecutive (as a fresh pool hands them out).
    kinds = [g.kind for g in plan.groups]
    step = 1 if args.contiguous else 2
    pages = list(range(2, 2 + step * args.request_pages, step))
    state = [pages[-1] + step * (1 + g) for g in range(kinds.count("mamba"))]
    tables, m = [], 0
    for kind in kinds:
        if kind == "mamba":
            tables.append([state[m]])
            m += 1
        else:
            tables.append(pages)
    lids, rids = read.descriptor_ids(tables, tables)
    local_list = read.local_descriptors()
    nbytes = sum(local_list[i][1] for i in lids)
    rows = {}
    for op in ("READ", "WRITE"):
        sec = _timed(transport, op, local_h, lids, remote_h, rids, args.repeats)
        rows[f"connector {op}"] = (nbytes, sec)
    # Raw NIXL: the same bytes as one contiguous range (inside region 0 of each side).
    if nbytes > regions[0].size:
        raise SystemExit(
            f"the request ({nbytes} bytes) does not fit in one region: raise "
            "--num-pages or lower --request-pages"
        )
    raw_l = transport.prepare([(_addr(regions[0]), nbytes, dev)])
    raw_r = transport.prepare([(remote.region_bases[0], nbytes, remote.device_id)], peer=agent)
    rows["raw NIXL READ"] = (
        nbytes,
        _timed(transport, "READ", raw_l, [0], raw_r, [0], args.repeats),
    )
    # Raw NIXL again, the same range cut into as many equal pieces as the connector's ids: what
    # the descriptor count alone costs.
    pieces = len(lids)
    cut = nbytes // pieces
    raw_ln = transport.prepare([(_addr(regions[0]) + i * cut, cut, dev) for i in range(pieces)])
    raw_rn = transport.prepare(
        [(remote.region_bases[0] + i * cut, cut, remote.device_id) for i in range(pieces)],
        peer=agent,
    )
    ids = list(range(pieces))
    rows[f"raw NIXL, {pieces} pieces"] = (
        cut * pieces,
        _timed(transport, "READ", raw_ln, ids, raw_rn, ids, args.repeats),
    )
    # Plain device copy of the same bytes (to a second buffer on this device).
    src = regions[0][:nbytes]
    jax.block_until_ready(jnp.copy(src))
    start = time.perf_counter()
    for _ in range(args.repeats):
        jax.block_until_ready(jnp.copy(src))
    rows["device copy (JAX)"] = (nbytes, (time.perf_counter() - start) / args.repeats)
    if args.gpu and args.gpu[0] != args.gpu[1]:  # and across the two GPUs
        other = _device(args.gpu[0])
        jax.block_until_ready(jax.device_put(src, other))
        start = time.perf_counter()
        for _ in range(args.repeats):
            jax.block_until_ready(jax.device_put(src, other))
        rows["peer copy (JAX)"] = (nbytes, (time.perf_counter() - start) / args.repeats)
    # Control plane for one request: ids + transfer handle (no data movement).
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        read.descriptor_ids(tables, tables)
    ids_us = (time.perf_counter() - start) / n * 1e6
    start = time.perf_counter()
    for _ in range(20):
        xfer = transport.agent.make_prepped_xfer("READ", local_h, lids, remote_h, rids)
        transport.release(xfer)
    handle_us = (time.perf_counter() - start) / 20 * 1e6
    xfer = transport.start("READ", local_h, lids[:1], remote_h, rids[:1])
    _wait(transport, xfer)
    backend = transport.backend_of(xfer)
    transport.release(xfer)
    transport.close()
    return {
        "rows": rows,
        "descriptors_per_request": len(lids),
        "prepared": len(read.local_descriptors()),
        "prepare_s": prep_s,
        "ids_us": ids_us,
        "handle_us": handle_us,
        "backend": backend,
        "ucx_tls": os.environ.get("UCX_TLS", ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gpu",
        type=int,
        nargs=2,
        default=None,
        metavar=("PREFILL", "DECODE"),
        help="GPU indices of the two sides (default: CPU memory)",
    )
    parser.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="pages per region and side (default: enough for the request to fit in one region)",
    )
    parser.add_argument(
        "--request-pages",
        type=int,
        default=8,
        help="attention pages of the request (plus one state page per group)",
    )
    parser.add_argument(
        "--contiguous",
        action="store_true",
        help="the request's pages are consecutive (merged into fewer descriptors)",
    )
    parser.add_argument("--threads", type=int, default=0, help="UCX backend threads (NIXL)")
    parser.add_argument("--repeats", type=int, default=30, help="timed transfers (median)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.num_pages is None:  # the raw range (the request's bytes) lies in region 0
        args.num_pages = max(80, 6 * (args.request_pages + 4) + 8)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    side = ctx.Process(
        target=_prefill,
        args=(child, args.gpu[0] if args.gpu else None, args.num_pages, args.threads),
    )
    side.start()
    host, port = parent.recv()
    try:
        result = _decode(args, host, port)
    finally:
        parent.send("done")
        side.join(30)
    raw = result["rows"]["raw NIXL READ"]
    raw_rate = raw[0] / raw[1]
    where = f"GPU {args.gpu[0]} -> GPU {args.gpu[1]}" if args.gpu else "CPU memory"
    alloc = os.environ.get("BENCH_ALLOC", "jax")
    layout = "contiguous" if args.contiguous else "scattered"
    print(
        f"one request of the Nano-30B shape ({layout} pages, {args.threads} UCX threads), "
        f"{where} ({alloc} allocation); NIXL backend {result['backend']}"
    )
    print(f"{'path':<22} {'MiB':>8} {'ms':>9} {'GB/s':>8} {'vs raw':>7}")
    for name, (nbytes, sec) in result["rows"].items():
        rate = nbytes / sec
        print(
            f"{name:<22} {nbytes / 2**20:>8.1f} {sec * 1e3:>9.3f} {rate / 1e9:>8.2f} "
            f"{rate / raw_rate:>7.2f}"
        )
    print(
        f"descriptors per request: {result['descriptors_per_request']} "
        f"(prepared once: {result['prepared']} in {result['prepare_s'] * 1e3:.1f} ms)"
    )
    print(
        f"control plane per request: ids {result['ids_us']:.1f} us, transfer handle "
        f"{result['handle_us']:.1f} us"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
