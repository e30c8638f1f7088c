"""The server's configuration: one JSON file, flags and environment variables, validated into frozen dataclasses.

Precedence, lowest first: defaults, the JSON file (`--config` or `STRATA_CONFIG`), `STRATA_API_KEY`, flags.
Unknown keys and bad values raise `ConfigError` naming the key, e.g. `config: unknown key "vision.gpuu"`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

KV_TYPES = ("f32", "f16", "int8")
DEVICES = ("cpu", "cuda", "host")
CACHE_ISOLATION = ("shared", "api_key")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key."""


@dataclass(frozen=True)
class SamplingConfig:
    """Server-side sampling defaults for requests that leave a parameter out (None: the sampler's default)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class VisionConfig:
    """The image encoder (built by the vision work; validated here so configs written for it load today)."""

    mmproj: str | None = None
    gpu: bool = False
    threads: int | None = None
    max_tokens: int | None = None  # most rows per picture; None: the mmproj file's budget, else 1024
    min_tokens: int | None = None  # small pictures are scaled up to about this many rows; None: the file's
    exe: list[str] | None = None
    # With an "hf:" model and no mmproj or exe configured: the quant of the mmproj file taken from the repository
    # when it has several ("none": no image encoder).
    hf_mmproj: str = "F16"
    remote: bool = False
    # Several remote encoders shared by a fleet's replicas: each entry one encoder's command line (as `exe`, split
    # as a shell would); a picture goes to an idle one. Replaces mmproj and exe.
    pool: list[str] | None = None
    lazy_load: bool = False
    # An encode taking longer than encode_timeout + rows * encode_timeout_per_row seconds (rows: the picture's
    # own, from its header and READY's sizing rule; READY's max_tokens for an encoder without one) means a hung
    # encoder: it is restarted and the request gets a 503.
    encode_timeout: float = 10.0
    encode_timeout_per_row: float = 0.05


@dataclass(frozen=True)
class ImagesConfig:
    """Image URL downloads (see `strata.pictures.downloads`)."""

    downloads: bool = True  # false: only inline pictures (data: URLs, base64)
    allow_private: bool = False  # true: URLs may reach loopback, private and link-local addresses too
    allow_hosts: list[str] | None = None  # host names, addresses or networks reachable although not public


@dataclass(frozen=True)
class LimitsConfig:
    max_body_bytes: int = 64 * 1024 * 1024  # base64 pictures are large
    max_tokens: int | None = None  # cap on generated tokens per request; None: the context's room
    queue_length: int = 64  # requests waiting for the engine beyond this get 503
    max_pictures: int = 16  # pictures per request (each is downloaded and encoded: checked before any is)
    max_grammar_bytes: int = 64 * 1024  # a request's grammar (GBNF or Lark), in UTF-8 bytes
    max_grammar_rules: int = 1000  # rules of a GBNF grammar (its conversion takes time quadratic in them)
    history_size: int = 256  # rows of /v1/history kept in memory
    body_timeout: float = 60.0  # seconds to receive a request body
    graceful_timeout: float = 3.0  # seconds in-flight requests get at shutdown
    status_streams: int = 16  # live status streams (/v1/status/stream, the monitor) open at once; more get 503


@dataclass(frozen=True)
class KvDiskConfig:
    """The disk tier under the prefix cache (`strata.kv_disk`): conversations' KV blocks in a directory, kept
    across restarts of the same model file and KV type. None: no tier."""

    path: str | None = None
    max_bytes: int = 16 * 2**30  # of block files; the least recently used go first
    block_tokens: int = 256  # positions per block (a block is one file)


@dataclass(frozen=True)
class McpServerConfig:
    """One MCP server the service connects to: a command it starts (stdio) or a streamable-HTTP `url`."""

    command: str | None = None
    args: list[str] | None = None
    env: dict[str, str] | None = None  # over a minimal inherited environment (PATH, HOME, ...)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] | None = None
    timeout: float | None = None  # seconds per tool call; None: mcp.call_timeout


@dataclass(frozen=True)
class McpConfig:
    """How the server runs MCP tool rounds (the servers themselves are the top-level `mcp_servers`)."""

    max_rounds: int = 8  # tool rounds one response may run before the model must answer
    call_timeout: float = 60.0  # seconds one tool call may take
    connect_timeout: float = 30.0  # seconds to start a server and list its tools
    request_urls: bool = False  # may a request name an MCP server by URL? (then under the images.* address rules)
    max_servers: int = 8  # MCP servers one request may name
    max_tools: int = 256  # tools one server may list (a longer listing is refused)
    max_schema_bytes: int = 16 * 1024  # of one listed tool's input schema as JSON (a larger one: listing refused)
    max_result_bytes: int = 4 * 1024 * 1024  # of one answer of a server: a tool result past it is cut, unread


SPECULATIVE_SOURCES = ("auto", "lookup", "mtp", "draft_model", "off")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`strata.scheduling.drafts`): where decoding requests' drafts come from, and how long.

    Attributes:
        source: "auto" (the request's `prediction` where it sent one, else the model's MTP block where the file
            has one, else prompt lookup), "lookup" (prompt lookup only: a prediction is ignored), "mtp" (the MTP
            block, which the file must have; prompt lookup where it has no draft; a prediction is ignored),
            "draft_model" (`draft_model` drafts) or "off". With "auto" and "mtp" and a file with an MTP block,
            the engine runs the block beside the model: a layer more of KV rows, and about a layer more per token
            in a prompt; in decode, filling the block's rows waits for a draft and is batched then, so a request
            whose drafts do not pay costs little more than without the block (on the CPU engine; the GPU backend
            fills them at every eval: a block pass a step).
        mtp_window: the MTP block's history on the CPU engine: it attends over the pairs filled since a request's
            drafts last started, at least the last `mtp_window` (at most 128): a request whose drafts do not pay
            costs no fill between its guesses, and a guess `mtp_window` pairs at most, whatever the prompt's length
            (`Engine.load`'s `mtp_window`); 0: the whole history, every pair filled (the GPU backend's way).
        max_draft: the most draft tokens a request adds to one engine step.
        adaptive: each request's draft length follows its measured acceptance and the measured cost of a draft
            token, down to none where drafts do not pay; false: `max_draft` whenever the source has that many.
        min_ngram, max_ngram: the shortest and the longest tail of the answer the prompt lookup matches.
        draft_model: a small GGUF model of the same vocabulary that drafts greedily (source "draft_model"), on a
            context of its own as long as the model's, with as many slots.
    """

    source: str = "auto"
    mtp_window: int = 32
    max_draft: int = 8
    adaptive: bool = True
    min_ngram: int = 2
    max_ngram: int = 12
    draft_model: str | None = None


