#!/usr/bin/env python
"""Start `hybridserve serve` on a model's shape and send it N requests at once.

The check of a deployment's defaults: the server is started as a user would start it (only
--max-model-len and the flags after `--` given; dummy weights for a --shape), then --requests
completions of --input-len random token ids and --output-len tokens each are sent at the same
moment (one thread each, `/v1/completions` with a token-id prompt). It reports how many
succeeded, every refusal by HTTP status and message, the server's pool line (pages, the
requests of max_model_len that fit) and the run's output tokens/s, and exits 1 if any request
failed.

    # the 9B shape with the serve defaults (one H200)
    python scripts/serve_load.py --shape nano-9b-v2 --max-model-len 8192 --requests 256 \\
        --json benchmarks/h200/serve_defaults.json
    # a CPU check (tiny shape)
    python scripts/serve_load.py --shape tiny --max-model-len 256 --requests 8 --input-len 32 \\
        --output-len 4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import random_models  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, {"error": err.read().decode(errors="replace")[:300]}
    except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
        return 0, {"error": f"{type(err).__name__}: {err}"}


def _wait_healthy(base: str, server: subprocess.Popen, timeout: float) -> float:
    start = time.time()
    while time.time() - start < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return time.time() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server was not healthy within {timeout:.0f} s")


def run(args: argparse.Namespace, model: str) -> dict:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "hybridserve.cli", "serve", model, "--port", str(port)]
    command += ["--max-model-len", str(args.max_model_len)]
    command += ["--load-format", "auto" if args.model else "dummy", *args.server_args]
    log = Path(args.log or tempfile.mktemp(suffix=".log"))
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    try:
        ready_s = _wait_healthy(base, server, args.start_timeout)
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
            name = json.loads(response.read())["data"][0]["id"]
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        rng = np.random.default_rng(0)
        bodies = [
            {
                "model": name,
                "prompt": rng.integers(3, vocab, args.input_len).tolist(),
                "max_tokens": args.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            for _ in range(args.requests)
        ]
        start = time.time()
        with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
            results = list(
                pool.map(lambda b: _post(f"{base}/v1/completions", b, args.timeout), bodies)
            )
        seconds = time.time() - start
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    lines = log.read_text(errors="replace").splitlines()
    ok = [r for status, r in results if status == 200]
    refused: dict[str, int] = {}
    for status, body in results:
        if status != 200:
            key = f"{status}: {str(body.get('error'))[:160]}"
            refused[key] = refused.get(key, 0) + 1
    tokens = sum(r["usage"]["completion_tokens"] for r in ok)
    return {
        "command": " ".join(command[1:]),
        "ready_s": ready_s,
        "requests": args.requests,
        "succeeded": len(ok),
        "refused": refused,
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
        "pool": [line.split(": ", 1)[-1] for line in lines if "cache pool" in line],
    }


def main(argv: list[str] | None = None) -> int:
    parser = random_models.model_parser(__doc__)
    add = parser.add_argument
    add("--max-model-len", type=int, default=8192, help="the server's --max-model-len (8192)")
    add("--requests", type=int, default=256, help="requests sent at once (256)")
    add("--input-len", type=int, default=1024, help="prompt tokens each (1024)")
    add("--output-len", type=int, default=64, help="output tokens each (64)")
    add("--timeout", type=float, default=1200.0, help="seconds a request may take (1200)")
    add("--start-timeout", type=float, default=900.0, help="seconds to become healthy (900)")
    add("--log", type=Path, help="keep the server's log here")
    add("--json", type=Path, help="write the report here")
    add("server_args", nargs="*", help="more server flags, after --")
    args = parser.parse_args(argv)
    if min(args.requests, args.input_len, args.output_len) < 1:
        parser.error("--requests, --input-len and --output-len must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(args.model or random_models.write_config(args.shape, tmp))
        report = run(args, model)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["succeeded"] == report["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
