"""Response bodies of one request, completions or chat: full responses, streamed chunks with
text deltas, logprobs in the OpenAI shapes.

Text deltas hold back a trailing incomplete UTF-8 character (the tokenizer decodes it as U+FFFD)
and, when the request has stop strings, the last `len(longest stop) - 1` characters, so that
no streamed text is later cut away by a stop string. `return_token_ids` (an extension, as in
vLLM) adds `token_ids` to non-streamed choices and `prompt_token_ids` to the response.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from hybridserve.outputs import Logprob, RequestOutput
from hybridserve.server import protocol as P
from hybridserve.tokenizer import Tokenizer

DONE = "data: [DONE]\n\n"  # a stream's last event


def sse(body: BaseModel) -> str:
    """One server-sent event."""
    return f"data: {body.model_dump_json()}\n\n"


class ResponseFormat:
    """Builds the response bodies of one request, completions or chat."""

    def __init__(
        self,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        req_id: str,
        model: str,
        tokenizer: Tokenizer | None,
        prompt_ids: list[int],
    ) -> None:
        self.chat = isinstance(req, P.ChatCompletionRequest)
        self.ids = req.return_token_ids
        self.prompt_ids = prompt_ids if req.return_token_ids else None
        self.req_id = req_id
        self.model = model
        self.tokenizer = tokenizer
        if self.chat:
            self.num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            self.num_logprobs = req.logprobs
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.holdback = max((len(s) for s in req.stop_strings), default=1) - 1
        self.sent = ""  # text streamed so far
        self.tokens_sent = 0
        self.offset = 0  # text offset of the next logprob token (completions)
        self.prompt_tokens = len(prompt_ids)  # the decode side of P/D: all of them
        self.completion_tokens = 0

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _text(self, token_id: int, lp: Logprob) -> str:
        """A logprob entry's token text: decoded once by the engine's output processor."""
        return self._token(token_id) if lp.decoded_token is None else lp.decoded_token

    def _logprobs(self, ids: list[int], entries: list[dict[int, Logprob]] | None) -> Any:
        if self.num_logprobs is None or entries is None:
            return None
        k = self.num_logprobs
        if self.chat:
            content = []
            for token_id, entry in zip(ids, entries, strict=False):
                token = self._text(token_id, entry[token_id])
                top = [
                    P.TopLogprob(
                        token=(t := self._text(i, lp)), logprob=lp.logprob, bytes=list(t.encode())
                    )
                    for i, lp in list(entry.items())[:k]
                ]
                content.append(
                    P.TokenLogprob(
                        token=token,
                        logprob=entry[token_id].logprob,
                        bytes=list(token.encode()),
                        top_logprobs=top,
                    )
                )
            return P.ChatLogprobs(content=content)
        result = P.CompletionLogprobs()
        for token_id, entry in zip(ids, entries, strict=False):
            token = self._text(token_id, entry[token_id])
            result.tokens.append(token)
            result.token_logprobs.append(entry[token_id].logprob)
            top = list(entry.items())[:k]
            result.top_logprobs.append({self._text(i, lp): lp.logprob for i, lp in top})
            result.text_offset.append(self.offset)
            self.offset += len(token)
        return result

    def _usage(self) -> P.UsageInfo:
        return P.UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )

    def full(self, out: RequestOutput) -> BaseModel:
        """The non-streamed response for the final output."""
        c = out.outputs[0]
        self.completion_tokens = len(c.token_ids)
        logprobs = self._logprobs(c.token_ids, c.logprobs)
        token_ids = list(c.token_ids) if self.ids else None
        common = dict(
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=token_ids,
        )
        prompt_logprobs = self._prompt_logprobs(out)
        if self.chat:
            choice = P.ChatChoice(message=P.ChatMessageOut(content=c.text), **common)
            extra = {"prompt_logprobs": prompt_logprobs}  # vLLM: on the response
            response = P.ChatCompletionResponse
        else:
            choice = P.CompletionChoice(
                text=c.text, prompt_logprobs=prompt_logprobs, **common
            )  # vLLM: on the choice
            extra, response = {}, P.CompletionResponse
        return response(
            id=self.req_id,
            model=self.model,
            choices=[choice],
            usage=self._usage(),
            prompt_token_ids=self.prompt_ids,
            kv_transfer_params=out.kv_transfer_params,
            **extra,
        )

    def _prompt_logprobs(self, out: RequestOutput) -> P.PromptLogprobs | None:
        """A request's prompt logprobs in vLLM's JSON shape (token texts decoded here when
        the engine had no tokenizer to do it)."""
        if out.prompt_logprobs is None:
            return None
        return [
            None
            if entry is None
            else {
                str(t): P.PromptLogprob(
                    logprob=lp.logprob, rank=lp.rank, decoded_token=self._text(t, lp)
                )
                for t, lp in entry.items()
            }
            for entry in out.prompt_logprobs
        ]

    def chunk(
        self,
        delta: P.DeltaMessage | str,
        finish: str | None,
        stop_reason: int | str | None,
        logprobs: Any = None,
        kv: dict | None = None,
    ) -> BaseModel:
        """One streamed chunk: a text delta (chat: a DeltaMessage) and maybe the finish."""
        if self.chat:
            if isinstance(delta, str):
                delta = P.DeltaMessage(content=delta)
            choice = P.ChatStreamChoice(
                delta=delta, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason
            )
            return P.ChatCompletionChunk(
                id=self.req_id, model=self.model, choices=[choice], kv_transfer_params=kv
            )
        choice = P.CompletionChoice(
            text=delta, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason
        )
        return P.CompletionResponse(
            id=self.req_id, model=self.model, choices=[choice], kv_transfer_params=kv
        )

    def delta(self, out: RequestOutput) -> BaseModel | None:
        """The chunk for a new output, or None when it adds nothing visible yet."""
        c = out.outputs[0]
        self.completion_tokens = len(c.token_ids)
        text = c.text
        if not out.finished:
            end = len(text.rstrip("\ufffd")) - self.holdback
            text = text[: max(end, len(self.sent))]
        piece = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += piece
        new_ids = c.token_ids[self.tokens_sent :]
        entries = c.logprobs[self.tokens_sent :] if c.logprobs is not None else None
        self.tokens_sent = len(c.token_ids)
        logprobs = self._logprobs(new_ids, entries) if new_ids else None
        if not piece and logprobs is None and not out.finished:
            return None
        finish = c.finish_reason if out.finished else None
        stop = c.stop_reason if out.finished else None
        return self.chunk(piece, finish, stop, logprobs, out.kv_transfer_params)

    def abort_chunk(self, why: str) -> BaseModel:
        return self.chunk("", "abort", why)

    def usage_chunk(self) -> BaseModel:
        if self.chat:
            body = P.ChatCompletionChunk(id=self.req_id, model=self.model, choices=[])
        else:
            body = P.CompletionResponse(id=self.req_id, model=self.model, choices=[])
        body.usage = self._usage()
        return body
