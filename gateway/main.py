"""dflash-gateway: the HTTP role. Loads no model and does not import torch: it handles token ids only."""

import asyncio
import logging
import sys
from pathlib import Path

import uvicorn

from gateway.app import GatewaySettings, create_app
from gateway.body_limit import body_bytes
from gateway.tokenization import TextCodec
from shared.config_json import read_config
from shared.errors import ConfigError, DFlashError
from shared.model_card import model_license
from shared.role import announce_ready, configure_process
from shared.settings.commands import GatewayCommand
from shared.settings.options import build_parser, parse_command
from shared.target_facts import TargetFacts


def target_facts(folder: str) -> TargetFacts:
    """vocab size, context length and eos ids from the target's config.json (plain JSON, no torch)."""
    return TargetFacts.from_config(read_config(folder))


def parse_args(argv) -> GatewayCommand:
    """The gateway's settings (shared.settings: GatewayCommand), from flags, $DFLASH_* or the launcher."""
    parser = build_parser(GatewayCommand, "dflash-gateway", "The DFlash HTTP gateway role.")
    return parse_command(GatewayCommand, parser, argv)[0]


async def serve(settings: GatewayCommand, log) -> int:
    model, http = settings.model, settings.http
    facts = target_facts(model.target)
    if (Path(model.target) / "tokenizer.json").is_file():
        codec = TextCodec.from_folder(model.target, facts.eos_token_ids)
    else:
        log.warning("%s has no tokenizer.json: serving token-id prompts only (text prompts, chat and stop strings "
                    "get a 400; outputs carry token_ids and empty text)", model.target)
        codec = TextCodec.ids_only(facts.eos_token_ids)
    max_model_len = min(model.max_model_len or facts.max_position_embeddings, facts.max_position_embeddings)
    app_settings = GatewaySettings(
        model_name=http.served_model_name or Path(model.target).resolve().name,
        vocab_size=facts.vocab_size, max_model_len=max_model_len,
        requests_addr=settings.channels.requests_addr, events_addr=settings.channels.events_addr,
        api_key=http.api_key, max_pending=http.max_pending, default_max_tokens=http.default_max_tokens,
        drafter_configured=not model.no_draft, max_body_bytes=body_bytes(http.max_body_mb, max_model_len),
        tool_call_parser=http.tool_call_parser, reasoning_parser=http.reasoning_parser,
        drafter_license=None if model.no_draft else model_license(model.draft),
    )
    if app_settings.drafter_license:
        log.warning("the drafter %s is published under %s: check its terms before a commercial deployment",
                    model.draft, app_settings.drafter_license)
    app = create_app(app_settings, codec, log)
    server = uvicorn.Server(uvicorn.Config(app, host=http.host, port=http.port, log_level="warning",
                                           timeout_graceful_shutdown=http.shutdown_timeout))
    task = asyncio.create_task(server.serve())
    deadline = asyncio.get_running_loop().time() + 30
    while not (server.started and app.state.client.alive) and not task.done():
        if server.started and asyncio.get_running_loop().time() > deadline:
            log.warning("no heartbeat from the verify worker yet: requests get 503 until it answers")
            break
        await asyncio.sleep(0.05)
    if task.done():
        return 2
    announce_ready("gateway", f"http://{http.host}:{http.port}")
    await task
    return 0


def main(argv=None) -> int:
    settings = parse_args(argv)
    log = configure_process("gateway")
    if not settings.model.target:
        print("dflash-gateway: error: --target is required", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(settings, log))
    except (ConfigError, DFlashError) as exc:
        print(f"dflash-gateway: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
