"""The library and notebook surface: `LLM` and `generate` (vLLM-shaped).

from hybridserve import LLM, SamplingParams

llm = LLM(model="path/to/model")            # an HF directory or a converted one
outs = llm.generate(["def ", {"prompt_token_ids": [1, 2, 3]}],
                    SamplingParams(temperature=0.0, max_tokens=32))
print(outs[0].outputs[0].text, outs[0].outputs[0].token_ids)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from hybridserve.engine import EngineConfig, LLMEngine
from hybridserve.outputs import RequestOutput
from hybridserve.sampling_params import SamplingParams

Prompt = str | dict

DEFAULT_MODEL = Path(__file__).parent / "assets" / "default"


class LLM:
    """A model loaded for offline generation.

    Args:
      model: an HF directory (nemotron_h, bamba, granitemoehybrid; converted on the fly) or a
        directory written by `hybridserve convert`. Defaults to the shipped toy model.
      dtype: "float32" or "bfloat16"; None keeps the checkpoint's dtype.
      tensor_parallel_size: devices to shard the model over.
      backend: op backend, "xla" (reference), "pallas" or "torch".
      max_model_len: longest prompt + output, in tokens.
      max_num_seqs: requests decoded together.
      max_prefill_chunk: prompt tokens processed per step and request (chunked prefill).
      seed: base seed of requests whose SamplingParams carry none.
      progress: show a progress bar while loading weights.
    """

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        dtype: str | None = None,
        tensor_parallel_size: int = 1,
        backend: str = "xla",
        max_model_len: int = 2048,
        max_num_seqs: int = 8,
        max_prefill_chunk: int = 256,
        seed: int = 0,
        progress: bool = True,
    ) -> None:
        if not Path(model).is_dir():
            raise FileNotFoundError(
                f"model directory {model} does not exist (no model hub "
                "downloads: pass a local directory)"
            )
        self.engine = LLMEngine(
            EngineConfig(
                model=str(model),
                dtype=dtype,
                tensor_parallel_size=tensor_parallel_size,
                backend=backend,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_prefill_chunk=max_prefill_chunk,
                seed=seed,
            ),
            progress=progress,
        )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or `{"prompt_token_ids": [...]}`); outputs come
        back in prompt order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            if isinstance(prompt, dict):
                if "prompt_token_ids" not in prompt:
                    raise ValueError('a dict prompt needs "prompt_token_ids"')
                prompt = list(prompt["prompt_token_ids"])
            ids.append(self.engine.add_request(prompt, p))
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    done[out.request_id] = out
                    bar.update(1)
        return [done[i] for i in ids]
