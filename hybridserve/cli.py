"""`hybridserve generate | serve | proxy | convert | bench serve`: the command line.

The CLI is the composition root: it may dispatch to the `checkpoints` tooling package, which
nothing else in the engine imports.
"""

from __future__ import annotations

import argparse
import sys
import time

from hybridserve.bench.serve import add_parser as add_bench_serve
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.server.flags import (
    SERVE_ENGINE_FLAGS,
    add_engine_args,
    add_http_args,
    add_proxy_parser,
    check_http_args,
    engine_kwargs,
    gpu_serve_defaults,
)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=str(DEFAULT_MODEL),
        help="HF directory (nemotron_h, bamba, granitemoehybrid) or a directory made "
        "by `hybridserve convert` (default: the shipped toy model)",
    )
    add_engine_args(p)


def _generate(args: argparse.Namespace) -> int:
    from hybridserve.entrypoints.jsonl import read_prompts, write_outputs
    from hybridserve.entrypoints.llm import LLM
    from hybridserve.sampling_params import SamplingParams

    given = [bool(args.prompts), args.input is not None, args.prompt_token_ids is not None]
    if sum(given) > 1:
        raise ValueError("give prompts, --prompt-token-ids or --input, not several")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    prompts, per_prompt = args.prompts or ["def "], params
    if args.prompt_token_ids is not None:
        prompts = [{"prompt_token_ids": ids} for ids in args.prompt_token_ids]
    if args.input is not None:  # read (and checked) before the model loads
        prompts, per_prompt = read_prompts(args.input, params)
    start = time.perf_counter()
    kwargs = engine_kwargs(args)
    if args.no_warmup:
        kwargs["enforce_eager"] = True
    llm = LLM(args.model, progress=True, **kwargs)
    load_s = time.perf_counter() - start  # the engine's warmup compiled every program
    start = time.perf_counter()
    outputs = llm.generate(prompts, per_prompt, use_tqdm=len(prompts) > 8)
    if args.output is not None:
        write_outputs(args.output, outputs)
    total_s = time.perf_counter() - start
    for out in outputs:
        if out.prompt is None:  # token ids in, token ids (and text, with a tokenizer) out
            print(f"--- prompt_token_ids: {out.prompt_token_ids}")
            print(f"token_ids: {out.outputs[0].token_ids}")
            if out.outputs[0].text:
                print(out.outputs[0].text)
            continue
        print(f"--- prompt: {out.prompt!r}")
        print(f"{out.prompt}{out.outputs[0].text}")
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = [o.metrics.time_to_first_token for o in outputs]
    decode_s = max(o.metrics.finished_time for o in outputs) - min(
        o.metrics.first_token_time for o in outputs
    )
    decode_tokens = n_out - len(outputs)
    print("---")
    print(f"load and compile {load_s:.1f}s")
    print(
        f"time to first token: {1000 * sum(ttft) / len(ttft):.1f} ms (mean over "
        f"{len(outputs)} prompts)"
    )
    rate = decode_tokens / decode_s if decode_s > 0 and decode_tokens > 0 else float("nan")
    print(f"output tokens: {n_out} in {total_s:.2f}s; decode {rate:.1f} tokens/s")
    stats = llm.stats()
    print(
        f"prefix cache: {stats['prefix_cache_hit_tokens']} of "
        f"{stats['prefix_cache_queried_tokens']} prompt tokens reused "
        f"(hit rate {stats['prefix_cache_hit_rate']:.0%})"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hybridserve.server.launch import parse_kv_transfer_config, parse_speculative_config, serve

    kv_transfer = parse_kv_transfer_config(args.kv_transfer_config)  # before any heavy import
    speculative = parse_speculative_config(args.speculative_config)
    model = args.model
    if args.model_arg is not None:
        if model != str(DEFAULT_MODEL) and model != args.model_arg:
            raise ValueError(f"two models given: {args.model_arg} and --model {model}")
        model = args.model_arg
    if not Path(model).is_dir():
        raise FileNotFoundError(
            f"model directory {model} does not exist (no model hub downloads: pass a local "
            "directory)"
        )
    for flag, value, least in (
        ("--max-queue", args.max_queue, 1),
        ("--max-body-bytes", args.max_body_bytes, 1024),
        ("--port", args.port, 0),
    ):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    check_http_args(args)
    from hybridserve.config import EngineConfig
    from hybridserve.server.app import ServerSettings

    names = args.served_model_name or [args.model_arg or "default"]
    given = engine_kwargs(args)
    import jax

    if jax.default_backend() in ("gpu", "cuda"):
        given |= gpu_serve_defaults(given)
    engine_config = EngineConfig.from_kwargs(
        model,
        **given,
        **engine_kwargs(args, SERVE_ENGINE_FLAGS),
        kv_transfer_config=kv_transfer,
        speculative_config=speculative,
    )
    settings = ServerSettings(
        model_names=tuple(names),
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout if args.request_timeout > 0 else None,
        drain_timeout_s=args.drain_timeout,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        api_key=args.api_key,
    )
    template = None
    if args.chat_template is not None:  # checked before the model loads
        from hybridserve.server.chat import ChatTemplate

        source = args.chat_template
        if Path(source).is_file():
            source = Path(source).read_text()
        elif "{{" not in source and "{%" not in source:
            raise ValueError(f"--chat-template {source!r} is neither a file nor a template")
        template = ChatTemplate(source, ChatTemplate.load(model).special_tokens)
    return serve(
        engine_config, settings, args.host, args.port, args.max_queue, args.log_level, template
    )


_SERVE_EPILOG = """\
endpoints: POST /v1/completions, POST /v1/chat/completions (streaming by server-sent events
or not), POST /v1/kv_transfer/release (a prefill instance frees a request's held pages),
GET /v1/models, GET /health, GET /metrics (Prometheus), GET /v1/stats (engine statistics as
JSON; 503 with the reason once the engine died).

On SIGTERM/SIGINT the server drains: new requests get 503 with Retry-After while those in
flight finish (up to --drain-timeout), then it exits; a second signal ends the drain.

environment:
  HYBRIDSERVE_API_KEY=KEY            the default of --api-key
  HYBRIDSERVE_SSM_CONV_LAYOUT=DS|SD  layout of the Mamba conv state in the cache (default DS:
                                     x, B and C each contiguous, what P/D transfers expect)

examples:
  hybridserve serve --port 8000
  hybridserve serve /models/nemotron-h --dtype bfloat16 -tp 2 --max-model-len 8192
  hybridserve serve --port 8100 --kv-transfer-config '{"kv_role":"kv_producer"}'   # prefill
  hybridserve serve --port 8200 --kv-transfer-config '{"kv_role":"kv_consumer"}'   # decode
"""


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        default=None,
        help="model directory, as --model (default: the shipped toy model)",
    )
    _add_engine_args(p)
    add_engine_args(p, SERVE_ENGINE_FLAGS)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model' (default: MODEL as given, or 'default')",
    )
    p.add_argument(
        "--kv-transfer-config",
        default=None,
        metavar="JSON",
        help="make this a P/D instance, e.g. "
        '\'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}\' (kv_producer: prefill, '
        "kv_consumer: decode, kv_both); other keys: engine_id, host, port, lease_s, "
        "transfer_timeout_s, handshake_timeout_s, wait_timeout_s, failure_policy, transfer_mode, "
        "nixl_threads, nixl_progress_delay_us; unknown keys are an error",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method":"ngram","num_speculative_tokens":3}\' '
        "(prompt lookup: any model; prompt_lookup_min / prompt_lookup_max, default 1 / 4) or "
        '\'{"method":"mtp","num_speculative_tokens":3}\' (the model\'s MTP heads); '
        "greedy output is unchanged, sampled output keeps its distribution",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a jinja chat template (a file, or the template itself) instead of the model's "
        "(default: the model's chat_template.jinja / tokenizer_config.json, else a plain "
        "'role: content' fallback)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="most requests waiting or running; more get HTTP 429 with Retry-After",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds before a request is aborted (JSON: 504; stream: finish_reason "
        "'abort'); 0: none (default: 600)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        help="largest request body (images and audio come inline, base64); larger ones get "
        "HTTP 413 (default: 8 MiB)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds to let requests in flight finish while new ones get "
        "503 (default: 30)",
    )
    add_http_args(p)
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (info: one line per request)",
    )


