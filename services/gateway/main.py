"""`meshserve serve gateway`: HTTP (uvicorn) and the NATS API in one event loop.

Shutdown on SIGTERM/SIGINT: stop taking NATS requests, let uvicorn finish the HTTP ones (up to
GRACE seconds), finish the NATS ones, then drain the connection so nothing published is lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

# Only light imports here: the CLI imports this module to build its parser.
from meshserve.shared.models_repo import DEFAULT_MODEL, generation_defaults, load_tokenizer
from meshserve.shared.limits import add_request_limit_arguments, limits_from_args
from meshserve.shared.reasoning import add_reasoning_argument
from meshserve.shared.tool_calls import add_tool_call_parser_argument
from meshserve.shared.subjects import DEFAULT_NAMESPACE

from .request_log import DEFAULT_BACKUPS as REQUEST_LOG_BACKUPS
from .request_log import DEFAULT_MAX_BYTES as REQUEST_LOG_MAX_BYTES
from .request_log import DEFAULT_PATH as REQUEST_LOG_PATH

log = logging.getLogger("meshserve.gateway")

GRACE = 30.0  # seconds in-flight requests get at shutdown
# An idle keep-alive connection is closed after this long. It must outlast the clients' own pools:
# httpx (so the openai client) reuses a connection idle up to 5 s, uvicorn's default timeout, so a
# request sent as the server closes is lost ("Server disconnected without sending a response").
KEEP_ALIVE_S = 75  # nginx's keepalive_timeout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=None,
                        help="NATS server (default: $MESHSERVE_NATS_URL or nats://127.0.0.1:4222)")
    parser.add_argument("--namespace", default=os.environ.get("MESHSERVE_NAMESPACE", DEFAULT_NAMESPACE),
                        help="subject namespace of the mesh (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model name, HF directory or .gguf file; only its tokenizer is loaded here")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    add_reasoning_argument(parser)
    add_tool_call_parser_argument(parser)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the longest context (prompt plus output) of any model here; a chat without "
                             "max_tokens may fill it (default: each model's own, as its workers serve it)")
    parser.add_argument("--stream-timeout", type=float, default=300.0,
                        help="fail a request when no token arrives for this many seconds; a request waiting its "
                             "turn (queued or preempted) says so every 20 s, which starts it again (default: %(default)s)")
    parser.add_argument("--ready-timeout", type=float, default=120.0,
                        help="a request that arrives while the mesh is starting (no scheduler or no worker yet) "
                             "waits this many seconds for it, then gets a 503 with Retry-After (default: %(default)s)")
    parser.add_argument("--keep-alive-timeout", type=int, default=KEEP_ALIVE_S,
                        help="seconds an idle HTTP keep-alive connection stays open; longer than the clients' pools "
                             "keep one (httpx and openai: 5 s), so none sends a request as it closes (default: %(default)s)")
    parser.add_argument("--request-log", default=os.environ.get("MESHSERVE_REQUEST_LOG", REQUEST_LOG_PATH),
                        help="JSONL log, a line per request, for `meshserve analyze` (default: $MESHSERVE_REQUEST_LOG "
                             "or %(default)s)")
    parser.add_argument("--request-log-max-bytes", type=int, default=REQUEST_LOG_MAX_BYTES,
                        help="rotate the request log at this size (default: %(default)s)")
    parser.add_argument("--request-log-backups", type=int, default=REQUEST_LOG_BACKUPS,
                        help="rotated request logs kept, .1 the newest (default: %(default)s)")
    parser.add_argument("--no-request-log", action="store_true", help="do not write the request log")
    parser.add_argument("--tenants", default=None, metavar="FILE",
                        help="tenants file (docs/tenants.md): API keys, classes and quotas; every endpoint but /health "
                             "then needs a key. Give the scheduler the same file (default: none, the API is open)")
    add_request_limit_arguments(parser)


def _server(config):
    """uvicorn, minus its signal handling: run() handles signals for the whole process, and
    uvicorn's would re-raise SIGTERM after serving, killing us before NATS is drained."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server(config)


async def _announce(server, served: str) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.05)
    for s in server.servers:
        for sock in s.sockets:
            host, port = sock.getsockname()[:2]
            # Not "serving": whether requests can be served is the scheduler's to say (/health).
            log.info("gateway for %s listening on http://%s:%d/v1", served, host, port)


