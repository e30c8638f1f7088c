"""A config whose model is `hf:REPO[:QUANT]`, turned into one that names the downloaded files (`strata.models.hub`),
with a progress line every few seconds while the download runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from strata.models.hub import Transfer, fetch, is_hub_model, parse_ref
from strata.progress import Stage, with_progress

if TYPE_CHECKING:
    from strata.config import Config


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
    wants_mmproj = not vision.mmproj and not vision.exe and vision.hf_mmproj != "none"

    async def work(stage: Stage) -> tuple[str, str | None]:
        def report(line: str) -> None:
            stage.now = line

        return await trio.to_thread.run_sync(fetch, ref, vision.hf_mmproj if wants_mmproj else None, report, watch)

    model, mmproj = await with_progress(log, f"downloading {ref}", work)
    log(f"{ref}: {model}" + (f" (mmproj {mmproj})" if mmproj else ""))
    if mmproj:
        vision = dataclasses.replace(vision, mmproj=mmproj)
    return dataclasses.replace(config, model=model, vision=vision)

