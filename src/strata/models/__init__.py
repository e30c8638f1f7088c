"""Model files shipped with Strata: the trained demo model (`demo.gguf`) and its vision encoder
(`demo-mmproj.gguf`). `docs/DEMO_MODEL.md` describes them; `strata make-model --demo` trains them and
`python -m strata.modelgen.demo.polish` polishes the text model, as they were made."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata.config import Config

DEMO_MODEL = Path(__file__).with_name("demo.gguf")
DEMO_MMPROJ = Path(__file__).with_name("demo-mmproj.gguf")


def with_demo_model(config: Config) -> Config:
    """`config` serving the shipped demo model, with its own CPU image encoder unless one is configured."""
    vision = config.vision
    if not vision.mmproj and not vision.exe:  # the file carries its picture budget
        vision = dataclasses.replace(vision, mmproj=str(DEMO_MMPROJ))
    return dataclasses.replace(config, model=str(DEMO_MODEL), vision=vision)
