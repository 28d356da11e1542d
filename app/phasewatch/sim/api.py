"""The simulator's HTTP routes: vLLM's OpenAI-compatible API, two `/sim/` inspection routes and
`POST /sim/config`, the chunked-prefill switch.

Routes validate, hand the request to the engine, and return a response object that streams
the engine's tokens as they fall due. The streaming response is written directly against ASGI
`send` (no per-request task group) and watches `receive` for the client leaving: vLLM aborts
a request whose connection closes, and so does this, in `finally`.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from phasewatch.sim.config import SimConfigError
from phasewatch.sim.engine import SimRequest, TokenEvent
from phasewatch.sim.faults import FAULT_HEADER, Fault, FaultSyntaxError, parse_fault
from phasewatch.sim.protocol import (
    DONE,
    ApiError,
    ChunkBuilder,
    GenerationRequest,
    Kind,
    error_body,
    parse_generation,
    parse_json,
    streaming_error,
)
from phasewatch.sim.tokenizer import message_text

if TYPE_CHECKING:
    from phasewatch.sim.app import SimState

# The vLLM release whose wire shapes the simulator copies; /version reports it. (Completion
# chunks' serialization and the fingerprint follow 0.32: see app/phasewatch/sim/protocol.py.)
VLLM_COMPAT_VERSION = "0.10.1"
# vLLM's is `vllm-<version>-<8 hex of its config hash>`; the simulator's is one fixed string.
SYSTEM_FINGERPRINT = f"vllm-{VLLM_COMPAT_VERSION}-phasewatch-sim"

router = APIRouter()


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _error(exc: ApiError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type="application/json")


def _state(request: Request) -> SimState:
    state: SimState = request.app.state.sim
    return state


class DropConnection(Exception):
    """Raised inside a response to close the TCP connection without finishing the body."""


@dataclass(slots=True)
class _Job:
    """Everything one generation response needs once the route has validated the request."""

    sim: SimState
    request: SimRequest
    params: GenerationRequest
    builder: ChunkBuilder
    fault: Fault | None


class GenerationResponse(Response):
    """Streams (or waits for) one request's tokens; aborts the request if the client leaves."""

    def __init__(self, job: _Job) -> None:
        super().__init__(
            status_code=200,
            media_type="text/event-stream" if job.params.stream else "application/json",
        )
        # A stream has no length: drop the content-length: 0 Response adds for an empty body.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        job = self.job
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.create_task(watch())
        job.sim.engine.submit(job.request)
        try:
            if job.params.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        except DropConnection:
            pass  # returning without the final body makes uvicorn close the connection
        except asyncio.CancelledError:
            if not gone:
                raise
        finally:
            watcher.cancel()
            if gone:
                task.uncancel()
            job.sim.engine.abort(job.request.request_id)

    # -- streaming -----------------------------------------------------------------------------

    async def _stream(self, send: Send) -> None:
        job = self.job
        request, builder, fault = job.request, job.builder, job.fault
        clock = job.sim.engine.clock
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        sent = 0
        role_pending = job.params.kind == "chat"
        fault_pending = fault is not None
        while True:
            if fault is not None and fault_pending and sent >= fault.after:
                fault_pending = False
                if fault.kind == "stall":
                    await clock.sleep(fault.seconds)
                elif fault.kind == "error":
                    await self._send(send, _fault_error_event() + DONE, more=False)
                    return
                else:
                    raise DropConnection
            event = await request.events.get()
            if event is None:
                await self._send(
                    send, streaming_error("The engine shut down", 500) + DONE, more=False
                )
                return
            batch: list[TokenEvent] = [event]
            limit = fault.after - sent if fault is not None and fault_pending else 1 << 30
            # Tokens that piled up while we were away go out together, as vLLM merges deltas.
            while len(batch) < limit and not request.events.empty():
                nxt = request.events.get_nowait()
                if nxt is None:
                    break
                batch.append(nxt)
            sent += len(batch)
            last = batch[-1]
            text = "".join(self._token_text(e) for e in batch)
            payload = builder.role() if role_pending else b""
            role_pending = False
            finish = request.finish_reason if last.finished else None
            payload += builder.tokens(text, sent, finish)
            if last.finished:
                if job.params.include_usage:
                    payload += builder.final_usage(sent)
                payload += DONE
            request.emitted_ns.append((time.perf_counter_ns(), len(batch)))
            await self._send(send, payload, more=not last.finished)
            if last.finished:
                return

    def _token_text(self, event: TokenEvent) -> str:
        request = self.job.request
        if event.finished and request.finish_reason == "stop":
            return ""  # the EOS token has no text
        return self.job.sim.tokenizer.output_text(request.seed, event.index)

    @staticmethod
    async def _send(send: Send, body: bytes, more: bool) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": True})
        if not more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    # -- non-streaming -------------------------------------------------------------------------

    async def _whole(self, send: Send) -> None:
        job = self.job
        request, fault = job.request, job.fault
        tokens: list[TokenEvent] = []
        while not tokens or not tokens[-1].finished:
            if (
                fault is not None
                and fault.kind in ("error", "disconnect")
                and len(tokens) >= fault.after
            ):
                break
            event = await request.events.get()
            if event is None:
                await self._respond(send, error_body("The engine shut down", 500), 500)
                return
            tokens.append(event)
        if fault is not None:
            if fault.kind == "stall":
                await job.sim.engine.clock.sleep(fault.seconds)
            elif fault.kind == "error":
                await self._respond(send, _fault_error_body(), 500)
                return
            elif fault.kind == "disconnect":
                # Promise a body, send none, and hang up.
                headers = [(b"content-type", b"application/json"), (b"content-length", b"1024")]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                raise DropConnection
        text = "".join(self._token_text(e) for e in tokens)
        body = job.builder.response(text, len(tokens), request.finish_reason)
        request.emitted_ns.append((time.perf_counter_ns(), len(tokens)))
        await self._respond(send, body, 200)

    async def _respond(self, send: Send, body: bytes, status: int) -> None:
        headers = [
            (k, v) for k, v in self.raw_headers if k not in (b"content-type", b"content-length")
        ]
        headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _fault_error_event() -> bytes:
    return b"data: " + _fault_error_body() + b"\n\n"


