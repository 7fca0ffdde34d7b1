"""hybridserve: a JAX/Flax serving engine for hybrid (Mamba2 + attention) language models.

    from hybridserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-or-converted-dir")
    outputs = llm.generate(["def "], SamplingParams(temperature=0.0, max_tokens=32))
    print(outputs[0].outputs[0].text)

The public names are imported lazily, so that `import hybridserve.core` stays free of JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
_PUBLIC = {
    "LLM": "hybridserve.entrypoints.llm",
    "DisaggregatedLLM": "hybridserve.entrypoints.disaggregated",
    "KVTransferConfig": "hybridserve.config",
    "SamplingParams": "hybridserve.sampling_params",
    "RequestOutput": "hybridserve.outputs",
    "CompletionOutput": "hybridserve.outputs",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hybridserve' has no attribute {name!r}")
