"""The ``conveyor`` command: ``conveyor serve <service> [flags]`` runs one process of the stack."""

from __future__ import annotations

import argparse
import logging
import sys

from conveyor.config import add_arguments, from_args
from conveyor.errors import ConfigError
from conveyor.model_files import ModelFileError


def _serve_worker(args: argparse.Namespace) -> None:
    from worker_svc.config import WorkerConfig

    cfg = from_args(WorkerConfig, args)  # bad flags fail here, before torch is imported
    logging.getLogger().setLevel(cfg.log_level.upper())
    from worker_svc.server import serve

    serve(cfg)


def build_parser() -> argparse.ArgumentParser:
    from worker_svc.config import ENV_PREFIX as WORKER_ENV, WorkerConfig

    parser = argparse.ArgumentParser(prog="conveyor", description="Conveyor: an LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run one service of the stack in this process")
    services = serve.add_subparsers(dest="service", required=True)
    worker = services.add_parser("worker", help="the model worker (weights, KV cache, forward, sampling)")
    add_arguments(worker, WorkerConfig, WORKER_ENV)
    worker.set_defaults(run=_serve_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
        args.run(args)
    except (ConfigError, ModelFileError) as exc:
        print(f"conveyor: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
