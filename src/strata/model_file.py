"""What a model file must be before anything loads it: a GGUF file of an architecture the engine runs.

`strata serve` (before it listens), `strata generate` and the app under another ASGI server check the file here
first, so every wrong path gets the same one line, naming the file and what is wrong with it, before anything
else is printed or loaded. Reading the metadata maps the file and parses its header (a quarter of a second for a
151,936-token vocabulary); the tensors are not touched.
"""

from __future__ import annotations

import os
from pathlib import Path

from strata.gguf_file import GGUFError, GGUFFile


class ModelFileError(ValueError):
    """The model file cannot be served: missing, a directory, not GGUF, or an architecture the engine lacks."""


def check_model_file(path: str | os.PathLike[str] | None) -> str:
    """The file's architecture, once the file is known to be one the engine can load.

    Raises:
        ModelFileError: with one line for the user.
    """
    from strata.engine_cffi import SUPPORTED_ARCHITECTURES

    if not path:
        raise ModelFileError('no model configured (the "model" key or --model)')
    if str(path).startswith("hf:"):  # `serve()` and `strata generate` download it before they get here
        raise ModelFileError(f"model {path}: Hugging Face models are downloaded by `strata serve`; under another "
                             "ASGI server, name the downloaded file")
    where = Path(path)
    if where.is_dir():
        raise ModelFileError(f"model {path}: a directory, not a GGUF model file (name the .gguf file in it)")
    if not where.exists():
        raise ModelFileError(f"model {path}: no such file")
    try:
        with GGUFFile(where) as model:
            arch = model.metadata.get("general.architecture")
    except GGUFError as error:
        raise ModelFileError(f"model {error}") from None
    except OSError as error:
        raise ModelFileError(f"model {path}: cannot be read ({error.strerror or error})") from None
    if not isinstance(arch, str):
        raise ModelFileError(f"model {path}: the file names no architecture (general.architecture)")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"model {path}: unsupported architecture '{arch}' (this engine runs "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch
