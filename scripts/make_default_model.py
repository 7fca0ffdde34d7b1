"""Build the tiny default model shipped with hybridserve (``hybridserve/assets/default/``).

Steps: collect docstrings of the offline Python standard library, train a byte-level BPE
tokenizer on them, train a small Nemotron-H-pattern hybrid (Mamba2 + attention + MLP + MoE)
language model with torch on CPU, and save it in Hugging Face format (bfloat16 safetensors).
The run is seeded and uses a deterministic data order, so it is reproducible on one machine.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import shutil
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, NemotronHConfig, NemotronHForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"
PAD = "<|pad|>"
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "ensurepip", "turtledemo"}
# Block pattern: M = Mamba2, * = attention, - = MLP, E = MoE (Nemotron-H notation).
PATTERN = "M*M-ME*M"
BLOCK_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# Words keep one trailing space ("def " is one pre-token), so prompts ending in a space
# tokenize the same way as in running text.
PRE_TOKEN_REGEX = r"\p{L}+ ?|\p{N}+ ?|[^\s\p{L}\p{N}]+ ?|\s+"


def collect_corpus() -> list[str]:
    """Return stdlib docstrings as documents, in sorted-path order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and d != "__pycache__")
        paths += [Path(root) / f for f in files if f.endswith(".py")]
    docs: list[str] = []
    for path in sorted(paths):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc := ast.get_docstring(tree):
            docs.append(doc)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (doc := ast.get_docstring(node)):
                docs.append(f"class {node.name}:\n{doc}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                doc := ast.get_docstring(node)
            ):
                docs.append(f"def {node.name}({ast.unparse(node.args)}):\n{doc}")
    return docs


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer (special tokens first: eos=0, pad=1)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKEN_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def build_config(vocab_size: int, eos_id: int, pad_id: int, seq_len: int) -> NemotronHConfig:
    """The tiny hybrid model configuration."""
    return NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        layers_block_type=[BLOCK_TYPES[c] for c in PATTERN],
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4 * seq_len,
        intermediate_size=768,
        mlp_hidden_act="relu2",
        ssm_state_size=64,
        mamba_num_heads=8,
        mamba_head_dim=64,
        n_groups=2,
        conv_kernel=4,
        expand=2,
        chunk_size=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=512,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
    )


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))