def _fault_error_body() -> bytes:
    return error_body("Simulated engine failure (x-sim-fault: error)", 500)


# -- generation routes ----------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def _generate(http: Request, kind: Kind) -> Response:
    sim = _state(http)
    arrival = sim.engine.clock.now()  # vLLM's frontend arrival: TTFT is measured from here
    try:
        fault = _fault_for(http, sim)
        if fault is not None and fault.kind == "http":
            raise ApiError(f"Simulated HTTP {fault.status} (x-sim-fault)", status=fault.status)
        params = parse_generation(parse_json(await http.body()), kind, sim.served)
    except ApiError as exc:
        return _error(exc)

    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    request_id = prefix + secrets.token_hex(16)
    seed = sim.seed if params.seed is None else params.seed
    max_output, finish_reason = _draw_length(params, sim.eos_probability, seed, request_id)
    request = SimRequest(
        request_id=request_id,
        prompt_len=params.prompt_len,
        max_output=max_output,
        finish_reason=finish_reason,
        seed=seed,
        arrival=arrival,
    )
    builder = ChunkBuilder(
        kind=kind,
        request_id=request_id,
        created=int(time.time()),
        model=sim.served.name,
        prompt_tokens=params.prompt_len,
        include_usage=params.include_usage,
        continuous_usage=params.continuous_usage,
        fingerprint=SYSTEM_FINGERPRINT,
    )
    return GenerationResponse(_Job(sim, request, params, builder, fault))


def _fault_for(http: Request, sim: SimState) -> Fault | None:
    header = http.headers.get(FAULT_HEADER)
    if header is None:
        return sim.server_fault
    try:
        return parse_fault(header)
    except FaultSyntaxError as exc:
        raise ApiError(str(exc), param=FAULT_HEADER) from None


