"""What each config key means, with its unit, for `strata serve --help` (the default is added from the config
itself, so it cannot drift). A key missing here still gets a flag and its default."""

from __future__ import annotations

HELP = {
    "model": "GGUF model file (default: the shipped demo model)",
    "host": "address(es) to listen on, comma-separated",
    "port": "TCP port",
    "api_key": "key clients must send (Authorization: Bearer or x-api-key); also $STRATA_API_KEY",
    "allowed_hosts": "Host header names served, as a JSON list (default on loopback: loopback names only)",
    "context": "context length in tokens (prompt and answer)",
    "threads": "engine threads (default: all cores)",
    "kv": "KV cache type: f32, f16 or int8",
    "batch": "prompt tokens per engine call",
    "web": "serve the chat page (/) and the monitor (/monitor)",
    "model_alias": "the served model name(s), comma-separated; the first is reported",
    "cors_origins": 'browser origins allowed to call the API, as a JSON list ("*": any)',
    "sampling.temperature": "default temperature for requests that send none",
    "sampling.top_k": "default top-k (tokens)",
    "sampling.top_p": "default top-p (probability mass, 0..1)",
    "sampling.min_p": "default min-p (fraction of the top probability, 0..1)",
    "sampling.seed": "default sampling seed",
    "vision.mmproj": "image encoder file (mmproj GGUF)",
    "vision.gpu": "run the image encoder on the GPU",
    "vision.threads": "image encoder threads (default: a quarter of the cores)",
    "vision.max_tokens": "most rows (tokens) per picture (default: the mmproj file's budget)",
    "vision.min_tokens": "small pictures are scaled up to about this many rows",
    "vision.exe": "encoder command as a JSON list, e.g. an ssh command for a remote encoder",
    "vision.remote": "the encoder is remote: its absence does not stop startup",
    "vision.lazy_load": "start the encoder on the first picture",
    "vision.encode_timeout": "seconds an encode may take, plus encode_timeout_per_row per row, before the "
                             "encoder is deemed hung and restarted",
    "vision.encode_timeout_per_row": "seconds per picture row added to encode_timeout",
    "images.downloads": "download http(s) image URLs (false: inline pictures only)",
    "images.allow_private": "let image URLs reach loopback, private and link-local addresses",
    "images.allow_hosts": "host names, addresses or networks image URLs may reach although not public (JSON list)",
    "limits.max_body_bytes": "largest request body, in bytes",
    "limits.max_tokens": "cap on generated tokens per request (default: the context's room)",
    "limits.queue_length": "requests waiting for the engine beyond this get 503",
    "limits.history_size": "rows of /v1/history kept",
    "limits.body_timeout": "seconds to receive a request body",
    "limits.graceful_timeout": "seconds in-flight requests get at shutdown",
}