def with_defaults(args) -> argparse.Namespace:
    """`args` with every option it lacks at its default (callers may build their own namespace)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return argparse.Namespace(**{**vars(p.parse_args([])), **vars(args)})


async def run(args) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit status."""
    import uvicorn

    from meshserve.shared.bus import DEFAULT_NATS_URL, Bus

    from meshserve.shared.tenants import load_tenants

    from .app import create_app
    from .auth import Auth
    from .handler import Gateway
    from .metrics import GatewayMetrics
    from .request_log import RequestLog
    from .nats_api import NatsAPI
    from .streams import GATEWAY_ID, TokenStreams

    from meshserve.shared import telemetry

    args = with_defaults(args)
    telemetry.init_tracing("gateway")
    served = args.served_model_name or args.model
    auth = Auth(load_tenants(args.tenants) if args.tenants else None)
    if auth.enabled:
        log.info("tenants: %d from %s; every endpoint but /health needs an API key", len(auth.config.tenants),
                 args.tenants)
    from meshserve.shared.manifest import load_manifest

    from meshserve.shared.openai_protocol import OpenAIError

    from .catalog import Catalog

    if getattr(args, "models", None):  # many models: tokenizers load on first use (catalog.py)
        catalog = Catalog(load_manifest(args.models), args.models, max_model_len=args.max_model_len,
                          reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser)
        served = catalog.manifest.models[0].name
        unknown = catalog.manifest.tenant_names - {t.name for t in (auth.config.tenants if auth.enabled else ())}
        if unknown:  # their requests would never reach the variant meant for them
            log.warning("the manifest's variants name tenants %s, which %s", ", ".join(sorted(unknown)),
                        "the tenants file does not list" if auth.enabled else "nobody is (no --tenants)")
        try:
            first = catalog.default
            tokenizer, defaults = first.tokenizer, first.generation_defaults
        except OpenAIError as e:  # that model's requests fail with why; the others are served
            log.error("%s", e.message)
            tokenizer, defaults = None, {}
    else:
        tokenizer, defaults = load_tokenizer(args.model), generation_defaults(args.model)
        catalog = Catalog.single(served, tokenizer, defaults, args.model, args.max_model_len, args.reasoning_parser,
                                 args.tool_call_parser)
    bus = await Bus.connect(args.nats_url or DEFAULT_NATS_URL, name=f"meshserve-gateway-{GATEWAY_ID[:8]}",
                            namespace=args.namespace)
    streams = TokenStreams(bus, GATEWAY_ID)
    await streams.start()
    request_log = None if args.no_request_log else RequestLog(
        args.request_log, args.request_log_max_bytes, args.request_log_backups)
    if request_log:
        log.info("request log: %s", request_log.path)
    gw = Gateway(bus, tokenizer, served, streams, GatewayMetrics(served),
                 stream_timeout=args.stream_timeout, request_log=request_log, auth=auth,
                 ready_timeout=args.ready_timeout, generation_defaults=defaults, catalog=catalog,
                 limits=limits_from_args(args))
    nats_api = NatsAPI(gw)
    await nats_api.start()

    config = uvicorn.Config(create_app(gw), host=args.host, port=args.port, loop="uvloop", lifespan="off",
                            log_config=None, access_log=False, timeout_graceful_shutdown=int(GRACE),
                            timeout_keep_alive=args.keep_alive_timeout)
    server = _server(config)

    loop = asyncio.get_running_loop()
    background: set[asyncio.Task] = set()

    def on_signal(sig: signal.Signals) -> None:
        if server.should_exit:
            server.force_exit = True
            return
        log.info("%s: shutting down", sig.name)
        server.should_exit = True
        task = loop.create_task(nats_api.stop_accepting())
        background.add(task)
        task.add_done_callback(background.discard)

    def on_hangup() -> None:  # SIGHUP: re-read the manifest, as POST /admin/models/reload does
        task = loop.create_task(gw.reload_models())
        background.add(task)
        task.add_done_callback(lambda t: (background.discard(t), t.exception() and log.error(
            "manifest not reloaded: %s", t.exception())))

    handled = []
    if getattr(args, "models", None):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, on_hangup)
            handled.append(signal.SIGHUP)
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(sig, on_signal, sig)
            handled.append(sig)
    announce = loop.create_task(_announce(server, served))
    try:
        await server.serve()
    finally:
        announce.cancel()
        for sig in handled:
            loop.remove_signal_handler(sig)
        await nats_api.stop(GRACE)
        await streams.stop()
        await bus.close()
        if request_log:
            request_log.close()
        telemetry.shutdown()
        log.info("gateway stopped")
    return 0 if server.started else 1


def main(args) -> int:
    """Sync entry for the CLI: runs `run` on uvloop."""
    import uvloop

    return uvloop.run(run(args))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    p = argparse.ArgumentParser(prog="python -m meshserve.services.gateway.main",
                                description="The meshserve gateway (OpenAI API over HTTP and NATS).")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
