"""Models named by a Hugging Face repository: `strata serve --hf REPO[:QUANT]`, or `"model": "hf:REPO[:QUANT]"`.

The `huggingface_hub` client does the transfer, so its cache (`HF_HOME`, `HF_HUB_CACHE`), its offline mode
(`HF_HUB_OFFLINE=1`), its token (`HF_TOKEN`) and its resumable downloads are the user's usual ones. The file for a
quant is chosen as llama.cpp's `-hf` and the hub's own GGUF manifest choose it: the first GGUF file whose path has
the quant followed by `.` or `-` (case-insensitive; and, unlike llama.cpp, as a word of its own: F16 is not BF16);
with no quant, Q4_K_M, else the first GGUF file. A model split into several files (`-00001-of-0000N`) comes whole:
every part, into the same folder, where the engine reads them from the first (`strata.gguf_file`). An `mmproj`
file beside it is taken too, the one of the preferred quant (F16 unless configured) when there are several.

A second start needs no network: when the hub cannot be reached (or offline mode is on), the files come from the
cache. Everything that goes wrong is one `HubError` line: `plan` finds every error but a transfer's before
`strata serve` listens; the transfer itself runs while it does (`strata.models.resolve`).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"
SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class HubError(ValueError):
    """A Hugging Face model cannot be had: one line for the user."""


@dataclass(frozen=True)
class HubRef:
    """`REPO[:QUANT]`: a repository and the quant asked for (None: the default choice)."""

    repo: str
    quant: str | None

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo}" + (f":{self.quant}" if self.quant else "")


@dataclass(frozen=True)
class HubChoice:
    """The repository's files to fetch: the model (a split model's first part) and, when there is one, its mmproj;
    `parts` are all the model's files (a split model's every part, in order)."""

    model: str
    mmproj: str | None
    parts: tuple[str, ...] = ()


def parse_ref(text: str) -> HubRef:
    """`owner/name[:QUANT]` (an `hf:` prefix allowed) as a `HubRef`.

    Raises:
        HubError: when the text is not of that form.
    """
    body = text.removeprefix(PREFIX)
    repo, _, quant = body.partition(":")
    if not _REPO.fullmatch(repo) or ":" in quant:
        raise HubError(f"{text}: not a Hugging Face model name (owner/name or owner/name:QUANT)")
    return HubRef(repo, quant or None)


def is_hub_model(model: str | None) -> bool:
    return bool(model) and model.startswith(PREFIX)  # type: ignore[union-attr]


# --- choosing files


def quant_of(name: str) -> str:
    """The quant a GGUF file name ends with: `Qwen3-8B-Q4_K_M.gguf` and `m.Q8_0-00001-of-00002.gguf` give Q4_K_M
    and Q8_0."""
    stem = SPLIT_PART.sub("", Path(name).name)
    stem = stem[:-len(".gguf")] if stem.lower().endswith(".gguf") else stem
    return re.split(r"[-.]", stem)[-1]


def _has_quant(name: str, quant: str) -> bool:
    return re.search(r"(?<![A-Za-z0-9])" + re.escape(quant) + r"[.-]", name, re.IGNORECASE) is not None


def choose_files(ref: HubRef, names: list[str], mmproj_quant: str | None) -> HubChoice:
    """The files of the repository (`names`, paths in it) that serve `ref`.

    Args:
        ref: the repository and quant.
        names: every file path in the repository.
        mmproj_quant: the mmproj quant preferred when there are several; None: no mmproj.

    Raises:
        HubError: no GGUF file for the quant (naming the quants there are), or a split model with a part missing.
    """
    ggufs = sorted(name for name in names if name.lower().endswith(".gguf"))
    models = [name for name in ggufs if "mmproj" not in Path(name).name.lower()]
    if not models:
        raise HubError(f"{ref}: the repository has no GGUF model file")
    quants = sorted({quant_of(name) for name in models})
    if ref.quant:
        found = [name for name in models if _has_quant(name, ref.quant)]
    else:
        found = [name for name in models if _has_quant(name, DEFAULT_QUANT)] or models
    if not found:
        raise HubError(f"{ref}: no GGUF file for quant {ref.quant} (there are: {', '.join(quants)})")
    model = found[0]
    parts = _split_parts(ref, model, set(names))
    return HubChoice(parts[0], _choose_mmproj(ggufs, parts[0], mmproj_quant), parts)


def _split_parts(ref: HubRef, model: str, names: set[str]) -> tuple[str, ...]:
    """The files of `model`: itself, or every part of the split model it is a part of (`-0000K-of-0000N`, as
    llama.cpp's `gguf-split` names them), in order.

    Raises:
        HubError: a part is missing.
    """
    match = SPLIT_PART.search(model)
    if match is None:
        return (model,)
    count = int(match[2])
    stem = model[:match.start()]
    parts = tuple(f"{stem}-{no:05d}-of-{count:05d}.gguf" for no in range(1, count + 1))
    missing = [part for part in parts if part not in names]
    if missing:
        raise HubError(f"{ref}: the split model {parts[0]} lacks {len(missing)} of its {count} parts "
                       f"({', '.join(missing)})")
    return parts


def _choose_mmproj(ggufs: list[str], model: str, quant: str | None) -> str | None:
    """The mmproj beside the model (in its folder, else anywhere in the repository), of `quant` if there is one."""
    if quant is None:
        return None
    mmprojs = [name for name in ggufs if "mmproj" in Path(name).name.lower()]
    beside = [name for name in mmprojs if Path(name).parent == Path(model).parent] or mmprojs
    preferred = [name for name in beside if _has_quant(name, quant)]
    return next(iter(preferred or beside), None)


# --- the hub and the cache


@dataclass
class Transfer:
    """Bytes of a download so far, for the progress line; updated from the download's thread."""

    total: int
    report: Callable[[str], None]
    done: int = 0
    resumed: int = 0  # of `done`: bytes an interrupted download had left in the cache (not in the rate)
    started: float = dataclasses.field(default_factory=time.monotonic)
    name: str = ""
    reported: float = 0.0  # when `report` last had a line

    REPORT_EVERY = 0.1  # seconds: a download's reads (64 KiB each) come far more often than a line is wanted

    def advance(self, n: int, resumed: bool = False) -> None:
        """Count `n` more bytes; the line goes to `report` for a new file, its last bytes, and every
        `REPORT_EVERY` seconds between."""
        self.done += n
        self.resumed += n if resumed else 0
        now = time.monotonic()
        if n == 0 or resumed or self.done >= self.total or now - self.reported >= self.REPORT_EVERY:
            self.reported = now
            self.report(self.line())

    def rate(self) -> float:
        """Bytes a second so far (the resumed ones left out)."""
        return (self.done - self.resumed) / max(time.monotonic() - self.started, 1e-3)

    def eta(self) -> float | None:
        """Seconds left at the rate so far; None before any byte came."""
        rate = self.rate()
        return (self.total - self.done) / rate if rate > 0 and self.total > self.done else None

    def line(self) -> str:
        eta = self.eta()
        left = f", ETA {eta:.0f} s" if eta is not None else ""
        return (f"{self.name}: {self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB, {self.rate() / 1e6:.1f} MB/s"
                f"{left}")

    def as_dict(self) -> dict[str, Any]:
        """The download now, as the status routes show it."""
        return {"file": self.name, "done": self.done, "total": self.total, "bytes_per_second": self.rate(),
                "eta_seconds": self.eta()}


def _listing(ref: HubRef) -> tuple[list[str], dict[str, int]] | None:
    """The repository's file paths and sizes from the hub; None when the hub cannot be reached.

    Raises:
        HubError: no such repository (or one the token cannot see).
    """
    import httpx2  # the HTTP client huggingface_hub 2.x runs on
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if constants.is_offline_mode():
        return None
    try:
        info = HfApi().model_info(ref.repo, files_metadata=True)
    except GatedRepoError:
        raise HubError(f"{ref}: a gated repository: accept its terms on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise HubError(f"{ref}: no such repository on the hub (or a private one: set HF_TOKEN)") from None
    except (httpx2.TransportError, HfHubHTTPError, OSError):
        return None
    siblings = info.siblings or []
    return [file.rfilename for file in siblings], {file.rfilename: file.size or 0 for file in siblings}


def _cached_snapshot(repo: str) -> Path | None:
    """The cache's folder of the repository's main revision, when it has one."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    try:
        revision = (folder / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = folder / "snapshots" / revision
    return snapshot if snapshot.is_dir() else None


def _from_cache(ref: HubRef, mmproj_quant: str | None) -> tuple[Path, HubChoice]:
    """The cache's snapshot of the repository and the files in it that serve `ref`.

    Raises:
        HubError: nothing of the repository is cached, or not the files for `ref`.
    """
    snapshot = _cached_snapshot(ref.repo)
    if snapshot is None:
        raise HubError(f"{ref}: the hub cannot be reached and nothing of the repository is cached")
    names = [path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*") if path.is_file()]
    return snapshot, choose_files(ref, names, mmproj_quant)


def _check_disk(ref: HubRef, needed: int) -> None:
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if needed > free:
        raise HubError(f"{ref}: the download needs {needed / 1e9:.2f} GB and {cache} has {free / 1e9:.2f} GB free")


def _meter(transfer: Transfer) -> type:
    """A tqdm class for `hf_hub_download` that prints nothing and counts bytes into `transfer`."""
    from huggingface_hub.utils import tqdm

    class Meter(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            transfer.advance(kwargs.get("initial") or 0, resumed=True)

        def update(self, n: float | None = 1) -> bool | None:
            transfer.advance(int(n or 0))
            return None

    return Meter


@dataclass(frozen=True)
class HubPlan:
    """What serving `ref` takes: its files (`choice`), and of them those the cache lacks with their sizes
    (`missing`); or, when the hub was not asked (offline mode, no network), the cache's `snapshot` holding them."""

    ref: HubRef
    choice: HubChoice
    missing: dict[str, int]
    snapshot: Path | None = None

    @property
    def model_name(self) -> str:
        """The model file's name (a split model's first part), as a local file's names the model it serves."""
        return Path(self.choice.model).name


def plan(ref: HubRef, mmproj_quant: str | None) -> HubPlan:
    """The files serving `ref`, asked of the hub (or found in the cache when it cannot be reached), and the disk
    checked for those the cache lacks: every error `fetch` can raise before its transfer, in one listing request.

    Raises:
        HubError: one line for the user.
    """
    from huggingface_hub import try_to_load_from_cache

    listing = _listing(ref)
    if listing is None:
        snapshot, choice = _from_cache(ref, mmproj_quant)
        return HubPlan(ref, choice, {}, snapshot)
    names, sizes = listing
    choice = choose_files(ref, names, mmproj_quant)
    missing = {name: sizes.get(name, 0) for name in _wanted(choice)
               if not isinstance(try_to_load_from_cache(ref.repo, name), str)}
    _check_disk(ref, sum(missing.values()))
    return HubPlan(ref, choice, missing)


def _wanted(choice: HubChoice) -> list[str]:
    return [*choice.parts, *([choice.mmproj] if choice.mmproj else [])]


def fetch(ref: HubRef, mmproj_quant: str | None, report: Callable[[str], None] = lambda _: None,
          watch: Callable[[Transfer], None] | None = None) -> tuple[str, str | None]:
    """Download (or find in the cache) the files serving `ref`; returns the model's path and the mmproj's.

    Args:
        ref: the repository and quant.
        mmproj_quant: the mmproj quant preferred; None: no mmproj.
        report: called from the download's thread with a progress line (bytes, rate, ETA) as bytes arrive.
        watch: called once with the download's `Transfer`, whose counts then grow as bytes arrive.

    Raises:
        HubError: one line for the user.
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    # The client gathers each download's reads into 10 MB pieces before writing them (`iter_bytes(chunk_size)`):
    # growing and copying a fresh 10 MB buffer each time, it took 2-3 times curl's CPU a megabyte and ran at
    # 0.3-0.6x curl's rate here; unchunked, every read is written as it comes, at curl's rate (bench/models.py).
    # A resumed download then keeps every byte written before the cut, not only whole pieces.
    constants.DOWNLOAD_CHUNK_SIZE = None  # type: ignore[assignment]  # typed int; `iter_bytes` takes None
    planned = plan(ref, mmproj_quant)
    choice = planned.choice
    if planned.snapshot is not None:
        return str(planned.snapshot / choice.model), str(planned.snapshot / choice.mmproj) if choice.mmproj else None
    progress = Transfer(total=sum(planned.missing.values()), report=report)
    if watch is not None:
        watch(progress)
    paths = []
    for name in _wanted(choice):
        progress.name = name
        progress.advance(0)  # the line names the file before its first bytes arrive
        try:
            paths.append(hf_hub_download(ref.repo, name, tqdm_class=_meter(progress)))
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
            why = " ".join(str(error).split())  # the client's messages span lines
            raise HubError(f"{ref}: downloading {name} failed ({why}); run again to resume") from None
    return paths[0], paths[-1] if choice.mmproj else None
