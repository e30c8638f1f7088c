"""`strata serve`: load a model (the shipped demo model when none is given) and serve the HTTP API with
hypercorn's trio worker.

Every config key has a flag (`--context`, `--limits.max-tokens`, `--vision.mmproj`, ...); flags override the JSON
file given with `--config` (or `STRATA_CONFIG`), which overrides the defaults. Heavy imports happen in `run`, so
that `strata --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata.config import Config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from strata.cli.flag_help import HELP
    from strata.config import Config, flag_names

    defaults = Config()
    parser.add_argument("--config", metavar="FILE", help="JSON config file (default: $STRATA_CONFIG)")
    parser.add_argument("--hf", metavar="REPO[:QUANT]",
                        help='download the model (and its mmproj) from Hugging Face into its cache and serve it; '
                             'the same as --model hf:REPO[:QUANT], the "model" config key')
    for key, hint in flag_names():
        flag = "--" + key.replace("_", "-")
        section, _, name = key.rpartition(".")
        default = getattr(getattr(defaults, section) if section else defaults, name)
        shown = "" if default is None or "(default" in HELP.get(key, "") else f" (default: {json.dumps(default)})"
        parser.add_argument(flag, dest=f"cfg:{key}", metavar=_metavar(hint), default=None,
                            help=f'{HELP.get(key, "see the docs")}{shown}; the "{key}" config key')


def _metavar(hint: Any) -> str:
    text = str(hint)
    if "dict" in text:
        return "JSON_OBJECT"
    if "list" in text:
        return "JSON_LIST"
    if "bool" in text:
        return "true|false"
    return "N" if ("int" in text or "float" in text) else "VALUE"


def _flag_value(key: str, hint: Any, text: str) -> Any:
    """A flag's text as the JSON value the config expects (numbers, booleans, lists and objects parse as
    JSON)."""
    if "str" in str(hint) and "list" not in str(hint) and "dict" not in str(hint):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text  # validation names the key and the expected type


def config_from_args(args: argparse.Namespace) -> Config:
    from strata.config import flag_names, load_config

    overrides: dict[str, Any] = {}
    for key, hint in flag_names():
        text = getattr(args, f"cfg:{key}", None)
        if text is None:
            continue
        section, _, name = key.rpartition(".")
        target = overrides.setdefault(section, {}) if section else overrides
        target[name] = _flag_value(key, hint, text)
    if args.hf:
        overrides["model"] = "hf:" + args.hf.removeprefix("hf:")
    return load_config(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    import trio

    from strata.api.server import serve
    from strata.config import ConfigError
    from strata.models import with_demo_model

    try:
        config = config_from_args(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not config.model and not config.models:
        config = with_demo_model(config)
        print(f"no model given: serving the demo model {config.model} (docs/DEMO_MODEL.md)")
    try:
        return trio.run(partial(serve, config, handle_signals=True))
    except BaseException as error:
        # The signal receiver covers all of serve(); an interrupt in trio's last instants after it is still one
        # line, not a traceback.
        if not _only_interrupts(error):
            raise
        print("SIGINT: stopped", flush=True)
        return 130


def _only_interrupts(error: BaseException) -> bool:
    if isinstance(error, BaseExceptionGroup):
        return error.split(KeyboardInterrupt)[1] is None
    return isinstance(error, KeyboardInterrupt)


