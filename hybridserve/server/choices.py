"""Responses with several choices: a batch of completion prompts, or `n` > 1.

Each choice is one engine request (choice j of a prompt with seed + j when a seed is given:
`SamplingParams.choice`), all admitted before any is answered (a refusal of one aborts the
others). Choices are indexed prompt by prompt; the response carries the first request's id and
the usage summed (each prompt's tokens counted once).

Lifecycle of a streamed response:
  1. every choice is admitted, each with its own `ResponseFormat`;
  2. one task per choice reads that request's bodies (`OpenAIServing._chunks`) into a shared
     queue; the response sends them as they come, each with the response's id and its choice's
     index (an error body once, whichever choice met it);
  3. when every choice has ended: the summed usage chunk (when asked, and no error), then
     [DONE]; a client that leaves cancels the tasks, which aborts every request still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from hybridserve.sampling_params import SamplingParams
from hybridserve.server import protocol as P
from hybridserve.server.errors import APIError
from hybridserve.server.formatting import DONE, ResponseFormat, sse

if TYPE_CHECKING:
    from hybridserve.server.async_engine import RequestStream
    from hybridserve.server.metrics import RequestTrack


class Serving(Protocol):
    """What a response of several choices uses of `serving.OpenAIServing` (named
    structurally: serving imports this module)."""

    tokenizer: Any

    async def _start(self, req: Any, ids: list[int], params: SamplingParams, *a: Any) -> tuple:
        """Admit one engine request: (req_id, its stream, its metrics tracker)."""

    async def _collect(self, stream: Any, track: Any, request: Request) -> Any:
        """Its final output (None: the client left)."""

    def _chunks(self, stream: Any, track: Any, fmt: ResponseFormat) -> AsyncIterator[BaseModel]:
        """The bodies it streams."""


class Choices:
    """One response of several choices (see the module docstring)."""

    def __init__(
        self,
        serving: Serving,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        prompts: list[list[int]],
        params: list[SamplingParams],
        model: str,
        prefix: str,
        arrival: float,
        media: dict | None = None,
    ) -> None:
        self.serving, self.req, self.model = serving, req, model
        self.prefix, self.arrival = prefix, arrival
        self.media = media  # multi_modal_data of a chat prompt (its one prompt)
        # (prompt, settings) of each choice, in response order
        pairs = zip(prompts, params, strict=True)
        self.todo = [(ids, p.choice(j)) for ids, p in pairs for j in range(req.n)]
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.batch = len(prompts) > 1

    async def _start(self, ids: list[int], params: SamplingParams) -> tuple:
        req_id, stream, track = await self.serving._start(
            self.req, ids, params, self.prefix, self.arrival, self.media
        )
        fmt = ResponseFormat(self.req, req_id, self.model, self.serving.tokenizer, ids)
        return stream, track, fmt

    async def respond(self, request: Request) -> Response:
        """The response: streamed when the request asks, else one JSON body."""
        return await (self.stream() if self.req.stream else self.collect(request))

    async def collect(self, request: Request) -> Response:
        """The whole response as one JSON body (every choice run together)."""

        async def one(ids: list[int], params: SamplingParams) -> dict | None:
            stream, track, fmt = await self._start(ids, params)
            final = await self.serving._collect(stream, track, request)
            return None if final is None else fmt.full(final).model_dump()

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(ids, p)) for ids, p in self.todo]
        except* APIError as errors:
            raise errors.exceptions[0] from None
        parts = [t.result() for t in tasks]
        if any(part is None for part in parts):  # the client left
            return Response(status_code=499)
        merged = parts[0]
        choices = [{**part["choices"][0], "index": i} for i, part in enumerate(parts)]
        n = self.req.n
        for i, choice in enumerate(choices):  # its first choice computed the prompt logprobs
            if "prompt_logprobs" in choice:
                choice["prompt_logprobs"] = choices[i - i % n]["prompt_logprobs"]
        merged["choices"] = choices
        completion = sum(part["usage"]["completion_tokens"] for part in parts)
        merged["usage"] = self._usage(completion).model_dump()
        if self.batch:
            merged["prompt_token_ids"] = None  # each choice's prompt differs
        return JSONResponse(merged, headers={"X-Request-Id": merged["id"]})

    def _usage(self, completion: int) -> P.UsageInfo:
        return P.UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
        )

    async def stream(self) -> Response:
        """The response as server-sent events, the choices' chunks interleaved."""
        started: list[tuple[RequestStream, RequestTrack, ResponseFormat]] = []
        try:
            for ids, p in self.todo:
                started.append(await self._start(ids, p))
        except APIError:
            for stream, track, _ in started:
                stream.close()
                track.done()
            raise
        first = started[0][2].req_id

        def close() -> None:
            for stream, _, _ in started:
                stream.close()

        return StreamingResponse(
            self._events(started, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": first},
            background=BackgroundTask(close),
        )

    async def _events(self, started: list[tuple], first: str) -> AsyncIterator[str]:
        queue: asyncio.Queue[tuple[int, BaseModel | None]] = asyncio.Queue()

        async def pump(index: int, bodies: AsyncIterator[BaseModel]) -> None:
            try:
                async for body in bodies:
                    await queue.put((index, body))
            finally:
                queue.put_nowait((index, None))

        tasks = [
            asyncio.ensure_future(pump(i, self.serving._chunks(*one)))
            for i, one in enumerate(started)
        ]
        failed = False
        try:
            running = len(tasks)
            while running:
                index, body = await queue.get()
                if body is None:
                    running -= 1
                elif isinstance(body, P.ErrorResponse):
                    if not failed:
                        yield sse(body)
                    failed = True
                else:
                    body.id = first
                    for choice in body.choices:
                        choice.index = index
                    yield sse(body)
            fmts = [fmt for _, _, fmt in started]
            if fmts[0].include_usage and not failed:
                usage = fmts[0].usage_chunk()
                usage.id = first
                usage.usage = self._usage(sum(f.completion_tokens for f in fmts))
                yield sse(usage)
        finally:
            for task in tasks:
                task.cancel()
            for stream, _, _ in started:
                stream.close()
        yield DONE
