"""`batchspec serve`: an OpenAI-compatible HTTP server over the engine, with continuous batching.

Endpoints: POST /v1/completions and /v1/chat/completions (`stream: true` gives server-sent events in the OpenAI
chunk format, ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus).

One engine thread (`engine_loop.EngineLoop`) owns the engine; handlers only validate, tokenise and wait on their
request's stream. Every response carries this request's speculative counters in `usage.spec`. Errors are OpenAI
JSON (`{"error": {"message", "type", "param", "code"}}`): 400 malformed body or prompt too long for the context,
404 unknown model or route, 413 body too large, 422 invalid field values, 429 queue full, 503 shutting down.

The command line is `batchspec.cli.serve`. FastAPI is imported inside `create_app`, so that other `batchspec`
commands do not pay for it. (No `from __future__ import annotations` here: FastAPI reads the handlers'
annotations at run time.)
"""

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from batchspec.errors import BatchspecError
from batchspec.runtime.sampling import SamplingParams
from batchspec.serving.engine_loop import EngineLoop, QueueFull, ShuttingDown
from batchspec.serving.errors import APIError, BodyGuard, install_error_handlers
from batchspec.serving.protocol import SSE_DONE, ChatRequest, CompletionRequest, ResponseFormatter, error_body, sse
from batchspec.weights.known_models import DEFAULT_TARGET, KNOWN_MODELS

DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks whether its client is still there


@dataclass(frozen=True)
class ServerConfig:
    model_name: str  # the id clients must send as `model`
    max_model_len: int  # longest prompt + output, in tokens
    max_queue: int = 256  # requests waiting for a slot before 429
    max_body_bytes: int = 1 << 20
    drain_timeout_s: float = 10.0  # at shutdown, how long in-flight requests may still run


