"""dflash-gateway: the HTTP role. Loads no model and does not import torch: it handles token ids only."""

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

import uvicorn

from gateway.app import GatewaySettings, create_app
from gateway.body_limit import MAX_BODY_HELP, body_bytes, positive_mb
from gateway.tokenization import TextCodec
from shared.config_json import read_config
from shared.errors import ConfigError, DFlashError
from shared.role import announce_ready, configure_process
from shared.target_facts import TargetFacts


def target_facts(folder: str) -> TargetFacts:
    """vocab size, context length and eos ids from the target's config.json (plain JSON, no torch)."""
    return TargetFacts.from_config(read_config(folder))


def parse_args(argv):
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="dflash-gateway", description="The DFlash HTTP gateway role.")
    parser.add_argument("--role", default="gateway", choices=["gateway"], help=argparse.SUPPRESS)
    parser.add_argument("--target", default=env("DFLASH_TARGET"), help="target checkpoint (tokenizer and config only)")
    parser.add_argument("--served-model-name", default=env("DFLASH_MODEL_NAME"))
    parser.add_argument("--host", default=env("DFLASH_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("DFLASH_PORT", "8000")))
    parser.add_argument("--requests-addr", default=env("DFLASH_REQUESTS_ADDR", "tcp://127.0.0.1:5555"))
    parser.add_argument("--events-addr", default=env("DFLASH_EVENTS_ADDR", "tcp://127.0.0.1:5556"))
    parser.add_argument("--api-key", default=env("DFLASH_API_KEY"), help="require Authorization: Bearer KEY")
    parser.add_argument("--max-pending", type=int, default=64, help="requests in flight before 429")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--default-max-tokens", type=int, default=256)
    parser.add_argument("--max-body-mb", type=positive_mb, default=None, help=MAX_BODY_HELP)
    parser.add_argument("--no-draft", action="store_true", help="no drafter is configured (affects /ready)")
    parser.add_argument("--shutdown-timeout", type=float, default=float(env("DFLASH_SHUTDOWN_TIMEOUT", "30")),
                        help="on SIGTERM: stop accepting connections and let requests in flight finish for up to "
                             "this many seconds (then they are cut)")
    return parser.parse_args(argv)


async def serve(args, log) -> int:
    facts = target_facts(args.target)
    codec = TextCodec.from_folder(args.target, facts.eos_token_ids)
    max_model_len = min(args.max_model_len or facts.max_position_embeddings, facts.max_position_embeddings)
    settings = GatewaySettings(
        model_name=args.served_model_name or Path(args.target).resolve().name,
        vocab_size=facts.vocab_size, max_model_len=max_model_len,
        requests_addr=args.requests_addr, events_addr=args.events_addr, api_key=args.api_key,
        max_pending=args.max_pending, default_max_tokens=args.default_max_tokens,
        drafter_configured=not args.no_draft,
        max_body_bytes=body_bytes(args.max_body_mb, max_model_len),
    )
    app = create_app(settings, codec, log)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    task = asyncio.create_task(server.serve())
    deadline = asyncio.get_running_loop().time() + 30
    while not (server.started and app.state.client.alive) and not task.done():
        if server.started and asyncio.get_running_loop().time() > deadline:
            log.warning("no heartbeat from the verify worker yet: requests get 503 until it answers")
            break
        await asyncio.sleep(0.05)
    if task.done():
        return 2
    announce_ready("gateway", f"http://{args.host}:{args.port}")
    await task
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    log = configure_process("gateway")
    if not args.target:
        print("dflash-gateway: error: --target is required", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(args, log))
    except (ConfigError, DFlashError) as exc:
        print(f"dflash-gateway: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
