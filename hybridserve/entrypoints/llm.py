"""The library and notebook surface: `LLM` and `generate` (vLLM-shaped).

from hybridserve import LLM, SamplingParams

llm = LLM(model="path/to/model")            # an HF directory or a converted one
outs = llm.generate(["def ", {"prompt_token_ids": [1, 2, 3]}],
                    SamplingParams(temperature=0.0, max_tokens=32))
print(outs[0].outputs[0].text, outs[0].outputs[0].token_ids)

Models with encoders (Inkling) take images and audio next to the prompt's placeholder tokens:
`{"prompt_token_ids": ids, "multi_modal_data": {"image": [img], "audio": [wave]}}`
(see `hybridserve.runner.multimodal_prompt`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hybridserve.chat_prompt import piece_encoder, render_chat
from hybridserve.config import EngineConfig
from hybridserve.engine import LLMEngine
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.outputs import RequestOutput
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import Tokenizer

Prompt = str | dict


class LLM:
    """A model loaded for offline generation.

    Args:
      model: an HF directory (nemotron_h, bamba, granitemoehybrid; converted on the fly) or a
        directory written by `hybridserve convert`. Defaults to the shipped toy model.
      progress: show a progress bar while loading weights.
      **engine_kwargs: the engine settings, as `EngineConfig.from_kwargs` takes them (an
        unknown name is a `TypeError`; the defaults are `EngineConfig`'s):
        dtype: "float32", "bfloat16" or "float16"; None or "auto" keeps the checkpoint's dtype.
        tensor_parallel_size: devices to shard the model (and its cache) over.
        backend: op backend, "auto" (pallas kernels with XLA norms on GPUs, xla elsewhere),
          "xla" (reference), "pallas" or "torch"; "BASE,OP=OTHER" takes one op from another.
        max_model_len: longest prompt + output, in tokens.
        max_num_seqs: requests decoded together.
        max_num_batched_tokens: tokens computed per step (prefill chunks and decode tokens).
        max_prefill_chunk: prompt tokens per request and step (chunked prefill).
        max_num_prefill_tokens: prompt tokens per step, all requests together (None: the
          step's budget).
        decode_first: every running decode gets its token before any prompt chunk (default);
          False takes running requests in arrival order.
        enable_prefix_caching: reuse computed prefixes (KV pages and Mamba state snapshots).
        prefix_unit: the granularity of prefix-cache sharing, in tokens (None: the largest
          divisor of the attention block that is a kernel-block multiple <= 256).
        max_held_fraction: the most of the pool finished P/D prefill requests may hold.
        gpu_memory_utilization: the share (0.9) of the device memory allocator's limit for
          weights, activations and the cache pool, which takes the rest (GPUs only).
        kv_cache_memory: cache pool bytes per device (default: by gpu_memory_utilization on
          GPUs, 256 MiB on CPUs).
        kv_cache_dtype: "auto" (the model dtype, or e4m3 for a checkpoint with FP8 KV scales),
          "bfloat16", "fp8" (= "fp8_e4m3"), ...
        enforce_eager: skip the start-up compile of every step program (they compile on
          first use); default False: ready means compiled.
        cache: the paged cache's settings (`CacheConfig` or its fields as a dict: dtypes,
          conv layout, pool size); block_size: the least tokens per cache page.
        seed: base seed of requests whose SamplingParams carry none (and of dummy weights).
        speculative_config: speculative decoding (`SpeculativeConfig` or its fields as a dict,
          e.g. `{"method": "mtp", "num_speculative_tokens": 3}`): the MTP heads draft, one pass
          verifies (exact for every sampling setting).
        kv_transfer_config: makes this a prefill (kv_producer) or decode (kv_consumer) engine
          of a disaggregated pair (`KVTransferConfig` or a dict); prompts then carry
          "kv_transfer_params".
        load_format: "auto" reads the checkpoint; "dummy" reads only the config and draws
          random weights from `seed` (benchmarks of sizes no checkpoint here has).
    """

    def __init__(
        self, model: str | Path = DEFAULT_MODEL, progress: bool = True, **engine_kwargs: Any
    ) -> None:
        if not Path(model).is_dir():
            raise FileNotFoundError(
                f"model directory {model} does not exist (no model hub "
                "downloads: pass a local directory)"
            )
        config = EngineConfig.from_kwargs(str(model), **engine_kwargs)
        self.engine = LLMEngine(config, progress=progress)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _add(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[list[str]]:
        """Validate every prompt, then queue them; per prompt, the req_ids of its `n`
        completions (the i-th with seed `seed + i` when the params have a seed)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        unpacked = []
        for prompt, p in zip(prompts, params, strict=True):
            kv = mm = None
            if isinstance(prompt, dict):
                if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                    raise ValueError('a dict prompt needs "prompt_token_ids" or "prompt"')
                kv = prompt.get("kv_transfer_params")
                data = prompt.get("multi_modal_data")
                prompt = (
                    prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
                )
                if data:
                    prompt, mm = self.engine.prepare_multimodal(prompt, data)
            self.engine.validate(prompt, p)  # all or nothing: check every prompt first
            unpacked.append((prompt, p, kv, mm))
        groups = []
        for prompt, p, kv, mm in unpacked:
            groups.append(
                [
                    self.engine.add_request(prompt, p.choice(i), kv_transfer_params=kv, mm=mm)
                    for i in range(p.n)
                ]
            )
        return groups

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, `{"prompt_token_ids": [...]}` or `{"prompt":
        "..."}`, either dict with an optional `"multi_modal_data"`); outputs come back in
        prompt order."""
        groups = self._add(prompts, sampling_params)
        total = sum(map(len, groups))
        done: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(done) < total:
                outs = self.engine.step()
                if not outs:
                    time.sleep(0.0005)  # waiting for transfers
                for out in outs:
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [_merged([done[i] for i in group]) for group in groups]

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (`encode`, `decode`, `apply_chat_template`, `eos_token_id`);
        ValueError when the model directory has no `tokenizer.json`."""
        if self.engine.tokenizer is None:
            raise ValueError(
                f"{self.engine.config.model} has no tokenizer.json: pass prompts as "
                '{"prompt_token_ids": [...]}'
            )
        return self.engine.tokenizer

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages;
        content a string or a list of OpenAI parts: text, `image_url` with a data URL,
        `input_audio` with base64 WAV) or a list of them, each rendered by the model's chat
        template (or the jinja source `chat_template`) as the server renders it
        (`hybridserve.chat_prompt`); outputs in conversation order (vLLM's `LLM.chat`)."""
        batch = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        template = tokenizer.template(chat_template)
        prompts: list[Prompt] = []
        for conversation in batch:
            chat = render_chat(conversation, template, self.engine.model_config,
                               add_generation_prompt)  # fmt: skip
            if not chat.media:
                prompts.append(chat.text)
                continue
            bos = template.special_tokens.get("bos_token")
            ids = chat.token_ids(piece_encoder(tokenizer, bos))
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": chat.multi_modal_data()})
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like `generate`, but yields a `RequestOutput` each time a request gets a token
        (`new_token_ids` holds the tokens since its previous update). Closing the generator
        early aborts the requests still running."""
        groups = self._add(prompts, sampling_params)
        if any(len(group) > 1 for group in groups):
            for req_id in (i for group in groups for i in group):
                self.engine.abort_request(req_id)
            raise ValueError("n > 1 is not supported by generate_stream: use generate")
        ids = [group[0] for group in groups]
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for req_id in pending:
                self.engine.abort_request(req_id)

    def stats(self) -> dict[str, float]:
        """Engine statistics: queue sizes, cache usage, prefix-cache hit rate."""
        return self.engine.stats()

    def close(self) -> None:
        """Release what outlives a Python reference: a P/D engine's NIXL agent (whose progress
        thread polls without pause) and its handshake server. Idempotent; `with LLM(...) as
        llm:` calls it on exit."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _merged(outputs: list[RequestOutput]) -> RequestOutput:
    """The n completions of one prompt as one output (vLLM's shape): the first request's id,
    prompt and metrics, `outputs[i].index == i`."""
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    completions = [dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outputs)]
    return dataclasses.replace(first, outputs=completions)
