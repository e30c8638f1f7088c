"""The `strata` command: one sub-command per module, each exposing `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import difflib
import importlib

# sub-command -> (module, one-line help). Command modules keep heavy imports (the engine, torch) inside `run`, so
# building the parser stays fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("strata.cli.serve", "start the HTTP server"),
    "make-model": ("strata.modelgen.cli", "write a GGUF model with generated weights"),
    "generate": ("strata.cli.generate", "print a completion of a prompt, streaming"),
    "fleet": ("strata.cli.fleet", "start several replicas behind vllm-router (KV-aware routing)"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and each sub-command's own (which reports the flags it does not know)."""
    parser = argparse.ArgumentParser(prog="strata", description="Strata: local LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {}
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub_parser)
        commands[name] = sub_parser
    return parser, commands


def unknown_flags_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """What `parser` says of arguments it does not know: each flag with the nearest one it has, if any is near."""
    known = [flag for flag in parser._option_string_actions if flag.startswith("--")]
    parts = []
    for argument in unknown:
        flag = argument.split("=", 1)[0]
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6) if flag.startswith("-") else []
        parts.append(f"{argument} (did you mean {near[0]}?)" if near else argument)
    return "unrecognized arguments: " + " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # told by the sub-command, with its usage, not by the top-level parser
        command = commands[args.command]
        command.error(unknown_flags_message(command, unknown))
    return int(importlib.import_module(args._module).run(args))
