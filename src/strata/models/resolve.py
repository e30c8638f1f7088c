"""A config whose model is `hf:REPO[:QUANT]`: checked against the hub before a server listens (`check_config`), and
turned into one that names the downloaded files (`resolve_config`, `strata.models.hub`), with a progress line
every few seconds while the download runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from strata.models.hub import Transfer, fetch, is_hub_model, parse_ref, plan
from strata.progress import Stage, with_progress

if TYPE_CHECKING:
    from strata.config import Config, VisionConfig


async def resolve_config(config: Config, log: Callable[[str], None],
                         watch: Callable[[Transfer], None] | None = None) -> Config:
    """`config` with an `hf:` model replaced by the downloaded file (and its mmproj, unless one is configured),
    logging a progress line every few seconds while the download runs. (Each of `models` is downloaded when a
    request first names it: `strata.model_set`.)

    Args:
        watch: called with the download's `Transfer` (bytes, rate, ETA) once it starts.

    Raises:
        HubError: one line for the user (the repository, the quant, the disk or the network).
    """
    if not is_hub_model(config.model):
        return config
    ref = parse_ref(config.model or "")
    vision = config.vision

    async def work(stage: Stage) -> tuple[str, str | None]:
        def report(line: str) -> None:
            stage.now = line

        # Abandoned when cancelled (a shutdown during the download): the client cannot be interrupted, and the
        # process ends without waiting for it (the client's partial file is its own: the next start downloads
        # that file again).
        return await trio.to_thread.run_sync(fetch, ref, _mmproj_quant(vision), report, watch,
                                             abandon_on_cancel=True)

    model, mmproj = await with_progress(log, f"downloading {ref}", work)
    log(f"{ref}: {model}" + (f" (mmproj {mmproj})" if mmproj else ""))
    if mmproj:
        vision = dataclasses.replace(vision, mmproj=mmproj)
    return dataclasses.replace(config, model=model, vision=vision)



async def check_config(config: Config) -> Config:
    """`config` as a server that downloads its `hf:` model while it listens starts with: the repository, quant,
    files and free disk checked now (one listing request, or the cache; `hub.plan`), and, with no `model_alias`,
    the model named after its file, as a local file names it.

    Raises:
        HubError: every error `resolve_config` can raise but the transfer's own.
    """
    if not is_hub_model(config.model):
        return config
    planned = await trio.to_thread.run_sync(plan, parse_ref(config.model or ""), _mmproj_quant(config.vision))
    if config.model_alias:
        return config
    return dataclasses.replace(config, model_alias=planned.model_name.removesuffix(".gguf"))


def _mmproj_quant(vision: VisionConfig) -> str | None:
    """The mmproj quant to download beside the model; None: none (one is configured, or `hf_mmproj` is "none")."""
    wants = not vision.mmproj and not vision.exe and vision.hf_mmproj != "none"
    return vision.hf_mmproj if wants else None
