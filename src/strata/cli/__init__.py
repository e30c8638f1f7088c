"""The `strata` command: one sub-command per module, each exposing `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib

# sub-command -> (module, one-line help). Command modules keep heavy imports (the engine, torch) inside `run`, so
# building the parser stays fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("strata.cli.serve", "start the HTTP server"),
    "make-model": ("strata.modelgen.cli", "write a GGUF model with generated weights"),
    "generate": ("strata.cli.generate", "print a completion of a prompt, streaming"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata: local LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return importlib.import_module(args._module).run(args)