def batches(ids: torch.Tensor, n: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """``n`` seeded random windows of ``seq_len + 1`` tokens, shape (n, batch, seq_len + 1)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len - 1, (n, batch), generator=gen)
    return ids[starts[..., None] + torch.arange(seq_len + 1)]


def lm_loss(model: NemotronHForCausalLM, xy: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a (batch, seq_len + 1) window batch."""
    logits = model(input_ids=xy[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1))


@torch.no_grad()
def min_dt_per_layer(model: NemotronHForCausalLM, xy: torch.Tensor) -> dict[int, float]:
    """Min of softplus(dt + dt_bias) per Mamba layer over a sample batch (hooks on in_proj)."""
    found: dict[int, float] = {}
    hooks = []
    for idx, layer in enumerate(model.model.layers):
        if layer.block_type != "linear_attention":
            continue
        mixer = layer.mixer

        def hook(_mod, _inp, out, idx=idx, mixer=mixer) -> None:
            dt = out[..., -mixer.num_heads :]
            found[idx] = F.softplus(dt + mixer.dt_bias).min().item()

        hooks.append(mixer.in_proj.register_forward_hook(hook))
    model(input_ids=xy[:, :-1])
    for h in hooks:
        h.remove()
    return found


def write_tokenizer(tok: Tokenizer, out: Path, seq_len: int) -> None:
    """Write tokenizer.json plus the transformers side files."""
    tok.save(str(out / "tokenizer.json"))
    special = {"eos_token": EOS, "bos_token": EOS, "pad_token": PAD, "unk_token": EOS}
    cfg = {**special, "model_max_length": 4 * seq_len, "add_bos_token": False}
    cfg |= {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def main() -> None:
    """Parse arguments, then build, train, save and smoke-test the default model."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "hybridserve/assets/default",
        help="output directory (replaced)",
    )
    ap.add_argument(
        "--steps", type=int, default=260, help="optimizer steps (~8 min on 2 CPU cores)"
    )
    ap.add_argument(
        "--minutes",
        type=float,
        default=15.0,
        help="wall-clock cap on training; hitting it makes the run non-reproducible",
    )
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    ap.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    ap.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size")
    ap.add_argument("--seed", type=int, default=0, help="seed for init and data order")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    docs = collect_corpus()
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f} M characters")
    tok = train_tokenizer(docs, args.vocab)
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    held = [d for i, d in enumerate(docs) if i % 50 == 49]  # 2% held-out split
    train = [d for i, d in enumerate(docs) if i % 50 != 49]

    def stream(ds: list[str]) -> torch.Tensor:
        enc = tok.encode_batch([EOS + d for d in ds])
        return torch.tensor([t for e in enc for t in e.ids], dtype=torch.long)

    train_ids, held_ids = stream(train), stream(held)
    vocab = tok.get_vocab_size()
    print(f"tokens: train {len(train_ids):,}, held-out {len(held_ids):,}, vocab {vocab}")

    config = build_config(tok.get_vocab_size(), eos_id, pad_id, args.seq_len)
    model = NemotronHForCausalLM(config).float().train()
    for layer in model.model.layers:
        if layer.block_type == "linear_attention":
            layer.mixer.time_step_limit = (0.0, float("inf"))  # train without HF's prefill clamp
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {PATTERN} ({config.layers_block_type}), {n_params:,} parameters")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    data = batches(train_ids, args.steps, args.batch, args.seq_len, args.seed)
    t0, step, loss_ema = time.time(), 0, float("nan")
    bar = tqdm(range(args.steps), desc="train")
    for step in bar:
        if time.time() - t0 > 60 * args.minutes:
            print(f"wall-clock cap of {args.minutes} min reached at step {step}")
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = lm_loss(model, data[step])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_ema = loss.item() if step == 0 else 0.9 * loss_ema + 0.1 * loss.item()
        bar.set_postfix(loss=f"{loss.item():.3f}", ema=f"{loss_ema:.3f}")
    else:
        step = args.steps
    minutes = (time.time() - t0) / 60
    model.eval()
    with torch.no_grad():
        ev = batches(held_ids, 4, args.batch, args.seq_len, args.seed + 1)
        held_loss = sum(lm_loss(model, b).item() for b in ev) / len(ev)
        tr = batches(train_ids, 4, args.batch, args.seq_len, args.seed + 2)
        train_loss = sum(lm_loss(model, b).item() for b in tr) / len(tr)
    print(
        f"trained {step} steps in {minutes:.1f} min; train loss {train_loss:.3f} "
        f"(last-step EMA {loss_ema:.3f}), held-out loss {held_loss:.3f}"
    )

    dt_min = min_dt_per_layer(model, ev[0])
    for idx, v in dt_min.items():
        print(f"layer {idx} (mamba): min softplus(dt + dt_bias) = {v:.3e}")
    # HF clamps dt >= time_step_min in its prefill path only; keep it far below observed dt.
    floor = min(dt_min.values()) / 100
    time_step_min = min(1e-4, 10 ** math.floor(math.log10(floor)))
    model.config.time_step_min = time_step_min
    model.config.time_step_floor = min(model.config.time_step_floor, time_step_min)
    print(f"time_step_min written to config: {time_step_min:g}")

    out: Path = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # save_pretrained makes it owner-only
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(
        out
    )
    write_tokenizer(tok, out, args.seq_len)
    (out / "README.md").write_text(
        f"# hybridserve default model\n\n"
        f"A {n_params / 1e6:.1f}M-parameter toy language model with the Nemotron-H block pattern "
        f"`{PATTERN}` (Mamba2 `M`, attention `*`, MLP `-`, MoE `E`), trained for "
        f"{minutes:.0f} minutes ({step} steps) on CPU on docstrings of the Python standard "
        f"library, with a {tok.get_vocab_size()}-token byte-level BPE tokenizer. It makes "
        f"text-like but meaningless output; it exists to exercise the serving engine.\n\n"
        f"Held-out loss: {held_loss:.2f} nats/token. Weights are bfloat16 safetensors in "
        f"Hugging Face `nemotron_h` format.\n\n"
        f"Reproduce with `python scripts/make_default_model.py`.\n"
    )
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"saved to {out} ({size / 1e6:.2f} MB)")

    # Smoke test: fresh load through transformers, plus the plain tokenizers path.
    model2 = NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    plain = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "def f(x):\n    Return  x.\n\n"
    assert plain.decode(plain.encode(text).ids) == text, "tokenizer round-trip failed"
    assert hf_tok(text)["input_ids"] == plain.encode(text).ids
    prompt = hf_tok("def ", return_tensors="pt")
    for name, kw in [("greedy", {"do_sample": False}), ("T=0.8", {"do_sample": True})]:
        torch.manual_seed(0)
        extra = {"temperature": 0.8} if kw["do_sample"] else {}
        gen = model2.generate(**prompt, max_new_tokens=40, **kw, **extra)
        print(f"--- {name} ---\n{hf_tok.decode(gen[0])}")


if __name__ == "__main__":
    main()
