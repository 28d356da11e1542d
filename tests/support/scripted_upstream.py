"""A scripted OpenAI-compatible upstream for tests: emits chunks at the times a test asks for.

The request's `x-script` header (JSON) says what to send and when, relative to the moment the
request arrived; chunks follow vLLM 0.32's shapes (set fields only: no `usage` key unless
continuous usage) and honour `stream_options` as vLLM does. Each request's log (what
arrived, the CLOCK_MONOTONIC ns just before each chunk was written, so never after a reader
could have it, whether the client went away) is served at `GET /_log/{x-request-id}`. Run it
as `python -m uvicorn tests.support.scripted_upstream:app --port N`.

Script keys: `tokens` [[t_s, text, n_tokens], ...]; `role` (chat role chunk first, default
true); `role_at` (s); `prompt_tokens`; `status` and `delay` (an error status, sent after
`delay` s; `error_type` its error's type); `error_at` (in-band error then [DONE]); `drop_at`
(close the connection mid-stream);
`split` (write every event in two pieces, 5 ms apart); `done` (send [DONE], default true);
`pad` (repeat each token's text this many times, for streams bigger than any buffer);
`linger` (s to wait after [DONE] before ending the body, as an engine may).

After the tokens, each choice that has not finished gets a terminal chunk (empty text,
finish_reason `length`), then the include_usage chunk if asked for, then [DONE]. More keys:
`n` (choices, default 1: a token entry may add the choice index and a finish reason,
[t_s, text, n_tokens, index, finish], which makes it that choice's terminal chunk);
`fingerprint` (a string: stamp it as vLLM 0.32 does, as `system_fingerprint` on each terminal
chunk without include_usage, else on the usage chunk only); `usage_at` (s: when to write the
usage chunk, instead of right after the terminal chunks).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

LOG: dict[str, dict[str, Any]] = {}


def _chunk(endpoint: str, model: str, text: str | None, role: bool, usage: Any,
           finish: str | None = None, index: int = 0) -> dict[str, Any]:
    if endpoint == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}
        obj: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                               "created": 1, "model": model, "choices": [choice]}
    else:
        obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model,
               "choices": [{"index": index, "text": text or "", "logprobs": None,
                            "finish_reason": finish, "stop_reason": None}]}
    if usage is not None:  # vLLM 0.32 dumps set fields only: no `"usage":null`
        obj["usage"] = usage
    return obj


async def _read(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    path = scope["path"]
    headers = {k.decode(): v.decode() for k, v in scope["headers"]}
    if path.startswith("/_log/"):
        entry = LOG.get(path[len("/_log/"):])
        status, body = (200, orjson.dumps(entry)) if entry else (404, b"{}")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return
    if path in ("/health", "/v1/models"):
        body = b"" if path == "/health" else orjson.dumps(
            {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"x-upstream", b"yes")]})
        await send({"type": "http.response.body", "body": body})
        return
    arrived = time.monotonic_ns()
    request = await _read(receive)
    rid = headers.get("x-request-id", "none")
    log: dict[str, Any] = {"arrived_ns": arrived, "headers": headers,
                           "body": request.decode(), "sent_ns": [], "disconnected": False,
                           "query": scope["query_string"].decode(), "path": path,
                           "raw_path": (scope.get("raw_path") or b"").decode("latin-1")}
    LOG[rid] = log
    script = orjson.loads(headers.get("x-script", "{}"))
    req = orjson.loads(request) if request else {}
    endpoint = "chat" if path.endswith("chat/completions") else "completions"
    model = req.get("model", "scripted")

    async def at(offset: float) -> None:
        delay = arrived / 1e9 + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    disconnected = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        log["disconnected"] = True
        log["disconnected_ns"] = time.monotonic_ns()
        disconnected.set()

    watcher = asyncio.create_task(watch())
    status = script.get("status", 200)
    if status != 200:
        await at(script.get("delay", 0))
        body = orjson.dumps({"error": {"message": "scripted failure for prompt 'secret'",
                                       "type": script.get("error_type", "BadRequestError"),
                                       "param": None, "code": status}})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return
    tokens = script.get("tokens", [[0.01, "Hello", 1], [0.02, " world", 1]])
    prompt_tokens = script.get("prompt_tokens", 7)
    if not req.get("stream"):
        await at(tokens[-1][0])
        completion = sum(t[2] for t in tokens)
        text = "".join(t[1] for t in tokens)
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion,
                 "completion_tokens": completion}
        if endpoint == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "length"}
            obj = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                   "model": model, "choices": [choice], "usage": usage}
        else:
            obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model,
                   "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                   "usage": usage}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        writing = time.monotonic_ns()
        await send({"type": "http.response.body", "body": orjson.dumps(obj)})
        log["sent_ns"].append(writing)
        return

    options = req.get("stream_options") or {}
    include_usage = options.get("include_usage") is True
    continuous = include_usage and options.get("continuous_usage_stats") is True
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})

    async def emit(obj: Any) -> None:
        data = b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"
        if script.get("split"):
            cut = len(data) // 2
            await send({"type": "http.response.body", "body": data[:cut], "more_body": True})
            await asyncio.sleep(0.005)
            data = data[cut:]
        writing = time.monotonic_ns()
        await send({"type": "http.response.body", "body": data, "more_body": True})
        log["sent_ns"].append(writing)

    def usage_for(done_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + done_tokens,
                "completion_tokens": done_tokens}

    try:
        count = 0
        if endpoint == "chat" and script.get("role", True):
            await at(script.get("role_at", 0.0))
            await emit(_chunk(endpoint, model, None, True, usage_for(0) if continuous else None))
        fingerprint = script.get("fingerprint")
        unfinished = list(range(script.get("n", 1)))

        def terminal(obj: dict[str, Any]) -> dict[str, Any]:
            if fingerprint is not None and not include_usage:
                obj["system_fingerprint"] = fingerprint
            return obj

        for offset, text, n, *choice in tokens:
            if "drop_at" in script and offset >= script["drop_at"]:
                await at(script["drop_at"])
                raise ConnectionAbortedError("scripted drop")
            if "error_at" in script and offset >= script["error_at"]:
                await at(script["error_at"])
                await emit({"error": {"message": "scripted in-band error", "type": "InternalError",
                                      "param": None, "code": 500}})
                await emit(b"[DONE]")
                break
            await at(offset)
            if disconnected.is_set():
                return
            count += n
            index = choice[0] if choice else 0
            finish = choice[1] if len(choice) > 1 else None
            chunk = _chunk(endpoint, model, text * script.get("pad", 1), False,
                           usage_for(count) if continuous else None, finish, index)
            if finish is not None:
                unfinished.remove(index)
                chunk = terminal(chunk)
            await emit(chunk)
        else:
            for index in unfinished:
                await emit(terminal(_chunk(endpoint, model, "", False,
                                           usage_for(count) if continuous else None,
                                           "length", index)))
            if include_usage:
                final: dict[str, Any] = {"id": "x", "object": "chunk", "created": 1,
                                         "model": model, "choices": [], "usage": usage_for(count)}
                if fingerprint is not None:
                    final["system_fingerprint"] = fingerprint
                if "usage_at" in script:
                    await at(script["usage_at"])
                await emit(final)
            if script.get("done", True):
                await emit(b"[DONE]")
        if script.get("linger"):
            await asyncio.sleep(script["linger"])
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        watcher.cancel()