def _draw_length(
    params: GenerationRequest, eos_probability: float, seed: int, request_id: str
) -> tuple[int, str]:
    """How many tokens to generate, and why it stops: max_tokens, or an EOS drawn with the seed."""
    if params.ignore_eos or eos_probability <= 0:
        return params.max_tokens, "length"
    rng = random.Random(f"{seed}" if params.seed is not None else request_id)
    for n in range(1, params.max_tokens + 1):
        if rng.random() < eos_probability:
            return n, "stop"
    return params.max_tokens, "length"


# -- the rest of vLLM's surface -------------------------------------------------------------------


@router.get("/v1/models")
async def models(request: Request) -> Response:
    sim = _state(request)
    name = sim.served.name
    return _json(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": sim.started,
                    "owned_by": "vllm",
                    "root": sim.config.model.hf_name,
                    "parent": None,
                    "max_model_len": sim.served.max_model_len,
                    "permission": [
                        {
                            "id": "modelperm-" + secrets.token_hex(16),
                            "object": "model_permission",
                            "created": sim.started,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }
    )


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    sim = _state(request)
    try:
        body = parse_json(await request.body())
        model = body.get("model")
        if model is not None and model != sim.served.name:
            raise ApiError(f"The model `{model}` does not exist.", status=404, param="model")
        if isinstance(body.get("messages"), list):
            messages = [m for m in body["messages"] if isinstance(m, dict)]
            tokens = sim.tokenizer.encode_chat(
                messages, body.get("add_generation_prompt", True) is not False
            )
            words = [str(m.get("role", "")) + ": " + message_text(m) for m in messages]
        elif isinstance(body.get("prompt"), str):
            tokens = sim.tokenizer.encode(body["prompt"])
            words = body["prompt"].split()
        else:
            raise ApiError("Either prompt (a string) or messages must be given", param="prompt")
    except ApiError as exc:
        return _error(exc)
    token_strs = (
        (words if "messages" not in body else None) if body.get("return_token_strs") else None
    )
    return _json(
        {
            "count": len(tokens),
            "max_model_len": sim.served.max_model_len,
            "tokens": tokens,
            "token_strs": token_strs,
        }
    )


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    sim = _state(request)
    try:
        body = parse_json(await request.body())
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < sim.tokenizer.vocab_size
            for t in tokens
        ):
            raise ApiError(
                "tokens must be a list of token ids within the vocabulary", param="tokens"
            )
    except ApiError as exc:
        return _error(exc)
    return _json({"prompt": sim.tokenizer.decode(tokens)})


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/version")
async def version(request: Request) -> Response:
    sim = _state(request)
    return _json({"version": VLLM_COMPAT_VERSION, "phasewatch_sim": sim.config.summary()})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/sim/state")
async def sim_state(request: Request) -> Response:
    sim = _state(request)
    return _json({**sim.engine.state(), "config": sim.config.summary()})


@router.post("/sim/config")
async def sim_config(request: Request) -> Response:
    """Switch chunked prefill while serving: `{"enable_chunked_prefill": false}`. It is the one
    setting that can change (from the next step); the answer is the new configuration."""
    sim = _state(request)
    try:
        body = parse_json(await request.body())
        enabled = body.get("enable_chunked_prefill")
        if set(body) != {"enable_chunked_prefill"} or not isinstance(enabled, bool):
            raise ApiError(
                'send {"enable_chunked_prefill": true} or false: it is the one setting that '
                "can change while the simulator serves", param="enable_chunked_prefill")
        config = sim.set_chunked_prefill(enabled)
    except ApiError as exc:
        return _error(exc)
    except SimConfigError as exc:
        return _error(ApiError(str(exc), param="enable_chunked_prefill"))
    return _json({"config": config.summary()})


@router.get("/sim/requests/{request_id}")
async def sim_request(request: Request, request_id: str) -> Response:
    sim = _state(request)
    found = sim.engine.lookup(request_id)
    if found is None:
        return _error(ApiError(f"No timeline kept for request {request_id}", status=404))
    return _json(found.timeline(sim.engine.clock))
