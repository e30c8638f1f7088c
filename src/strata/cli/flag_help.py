"""What each config key means, with its unit, for `strata serve --help` (the default is added from the config
itself, so it cannot drift). A key missing here still gets a flag and its default."""

from __future__ import annotations

HELP = {
    "model": 'GGUF model file, or "hf:owner/name[:QUANT]" downloaded from Hugging Face (default: the shipped '
             "demo model)",
    "host": "address(es) to listen on, comma-separated",
    "port": "TCP port",
    "api_key": "key clients must send (Authorization: Bearer or x-api-key); also $STRATA_API_KEY",
    "status_key": "key the routes that show every client's requests need (/status, /v1/status, its stream, "
                  "/v1/history, /metrics) even when api_key is unset (api_key works too)",
    "cache_isolation": "who shares the prefix cache: shared (every request without a cache_salt) or api_key "
                       "(only requests that sent the same key)",
    "allowed_hosts": "Host header names served, as a JSON list (default on loopback: loopback names only)",
    "context": "context length in tokens (prompt and answer)",
    "threads": "engine threads (default: all cores)",
    "kv": "KV cache type: f32, f16 or int8",
    "batch": "prompt tokens per engine call",
    "mapped_weights": "read the weights where the model file is mapped, not from a copy in huge pages (slower "
                      "decode; for a model about the size of the RAM)",
    "record_routing": "write each MoE layer's chosen experts per token of every step to this file (a routing "
                      "trace for bench/expert_cache.py)",
    "device": "where the forward pass runs: cpu, or cuda (the GPU backend, qwen3moe and qwen35moe models; the CPU "
              "engine when there is no CUDA build or GPU); host runs the GPU backend on the host device, for tests",
    "gpu_memory": "GiB the GPU backend may take on the card: dense weights, KV cache, then the expert cache "
                  "(default: the free memory less 1 GiB), less a local vision.gpu encoder's share",
    "expert_prior": "a routing trace recorded earlier on this model (--record-routing): the GPU backend's expert "
                    "cache starts holding its most used experts",
    "slots": "requests generating at once (each keeps its KV cache of context positions while idle)",
    "kv_budget": "most MiB the KV cache of all slots may take (slots x context must fit; default: no bound)",
    "snapshot_budget": "most MiB a hybrid model's state snapshots may take, for prefix reuse (default: 4 per slot)",
    "kv_disk.path": "directory of the disk tier under the prefix cache: conversations' KV blocks, kept across "
                    "restarts of the same model file and KV type (default: none)",
    "kv_disk.max_bytes": "most bytes of block files in kv_disk.path; the least recently used go first",
    "kv_disk.block_tokens": "positions per block of the disk tier (a block is one file)",
    "step_tokens": "most tokens per engine step while requests decode (a joining prompt comes in chunks)",
    "step_slowdown": "most a joining prompt longer than step_tokens may slow the decoding requests' steps, as a "
                     "multiple of their own step",
    "web": "serve the chat page (/) and the monitor (/monitor)",
    "model_alias": "the served model name(s), comma-separated; the first is reported",
    "models": 'several models served by name instead of "model", as a JSON list of {"name", "model", "aliases", '
              '"mmproj", "context", "slots", "vision": {...}, ...}; each loads when a request first names it',
    "models_memory": 'bytes the loaded models may take together (files and KV caches), e.g. "12GiB": the least '
                     "recently used idle ones are unloaded to make room (default: no bound)",
    "cors_origins": 'browser origins allowed to call the API, as a JSON list ("*": any)',
    "sampling.temperature": "default temperature for requests that send none",
    "sampling.top_k": "default top-k (tokens)",
    "sampling.top_p": "default top-p (probability mass, 0..1)",
    "sampling.min_p": "default min-p (fraction of the top probability, 0..1)",
    "sampling.seed": "default sampling seed",
    "vision.mmproj": "image encoder file (mmproj GGUF)",
    "vision.hf_mmproj": 'with an hf: model, the quant of the mmproj file taken beside it ("none": no encoder)',
    "vision.gpu": "run the image encoder on the GPU",
    "vision.threads": "image encoder threads (default: a quarter of the cores)",
    "vision.max_tokens": "most rows (tokens) per picture (default: the mmproj file's budget)",
    "vision.min_tokens": "small pictures are scaled up to about this many rows",
    "vision.exe": "encoder command as a JSON list, e.g. an ssh command for a remote encoder",
    "vision.remote": "the encoder is remote: its absence does not stop startup",
    "vision.pool": "several remote encoders shared by a fleet's replicas, one command line each (a JSON list); a "
                   "picture goes to an idle one",
    "vision.lazy_load": "start the encoder on the first picture",
    "vision.encode_timeout": "seconds an encode may take, plus encode_timeout_per_row per row, before the "
                             "encoder is deemed hung and restarted",
    "vision.encode_timeout_per_row": "seconds per picture row added to encode_timeout",
    "images.downloads": "download http(s) image URLs (false: inline pictures only)",
    "images.allow_private": "let image URLs reach loopback, private and link-local addresses",
    "images.allow_hosts": "host names, addresses or networks image URLs may reach although not public (JSON list)",
    "limits.max_body_bytes": "largest request body, in bytes",
    "limits.max_tokens": "cap on generated tokens per request (default: the context's room)",
    "limits.max_pictures": "pictures per request (more are refused before any is downloaded or encoded)",
    "limits.max_grammar_bytes": "largest grammar (GBNF or Lark) a request may send, in bytes",
    "limits.max_grammar_rules": "most rules in a request's GBNF grammar (converting takes time quadratic in them)",
    "limits.queue_length": "requests waiting for the engine beyond this get 503",
    "limits.history_size": "rows of /v1/history kept",
    "limits.body_timeout": "seconds to receive a request body",
    "limits.graceful_timeout": "seconds in-flight requests get at shutdown",
    "limits.status_streams": "live status streams (/v1/status/stream, the monitor page) open at once; more get 503",
    "mcp.max_rounds": "MCP tool rounds one response may run (docs/MCP.md)",
    "mcp.call_timeout": "seconds one MCP tool call may take",
    "mcp.connect_timeout": "seconds an MCP server gets to start and list its tools",
    "mcp.request_urls": "let requests name MCP servers by URL (under the images.* address rules)",
    "mcp.max_servers": "MCP servers one request may name (more are refused with a 400)",
    "mcp.max_tools": "tools one MCP server may list (a longer listing is refused and the server marked failed)",
    "mcp.max_schema_bytes": "bytes of one MCP tool's input schema as JSON (a larger one refuses the listing)",
    "mcp.max_result_bytes": "bytes of one answer of an MCP server read at most (a tool result is cut there, "
                            "saying so; a longer listing is refused)",
    "speculative.source": "speculative decoding's drafts: auto (a request's prediction, else the file's MTP "
                          "block, else prompt lookup), lookup (prompt lookup only), mtp, draft_model or off",
    "speculative.draft_model": "small GGUF model of the same vocabulary that drafts (source draft_model)",
    "speculative.mtp_window": "pairs of the recent history the MTP block's drafts start from at least (0: the whole "
                              "history, every pair filled; at most 128)",
    "speculative.max_draft": "most draft tokens a request adds to one engine step",
    "speculative.adaptive": "draft lengths follow each request's acceptance and the measured step costs (false: "
                            "always max_draft)",
    "speculative.min_ngram": "shortest tail of the answer the prompt lookup matches (tokens)",
    "speculative.max_ngram": "longest tail of the answer the prompt lookup matches (tokens)",
    "mcp_servers": 'MCP servers as a JSON object: name -> {"command", "args", "env", "cwd"} or {"url", "headers"}',
    "kv_events.endpoint": "publish KV events (vLLM's format) on this ZMQ address for a KV-aware router, e.g. "
                          "tcp://*:5557 (docs/SCALE_OUT.md)",
    "kv_events.replay_endpoint": "ZMQ address where a router that joined late asks for the KV event batches it missed",
    "kv_events.block_size": "tokens per KV event block (the router's --kv-event-block-size)",
    "kv_events.topic": "topic frame of every KV event message",
}
