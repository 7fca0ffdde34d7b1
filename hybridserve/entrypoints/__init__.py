"""What users drive, above the engine: `LLM` (`llm`), `DisaggregatedLLM` (`disaggregated`) and
the worker process a P/D deployment runs each engine in (`worker`).

`DEFAULT_MODEL` is the shipped toy model's folder; this module imports nothing heavy, so that
the CLI can name it before it parses its arguments.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "default"
