"""The command line, run as a user would: a subprocess on the shipped default model."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from hybridserve.entrypoints import DEFAULT_MODEL


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_default_model_is_small_and_complete():
    files = {p.name: p.stat().st_size for p in DEFAULT_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(files)
    assert sum(files.values()) < 20 * 2**20


def test_generate_prints_text_and_timings():
    proc = _run("generate", "def ", "class ", "--max-tokens", "24", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("--- prompt:") == 2
    text = out.split("--- prompt: 'def '\n")[1].split("--- prompt:")[0]
    assert text.startswith("def ") and len(text.strip()) > len("def ") + 10
    assert "time to first token:" in out and "tokens/s" in out


def test_generate_takes_token_ids():
    proc = _run("generate", "--prompt-token-ids", "[[5, 6, 7], [9]]", "--max-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    for ids in ("[5, 6, 7]", "[9]"):
        assert f"--- prompt_token_ids: {ids}" in proc.stdout
    outs = [line for line in proc.stdout.splitlines() if line.startswith("token_ids: ")]
    assert len(outs) == 2 and all(len(json.loads(line.split(": ", 1)[1])) == 3 for line in outs)
    bad = _run("generate", "--prompt-token-ids", "[1, 'a']")
    assert bad.returncode == 2 and "--prompt-token-ids" in bad.stderr


def test_generate_reads_and_writes_json_lines(tmp_path):
    """`generate --input FILE.jsonl --output FILE.jsonl`: per-line prompts and settings in,
    one result line per prompt out (in order); a bad line is refused before the model loads."""
    lines = [
        {"prompt": "def ", "max_tokens": 3, "ignore_eos": True},
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 2, "ignore_eos": True, "temperature": 0},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    proc = _run("generate", "--input", str(src), "--output", str(dst), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [len(g["token_ids"]) for g in got] == [3, 2]
    assert got[0]["prompt"] == "def " and got[1]["prompt_token_ids"] == [5, 6, 7]
    assert all(g["finish_reason"] == "length" for g in got)
    src.write_text('{"prompt": "a"}\n{"prompt": "b", "max_tokenz": 3}\n')
    bad = _run("generate", "--input", str(src))
    assert bad.returncode == 2 and "line 2" in bad.stderr and "max_tokenz" in bad.stderr
    both = _run("generate", "x", "--input", str(src))
    assert both.returncode == 2 and "not several" in both.stderr


def test_help_imports_no_jax():
    """`--help` of every command answers without importing JAX (which alone takes seconds)."""
    for command in ([], ["serve"], ["generate"], ["proxy"], ["convert"], ["bench", "serve"]):
        code = (
            "import sys\nfrom hybridserve import cli\ntry:\n"
            f"    cli.main({[*command, '--help']!r})\nexcept SystemExit:\n    pass\n"
            "print('JAX', 'jax' in sys.modules)"
        )
        begin = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        elapsed = time.perf_counter() - begin
        assert proc.stdout.strip().endswith("JAX False"), (command, proc.stdout[-300:])
        assert elapsed < 1.0, f"{command} --help took {elapsed:.2f} s"


def test_help_and_bad_input():
    proc = _run("--help")
    assert proc.returncode == 0 and "generate" in proc.stdout and "convert" in proc.stdout
    proc = _run("generate", "--model", "/nonexistent")
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_engine_flags_reach_the_config():
    """`serve --prefix-unit` and friends go through `EngineConfig.from_kwargs`: a bad value is
    refused with its config message before the model loads."""
    proc = _run("serve", "--prefix-unit", "0")
    assert proc.returncode == 2 and "prefix_unit must be >= 1" in proc.stderr
    proc = _run("serve", "--max-num-seqs", "0")
    assert proc.returncode == 2 and "max_num_seqs must be >= 1" in proc.stderr
    proc = _run("serve", "--gpu-memory-utilization", "1.5")
    assert proc.returncode == 2 and "gpu_memory_utilization must be in (0, 1]" in proc.stderr
    proc = _run("serve", "--max-num-prefill-tokens", "0")
    assert proc.returncode == 2 and "max_num_prefill_tokens must be >= 1" in proc.stderr
    proc = _run("serve", "--help")
    assert "--prefix-unit" in proc.stdout and "--max-prefill-chunk" in proc.stdout
    for flag in (
        "--gpu-memory-utilization",
        "--kv-cache-memory",
        "--kv-cache-dtype",
        "--no-decode-first",
    ):
        assert flag in proc.stdout


def test_vllm_spellings_and_no_abbreviations():
    """`--dtype auto` and `--no-enable-prefix-caching` (vLLM's names) are flags; an abbreviation
    of a flag is an error, not a silent match."""
    help_text = _run("serve", "--help").stdout
    assert "--no-enable-prefix-caching" in help_text and "auto" in help_text
    proc = _run("serve", "--max-num-seq", "4")
    assert proc.returncode == 2 and "unrecognized arguments: --max-num-seq" in proc.stderr
    proc = _run("generate", "--max-token", "4")
    assert proc.returncode == 2 and "unrecognized arguments: --max-token" in proc.stderr
    assert "--chat-template" in help_text and "--enforce-eager" in help_text
    proc = _run("serve", "--chat-template", "{% if %}")
    assert proc.returncode == 2 and "the chat template does not parse" in proc.stderr
