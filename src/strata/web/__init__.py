"""The web page's built bundle (`static/`, made from the sources in the repository's `web/` folder by
`./scripts/build-web.sh`) and the fingerprint of the sources it was built from."""

from __future__ import annotations

import hashlib
from pathlib import Path

STATIC = Path(__file__).parent / "static"
BUILD_INFO = STATIC / "build.json"  # {"sources": fingerprint, "files": {name: sha256}}, written by the build


def sources_fingerprint(root: Path) -> str:
    """The fingerprint of the front-end sources under `root` (every file but `node_modules/`), computed as the
    build's Vite plugin computes it: sha256 over the sorted relative paths, each with its content's sha256."""
    digest = hashlib.sha256()
    files = sorted(path.relative_to(root).as_posix() for path in root.rglob("*")
                   if path.is_file() and "node_modules" not in path.relative_to(root).parts)
    for name in files:
        digest.update(f"{name}\0{hashlib.sha256((root / name).read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()
