"""`conductor serve --prefill URL ... --decode URL ...`: run the gateway until SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal

from kvstore.cli_args import number, positive_float, positive_int

from .app import Gateway
from .config import GatewayConfig, read_api_keys
from .guard import raise_descriptor_limit

# What outside traffic may hold: flag -> GatewayConfig field (None: keep the config file's or the default).
LIMITS = ("max_connections", "max_connections_per_source", "header_timeout_s", "body_timeout_s",
          "keepalive_timeout_s", "max_body_bytes", "max_json_depth", "shed_after_s", "max_n")


def add_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--prefill", nargs="*", default=None, metavar="URL", help="prefill engines (vllm serve)")
    serve.add_argument("--decode", nargs="*", default=None, metavar="URL", help="decode (or colocated) engines")
    serve.add_argument("--config", help="JSON file with GatewayConfig fields (flags override it)")
    serve.add_argument("--model-dir", help="the engines' model dir: local tokenizer and store fingerprint")
    serve.add_argument("--api-key-file", help="client bearer tokens, one a line")
    serve.add_argument("--local-prefill-tokens", type=int, default=None,
                       help="prompts with fewer uncached tokens skip disaggregation (default: 256 for the gateway, "
                            "0 for /route)")
    serve.add_argument("--overflow-kv-share", type=number(float, 0, 1), default=None, metavar="SHARE",
                       help="P/D: while every decode engine's KV is full, a prefill engine decodes the "
                            "request itself, up to this share of its KV cache (default: 0.5 for the gateway, 0 "
                            "for /route; 0: never)")
    serve.add_argument("--slo-ttft-ms", type=float, default=None, help="429 above this predicted TTFT")
    serve.add_argument("--kv-events", action="append", default=[], metavar="URL=tcp://HOST:PORT",
                       help="an engine's ZMQ KV-event endpoint (repeat per engine)")
    limits = serve.add_argument_group("client limits (what outside traffic may hold)")
    limits.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                        help="open client connections; more are answered 503 with Retry-After and closed "
                             "(lowered to fit ulimit -n)")
    limits.add_argument("--max-connections-per-source", type=number(int, 0), default=None, metavar="N",
                        help="of those, from one IPv4 /24 or IPv6 /64 (0: no per-source cap; behind a proxy "
                             "that hides client addresses, raise it or use 0)")
    limits.add_argument("--header-timeout-s", type=positive_float, default=None, metavar="S",
                        help="a request's line and headers must arrive within this, else 408 and closed")
    limits.add_argument("--body-timeout-s", type=positive_float, default=None, metavar="S",
                        help="a request's whole body must arrive within this after its headers, else 408")
    limits.add_argument("--keepalive-timeout-s", type=positive_float, default=None, metavar="S",
                        help="an idle keep-alive connection is closed after this")
    limits.add_argument("--max-body-bytes", type=positive_int, default=None, metavar="N",
                        help="larger request bodies are answered 413")
    limits.add_argument("--max-json-depth", type=positive_int, default=None, metavar="N",
                        help="request JSON nested deeper is answered 400")
    limits.add_argument("--shed-after-s", type=positive_float, default=None, metavar="S",
                        help="at a connection cap, the connection whose headers have been arriving the longest "
                             "is shed (408) once it has had this long")
    limits.add_argument("--max-n", type=positive_int, default=None, metavar="N",
                        help="choices a request may ask for (n, best_of); more is answered 400")


def config_from(args: argparse.Namespace) -> GatewayConfig:
    overrides = {"prefill": args.prefill, "decode": args.decode, "metadata": args.metadata,
                 "model_dir": args.model_dir, "local_prefill_tokens": args.local_prefill_tokens,
                 "overflow_kv_share": args.overflow_kv_share,
                 "slo_ttft_ms": args.slo_ttft_ms, **{name: getattr(args, name, None) for name in LIMITS}}
    if args.policy is not None:
        overrides["policy"] = args.policy
    if args.cluster is not None:
        overrides["cluster"] = args.cluster
    if args.block_tokens is not None:
        overrides["block_tokens"] = args.block_tokens
    if args.fingerprint:
        overrides["fingerprint"] = json.loads(args.fingerprint)
    if args.api_key_file:
        overrides["api_keys"] = read_api_keys(args.api_key_file)
    if args.kv_events:
        overrides["kv_events"] = dict(item.split("=", 1) for item in args.kv_events)
    if args.config:
        return GatewayConfig.from_file(args.config, **overrides).validate()
    return GatewayConfig(**{k: v for k, v in overrides.items() if v is not None}).validate()


def startup_line(config: GatewayConfig, listen: str) -> str:
    """The one line the gateway logs once it serves: where, in front of what, and who may call it."""
    engines = f"decode {', '.join(config.decode)}" + (f"; prefill {', '.join(config.prefill)}" if config.prefill
                                                       else " (colocated)")
    store = f"store index {config.metadata} (cluster {config.cluster!r})" if config.metadata else "no store index"
    auth = (f"{len(config.api_keys)} API key(s), cache salts bound to keys" if config.api_keys
            else "off (no API keys: callers' cache salts go to the engines as sent)")
    price = f"; GPU price {config.gpu_hour_price:g}/h x {config.gpus_per_engine}" if config.gpu_hour_price else ""
    return (f"conductor gateway: serving OpenAI on http://{listen} in front of {engines}; policy {config.policy}, "
            f"{store}, {len(config.kv_events)} KV-event feed(s), blocks of {config.block_tokens} tokens{price}; "
            f"auth {auth}")


async def _run(config: GatewayConfig, listen: str) -> None:
    host, _, port = listen.rpartition(":")
    raise_descriptor_limit()  # else a default `ulimit -n` of 1024 caps the connections at 448
    gateway = Gateway(config)
    bound = await gateway.start(host or "127.0.0.1", int(port or 0))
    print(json.dumps({"listen": f"{host}:{bound}"}), flush=True)
    logging.getLogger("conductor.gateway").info("%s", startup_line(config, f"{host}:{bound}"))
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    await gateway.stop()


def serve_gateway(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_run(config_from(args), args.listen))
    return 0
