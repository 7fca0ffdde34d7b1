"""`hybridserve bench serve`: load an OpenAI-compatible server over HTTP and report latencies.

Requests are streamed completions (`/v1/completions`, `stream: true`, the usage in the last
event), so any OpenAI-compatible server can be measured, ours or another, and the numbers
compare with `vllm bench serve`'s: the result JSON uses its field names (`duration`,
`completed`, `total_input_tokens`, `total_output_tokens`, `request_throughput`,
`output_throughput`, `total_token_throughput`, and for ttft, tpot, itl and e2el the `mean_`,
`median_`, `std_` and `pXX_` values in milliseconds, plus the per-request `input_lens`,
`output_lens`, `ttfts`, `itls`, `errors`).

Definitions (per request): TTFT, the time from sending to the first streamed text; ITL, the
gaps between streamed events that carry text; E2EL, sending to the last event; TPOT,
`(E2EL - TTFT) / (output tokens - 1)` for requests of more than one token.

Lifecycle:
  1. the prompts are built (random token ids of `--random-input-len`, or a JSONL file's
     "prompt" fields) and each request's send time drawn: all at once (`--request-rate inf`) or
     a Poisson process at that rate; `--max-concurrency` caps the requests in flight;
  2. each request streams on its own task; a failed request is counted in `errors` (its
     message kept), never ending the run;
  3. when all have ended the metrics are computed, printed, and written to `--result-file`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class RequestResult:
    """What one request measured (seconds)."""

    input_len: int
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def random_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `input_len` random token ids in [1, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(input_len)] for _ in range(n)]


def file_prompts(path: Path, n: int) -> list[str]:
    """The first `n` "prompt" fields of a JSONL file (cycled when it has fewer)."""
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return [prompts[i % len(prompts)] for i in range(n)]


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict, input_len: int
) -> RequestResult:
    """Stream one completion; the result holds the error instead of raising."""
    result = RequestResult(input_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                now = time.perf_counter()
                if event.get("choices") and event["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if event.get("usage"):
                    result.output_len = int(event["usage"]["completion_tokens"])
                    result.input_len = int(event["usage"]["prompt_tokens"])
        result.latency = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s] or [0.0]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
    }
    ordered = sorted(ms)
    for p in percentiles:
        rank = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
        out[f"p{p:g}_{name}_ms"] = ordered[rank]
    return out


def metrics(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    """The run's numbers under `vllm bench serve`'s names (module docstring)."""
    ok = [r for r in results if not r.error]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **_stats("ttft", [r.ttft for r in ok], percentiles),
        **_stats("tpot", tpot, percentiles),
        **_stats("itl", [g for r in ok for g in r.itl], percentiles),
        **_stats("e2el", [r.latency for r in ok], percentiles),
        "input_lens": [r.input_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }


async def run(args: argparse.Namespace) -> dict:
    """Send every request (module docstring, steps 1-3); returns the result dict."""
    if args.dataset_path is not None:
        prompts: list = file_prompts(Path(args.dataset_path), args.num_prompts)
    else:
        prompts = random_prompts(
            args.num_prompts, args.random_input_len, args.random_vocab_size, args.seed
        )
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    pool = httpx.Limits(max_connections=args.max_concurrency or None)

    async def limited(client: httpx.AsyncClient, prompt: Any) -> RequestResult:
        body = {
            "model": args.model,
            "prompt": prompt,
            "max_tokens": args.random_output_len,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body = {k: v for k, v in body.items() if v is not None}
        input_len = len(prompt) if isinstance(prompt, list) else 0
        async with limit:
            return await one_request(client, url, body, input_len)

    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=pool) as client:
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(client, prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    result = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "base_url": args.base_url,
        "model_id": args.model,
        "num_prompts": len(prompts),
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        **metrics(results, duration, percentiles),
    }
    return result


def add_parser(subcommands: Any) -> None:
    """`bench serve` under `hybridserve bench`."""
    p = subcommands.add_parser(
        "serve",
        allow_abbrev=False,
        help="load an OpenAI-compatible server and report TTFT / TPOT / ITL / E2E latency",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)"
    )
    p.add_argument("--model", default=None, help="the model name to request (default: none sent)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token")
    p.add_argument("--num-prompts", type=int, default=100, help="requests (default: %(default)s)")
    p.add_argument(
        "--random-input-len", type=int, default=128, help="prompt tokens (default: %(default)s)"
    )
    p.add_argument(
        "--random-output-len", type=int, default=128, help="max_tokens (default: %(default)s)"
    )
    p.add_argument(
        "--random-vocab-size",
        type=int,
        default=1000,
        help="random ids below this (default: %(default)s)",
    )
    p.add_argument(
        "--dataset-path", default=None, help='a JSONL file of {"prompt": ...} lines instead'
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson (default: all at once)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (default: no cap)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="stop at EOS (default: generate the full length)",
    )
    p.add_argument(
        "--metric-percentiles", default="99", help="comma-separated (default: %(default)s)"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--result-file", default=None, help="write the result JSON here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """CLI body: run, print the summary, write the JSON."""
    result = asyncio.run(run(args))
    print(f"{'successful requests':<32}{result['completed']}")
    print(f"{'failed requests':<32}{result['failed']}")
    print(f"{'duration (s)':<32}{result['duration']:.2f}")
    print(f"{'output tokens/s':<32}{result['output_throughput']:.1f}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        row = [f"{k.split('_')[0]} {result[k]:.2f}" for k in result if k.endswith(f"_{name}_ms")]
        print(f"{name.upper() + ' (ms)':<32}{', '.join(row)}")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=1))
    return 0 if result["completed"] else 1
