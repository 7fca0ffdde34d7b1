"""Command-line flags: the engine settings (`ENGINE_FLAGS`, one table onto the keywords of
`EngineConfig.from_kwargs`, used by `generate` and `serve`), those of the HTTP front ends that
`serve` and `proxy` share (API key, connection deadlines) and the `proxy` subcommand
(`hybridserve.cli` builds the parser)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from hybridserve.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class EngineFlag:
    """One command-line flag of an `EngineConfig.from_kwargs` keyword `key`. Its default is
    the config's (the flag is left out of the keywords when not given); `const`: a flag that
    takes no value and sets `key` to `const`."""

    names: tuple[str, ...]
    key: str
    help: str
    type: Any = int
    choices: tuple[str, ...] | None = None
    const: Any = None


ENGINE_FLAGS = (
    EngineFlag(
        ("--dtype",),
        "dtype",
        "compute dtype (auto: the checkpoint's)",
        str,
        ("auto", "float32", "bfloat16", "float16"),
    ),
    EngineFlag(
        ("--backend",),
        "backend",
        "op backend (auto: pallas kernels with XLA norms on GPUs, xla elsewhere; xla is the "
        "reference)",
        str,
        ("auto", "xla", "pallas", "torch"),
    ),
    EngineFlag(
        ("--load-format",),
        "load_format",
        "auto reads the checkpoint's weights; dummy draws random ones (config.json only: "
        "benchmarks of a model's shape)",
        str,
        ("auto", "dummy"),
    ),
    EngineFlag(
        ("--tensor-parallel-size", "-tp"), "tensor_parallel_size", "devices to shard the model over"
    ),
    EngineFlag(("--max-model-len",), "max_model_len", "longest prompt + output in tokens"),
    EngineFlag(
        ("--max-num-seqs",),
        "max_num_seqs",
        "requests decoded together (serve on GPUs: 256)",
    ),
    EngineFlag(
        ("--max-num-batched-tokens",),
        "max_num_batched_tokens",
        "tokens computed per step (serve on GPUs: 8192)",
    ),
    EngineFlag(
        ("--max-prefill-chunk",),
        "max_prefill_chunk",
        "prompt tokens per request and step (serve on GPUs: 2048)",
    ),
    EngineFlag(
        ("--max-num-prefill-tokens",),
        "max_num_prefill_tokens",
        "prompt tokens per step, all requests together, while requests decode (None: the "
        "step's budget; serve on GPUs: 512)",
    ),
    EngineFlag(
        ("--no-decode-first",),
        "decode_first",
        "take running requests in arrival order (default: every decode first, prompt chunks "
        "in what is left)",
        const=False,
    ),
    EngineFlag(
        ("--gpu-memory-utilization",),
        "gpu_memory_utilization",
        "share of the device memory allocator's limit for weights, activations and the cache "
        "pool (default 0.9; GPUs only)",
        float,
    ),
    EngineFlag(
        ("--kv-cache-memory",),
        "kv_cache_memory",
        "cache pool bytes per device (default: sized by --gpu-memory-utilization on GPUs, "
        "256 MiB on CPUs)",
    ),
    EngineFlag(
        ("--enforce-eager",),
        "enforce_eager",
        "skip the start-up compile of every step program (default: compiled before the "
        "server reports healthy; they then compile on first use)",
        const=True,
    ),
    EngineFlag(
        ("--kv-cache-dtype",),
        "kv_cache_dtype",
        "KV cache dtype (auto: the model dtype, or e4m3 for a checkpoint with FP8 KV scales; "
        "fp8 = fp8_e4m3: e4m3 with the checkpoint's per-layer scales or 1)",
        str,
        ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"),
    ),
    EngineFlag(
        ("--no-enable-prefix-caching", "--no-prefix-caching"),
        "enable_prefix_caching",
        "do not reuse computed prefixes",
        const=False,
    ),
    EngineFlag(
        ("--no-async-scheduling",),
        "async_scheduling",
        "step one at a time (default: the next step is scheduled while one runs)",
        const=False,
    ),
    EngineFlag(
        ("--prefix-unit",),
        "prefix_unit",
        "prefix-cache granularity in tokens (default: the largest divisor of the attention "
        "block that is a kernel-block multiple <= 256)",
    ),
)
# `serve` only (`generate`'s --seed is the sampling seed)
SERVE_ENGINE_FLAGS = (
    EngineFlag(
        ("--block-size",),
        "block_size",
        "least tokens per cache page (raised to fit a Mamba state; default: just that)",
    ),
    EngineFlag(("--seed",), "seed", "base seed of requests that give none"),
)


def add_engine_args(
    p: argparse.ArgumentParser, flags: tuple[EngineFlag, ...] = ENGINE_FLAGS
) -> None:
    """Add `flags` to `p`; `engine_kwargs(args)` reads them back."""
    defaults = EngineConfig.defaults()
    for flag in flags:
        default = defaults[flag.key]
        shown = "the checkpoint's" if flag.key == "dtype" and default is None else default
        text = (
            flag.help
            if flag.const is not None or "(default:" in flag.help
            else f"{flag.help} (default: {shown})"
        )
        if flag.const is not None:
            p.add_argument(
                *flag.names,
                dest=flag.key,
                action="store_const",
                const=flag.const,
                default=None,
                help=text,
            )
        else:
            p.add_argument(
                *flag.names,
                dest=flag.key,
                type=flag.type,
                choices=flag.choices,
                default=None,
                help=text,
            )


def engine_kwargs(
    args: argparse.Namespace, flags: tuple[EngineFlag, ...] = ENGINE_FLAGS
) -> dict[str, Any]:
    """The `EngineConfig.from_kwargs` keywords of the `flags` given on the command line."""
    return {f.key: getattr(args, f.key) for f in flags if getattr(args, f.key) is not None}


# `serve` on a GPU: the scheduler settings a user leaves out are sized for serving many
# requests (as vLLM's API server sizes its own), not the CPU-sized `SchedulerConfig` defaults.
# The prompt cap keeps the decodes' inter-token latency within about 3x a decode step while
# prompts stream in, and is a whole number of the longest packed segments (256 tokens: a cap of
# 576 or 640 leaves partial rows in every step); measured on an H200 with the 9B shape
# (issue 24, BENCHMARKS.md).
GPU_SERVE_DEFAULTS = {
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "max_prefill_chunk": 2048,
    "max_num_prefill_tokens": 512,
}


def gpu_serve_defaults(given: dict[str, Any]) -> dict[str, Any]:
    """`GPU_SERVE_DEFAULTS` for the keys not in `given` (the flags given), the number of
    requests never above a given per-step token budget."""
    out = {k: v for k, v in GPU_SERVE_DEFAULTS.items() if k not in given}
    if "max_num_seqs" in out and "max_num_batched_tokens" in given:
        out["max_num_seqs"] = min(out["max_num_seqs"], given["max_num_batched_tokens"])
    return out


def check_http_args(args: argparse.Namespace) -> None:
    """ValueError for a deadline flag that is not positive."""
    for flag, value in (
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
    ):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")


def add_http_args(p: argparse.ArgumentParser, upstream: bool = False) -> None:
    """Flags shared by `serve` and `proxy`: API keys and the connection deadlines."""
    p.add_argument(
        "--api-key",
        default=os.environ.get("HYBRIDSERVE_API_KEY") or None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (401 otherwise); "
        "default: $HYBRIDSERVE_API_KEY (better than the flag, which `ps` shows), unset: no key",
    )
    if upstream:
        p.add_argument(
            "--upstream-api-key",
            default=None,
            metavar="KEY",
            help="the key sent to the prefill and decode instances (default: --api-key)",
        )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a request's headers; slower connections are closed "
        "(default: 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's body; slower ones get HTTP 408 "
        "(default: 30)",
    )


def _run(args: argparse.Namespace) -> int:
    """`hybridserve proxy ARGS`."""
    check_http_args(args)
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    from hybridserve.server.listener import HTTPLimits
    from hybridserve.server.proxy import run_proxy

    return run_proxy(
        args.prefill,
        args.decode,
        args.host,
        args.port,
        args.request_timeout,
        args.log_level,
        api_key=args.api_key,
        upstream_api_key=args.upstream_api_key,
        limits=HTTPLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout),
        max_body_bytes=args.max_body_bytes,
    )


_PROXY_EPILOG = """
Each request goes to a prefill instance (max_tokens 1, kv_transfer_params
{"do_remote_decode": true}), then with the returned transfer parameters to a decode
instance, whose reply (JSON or server-sent events) is relayed. Instances are used
round-robin. One that refuses connections, or whose /health answers non-200, leaves the
rotation at once; one that fails 3 health checks in a row (timeouts) leaves it too; a 200
from /health brings it back. No decode instance in rotation: 503 before any prefill. When
the decode leg fails or the client leaves, the prefill instance is told to free the held
pages (POST /v1/kv_transfer/release). GET /v1/stats: the proxy's counters.

environment:
  HYBRIDSERVE_API_KEY=KEY  the default of --api-key (and so of --upstream-api-key)

example (one machine, default model):
  hybridserve serve --port 8100 --kv-transfer-config '{"kv_role":"kv_producer"}' &
  hybridserve serve --port 8200 --kv-transfer-config '{"kv_role":"kv_consumer"}' &
  hybridserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""


def add_proxy_parser(subcommands: Any) -> argparse.ArgumentParser:
    """Add `proxy` to the CLI's subcommands (an argparse subparsers object)."""
    prx = subcommands.add_parser(
        "proxy",
        allow_abbrev=False,
        help="route requests through prefill and decode instances (disaggregated serving)",
        description="One OpenAI-compatible endpoint in front of `hybridserve serve` prefill "
        "(kv_producer) and decode (kv_consumer) instances.",
        epilog=_PROXY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prx.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill URLs")
    prx.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode URLs")
    prx.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    prx.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    prx.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per upstream request"
    )
    prx.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        help="largest request body (images and audio come inline, base64); larger ones get "
        "HTTP 413 (default: 8 MiB)",
    )
    add_http_args(prx, upstream=True)
    prx.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    prx.set_defaults(func=_run)
    return prx
