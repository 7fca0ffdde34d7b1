"""Engine parity across backends: greedy tokens with `backend="torch"` / `"pallas"` equal those
with the `xla` reference on the tiny parity checkpoints (float32, CPU).

Four prompts of different lengths run together (so prefill chunks cross the Mamba chunk and
padding rows are present), 16 greedy tokens each, EOS ignored.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_shapes import TINY

from backends.protocol import BackendError, load_ops
from hybridserve import LLM, SamplingParams

FAMILIES = ["nemotron_h", "bamba", "granitemoehybrid"]
PROMPT_LENGTHS = [5, 13, 21, 30]
_REFERENCE: dict[str, list[list[int]]] = {}


def _prompts() -> list[dict]:
    rng = np.random.default_rng(2026)
    return [{"prompt_token_ids": rng.integers(3, 512, size=n).tolist()} for n in PROMPT_LENGTHS]


def _greedy(directory, backend: str) -> list[list[int]]:
    llm = LLM(directory, **TINY, backend=backend, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["torch", "pallas"])
def test_greedy_tokens_match_xla(hf_checkpoint, backend, family):
    try:
        load_ops(backend)
    except BackendError as err:
        pytest.skip(str(err))
    directory, _ = hf_checkpoint(family)
    if family not in _REFERENCE:
        _REFERENCE[family] = _greedy(directory, "xla")
    ref = _REFERENCE[family]
    assert all(len(tokens) == 16 for tokens in ref)
    assert len({t for tokens in ref for t in tokens}) > 8, "weak test: few distinct tokens"
    assert _greedy(directory, backend) == ref


def test_auto_backend_and_per_op_overrides():
    """Backend "auto" is the reference on the CPU and pallas with XLA's norms and one-token conv
    on GPUs, with tokamax's grouped matmul where tokamax imports (overrides after "auto" win);
    "BASE,OP=OTHER" takes one op from another backend; a malformed override is refused with the
    ops it may name."""
    from backends import protocol
    from backends.protocol import GPU_DEFAULT, GPU_TOKAMAX, default_backend, get_op

    tokamax = protocol._available("tokamax")
    gpu = f"{GPU_DEFAULT},{GPU_TOKAMAX}" if tokamax else GPU_DEFAULT
    assert default_backend("cpu") == "xla" and default_backend("gpu") == gpu
    assert GPU_DEFAULT.split(",")[0] == "pallas"
    ops = load_ops("auto")
    assert ops.backend == "xla" and ops.mamba2_step is get_op("mamba2_step", "xla")
    picked = load_ops("auto,rms_norm=pallas")
    assert picked.rms_norm is get_op("rms_norm", "pallas")
    assert picked.mamba2_step is get_op("mamba2_step", "xla")
    mixed = load_ops("xla,mamba2_step_paged=pallas")
    assert mixed.mamba2_step_paged is get_op("mamba2_step_paged", "pallas")
    assert mixed.paged_attention is get_op("paged_attention", "xla")
    for bad in ("xla,mamba2_step_paged", "xla,no_such_op=pallas", "xla,rms_norm=nope"):
        with pytest.raises(BackendError):
            load_ops(bad)


def test_gpu_default_takes_tokamax_only_where_it_imports(monkeypatch):
    """On a GPU, "auto" adds tokamax's grouped matmul when the tokamax backend imports, and
    leaves it out (no error) when it does not."""
    from backends import protocol

    for present in (True, False):
        monkeypatch.setattr(protocol, "_available", lambda name, present=present: present)
        got = protocol.default_backend("gpu")
        assert got.startswith(protocol.GPU_DEFAULT)
        assert (protocol.GPU_TOKAMAX in got) is present
    assert protocol.default_backend("cpu") == "xla"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "pallas"])
def test_fp8_checkpoint_greedy_tokens_match_xla(fp8_checkpoint, backend):
    """The ModelOpt FP8 checkpoint (e4m3 projections and experts, e4m3 KV cache): the pallas
    GEMV over e4m3 rows at decode, the kernels over e4m3 pages, the torch ops."""
    try:
        load_ops(backend)
    except BackendError as err:
        pytest.skip(str(err))
    directory = fp8_checkpoint(True)[0]
    if "fp8" not in _REFERENCE:
        _REFERENCE["fp8"] = _greedy(directory, "xla")
    ref = _REFERENCE["fp8"]
    assert len({t for tokens in ref for t in tokens}) > 8, "weak test: few distinct tokens"
    assert _greedy(directory, backend) == ref