@dataclass(frozen=True)
class KvEventsConfig:
    """KV events for a KV-aware router in front of several replicas (`strata.kv_events`, docs/SCALE_OUT.md)."""

    endpoint: str | None = None  # the PUB socket routers connect to, e.g. "tcp://*:5557"; None: no events
    replay_endpoint: str | None = None  # the ROUTER socket a late router asks for missed batches, or None
    block_size: int = 16  # positions per block: the router's --kv-event-block-size
    topic: str = ""  # the first frame of every message


@dataclass(frozen=True)
class ModelEntry:
    """One of several models a server serves by name (the top-level `models` list): its file and names, and the
    engine keys a single model has at the top level; a key left out (None) is the top-level one. `mmproj` is its
    image encoder (none when left out); `vision` holds the encoder keys that differ from the top-level ones."""

    name: str
    model: str
    aliases: list[str] | None = None  # other names a request's `model` may use
    mmproj: str | None = None
    context: int | None = None
    slots: int | None = None
    threads: int | None = None
    kv: str | None = None
    kv_budget: float | None = None
    batch: int | None = None
    mapped_weights: bool | None = None
    step_tokens: int | None = None
    step_slowdown: float | None = None
    vision: dict[str, Any] | None = None  # `vision` keys of this model's encoder (checked as the section's)

    @property
    def names(self) -> list[str]:
        return [self.name, *(self.aliases or [])]


