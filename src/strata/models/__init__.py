"""Model files shipped with Strata: the trained demo model (`demo.gguf`) and its vision encoder
(`demo-mmproj.gguf`). `docs/DEMO_MODEL.md` describes them; `strata make-model --demo` rebuilds them."""

from pathlib import Path

DEMO_MODEL = Path(__file__).with_name("demo.gguf")
DEMO_MMPROJ = Path(__file__).with_name("demo-mmproj.gguf")