def create_app(engine, config: ServerConfig):
    """The FastAPI app serving `engine` (an `Engine`); its lifespan starts and stops the engine thread."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    from batchspec.serving.metrics import ServerMetrics

    metrics = ServerMetrics()
    engine_loop = EngineLoop(engine, config.max_model_len, config.max_queue, metrics)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop, config.drain_timeout_s)

    app = FastAPI(title="batchspec", lifespan=lifespan)
    app.state.engine_loop, app.state.metrics = engine_loop, metrics
    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes, metrics=metrics)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(engine_loop, config, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await _generate(engine_loop, config, body, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(config, engine, started)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(config, model_id)
        return _model_card(config, engine, started)

    @app.get("/health")
    async def health():
        body = {"status": "ok" if engine_loop.alive else "unavailable", "model": config.model_name,
                "policy": engine.spec.policy, "running": engine_loop.num_running, "waiting": engine_loop.num_waiting}
        return JSONResponse(body, status_code=200 if engine_loop.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _model_card(config: ServerConfig, engine, created: int) -> dict:
    return {"id": config.model_name, "object": "model", "created": created, "owned_by": "batchspec",
            "max_model_len": config.max_model_len, "policy": engine.spec.policy}


def _check_model(config: ServerConfig, name: str) -> None:
    if name != config.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {config.model_name!r}",
                       param="model", code="model_not_found")


# --- one generation request ------------------------------------------------------------------------------------------


async def _generate(engine_loop, config: ServerConfig, body, request, chat: bool):
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    _check_model(config, body.model)
    prompt_ids = await asyncio.to_thread(_encode, engine_loop.engine, body, chat)
    params = _sampling_params(config, body, len(prompt_ids), chat)
    try:
        stream = engine_loop.submit(prompt_ids, params)
    except QueueFull as full:
        raise APIError(429, str(full), "rate_limit_error", code="queue_full") from None
    except ShuttingDown as down:
        raise APIError(503, str(down), "server_error", code="unavailable") from None
    fmt = ResponseFormatter(chat, config.model_name)
    if body.stream:
        return StreamingResponse(_events(fmt, stream, engine_loop, body.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    result = await _collect(fmt, stream, engine_loop, request)
    return Response(status_code=499) if result is None else JSONResponse(result)


def _encode(engine, body, chat: bool) -> list[int]:
    """Prompt token ids of a request (runs in a worker thread: templating and tokenising long prompts take time)."""
    tokenizer = engine.target.tokenizer
    if chat:
        messages = [m.as_template_message() for m in body.messages]
        try:
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        except BatchspecError as err:
            raise APIError(400, str(err), param="messages") from None
    elif isinstance(body.prompt_value, str):
        if not body.prompt_value:
            raise APIError(400, "prompt is empty", param="prompt")
        ids = tokenizer.encode(body.prompt_value)
    else:
        ids = list(body.prompt_value)
        vocab = engine.target.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty after tokenisation", param="messages" if chat else "prompt")
    return ids


def _sampling_params(config: ServerConfig, body, prompt_len: int, chat: bool):
    limit = config.max_model_len
    where = "messages" if chat else "prompt"
    if prompt_len >= limit:
        raise APIError(400, f"the prompt has {prompt_len} tokens, but this server's context is {limit} tokens "
                            f"(prompt + output); shorten the prompt", param=where, code="context_length_exceeded")
    requested = body.max_new_tokens if chat else body.max_tokens
    # Defaults as OpenAI's: a chat answer may fill the context, a completion is 16 tokens.
    max_tokens = requested if requested is not None else (limit - prompt_len if chat else 16)
    if prompt_len + max_tokens > limit:
        raise APIError(400, f"the prompt has {prompt_len} tokens; with max_tokens {max_tokens} that is "
                            f"{prompt_len + max_tokens}, more than this server's context of {limit} tokens; "
                            f"reduce max_tokens or the prompt", param="max_tokens", code="context_length_exceeded")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=max(0, body.top_k), seed=body.seed, stop=body.stop_strings,
                              ignore_eos=body.ignore_eos)
    except BatchspecError as err:
        raise APIError(422, str(err)) from None


async def _events(fmt: ResponseFormatter, stream, engine_loop, include_usage: bool):
    """The SSE body of a streaming request. A client that leaves cancels this generator: the finally aborts."""
    try:
        if fmt.chat:
            yield sse(fmt.role_chunk())
        async for delta in stream:
            if delta.error is not None:
                yield sse(error_body(delta.error, "server_error", code=delta.error_code))
                break
            if delta.text:
                yield sse(fmt.chunk(delta.text))
            if delta.finish_reason is not None:
                yield sse(fmt.chunk(None, delta.finish_reason, delta.usage))
                if include_usage:
                    yield sse(fmt.usage_only(delta.usage))
        yield SSE_DONE
    finally:
        engine_loop.abort(stream)


async def _collect(fmt: ResponseFormatter, stream, engine_loop, request) -> dict | None:
    """The whole answer of a non-streaming request; None if the client went away (the request is aborted)."""
    parts, checked = [], time.monotonic()
    try:
        while True:
            try:
                delta = await asyncio.wait_for(stream.next(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                delta = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:  # deltas may keep coming: check by the clock
                checked = time.monotonic()
                if await request.is_disconnected():
                    return None
            if delta is None:
                continue
            if delta.error is not None:
                raise APIError(delta.error_status, delta.error, "server_error", code=delta.error_code)
            parts.append(delta.text)
            if delta.finish_reason is not None:
                return fmt.whole("".join(parts), delta.finish_reason, delta.usage)
    finally:
        engine_loop.abort(stream)


# --- the model id clients send ----------------------------------------------------------------------------------------


def served_model_name(target: str) -> str:
    if target == "default":
        return DEFAULT_TARGET.filename.split(".")[0]  # SmolLM2-135M-Instruct
    if target in KNOWN_MODELS:
        return target
    path = Path(target)
    return path.stem if path.suffix == ".gguf" else path.name
