"""`batchspec serve`: the OpenAI-compatible HTTP server of `batchspec.serving.app`, run by uvicorn."""

from __future__ import annotations

import argparse
import sys

from batchspec.cli.options import add_model_options, add_spec_options, positive_int, resolve_draft, spec_config
from batchspec.errors import BatchspecError


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching",
        description="Serve the target (speculatively with --policy and --draft) over the OpenAI HTTP API: "
                    "/v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health and Prometheus "
                    "/metrics. Binds 127.0.0.1 unless told otherwise.")
    add_model_options(p)
    add_spec_options(p)
    add = p.add_argument
    add("--max-batch-size", type=positive_int, default=16, help="requests decoded together (KV slots; default 16)")
    add("--max-queue", type=_non_negative_int, default=256,
        help="requests waiting for a slot before new ones get 429 (default 256)")
    add("--max-model-len", type=positive_int, default=2048,
        help="longest prompt + output in tokens (default 2048, capped at the models' context)")
    add("--served-model-name", default=None, help="model id clients send (default: the target's name)")
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    add("--port", type=int, default=8000, help="port (default 8000)")
    add("--seed", type=int, default=0, help="seed of requests that give none (default 0)")
    add("--max-request-bytes", type=positive_int, default=1 << 20, help="largest request body (default 1 MiB)")
    add("--prefill-chunk", type=_non_negative_int, default=256,
        help="prompt tokens prefilled per engine step (default 256): a long prompt is prefilled over several steps, "
             "alternating with the running requests' steps, so it does not stall them; 0 = whole prompts at once")
    add("--shutdown-timeout", type=_non_negative_float, default=10.0,
        help="on Ctrl-C/SIGTERM, seconds in-flight requests may still run before they are cancelled with a 503 "
             "error (default 10)")
    add("--header-timeout", type=_positive_float, default=10.0,
        help="seconds a connection has to send its request headers; idle sockets are closed, half-sent heads get "
             "408 (default 10)")
    add("--body-timeout", type=_positive_float, default=30.0,
        help="seconds a request body has to arrive once its headers have (else 408; default 30)")
    add("--keep-alive-timeout", type=_positive_float, default=5.0,
        help="seconds an idle keep-alive connection stays open (default 5)")
    add("--max-connections", type=positive_int, default=512,
        help="open connections at most; one more gets 503 at once (default 512)")
    add("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(run=cmd_serve)
    return p


def _non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(text)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a non-negative number of seconds, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from batchspec.engine.engine import Engine
    from batchspec.serving.app import ServerConfig, create_app, served_model_name
    from batchspec.serving.http_server import server_for
    from batchspec.spec.policies import policy_class

    if not 0 <= args.port < 65536:
        raise BatchspecError(f"--port must be in 0..65535, got {args.port}")
    speculative = policy_class(args.policy).speculative
    draft = args.draft if args.draft is not None or not speculative else "default"
    engine = Engine.from_pretrained(args.target, resolve_draft(draft, args.target), draft_dtype=args.draft_dtype,
                                    target_dtype=args.target_dtype, device=args.device,
                                    spec=spec_config(args), max_batch_size=args.max_batch_size, seed=args.seed,
                                    prefill_chunk=args.prefill_chunk or None)
    config = ServerConfig(model_name=args.served_model_name or served_model_name(args.target),
                          max_model_len=min(args.max_model_len, engine.context_length), max_queue=args.max_queue,
                          max_body_bytes=args.max_request_bytes, drain_timeout_s=args.shutdown_timeout,
                          header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                          keep_alive_s=args.keep_alive_timeout, max_connections=args.max_connections)
    app = create_app(engine, config)
    print(f"serving {config.model_name!r} (policy {args.policy}, batch {args.max_batch_size}, context "
          f"{config.max_model_len}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    server = server_for(app, config, args.host, args.port, args.log_level)
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind
        if server.started:
            raise
    if not server.started:
        raise BatchspecError(f"could not listen on {args.host}:{args.port} (is the port in use? see the log above)")
    return 0
