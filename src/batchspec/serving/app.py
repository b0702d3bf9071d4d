"""`batchspec serve`: an OpenAI-compatible HTTP server over the engine, with continuous batching.

Endpoints: POST /v1/completions and /v1/chat/completions (`stream: true` gives server-sent events in the OpenAI
chunk format, ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus).

One engine thread (`engine_loop.EngineLoop`) owns the engine; handlers only validate, tokenise and wait on their
request's stream. A completion's list of prompts is one engine request per prompt, a choice each. Every response
carries the speculative counters in `usage.spec` (a stream: in its one usage chunk, sent only with
stream_options.include_usage, as OpenAI). Errors are OpenAI JSON (`{"error": {"message", "type", "param", "code"}}`,
`code` always a string): 400 malformed body, prompt too long for the context, too many prompts or a non-text content
part, 404 unknown model or route, 413 body too large, 422 invalid field values, 429 queue full, 503 shutting down.

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
from batchspec.serving.protocol import (SSE_DONE, ChatRequest, CompletionRequest, ResponseFormatter, error_body, sse,
                                        total_usage)
from batchspec.weights.known_models import DEFAULT_TARGET, KNOWN_MODELS

DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks whether its client is still there


@dataclass(frozen=True)
class ServerConfig:
    model_name: str  # the id clients must send as `model`
    max_model_len: int  # longest prompt + output, in tokens
    max_queue: int = 256  # requests waiting for a slot before 429
    max_body_bytes: int = 1 << 20
    drain_timeout_s: float = 10.0  # at shutdown, how long in-flight requests may still run
    # Deadlines and limits of the HTTP connections (`serving.http_server`, `serving.errors.BodyGuard`).
    header_timeout_s: float = 10.0  # a connection's request head must arrive within this (else 408 / closed)
    body_timeout_s: float = 30.0  # and its body within this once the head has arrived (else 408)
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 512  # open sockets; one more gets 503 at once


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
    app.state.engine_loop, app.state.metrics, app.state.config = engine_loop, metrics, config
    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s, metrics=metrics)
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
    # A completion may hold several prompts: each is its own engine request, and the answer has a choice for each.
    one_prompt_bodies = [body] if chat else [body.one_prompt(p) for p in _prompts(body, engine_loop.capacity)]
    prepared = await asyncio.to_thread(_prepare_all, engine_loop.engine, config, one_prompt_bodies, chat)
    streams = _Streams(_submit_all(engine_loop, prepared))
    fmt = ResponseFormatter(chat, config.model_name, include_usage=body.stream and body.include_usage)
    if body.stream:
        return StreamingResponse(_events(fmt, streams, engine_loop), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    result = await _collect(fmt, streams, engine_loop, request)
    return Response(status_code=499) if result is None else JSONResponse(result)


def _prompts(body, capacity: int) -> list:
    """The prompts of a completion request; more than the server holds at once could never all be admitted."""
    prompts = body.prompts
    if len(prompts) > capacity:
        raise APIError(400, f"prompt: a list of {len(prompts)} prompts; this server takes at most {capacity} at once "
                            f"(its batch plus its queue)", param="prompt", code="too_many_prompts")
    return prompts


def _prepare_all(engine, config: ServerConfig, bodies: list, chat: bool) -> list[tuple[list[int], SamplingParams]]:
    """(prompt ids, sampling params) of every prompt, all checked before any is submitted (in a worker thread:
    templating and tokenising long prompts take time). An error names its prompt when there are several."""
    prepared = []
    for index, body in enumerate(bodies):
        try:
            ids = _encode(engine, body, chat)
            prepared.append((ids, _sampling_params(config, body, len(ids), chat)))
        except APIError as err:
            if len(bodies) > 1:
                err.message, err.param = f"prompt[{index}]: {err.message}", f"prompt[{index}]"
            raise
    return prepared


def _submit_all(engine_loop, prepared: list) -> list:
    """A stream per prompt; if one cannot be queued, the ones already queued are aborted and the whole request
    fails (429 queue full, 503 shutting down)."""
    streams = []
    try:
        for ids, params in prepared:
            streams.append(engine_loop.submit(ids, params))
    except (QueueFull, ShuttingDown) as refused:
        for stream in streams:
            engine_loop.abort(stream)
        if isinstance(refused, QueueFull):
            raise APIError(429, str(refused), "rate_limit_error", code="queue_full") from None
        raise APIError(503, str(refused), "server_error", code="unavailable") from None
    return streams


def _encode(engine, body, chat: bool) -> list[int]:
    """Prompt token ids of a request (runs in a worker thread: templating and tokenising long prompts take time)."""
    tokenizer = engine.target.tokenizer
    if chat:
        messages = [m.as_template_message() for m in body.messages]
        try:
            ids = tokenizer.encode_chat(messages)  # contents as plain text: no forged turns
        except BatchspecError as err:
            raise APIError(400, str(err), param="messages") from None
    elif isinstance(body.prompt_value, str):
        if not body.prompt_value:
            raise APIError(400, "prompt is empty", param="prompt")
        ids = tokenizer.encode_text(body.prompt_value)  # "<|im_start|>" here is text; control tokens come as ids
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


class _Streams:
    """The request streams of one HTTP request's prompts, read as one: (prompt index, delta) as they arrive."""

    def __init__(self, streams: list) -> None:
        self.streams = streams
        self._pending: dict[asyncio.Task, int] = {}  # one waiting `next()` per unfinished stream -> its index
        for index in range(len(streams)):
            self._watch(index)

    def _watch(self, index: int) -> None:
        self._pending[asyncio.ensure_future(self.streams[index].next())] = index

    @property
    def done(self) -> bool:
        """Every stream has given its last delta."""
        return not self._pending

    async def next(self, timeout: float | None = None) -> list[tuple[int, object]]:
        """The deltas that arrived, by prompt index; [] if none within `timeout` seconds (nothing is lost then)."""
        arrived, _ = await asyncio.wait(set(self._pending), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        deltas = []
        for task in arrived:
            index = self._pending.pop(task)
            deltas.append((index, task.result()))
            if not self.streams[index].done:
                self._watch(index)  # a stream's next delta is awaited only after this one: its order is kept
        return sorted(deltas, key=lambda pair: pair[0])

    def close(self, engine_loop) -> None:
        """Stop waiting and abort the requests still running (a client that left, or another prompt failed)."""
        for task in self._pending:
            task.cancel()
        self._pending.clear()
        for stream in self.streams:
            engine_loop.abort(stream)


async def _events(fmt: ResponseFormatter, streams: _Streams, engine_loop):
    """The SSE body of a streaming request: each prompt's text chunks and finishing chunk (its `index`), then, with
    stream_options.include_usage, one chunk with the usage of all. A client that leaves cancels this generator: the
    finally aborts."""
    try:
        if fmt.chat:
            yield sse(fmt.role_chunk())
        usages = []
        while not streams.done:
            for index, delta in await streams.next():
                if delta.error is not None:
                    yield sse(error_body(delta.error, "server_error", code=delta.error_code))
                    yield SSE_DONE
                    return
                if delta.text:
                    yield sse(fmt.chunk(delta.text, index=index))
                if delta.finish_reason is not None:
                    yield sse(fmt.chunk(None, delta.finish_reason, index=index))
                    usages.append(delta.usage)
        if fmt.include_usage:
            yield sse(fmt.usage_only(total_usage(usages)))
        yield SSE_DONE
    finally:
        streams.close(engine_loop)


async def _collect(fmt: ResponseFormatter, streams: _Streams, engine_loop, request) -> dict | None:
    """The whole answer of a non-streaming request; None if the client went away (its requests are aborted)."""
    texts: list[list[str]] = [[] for _ in streams.streams]
    finished: dict[int, tuple[str, dict]] = {}  # prompt index -> (finish_reason, usage)
    checked = time.monotonic()
    try:
        while not streams.done:
            arrived = await streams.next(timeout=DISCONNECT_POLL_S)
            if time.monotonic() - checked >= DISCONNECT_POLL_S:  # deltas may keep coming: check by the clock
                checked = time.monotonic()
                if await request.is_disconnected():
                    return None
            for index, delta in arrived:
                if delta.error is not None:
                    raise APIError(delta.error_status, delta.error, "server_error", code=delta.error_code)
                texts[index].append(delta.text)
                if delta.finish_reason is not None:
                    finished[index] = (delta.finish_reason, delta.usage)
        outputs = [("".join(parts), finished[index][0]) for index, parts in enumerate(texts)]
        return fmt.whole(outputs, total_usage([usage for _, usage in finished.values()]))
    finally:
        streams.close(engine_loop)


# --- the model id clients send ----------------------------------------------------------------------------------------


def served_model_name(target: str) -> str:
    if target == "default":
        return DEFAULT_TARGET.filename.split(".")[0]  # SmolLM2-135M-Instruct
    if target in KNOWN_MODELS:
        return target
    path = Path(target)
    return path.stem if path.suffix == ".gguf" else path.name
