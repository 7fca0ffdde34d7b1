"""Prompts in and results out as JSON lines (`hybridserve generate --input/--output`).

Input: one object a line, `{"prompt": "text"}` or `{"prompt_token_ids": [1, 2, 3]}`, with any
`SamplingParams` field for that prompt beside it (`{"prompt": "def ", "max_tokens": 8}`); blank
lines are skipped. Output: one object a prompt, in input order: the prompt (text and ids), the
completion (`text`, `token_ids`, `finish_reason`, `stop_reason`; `choices` with every one when
`n` > 1) and its metrics.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hybridserve.outputs import RequestOutput
from hybridserve.sampling_params import SamplingParams

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def read_prompts(
    path: str | Path, defaults: SamplingParams
) -> tuple[list[str | dict], list[SamplingParams]]:
    """The prompts of a JSON-lines file and the settings of each (`defaults` with the line's
    fields); ValueError naming the line of the first bad one."""
    prompts: list[str | dict] = []
    params: list[SamplingParams] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompt, settings = _parse(json.loads(line), defaults)
        except (json.JSONDecodeError, ValueError, TypeError) as err:
            raise ValueError(f"{path}, line {number}: {err}") from None
        prompts.append(prompt)
        params.append(settings)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts, params


def _parse(item: Any, defaults: SamplingParams) -> tuple[str | dict, SamplingParams]:
    if not isinstance(item, dict):
        raise ValueError('expected an object like {"prompt": "..."}')
    fields = dict(item)
    text, ids = fields.pop("prompt", None), fields.pop("prompt_token_ids", None)
    if (text is None) == (ids is None):
        raise ValueError('give one of "prompt" (text) and "prompt_token_ids"')
    if text is not None and not isinstance(text, str):
        raise ValueError('"prompt" must be a string')
    unknown = sorted(set(fields) - _PARAM_FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {unknown} (SamplingParams fields may be given)")
    settings = dataclasses.replace(defaults, **fields)
    return (text if text is not None else {"prompt_token_ids": ids}), settings


def write_outputs(path: str | Path, outputs: list[RequestOutput]) -> None:
    """One JSON line per output (see the module docstring)."""
    with open(path, "w", encoding="utf-8") as f:
        for out in outputs:
            choices = [
                {
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in out.outputs
            ]
            line = {
                "request_id": out.request_id,
                "prompt": out.prompt,
                "prompt_token_ids": out.prompt_token_ids,
                **choices[0],
                "time_to_first_token_s": out.metrics.time_to_first_token,
                "num_cached_tokens": out.metrics.num_cached_tokens,
            }
            if len(choices) > 1:
                line["choices"] = choices
            f.write(json.dumps(line) + "\n")
