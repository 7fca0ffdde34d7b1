#!/usr/bin/env python
"""Whole-region copies in the compiled step programs: a step must write only the rows it owns.

A step program that copies a cache region (and writes the copy back at the end) costs a full
pass over the cache every step, and loses every byte a P/D transfer writes into the region while
the step runs (NIXL writes into the same buffers). This builds an engine over a random-weight
model (`scripts/random_models.py` shapes, dummy weights drawn on the device), runs one prefill
chunk and one decode step of a few requests, compiles the same programs again from the
captured arguments and counts the `copy` instructions whose result is as large as one rank's
share of a region. Exit status 1 when a program copies one.

    python scripts/check_region_copies.py --shape tiny             # CPU, seconds
    python scripts/check_region_copies.py --shape nano-9b-v2       # one H200, about a minute
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import random_models  # noqa: E402

# the regions' storage in HLO: 32-bit words (`cache.view.WORD`), bytes before 2026-12-03
REGION_TYPES = {"s32": 4, "u8": 1}
TYPED_VIEWS = REGION_TYPES | {"f32": 4, "bf16": 2, "f16": 2, "f8e4m3fn": 1}


def region_copies(hlo: str, region_bytes: int, kinds: dict[str, int] = REGION_TYPES) -> list[str]:
    """The `copy` instructions of an HLO text whose result is a region shard (`region_bytes`
    bytes in the regions' storage type): a step that copies the buffer it updates and writes
    the copy back. `kinds=TYPED_VIEWS` also counts a typed view of a whole shard materialised
    for reading (K/V pages read through `cache.view.kv_pages` at TP > 1 were); it also counts
    any other value of that many bytes, so it suits models where none is that large."""
    out = []
    for line in hlo.splitlines():
        if " copy(" not in line or "=" not in line:
            continue
        shape = line.split("=", 1)[1].strip().split("{", 1)[0]
        kind, _, dims = shape.partition("[")
        if kind in kinds and dims.endswith("]"):
            size = int(np.prod([int(d) for d in dims[:-1].split(",") if d]))
            if size * kinds[kind] == region_bytes:
                out.append(line.strip()[:160])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(random_models.SHAPES), default="tiny")
    parser.add_argument("--backend", default="xla", choices=("xla", "pallas", "torch"))
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()

    from hybridserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model = random_models.write_config(args.shape, Path(tmp))
        llm = LLM(
            str(model),
            dtype="bfloat16",
            tensor_parallel_size=args.tensor_parallel_size,
            backend=args.backend,
            max_model_len=args.context + 8,
            max_num_seqs=args.batch,
            max_num_batched_tokens=args.batch * args.context,
            max_prefill_chunk=args.context,
            load_format="dummy",
            progress=False,
        )
        runner = llm.engine.runner
        step, texts = runner._step, []

        def spy(*a, **kw):  # the keyword arguments are the static ones
            program = step.lower(*a, **kw).compile()
            texts.append(program.as_text())
            return program(*a)

        runner._step = spy
        rng = np.random.default_rng(0)
        vocab = llm.engine.model_config.vocab_size
        prompts = [
            {"prompt_token_ids": rng.integers(3, vocab, args.context).tolist()}
            for _ in range(args.batch)
        ]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        region_bytes = runner.regions[0].nbytes // args.tensor_parallel_size
        bad = 0
        for i, hlo in enumerate(texts):
            copies = region_copies(hlo, region_bytes)
            bad += bool(copies)
            print(f"program {i}: {len(copies)} whole-region copies")
            for line in copies[:3]:
                print("   ", line)
        device = runner.regions[0].devices().pop()
        print(f"{device.platform} {device.device_kind}: {bad} of {len(texts)} programs copy")
        llm.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
