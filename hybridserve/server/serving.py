"""The OpenAI endpoints over an `AsyncEngine`: prompts, limits, sampling, response shapes.

One request: the prompt is tokenized (chat: rendered with the chat template first) and checked
against the vocabulary and `max_model_len`; `max_tokens` must fit in what the prompt leaves
(completions default to 16, chat to all that is left); then the engine admits it (429 when the
queue is full, 503 with Retry-After when shutting down) and the response is either one JSON
body or server-sent events (`data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`). A client that
disconnects aborts its request, streamed or not. A request past `--request-timeout` is
aborted: a JSON request gets a 504 error, a stream ends with `finish_reason: "abort"`
(`stop_reason: "timeout"`). An engine that dies (or stops) mid-stream ends the stream with an
error event, `data: {"error": {...}}`, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from hybridserve.chat_prompt import piece_encoder, render_chat
from hybridserve.config import ModelConfig
from hybridserve.disagg.params import Forbidden
from hybridserve.outputs import RequestOutput
from hybridserve.sampling_params import SamplingParams
from hybridserve.server import protocol as P
from hybridserve.server.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineStopped,
    NotAccepting,
    QueueFull,
    RequestStream,
    RequestTimeout,
)
from hybridserve.server.chat import ChatTemplate, ChatTemplateError
from hybridserve.server.choices import Choices
from hybridserve.server.errors import APIError
from hybridserve.server.formatting import DONE, ResponseFormat, sse
from hybridserve.server.metrics import RequestTrack, ServerMetrics
from hybridserve.tokenizer import Tokenizer

log = logging.getLogger("hybridserve.server")


@dataclasses.dataclass(frozen=True)
class ServingSettings:
    """What the endpoints need to know about the model and the limits."""

    model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    request_timeout_s: float | None = None
    retry_after_s: int = 1
    model_config: ModelConfig | None = None  # its encoders (None: text only)


class OpenAIServing:
    """`/v1/completions` and `/v1/chat/completions` (see the module docstring)."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer | None,
        chat_template: ChatTemplate,
        settings: ServingSettings,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.settings = settings
        self.metrics = metrics

    # -- checks -----------------------------------------------------------------------------

    def model_name(self, requested: str | None) -> str:
        """The served name to answer with; 404 for a model this server does not serve."""
        names = self.settings.model_names
        if requested is None:
            return names[0]
        if requested not in names:
            raise APIError(
                404,
                f"the model {requested!r} does not exist; this server serves {list(names)}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        return requested

    async def _encode(self, text: str, param: str) -> list[int]:
        """Token ids of a text prompt; long texts are tokenized off the event loop."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param=param)
        if len(text) > 16_384:
            ids = await asyncio.to_thread(self.tokenizer.encode, text)
        else:
            ids = self.tokenizer.encode(text)
        bos = self.chat_template.special_tokens.get("bos_token")
        tok = self.tokenizer
        doubled = len(ids) >= 2 and ids[0] == ids[1] == tok.bos_token_id
        if param == "messages" and tok.add_bos and bos and text.startswith(bos) and doubled:
            ids = ids[1:]  # the template wrote the BOS already
        return ids

    def _check_prompt(self, ids: list[int], param: str) -> None:
        s = self.settings
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        bad = [t for t in ids if not 0 <= t < s.vocab_size]
        if bad:
            message = f"token ids {bad[:5]} are outside the vocabulary (size {s.vocab_size})"
            raise APIError(400, message, param=param)
        if len(ids) >= s.max_model_len:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; this model's maximum context length "
                f"(max_model_len) is {s.max_model_len}, prompt plus at least one output token",
                param=param,
                code="context_length_exceeded",
            )

    def _params(
        self, req: P._SamplingRequest, n_prompt: int, max_tokens: int | None, default: int
    ) -> SamplingParams:
        s = self.settings
        room = s.max_model_len - n_prompt
        if max_tokens is None:
            max_tokens = min(default, room)
        if max_tokens > room:
            raise APIError(
                400,
                f"max_tokens is {max_tokens}, but the prompt has {n_prompt} tokens and "
                f"max_model_len is {s.max_model_len}: at most {room} can be generated",
                param="max_tokens",
                code="context_length_exceeded",
            )
        stop_ids = req.stop_token_ids or []
        if any(not 0 <= t < s.vocab_size for t in stop_ids):
            raise APIError(400, "stop_token_ids outside the vocabulary", param="stop_token_ids")
        logprobs = getattr(req, "logprobs", None)
        if isinstance(req, P.ChatCompletionRequest):
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:
            return SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                seed=req.seed,
                stop=req.stop_strings,
                stop_token_ids=tuple(stop_ids),
                ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens,
                logprobs=logprobs,
                prompt_logprobs=req.prompt_logprobs,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
            )
        except ValueError as err:
            raise APIError(400, str(err)) from err

    # -- endpoints --------------------------------------------------------------------------

    async def completions(self, req: P.CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        model = self.model_name(req.model)
        prompts, params = [], []
        for prompt in req.prompts:
            ids = await self._encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
            self._check_prompt(ids, "prompt")
            prompts.append(ids)
            params.append(self._params(req, len(ids), req.max_tokens, default=16))
        if len(prompts) == 1 and req.n == 1:
            return await self._serve(req, prompts[0], params[0], model, "cmpl", arrival, request)
        choices = Choices(self, req, prompts, params, model, "cmpl", arrival)  # server.choices
        return await choices.respond(request)

    async def chat(self, req: P.ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        model = self.model_name(req.model)
        ids, media = await self._chat_prompt(req)
        self._check_prompt(ids, "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = self._params(req, len(ids), max_tokens, default=self.settings.max_model_len)
        if req.n == 1:
            return await self._serve(req, ids, params, model, "chatcmpl", arrival, request, media)
        choices = Choices(self, req, [ids], [params], model, "chatcmpl", arrival, media)
        return await choices.respond(request)

    async def _chat_prompt(self, req: P.ChatCompletionRequest) -> tuple[list[int], dict | None]:
        """(token ids, multi_modal_data or None) of the conversation (`chat_prompt`): the
        placeholders already one per embedding; media are decoded off the event loop."""
        cfg = self.settings.model_config
        messages = [m.as_dict() for m in req.messages]
        has_media = any(
            isinstance(m.content, list) and any(not isinstance(p, P.TextPart) for p in m.content)
            for m in req.messages
        )
        try:
            if has_media and cfg is None:
                raise ValueError("this server takes no images or audio")
            render = (self.chat_template, cfg, req.add_generation_prompt)
            prompt = (
                await asyncio.to_thread(render_chat, messages, *render)
                if has_media
                else (render_chat(messages, *render))
            )
        except ChatTemplateError as err:
            raise APIError(400, str(err), param="messages") from err
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        if not prompt.media:
            return await self._encode(prompt.text, "messages"), None
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="messages")
        encode = piece_encoder(self.tokenizer, self.chat_template.special_tokens.get("bos_token"))
        data = prompt.multi_modal_data()
        try:
            ids = self.engine.engine.expand_multimodal(prompt.token_ids(encode), data)
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        return ids, data

    async def _start(
        self,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        ids: list[int],
        params: SamplingParams,
        prefix: str,
        arrival: float,
        media: dict | None = None,
    ) -> tuple[str, RequestStream, RequestTrack]:
        """Admit one engine request: (req_id, its stream, its metrics tracker); the engine's
        refusals as API errors."""
        req_id = P.new_id(prefix)
        kv = (
            req.kv_transfer_params.model_dump(exclude_none=True) if req.kv_transfer_params else None
        )
        try:
            stream = await self.engine.add_request(
                ids, params, req_id, kv, self.settings.request_timeout_s, media
            )
        except QueueFull as err:
            retry = {"Retry-After": str(self.settings.retry_after_s)}
            raise APIError(
                429, str(err), "rate_limit_error", code="queue_full", headers=retry
            ) from err
        except NotAccepting as err:
            retry = {"Retry-After": str(self.settings.retry_after_s)}
            raise APIError(
                503, str(err), "service_unavailable", code="unavailable", headers=retry
            ) from err
        except Forbidden as err:  # forged, expired or replayed kv_transfer_params
            raise APIError(403, str(err), "permission_error", code="forbidden") from err
        except ValueError as err:
            raise APIError(400, str(err)) from err
        track = RequestTrack(self.metrics, req_id, arrival)
        track.prompt_tokens = len(ids)
        self.metrics.prompt_tokens.inc(len(ids))
        return req_id, stream, track

    async def _serve(
        self,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        ids: list[int],
        params: SamplingParams,
        model: str,
        prefix: str,
        arrival: float,
        request: Request,
        media: dict | None = None,
    ) -> Response:
        req_id, stream, track = await self._start(req, ids, params, prefix, arrival, media)
        fmt = ResponseFormat(req, req_id, model, self.tokenizer, ids)
        if req.stream:
            events = self._events(stream, track, fmt)
            headers = {"Cache-Control": "no-cache", "X-Request-Id": req_id}
            # `events` closes the stream itself; the background task covers a response that is
            # cancelled before its first chunk (the generator never ran, so no `finally` runs)
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers=headers,
                background=BackgroundTask(stream.close),
            )
        final = await self._collect(stream, track, request)
        if final is None:  # the client left: nobody reads this
            return Response(status_code=499)
        return JSONResponse(fmt.full(final).model_dump(), headers={"X-Request-Id": req_id})

    async def _collect(
        self, stream: RequestStream, track: RequestTrack, request: Request
    ) -> RequestOutput | None:
        """The final output, or None when the client disconnected first (the request is
        aborted)."""

        async def consume() -> RequestOutput:
            last = None
            async for out in stream:
                track.observe(out)
                last = out
            return last

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            return None
        except RequestTimeout as err:
            track.done("timeout")
            timeout = self.settings.request_timeout_s
            message = f"{err}: it did not finish within --request-timeout {timeout} s"
            raise APIError(504, message, "timeout_error", code="request_timeout") from err
        except (EngineDead, EngineStopped) as err:
            track.done("error")
            raise APIError(503, str(err), "service_unavailable", code="engine_error") from err
        finally:
            for t in (task, watch):
                t.cancel()
            stream.close()
            track.done()

    async def _chunks(
        self, stream: RequestStream, track: RequestTrack, fmt: ResponseFormat
    ) -> AsyncIterator[BaseModel]:
        """The bodies one streamed request sends (see the module docstring): chat's role
        chunk, the deltas, then an abort chunk (timeout) or an error body if it ended so."""
        tail: list[BaseModel] = []
        try:
            if fmt.chat:
                yield fmt.chunk(P.DeltaMessage(role="assistant", content=""), None, None)
            async for out in stream:
                track.observe(out)
                chunk = fmt.delta(out)
                if chunk is not None:
                    yield chunk
        except RequestTimeout:
            track.done("timeout")
            tail.append(fmt.abort_chunk("timeout"))
        except (EngineDead, EngineStopped) as err:
            track.done("error")
            info = P.ErrorInfo(message=str(err), type="service_unavailable", code="engine_error")
            tail.append(P.ErrorResponse(error=info))
        except Exception as err:  # a stream must end with an event, not a cut connection
            log.exception("%s failed while streaming", track.req_id)
            track.done("error")
            message = f"internal error: {type(err).__name__}"
            info = P.ErrorInfo(message=message, type="internal_error", code="internal_error")
            tail.append(P.ErrorResponse(error=info))
        finally:
            stream.close()
            track.done()
        for body in tail:
            yield body

    async def _events(
        self, stream: RequestStream, track: RequestTrack, fmt: ResponseFormat
    ) -> AsyncIterator[str]:
        """Server-sent events of one streamed request: its bodies, the usage chunk when asked
        (not after an error), then [DONE]."""
        failed = False
        async for body in self._chunks(stream, track, fmt):
            failed = isinstance(body, P.ErrorResponse)
            yield sse(body)
        if fmt.include_usage and not failed:
            yield sse(fmt.usage_chunk())
        yield DONE