def _convert(args: argparse.Namespace) -> int:
    from checkpoints.convert import main

    return main(args.src, args.dst, args.dtype, args.verify, args.overwrite, args.verify_only)


def _token_id_lists(text: str) -> list[list[int]]:
    """`--prompt-token-ids`: one JSON list of ints, or a list of them."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    lists = value if value and all(isinstance(v, list) for v in value) else [value]
    for ids in lists:
        if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
            raise argparse.ArgumentTypeError("expected a list of token ids, or a list of lists")
    return lists


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridserve",
        description="Serve hybrid Mamba2 + attention language models with JAX.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        allow_abbrev=False,
        help="generate text for prompts and print timings",
        description="Generate continuations of PROMPTS with a local model and "
        "print the text, time to first token and tokens/s.",
    )
    gen.add_argument(
        "prompts", nargs="*", help='prompts (default: "def ", unless --input or --prompt-token-ids)'
    )
    _add_engine_args(gen)
    gen.add_argument(
        "--prompt-token-ids",
        type=_token_id_lists,
        default=None,
        metavar="JSON",
        help="prompts as token ids instead of text: [1, 2, 3] or [[1, 2], [3, 4]] (a model "
        "without a tokenizer takes only these)",
    )
    gen.add_argument(
        "--input",
        metavar="FILE.jsonl",
        help='prompts from a JSON-lines file: {"prompt": "..."} or {"prompt_token_ids": [...]} '
        'a line, with any SamplingParams field for that prompt beside it ("max_tokens": 8)',
    )
    gen.add_argument(
        "--output",
        metavar="FILE.jsonl",
        help="also write one JSON line per prompt: prompt, prompt_token_ids, text, token_ids, "
        "finish_reason, time to first token",
    )
    gen.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)"
    )
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    gen.add_argument("--top-p", type=float, default=0.95, help="(default: 0.95)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off (default: 0)")
    gen.add_argument("--seed", type=int, default=0, help="(default: 0)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    gen.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the start-up compile (as --enforce-eager: timings then include it)",
    )
    gen.set_defaults(func=_generate)
    srv = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="run an OpenAI-compatible HTTP server",
        description="Serve MODEL over an OpenAI-compatible HTTP API (completions and chat "
        "completions), with Prometheus metrics, a bounded queue and request limits.",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_args(srv)
    srv.set_defaults(func=_serve)
    add_proxy_parser(sub)
    bench = sub.add_parser(
        "bench",
        allow_abbrev=False,
        help="benchmark a running server (bench serve)",
        description="Benchmarks against a running OpenAI-compatible server.",
    )
    add_bench_serve(bench.add_subparsers(dest="bench_command", required=True))
    conv = sub.add_parser(
        "convert",
        allow_abbrev=False,
        help="convert an HF checkpoint to our orbax layout",
        description="Convert a Hugging Face checkpoint (safetensors, one file "
        "or sharded) to an orbax checkpoint plus our config.",
    )
    conv.add_argument("src", help="HF model directory (config.json + *.safetensors)")
    conv.add_argument("dst", help="output directory (must be new or empty)")
    conv.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="parameter dtype to store (default: the checkpoint's)",
    )
    conv.add_argument(
        "--verify",
        action="store_true",
        help="then run the source in transformers beside ours over 3 prompts: PASS when the "
        "max logit difference is within 1e-4 of the max logit (exit 1 on FAIL)",
    )
    conv.add_argument(
        "--verify-only",
        action="store_true",
        help="verify an existing output against the source, without converting",
    )
    conv.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty DST (default: refused)"
    )
    conv.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as err:
        print(f"hybridserve {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
