"""The ``conveyor`` command.

    conveyor up [flags]                   Redis + the four services + the default model, until Ctrl-C
    conveyor serve <service> [flags]      one process: worker, scheduler, detokenizer or frontend
    conveyor generate "prompt" [flags]    stream an answer from a running stack
    conveyor chat [flags]                 an interactive chat with a running stack
    conveyor bench [flags]                a serving benchmark against a running stack
    conveyor batch IN.jsonl -o OUT.jsonl  offline jobs through the HTTP API (OpenAI Batch API lines)

Every ``serve`` flag has an environment variable (``CONVEYOR_<SERVICE>_<FLAG>``); ``--help`` lists them.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys

from conveyor.config import add_arguments, from_args
from conveyor.errors import ConfigError, ConveyorError
from conveyor.model_files import ModelFileError

# service -> (module with its config, config class, env prefix, module with serve(cfg), help)
SERVICES = {
    "worker": ("worker_svc.config", "WorkerConfig", "worker_svc.server", "the model (weights, KV cache, forward, sampling)"),
    "scheduler": ("scheduler_svc.config", "SchedulerConfig", "scheduler_svc.server", "queue, KV blocks, the step loop"),
    "detokenizer": ("detokenizer_svc.config", "DetokenizerConfig", "detokenizer_svc.server", "text deltas, stop strings"),
    "frontend": ("tokenizer_svc.config", "FrontendConfig", "tokenizer_svc.server", "the public API"),
}


def config_class(service: str):
    """A service's config class and the prefix of its environment variables."""
    module, name, _, _ = SERVICES[service]
    loaded = importlib.import_module(module)
    return getattr(loaded, name), loaded.ENV_PREFIX


def _serve(args: argparse.Namespace) -> int:
    cls, _ = config_class(args.service)
    cfg = from_args(cls, args)  # bad flags fail here, before heavy imports
    logging.getLogger().setLevel(cfg.log_level.upper())
    service = importlib.import_module(SERVICES[args.service][2])
    # What the imports made (the worker's ~199,000 objects with torch, the others' 44,000-54,000) lives as long as
    # the process: moved out of the collector's sight, so that a full collection does not walk it in the middle of
    # a step or a token (90 ms in the worker, 6-10 ms in the others; vLLM freezes its start-up objects too).
    # conveyor_gc_frozen_objects says how many.
    gc.collect()
    gc.freeze()
    service.serve(cfg)
    return 0


def _up(args: argparse.Namespace) -> int:
    from conveyor.launcher import UpConfig, run

    cfg = UpConfig.from_args(args)
    logging.getLogger().setLevel(cfg.setting("log_level").upper())
    return run(cfg)


def _bench(args: argparse.Namespace) -> int:
    from conveyor.bench import BenchConfig, run

    return run(from_args(BenchConfig, args))


def _batch(args: argparse.Namespace) -> int:
    from conveyor.batch import BatchConfig, run

    return run(from_args(BatchConfig, args), args.input, args.output)


def _options(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ("temperature", "top_p", "top_k", "max_tokens", "seed")
            if getattr(args, name) is not None} | ({"stop": args.stop} if args.stop else {})


def _client(args: argparse.Namespace):
    from conveyor.client import Client

    return Client(args.target, timeout=args.timeout, api_key=args.api_key or None, tls=args.tls,
                  ca_cert=args.ca_cert or None)


def _generate(args: argparse.Namespace) -> int:
    with _client(args) as client:
        last = None
        for delta in client.stream(args.prompt, **_options(args)):
            print(delta.text, end="", flush=True)
            last = delta
        print()
        if last is not None:
            print(f"[{last.finish_reason}: {last.prompt_tokens} prompt + {last.completion_tokens} completion tokens]",
                  file=sys.stderr)
    return 0


def _chat(args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    with _client(args) as client:
        print("Chat with the model; an empty line or Ctrl-D ends it.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            reply = []
            for delta in client.stream(messages=messages, **_options(args)):
                print(delta.text, end="", flush=True)
                reply.append(delta.text)
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _credentials(args: argparse.Namespace) -> int:
    from conveyor.credentials import make_credentials

    written = make_credentials(args.folder, args.redis_host, args.redis_uid, args.grafana_uid)
    print(f"{args.folder}: made {', '.join(written)}" if written else f"{args.folder}: everything was there")
    return 0


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50051", help="the frontend's address (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of each call, in seconds")
    parser.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY", ""),
                        help="API key of the server (default: env CONVEYOR_API_KEY)")
    parser.add_argument("--tls", action="store_true", help="connect with TLS")
    parser.add_argument("--ca-cert", default="", help="PEM CA that signed the server's certificate (implies --tls)")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    """The whole ``conveyor`` command line: every subcommand and its flags."""
    from conveyor.launcher import add_up_arguments

    parser = argparse.ArgumentParser(prog="conveyor", description="Conveyor: an LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start Redis, the four services and the model; Ctrl-C stops them")
    add_up_arguments(up)
    up.set_defaults(run=_up)
    serve = commands.add_parser("serve", help="run one service of the stack in this process")
    services = serve.add_subparsers(dest="service", required=True)
    for name, (_, _, _, help_text) in SERVICES.items():
        sub = services.add_parser(name, help=help_text)
        cls, env_prefix = config_class(name)
        add_arguments(sub, cls, env_prefix)
        sub.set_defaults(run=_serve)
    generate = commands.add_parser("generate", help="stream an answer to a prompt from a running stack")
    generate.add_argument("prompt")
    _client_flags(generate)
    generate.set_defaults(run=_generate)
    from conveyor.bench import ENV_PREFIX as BENCH_ENV, BenchConfig

    bench = commands.add_parser("bench", help="a serving benchmark against a running stack (sweeps, JSON, plot)")
    add_arguments(bench, BenchConfig, BENCH_ENV)
    bench.set_defaults(run=_bench)
    from conveyor.batch import ENV_PREFIX as BATCH_ENV, BatchConfig

    batch = commands.add_parser("batch", help="offline jobs: OpenAI Batch API lines in, one result line each out "
                                "(resumable)")
    batch.add_argument("input", help="the JSONL file of requests")
    batch.add_argument("-o", "--output", required=True, help="the JSONL file of results (run again to resume)")
    add_arguments(batch, BatchConfig, BATCH_ENV)
    batch.set_defaults(run=_batch)
    creds = commands.add_parser("credentials", help="make internal TLS certificates and a Redis password in a "
                                "folder, keeping what is there (the compose stack's first start runs it)")
    creds.add_argument("folder")
    creds.add_argument("--redis-host", default="redis", help="Redis host in the redis_url file (default: %(default)s)")
    creds.add_argument("--redis-uid", type=int, default=None, help="owner of redis.conf (the user Redis runs as)")
    creds.add_argument("--grafana-uid", type=int, default=None, help="owner of grafana_password (Grafana's user)")
    creds.set_defaults(run=_credentials)
    chat = commands.add_parser("chat", help="chat with a running stack (reads lines from stdin)")
    chat.add_argument("--system", default="", help="a system message")
    _client_flags(chat)
    chat.set_defaults(run=_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``conveyor`` with ``argv`` (default: the process's); returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except (ConfigError, ModelFileError) as exc:
        print(f"conveyor: error: {exc}", file=sys.stderr)
        return 2
    except ConveyorError as exc:
        print(f"conveyor: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
