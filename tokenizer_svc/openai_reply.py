"""One OpenAI response: its choices (one client stream each) as SSE events or as one JSON body, in each
endpoint's shape (text, deltas, logprobs, usage)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from json.encoder import encode_basestring
from typing import TYPE_CHECKING

from starlette.requests import Request

from conveyor.errors import ConveyorError
from tokenizer_svc.frontend import ClientDelta, ClientStream
from tokenizer_svc.openai_bodies import HttpError, error_body, from_conveyor
from tokenizer_svc.streaming import RequestTimer, follow
from tokenizer_svc.tools import HeldText, Tools, openai_calls, parse_calls

if TYPE_CHECKING:
    from tokenizer_svc.openai_api import OpenAIApi

log = logging.getLogger("conveyor.frontend")
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class Reply:
    """One response: its choices (one stream each, index order), as SSE events or as one JSON body."""

    def __init__(self, api: OpenAIApi, streams: list[ClientStream], chat: bool, include_usage: bool,
                 echoed: list[str], logprobs: bool, n: int = 1, vllm_prompt_logprobs: bool = False,
                 tools: Tools | None = None):
        self.api = api
        self.tools = tools  # chat with tools: answers are parsed into tool_calls
        self.streams = streams
        self.logprobs = logprobs  # the request asked for them
        self.vllm_prompt_logprobs = vllm_prompt_logprobs  # vLLM's prompt_logprobs field: returned in its shape
        self.echoed = echoed  # per choice: the prompt its text starts with (``echo``), or ""
        self.chat = chat
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.n = n
        self.prompt_tokens = sum(s.prompt_tokens for s in streams[::n])  # each prompt once, whatever n (OpenAI)
        # A chunk's bytes as json.dumps writes them, the fixed parts encoded once: the envelope, and each choice's
        # text-only shape (most chunks), into which only the text goes. json.dumps of the whole chunk was ~12 % of
        # the frontend's CPU a token at 128 streams.
        envelope = json.dumps({"id": self.id, "object": self.object + (".chunk" if chat else ""),
                               "created": self.created, "model": api.model}, ensure_ascii=False)
        self._head = b"data: " + envelope[:-1].encode() + b', "choices": '
        text_part = '[{"index": %d, "delta": {"content": ' if chat else '[{"index": %d, "text": '
        self._text_heads = [self._head + (text_part % i).encode() for i in range(len(streams))]
        self._text_tail = (b'}' if chat else b'') + b', "logprobs": null, "finish_reason": null}]}\n\n'

    def _deltas(self, index: int) -> AsyncIterator[ClientDelta]:
        api = self.api
        return follow(self.streams[index], api.frontend, RequestTimer(api.metrics), api.metrics, api.request_timeout)

    def _choice(self, index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        if self.chat:
            return {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _role(self, index: int) -> dict:
        """A chat stream's first chunk of a choice: the role alone, with empty content (OpenAI, vLLM, llama.cpp)."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def _text(self, token_id: int) -> str:
        return self.api.frontend.tokenizer.decode([token_id])

    def _echoed_logprobs(self, index: int, scored: list) -> dict:
        """Completions' logprobs of an echoed prompt: every prompt token, the first with none (OpenAI's shape)."""
        text = self._text
        tokens = [text(t) for t in self.streams[index].prompt_ids]
        return {"tokens": tokens, "token_logprobs": [None] + [lp for _, lp, _, _ in scored],
                "top_logprobs": [None] + [{text(a): v for a, v in top} for _, _, _, top in scored],
                "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1]}

    def _vllm_prompt_logprobs(self, index: int, scored: list) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then {token id: {logprob, rank,
        decoded_token}} over the token itself and its alternatives."""
        out: list = [None]
        for token, logprob, rank, top in scored:
            entry = {str(a): {"logprob": v, "rank": r, "decoded_token": self._text(a)} for r, (a, v) in
                     enumerate(top, 1)}
            entry[str(token)] = {"logprob": logprob, "rank": rank, "decoded_token": self._text(token)}
            out.append(entry)
        return out[: len(self.streams[index].prompt_ids)]

    def _logprobs(self, delta: ClientDelta, offset: int, index: int = 0) -> dict | None:
        """A delta's tokens' log-probabilities in the endpoint's shape (None when not asked). ``offset``: where
        the delta's text starts in the choice's text (completions' ``text_offset``). With ``echo``, the first
        delta's come after the prompt's."""
        if not self.logprobs:
            return None
        out = self._token_logprobs(delta, offset)
        if not self.chat and self.echoed[index] and delta.prompt_logprobs is not None:
            echoed = self._echoed_logprobs(index, delta.prompt_logprobs)
            out = {key: echoed[key] + value for key, value in out.items()}
        return out

    def _token_logprobs(self, delta: ClientDelta, offset: int) -> dict:
        text = self._text

        if self.chat:
            def entry(token_id: int, logprob: float) -> dict:
                raw = self.api.frontend.tokenizer.token_bytes(token_id)  # a character's part: its own bytes
                return {"token": text(token_id), "logprob": logprob, "bytes": list(raw)}

            return {"content": [{**entry(lp.token_id, lp.logprob),
                                 "top_logprobs": [entry(a.token_id, a.logprob) for a in lp.top]}
                                for lp in delta.logprobs]}
        tokens = [text(lp.token_id) for lp in delta.logprobs]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in delta.logprobs],
                "top_logprobs": [{text(a.token_id): a.logprob for a in lp.top} for lp in delta.logprobs],
                "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=offset))[:-1]}

    async def _usage(self, completion: int) -> dict:
        """OpenAI's usage, with the prompt tokens the prefix cache held (each prompt once, whatever n)."""
        cached = 0
        for stream in self.streams[:: self.n]:
            cached += await self.api.frontend.cached_tokens(stream)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        body = json.dumps(choices, ensure_ascii=False)
        if usage is not None:
            body += ', "usage": ' + json.dumps(usage, ensure_ascii=False)
        return self._head + body.encode() + b"}\n\n"

    def _text_chunk(self, index: int, text: str) -> bytes:
        """``_chunk([_choice(index, text, None, None)])``, the same bytes, at the cost of encoding the text."""
        return self._text_heads[index] + encode_basestring(text).encode() + self._text_tail

    async def _items(self, index: int) -> AsyncIterator[tuple[int, ClientDelta | ConveyorError | None]]:
        """One choice's deltas as (index, delta), then (index, None), or the error that ended it (any reader error,
        a Redis error or a bug, ends this choice alone, said)."""
        try:
            async with contextlib.aclosing(self._deltas(index)) as deltas:
                async for delta in deltas:
                    yield index, delta
            yield index, None
        except ConveyorError as exc:
            yield index, exc
        except Exception as exc:  # noqa: BLE001
            log.exception("choice %d of %s failed", index, self.id)
            yield index, ConveyorError(f"internal error: {type(exc).__name__}: {exc}")

    def _merged(self) -> AsyncIterator[tuple[int, ClientDelta | ConveyorError | None]]:
        """Every choice's ``_items``, interleaved as they come. One choice (most requests) is followed in the
        caller's coroutine, its ``_items`` itself; several each in a task of its own, through a queue: a task
        switch a token, which cost one stream 0.18-0.20 against 0.16-0.17 ms of the frontend's CPU a token on the
        2-core Zen 4 (``bench/pipeline_ceiling.py --api openai --max-tokens 256 --requests-per-stream 4``,
        alternating; at 8 streams the same 0.07)."""
        return self._items(0) if len(self.streams) == 1 else self._interleaved()

    async def _interleaved(self) -> AsyncIterator[tuple[int, ClientDelta | ConveyorError | None]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            async with contextlib.aclosing(self._items(index)) as items:
                async for pair in items:
                    await queue.put(pair)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.streams))]
        try:
            ended = 0
            while ended < len(self.streams):
                index, item = await queue.get()
                ended += item is None or isinstance(item, ConveyorError)
                yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def events(self, owner: str) -> AsyncIterator[bytes]:
        """SSE: the choices' deltas as they come (interleaved), each choice's role first (chat), exactly one
        finish_reason per choice, the usage chunk when asked, then ``[DONE]``. A client that disconnects
        cancels this generator, which closes every stream (their requests are aborted)."""
        completion = [0] * len(self.streams)
        merged = self._merged()
        try:
            if self.chat:
                for index in range(len(self.streams)):
                    yield self._chunk([self._role(index)])
            first = [True] * len(self.streams)
            written = [0] * len(self.streams)  # characters of each choice's text sent
            held = [HeldText(self.tools) if self.tools else None for _ in self.streams]
            async for index, item in merged:
                if item is None:
                    continue
                if isinstance(item, ConveyorError):
                    err = from_conveyor(item)
                    yield b"data: " + json.dumps(error_body(err.status, str(err), None, err.code)).encode() + b"\n\n"
                    continue
                completion[index] += len(item.token_ids)
                finish = FINISH.get(item.finish_reason) if item.finish_reason else None
                if held[index] is not None:
                    for choice in self._tool_chunks(index, item, held[index], finish):
                        yield self._chunk([choice])
                    continue
                if item.text or finish or first[index] or item.token_ids:
                    text = self.echoed[index] + item.text if first[index] else item.text
                    logprobs = self._logprobs(item, written[index] + len(text) - len(item.text), index)
                    scored = self.vllm_prompt_logprobs and item.prompt_logprobs is not None
                    if finish is None and logprobs is None and not scored:
                        yield self._text_chunk(index, text)
                    else:
                        choice = self._choice(index, text, finish, logprobs)
                        if scored:
                            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(index, item.prompt_logprobs)
                        yield self._chunk([choice])
                    written[index] += len(text)
                    first[index] = False
            if self.include_usage:
                yield self._chunk([], await self._usage(sum(completion)))
            yield b"data: [DONE]\n\n"
        finally:
            await merged.aclose()  # every choice's stream closed (its request aborted when unfinished)
            self.api.access.close_stream(owner, len(self.streams))

    def _tool_chunks(self, index: int, item: ClientDelta, held: HeldText, finish: str | None) -> list[dict]:
        """A delta of a chat with tools: the content that can go now (a possible call is held back), and at
        the end the calls (each whole: id, type, name and arguments in one delta), then the finish."""
        text = held.feed(item.text)
        calls: list[dict] = []
        if finish:
            rest, calls = held.finish()
            text += rest or ""
        logprobs = self._logprobs(item, 0, index)
        out = [self._choice(index, text, None, logprobs)] if text or logprobs else []
        if calls:
            out.append({"index": index, "delta": {"tool_calls": [
                {"index": k, **call} for k, call in enumerate(openai_calls(calls, self.streams[index].request_id))]},
                "logprobs": None, "finish_reason": None})
        if finish:
            out.append({"index": index, "delta": {}, "logprobs": None,
                        "finish_reason": "tool_calls" if calls else finish})
        return out

    def _message(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A whole chat answer as OpenAI's message, its tool calls parsed when the request has tools."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = parse_calls(text, self.tools)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return ({"role": "assistant", "content": content,
                 "tool_calls": openai_calls(calls, self.streams[index].request_id)}, "tool_calls")

    async def whole(self, request: Request) -> dict:
        """The full response; a client that disconnects meanwhile aborts every choice."""
        texts, finishes, completion = list(self.echoed), [None] * len(self.streams), 0
        logprobs: list[dict | None] = [None] * len(self.streams)
        scored: list[list | None] = [None] * len(self.streams)

        async def collect(index: int) -> int:
            count = 0
            async for delta in self._deltas(index):
                if delta.prompt_logprobs is not None:
                    scored[index] = self._vllm_prompt_logprobs(index, delta.prompt_logprobs)
                more = self._logprobs(delta, len(texts[index]), index)
                if more is not None:
                    logprobs[index] = more if logprobs[index] is None else {
                        key: logprobs[index][key] + value for key, value in more.items()}
                texts[index] += delta.text
                count += len(delta.token_ids)
                if delta.finish_reason:
                    finishes[index] = FINISH.get(delta.finish_reason)
            return count

        tasks = [asyncio.create_task(collect(i)) for i in range(len(self.streams))]
        gathered = asyncio.gather(*tasks)
        # once done, its outcome counts as seen: a client that left cancels it, and an unseen CancelledError would
        # log "exception was never retrieved" with a traceback
        gathered.add_done_callback(lambda done: done.cancelled() or done.exception())
        watch = asyncio.create_task(_disconnected(request))
        try:
            done, _ = await asyncio.wait([watch, gathered], return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                raise HttpError(499, "the client closed the connection")
            completion = sum(gathered.result())
        finally:
            watch.cancel()
            for task in tasks:
                task.cancel()
            gathered.cancel()
        if self.chat:
            choices = []
            for i, (t, f, lp) in enumerate(zip(texts, finishes, logprobs)):
                message, f = self._message(i, t, f)
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": f})
        else:
            choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                       for i, (t, f, lp) in enumerate(zip(texts, finishes, logprobs))]
        if self.vllm_prompt_logprobs:
            for choice, entries in zip(choices, scored):
                choice["prompt_logprobs"] = entries
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.api.model,
                "choices": choices, "usage": await self._usage(completion)}


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