# The keys a model entry shares with the top level, each one replacing the top-level value when given.
MODEL_ENTRY_KEYS = ("context", "slots", "threads", "kv", "kv_budget", "batch", "mapped_weights", "step_tokens",
                    "step_slowdown")


@dataclass(frozen=True)
class Config:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    # /status, /v1/status, /v1/status/stream, /v1/history and /metrics show every client's requests: with this
    # set they need it (or api_key) even when the API itself is open.
    status_key: str | None = None
    # Who shares the prefix cache: "shared" (every request, unless it sends a `cache_salt`), or "api_key" (only
    # requests that sent the same key: each key's conversations are isolated from the others').
    cache_isolation: str = "shared"
    # Host header names accepted (a guard against DNS rebinding); None: when listening on loopback, the loopback
    # names and addresses only, else any.
    allowed_hosts: list[str] | None = None
    context: int = 4096
    threads: int | None = None
    kv: str = "f16"
    batch: int = 256
    # Read the weights where the model file is mapped instead of a copy in huge pages: slower decode, but memory
    # the kernel can drop, for a model about the size of the RAM.
    mapped_weights: bool = False
    # A file the engine writes each MoE layer's chosen experts to, per token of every step (strata.experts.trace):
    # the traces the expert cache's policy is measured on. None: off.
    record_routing: str | None = None
    # Where the forward pass runs: "cpu" (the CPU engine); "cuda" (the GPU backend, for qwen3moe and qwen35moe
    # models: attention or Gated DeltaNet, norms, router, shared expert, output, the KV cache and the recurrent state
    # on the card, the routed experts cached there and the rest computed by the CPU; without a CUDA build or a GPU
    # the CPU engine runs, and startup says why in one line); "host" (the GPU backend on the host device: the test
    # device, for running the backend's code path without a GPU).
    device: str = "cpu"
    # GiB the GPU backend may take on its device: the dense weights, the KV cache, then the expert cache in what
    # is left, less a local `vision.gpu` encoder's share (its weights and workspace). None: the card's free memory
    # less 1 GiB (on the host device: every expert).
    gpu_memory: float | None = None
    # A routing trace recorded earlier on the same model (record_routing): the GPU backend's expert cache starts
    # holding the experts its steps used most, and keeps that placement while it hits as well as what it learns.
    # It may name record_routing's own file: the trace is read before recording starts afresh. None: start empty.
    expert_prior: str | None = None
    web: bool = True  # the chat page (/) and the monitor (/monitor)
    model_alias: str | None = None  # the served model name(s), comma-separated; the first is reported
    cors_origins: list[str] | None = None  # browser origins allowed to call the API ("*": any); None: no CORS
    slots: int = 4  # requests generating at once; the KV cache holds slots x context positions
    # MiB the KV cache of all slots may take: startup refuses a slots x context that needs more (None: no bound)
    kv_budget: float | None = None
    # MiB a hybrid model's recurrent-state snapshots may take, for prefix reuse (None: four per slot)
    snapshot_budget: float | None = None
    step_tokens: int = 64  # most tokens per engine step while streams decode: a joining prompt comes in chunks
    # While streams decode and a prompt longer than step_tokens joins, a step carrying its chunk takes at most this
    # many times their own step (measured as the server runs); the chunk is sized to fit, within step_tokens. The
    # steps' spread puts the streams' p99 gap 1.4-1.6x the aim: 1.6 keeps them under 3x (bench/RESULTS.md).
    step_slowdown: float = 1.6
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    mcp: McpConfig = field(default_factory=McpConfig)
    kv_disk: KvDiskConfig = field(default_factory=KvDiskConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    mcp_servers: dict[str, McpServerConfig] = field(default_factory=dict)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    # Several models served by name (a request's `model` picks one), each loaded on first use; instead of `model`.
    models: list[ModelEntry] = field(default_factory=list)
    # Bytes the loaded models may take together (model files, mmproj files and KV caches), given as a number or
    # as "12GiB" / "800MB": loading one more unloads the least recently used idle ones (None: no bound).
    models_memory: int | None = None

    def __post_init__(self) -> None:
        _check(self)

    def model_files(self) -> list[str | None]:
        """The model files to check before serving: `model`, or each of `models`', but the "hf:" ones (downloaded
        once the server listens)."""
        models = [entry.model for entry in self.models] if self.models else [self.model]
        return [model for model in models if not (model or "").startswith("hf:")]

    def for_model(self, entry: ModelEntry) -> Config:
        """The configuration one of `models` is served with: the top-level keys, with the entry's file, names,
        image encoder and engine keys."""
        given = {key: getattr(entry, key) for key in MODEL_ENTRY_KEYS if getattr(entry, key) is not None}
        vision = dataclasses.replace(self.vision, **{**(entry.vision or {}), "mmproj": entry.mmproj})
        kv_disk = self.kv_disk
        if kv_disk.path is not None:  # a directory of its own: each tier removes other models' blocks at startup
            kv_disk = dataclasses.replace(kv_disk, path=os.path.join(kv_disk.path, _file_name(entry.names[0])))
        return dataclasses.replace(self, model=entry.model, model_alias=",".join(entry.names), models=[],
                                   models_memory=None, vision=vision, kv_disk=kv_disk, **given)


def _file_name(name: str) -> str:
    """A model's name as one directory name: characters other than letters, digits, '.', '_' and '-' become '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_"


# --- validation

_SECTIONS = {"sampling": SamplingConfig, "vision": VisionConfig, "limits": LimitsConfig, "images": ImagesConfig,
             "mcp": McpConfig, "kv_disk": KvDiskConfig, "kv_events": KvEventsConfig,
             "speculative": SpeculativeConfig}
MCP_SERVER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # configured names; requests' labels too


def _fail(key: str, message: str) -> ConfigError:
    return ConfigError(f'config: "{key}" {message}')


def _check(config: Config) -> None:
    _check_model_name(config.model)
    _check_engine(config)
    _check_limits(config.limits)
    _check_vision(config.vision)
    _check_mcp(config)
    _check_kv_disk(config.kv_disk)
    if config.kv_events.block_size < 1:
        raise _fail("kv_events.block_size", f"must be at least 1, got {config.kv_events.block_size}")
    _check_speculative(config.speculative)
    _check_models(config)


def _check_engine(config: Config) -> None:
    """The top-level keys: where the server listens, and the engine's shape."""
    if not 0 <= config.port <= 65535:
        raise _fail("port", f"must be 0..65535, got {config.port}")
    if config.kv not in KV_TYPES:
        raise _fail("kv", f"must be one of {', '.join(KV_TYPES)}, got {config.kv!r}")
    if config.cache_isolation not in CACHE_ISOLATION:
        raise _fail("cache_isolation", f"must be one of {', '.join(CACHE_ISOLATION)}, got {config.cache_isolation!r}")
    for key in ("context", "batch", "slots", "step_tokens"):
        if getattr(config, key) < 1:
            raise _fail(key, "must be at least 1")
    if config.threads is not None and config.threads < 1:
        raise _fail("threads", "must be at least 1")
    if config.device not in DEVICES:
        raise _fail("device", f"must be one of {', '.join(DEVICES)}, got {config.device!r}")
    if config.gpu_memory is not None and not config.gpu_memory > 0:
        raise _fail("gpu_memory", f"must be positive (GiB), got {config.gpu_memory}")
    if config.kv_budget is not None and not config.kv_budget > 0:
        raise _fail("kv_budget", f"must be positive (MiB), got {config.kv_budget}")
    if config.snapshot_budget is not None and not config.snapshot_budget >= 0:
        raise _fail("snapshot_budget", f"must be at least 0 (MiB), got {config.snapshot_budget}")
    if not config.step_slowdown >= 1:
        raise _fail("step_slowdown", f"must be at least 1 (a multiple of the decode step), got {config.step_slowdown}")


def _check_kv_disk(kv_disk: KvDiskConfig) -> None:
    if kv_disk.path is not None and not kv_disk.path.strip():
        raise _fail("kv_disk.path", "must be a directory, not empty")
    if kv_disk.max_bytes < 1:
        raise _fail("kv_disk.max_bytes", "must be at least 1")
    if kv_disk.block_tokens < 1:
        raise _fail("kv_disk.block_tokens", "must be at least 1")


def _check_model_name(model: str | None) -> None:
    """An "hf:owner/name[:QUANT]" model is well formed (it is downloaded when the server starts)."""
    from strata.models.hub import HubError, is_hub_model, parse_ref

    if is_hub_model(model):
        try:
            parse_ref(model or "")
        except HubError as error:
            raise _fail("model", str(error)) from None


def _check_limits(limits: LimitsConfig) -> None:
    for key in ("max_body_bytes", "queue_length", "history_size", "max_pictures", "status_streams",
                "max_grammar_bytes", "max_grammar_rules"):
        if getattr(limits, key) < 1:
            raise _fail(f"limits.{key}", "must be at least 1")
    if limits.max_tokens is not None and limits.max_tokens < 1:
        raise _fail("limits.max_tokens", "must be at least 1")
    for key in ("body_timeout", "graceful_timeout"):
        if getattr(limits, key) <= 0:
            raise _fail(f"limits.{key}", "must be positive")


def _check_vision(vision: VisionConfig) -> None:
    for key in ("encode_timeout", "encode_timeout_per_row"):
        if getattr(vision, key) <= 0:
            raise _fail(f"vision.{key}", "must be positive")
    for key in ("max_tokens", "min_tokens"):
        value = getattr(vision, key)
        if value is not None and value < 1:
            raise _fail(f"vision.{key}", "must be at least 1")
    for i, command in enumerate(vision.pool or ()):
        try:
            if not shlex.split(command):
                raise _fail(f"vision.pool[{i}]", "must be a command line, not blank")
        except ValueError as error:
            raise _fail(f"vision.pool[{i}]", f"is not a command line: {error}") from None


def _check_speculative(speculative: SpeculativeConfig) -> None:
    if speculative.source not in SPECULATIVE_SOURCES:
        raise _fail("speculative.source", f"must be one of {', '.join(SPECULATIVE_SOURCES)}, "
                                          f"got {speculative.source!r}")
    if not 0 <= speculative.mtp_window <= 128:
        raise _fail("speculative.mtp_window", f"must be 0..128, got {speculative.mtp_window}")
    if not 1 <= speculative.max_draft <= 64:
        raise _fail("speculative.max_draft", f"must be 1..64, got {speculative.max_draft}")
    if speculative.min_ngram < 1:
        raise _fail("speculative.min_ngram", "must be at least 1")
    if speculative.max_ngram < speculative.min_ngram:
        raise _fail("speculative.max_ngram", f"must be at least min_ngram ({speculative.min_ngram})")
    if (speculative.source == "draft_model") != (speculative.draft_model is not None):
        raise _fail("speculative.draft_model", 'is needed with source "draft_model", and only then')


def _check_models(config: Config) -> None:
    """`models`: each entry well formed, every name and alias served once; not mixed with the one-model keys."""
    if config.models_memory is not None and config.models_memory < 1:
        raise _fail("models_memory", "must be at least 1 byte")
    if not config.models:
        return
    for key in ("model", "model_alias"):
        if getattr(config, key) is not None:
            raise _fail(key, 'names one model: with "models", each entry names its own (leave this key out)')
    if config.kv_events.endpoint is not None:
        raise _fail("kv_events.endpoint", 'serves one model\'s prefix cache, as a router\'s replica does: not with '
                    '"models" (run one server per model behind the router)')
    seen: set[str] = set()
    for index, entry in enumerate(config.models):
        for name in entry.names:
            if not name.strip() or name != name.strip():
                raise _fail(f"models[{index}].name", "must be a non-empty name without surrounding spaces")
            if name in seen:
                raise _fail(f"models[{index}]", f"serves the name {name!r}, which another entry serves too")
            seen.add(name)
        try:
            config.for_model(entry)  # the entry's keys pass the checks of the top-level ones
        except ConfigError as error:
            raise ConfigError(str(error).replace('config: "', f'config: "models[{index}].', 1)) from None


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(key: str, value: Any) -> int:
    """A size as bytes: a number, or a string such as "12GiB", "800 MB" or "1.5GiB".

    Raises:
        ConfigError: naming `key`.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise _fail(key, f'must be a number of bytes or a size such as "12GiB", got {json.dumps(value)}')
    return int(float(match[1]) * _SIZE_UNITS[(match[2] or "").lower()])


def _check_mcp(config: Config) -> None:
    if config.mcp.max_rounds < 0:
        raise _fail("mcp.max_rounds", "must be at least 0")
    for key in ("max_servers", "max_tools", "max_schema_bytes", "max_result_bytes"):
        if getattr(config.mcp, key) < 1:
            raise _fail(f"mcp.{key}", "must be at least 1")
    for key in ("call_timeout", "connect_timeout"):
        if getattr(config.mcp, key) <= 0:
            raise _fail(f"mcp.{key}", "must be positive")
    for name, server in config.mcp_servers.items():
        _check_mcp_server(name, server)


def _check_mcp_server(name: str, server: McpServerConfig) -> None:
    """One of `mcp_servers`: a stdio server (`command`, and its args, env, cwd) or a streamable-HTTP one (`url`,
    and its headers), never a mix."""
    key = f"mcp_servers.{name}"
    if not MCP_SERVER_NAME.fullmatch(name):
        raise _fail(key, "must be named with 1 to 64 letters, digits, '_' or '-'")
    if (server.command is None) == (server.url is None):
        raise _fail(key, 'needs exactly one of "command" (a stdio server) and "url" (streamable HTTP)')
    stdio_only = [k for k in ("args", "env", "cwd") if getattr(server, k) is not None]
    if server.url is not None and stdio_only:
        raise _fail(f"{key}.{stdio_only[0]}", 'is for stdio servers ("command"), not "url" ones')
    if server.command is not None and server.headers is not None:
        raise _fail(f"{key}.headers", 'is for "url" servers, not stdio ones')
    if server.url is not None and not re.match(r"https?://", server.url, re.IGNORECASE):
        raise _fail(f"{key}.url", "must be an http:// or https:// URL")
    if server.timeout is not None and server.timeout <= 0:
        raise _fail(f"{key}.timeout", "must be positive")


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """`value` as type `hint` (a scalar, an optional scalar, a list of strings or an object of strings) or a
    ConfigError naming `key`."""
    allowed = [t for t in getattr(hint, "__args__", (hint,)) if t is not type(None)]
    if value is None:
        if len(allowed) < len(getattr(hint, "__args__", ())):
            return None
        raise _fail(key, "must not be null")
    target = allowed[0]
    origin = getattr(target, "__origin__", None)
    if origin is dict:
        return _string_object(key, value)
    if origin is list:
        return _string_list(key, value)
    return _scalar(key, target, value)


def _string_object(key: str, value: Any) -> dict[str, str]:
    if isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise _fail(key, "must be an object of strings")


def _string_list(key: str, value: Any) -> list[str]:
    may_be_empty = key.startswith("mcp_servers.")  # a command's arguments
    if isinstance(value, list) and all(isinstance(item, str) for item in value) and (value or may_be_empty):
        return list(value)
    raise _fail(key, "must be a list of strings" if may_be_empty else "must be a non-empty list of strings")


def _scalar(key: str, target: type, value: Any) -> Any:
    """A JSON number, string or boolean as `target`: an int is a float too, a boolean is not an int."""
    if target is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, target) and not (target is int and isinstance(value, bool)):
        return value
    raise _fail(key, f"must be {target.__name__}, got {json.dumps(value)}")


def _build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f'config: unknown key "{full}"')
        if key in _SECTIONS and not prefix:
            if not isinstance(value, Mapping):
                raise _fail(full, "must be an object")
            values[key] = _build(_SECTIONS[key], value, f"{key}.")
        elif key == "mcp_servers" and not prefix:
            if not isinstance(value, Mapping):
                raise _fail(full, "must be an object (server name -> server)")
            servers = {}
            for name, server in value.items():
                if not isinstance(server, Mapping):
                    raise _fail(f"{full}.{name}", "must be an object")
                servers[name] = _build(McpServerConfig, server, f"{full}.{name}.")
            values[key] = servers
        elif key == "models" and not prefix:
            if not isinstance(value, list) or not all(isinstance(entry, Mapping) for entry in value):
                raise _fail(full, "must be a list of objects (each a model: name, model, ...)")
            values[key] = [_model_entry(entry, f"{full}[{index}]") for index, entry in enumerate(value)]
        elif key == "models_memory" and not prefix:
            values[key] = None if value is None else parse_bytes(full, value)
        else:
            values[key] = _coerce(full, hints[key], value)
    return cls(**values)


def _model_entry(data: Mapping[str, Any], key: str) -> ModelEntry:
    for required in ("name", "model"):
        if required not in data:
            raise _fail(f"{key}.{required}", "is required")
    vision = data.get("vision")
    if vision is not None:
        if not isinstance(vision, Mapping):
            raise _fail(f"{key}.vision", "must be an object")
        if "mmproj" in vision:
            raise _fail(f"{key}.vision.mmproj", 'is the entry\'s own "mmproj" key')
        checked = _build(VisionConfig, vision, f"{key}.vision.")  # names a wrong key or value
        vision = {name: getattr(checked, name) for name in vision}
    entry: ModelEntry = _build(ModelEntry, {name: value for name, value in data.items() if name != "vision"},
                               f"{key}.")
    return dataclasses.replace(entry, vision=vision)


# --- loading


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if key in _SECTIONS and isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"config: cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"config: {path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a JSON object")
    return data


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """The configuration from a JSON file, the environment and overrides (flags).

    Args:
        path: the JSON file; None reads `STRATA_CONFIG` when set.
        overrides: keys as in the file (sections as nested dicts); the highest precedence.
        environ: the environment to read `STRATA_CONFIG` and `STRATA_API_KEY` from (default `os.environ`).

    Raises:
        ConfigError: an unreadable file, an unknown key or a bad value.
    """
    environ = os.environ if environ is None else environ
    path = path or environ.get("STRATA_CONFIG") or None
    data: dict[str, Any] = read_config_file(path) if path else {}
    if environ.get("STRATA_API_KEY"):
        data = _merge(data, {"api_key": environ["STRATA_API_KEY"]})
    data = _merge(data, overrides or {})
    return config_from_dict(data)


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Validate a configuration given as the JSON file's dict."""
    return _build(Config, data)


def flag_names() -> list[tuple[str, Any]]:
    """Every config key as (dotted key, type hint), for building one flag per key."""
    keys: list[tuple[str, Any]] = []
    for name, hint in get_type_hints(Config).items():
        if name in _SECTIONS:
            keys.extend((f"{name}.{sub}", sub_hint) for sub, sub_hint in get_type_hints(_SECTIONS[name]).items())
        else:
            keys.append((name, hint))
    return keys
