"""`scripts/serve.sh` installs only when what it builds from changed, and otherwise starts the server at once.

The script runs in a copy of the files it reads, with a stand-in virtual environment whose `python` and `strata`
record their calls: nothing is installed or served."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]

ACTIVATE = 'PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd):$PATH"\n'
RECORDER = '#!/usr/bin/env bash\necho "$(basename "$0") $*" >> "$(dirname "$0")/../calls"\n'


def project_copy(tmp_path: Path) -> Path:
    """The files serve.sh reads, and a .venv whose python, pip and strata only record their calls."""
    copy = tmp_path / "project"
    for name in ("pyproject.toml", "setup.py", "build_engine.py", "scripts/serve.sh"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "src/strata/engine_cffi", copy / "src/strata/engine_cffi",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    bin_dir = copy / ".venv/bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(ACTIVATE)
    for tool in ("python", "strata"):
        (bin_dir / tool).write_text(RECORDER)
        (bin_dir / tool).chmod(0o755)
    return copy


def run_serve(copy: Path) -> list[str]:
    (copy / ".venv/calls").unlink(missing_ok=True)
    done = subprocess.run(["bash", "scripts/serve.sh", "--port", "9001"], cwd=copy, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return (copy / ".venv/calls").read_text().splitlines()


def test_serve_installs_once_then_starts_at_once(tmp_path):
    copy = project_copy(tmp_path)
    first = run_serve(copy)
    assert any("pip install" in call and "-e .[clients]" in call for call in first), first
    assert first[-1] == "strata serve --port 9001"
    assert run_serve(copy) == ["strata serve --port 9001"]  # no pip: the stamp matches


def test_serve_reinstalls_when_the_engine_sources_change(tmp_path):
    copy = project_copy(tmp_path)
    run_serve(copy)
    with (copy / "src/strata/engine_cffi/engine.c").open("a") as source:
        source.write("\n/* changed */\n")
    again = run_serve(copy)
    assert any("pip install" in call for call in again), again
    assert run_serve(copy) == ["strata serve --port 9001"]
