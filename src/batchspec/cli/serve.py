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
    add("--shutdown-timeout", type=float, default=10.0,
        help="on Ctrl-C/SIGTERM, seconds in-flight requests may still finish before they are cancelled (10)")
    add("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(run=cmd_serve)
    return p


def _non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(text)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from batchspec.engine.engine import Engine
    from batchspec.serving.app import ServerConfig, create_app, served_model_name
    from batchspec.spec.policies import policy_class

    if not 0 <= args.port < 65536:
        raise BatchspecError(f"--port must be in 0..65535, got {args.port}")
    speculative = policy_class(args.policy).speculative
    draft = args.draft if args.draft is not None or not speculative else "default"
    engine = Engine.from_pretrained(args.target, resolve_draft(draft, args.target), draft_dtype=args.draft_dtype,
                                    target_dtype=args.target_dtype,
                                    spec=spec_config(args), max_batch_size=args.max_batch_size, seed=args.seed)
    config = ServerConfig(model_name=args.served_model_name or served_model_name(args.target),
                          max_model_len=min(args.max_model_len, engine.context_length), max_queue=args.max_queue,
                          max_body_bytes=args.max_request_bytes, drain_timeout_s=args.shutdown_timeout)
    app = create_app(engine, config)
    print(f"serving {config.model_name!r} (policy {args.policy}, batch {args.max_batch_size}, context "
          f"{config.max_model_len}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind
        if server.started:
            raise
    if not server.started:
        raise BatchspecError(f"could not listen on {args.host}:{args.port} (is the port in use? see the log above)")
    return 0
