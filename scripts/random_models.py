"""Config-only model directories of real hybrid shapes, for random-weight benchmarks.

Each shape is a Hugging Face `config.json` (model_type nemotron_h) with the published
dimensions; the engine reads it with `load_format="dummy"` and draws bf16 weights on the device
(`hybridserve/weights/dummy.py`), so nothing of the model's size is written or carried.

    nano-9b-v2     NVIDIA-Nemotron-Nano-9B-v2: 56 layers (27 Mamba2, 25 MLP, 4 attention),
                   hidden 4480, 8.89 B parameters
    nano-30b-a3b   NVIDIA-Nemotron-3-Nano-30B-A3B: 52 layers (23 Mamba2, 23 MoE of 128 experts
                   top-6 + 1 shared, 6 attention), hidden 2688, 31.6 B parameters, 3.2 B active
    tiny           8 layers (4 Mamba2, 2 MLP, 2 attention) at toy width, for CPU checks
    *-fp8          the same shapes as NVIDIA ModelOpt FP8 checkpoints (`quantization_config`
                   quant_algo FP8, kv_cache_quant_algo FP8) with the Nano FP8 recipe: every
                   projection and expert in e4m3 except the attention layers, the Mamba2 layer
                   before each, the conv1d and the lm_head; the KV cache is e4m3

    python scripts/random_models.py nano-9b-v2 /tmp/nano9b   # writes /tmp/nano9b/config.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NANO_9B_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
NANO_30B_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

COMMON = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "dtype": "bfloat16",
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    "use_conv_bias": True,
    "conv_kernel": 4,
    "chunk_size": 128,
    "mlp_hidden_act": "relu2",
    "mamba_hidden_act": "silu",
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "initializer_range": 0.02,
}

SHAPES: dict[str, dict] = {
    "nano-9b-v2": COMMON
    | {
        "hybrid_override_pattern": NANO_9B_PATTERN,
        "num_hidden_layers": len(NANO_9B_PATTERN),
        "vocab_size": 131072,
        "hidden_size": 4480,
        "intermediate_size": 15680,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 80,
        "ssm_state_size": 128,
        "n_groups": 8,
        "expand": 2,
        "max_position_embeddings": 131072,
    },
    "nano-30b-a3b": COMMON
    | {
        "hybrid_override_pattern": NANO_30B_PATTERN,
        "num_hidden_layers": len(NANO_30B_PATTERN),
        "vocab_size": 131072,
        "hidden_size": 2688,
        "intermediate_size": 1856,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "expand": 2,
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856,
        "n_shared_experts": 1,
        "moe_shared_expert_intermediate_size": 3712,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "n_group": 1,
        "topk_group": 1,
        "max_position_embeddings": 262144,
    },
    "tiny": COMMON
    | {
        "hybrid_override_pattern": "M-M*M-M*",
        "num_hidden_layers": 8,
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "expand": 1,
        "chunk_size": 16,
        "max_position_embeddings": 4096,
    },
}


def fp8_variant(config: dict) -> dict:
    """`config` as a ModelOpt FP8 checkpoint's (the `*-fp8` shapes of the module docstring)."""
    pattern = config["hybrid_override_pattern"]
    exclude = ["lm_head", "*.conv1d", "*.gate"]
    for i, kind in enumerate(pattern):
        if kind == "*":
            exclude.append(f"backbone.layers.{i}.mixer*")
            if i and pattern[i - 1] == "M":
                exclude.append(f"backbone.layers.{i - 1}.mixer*")
    quant = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8",
        "exclude_modules": exclude,
    }
    return config | {"quantization_config": quant}


SHAPES |= {
    f"{name}-fp8": fp8_variant(SHAPES[name]) for name in ("nano-9b-v2", "nano-30b-a3b", "tiny")
}


def write_config(shape: str, directory: str | Path) -> Path:
    """Write `shape`'s config.json into `directory` (created); returns the directory."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(SHAPES[shape], indent=2) + "\n")
    return directory


def model_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark script's parser: description and epilog from its docstring `doc`, and the
    model choice (`--shape` of SHAPES with dummy weights, or `--model` a directory)."""
    head, tail = doc.split("\n\n", 1)
    parser = argparse.ArgumentParser(
        description=head, epilog=tail, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=sorted(SHAPES), default="nano-9b-v2")
    src.add_argument("--model", type=Path, help="a model directory (real weights)")
    return parser


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    print(write_config(args.shape, args.directory) / "config.json")


if __name__ == "__main__":
    main()
