"""OpenAI-compatible proxy for PD-disaggregated SlimWise: full-model prefill -> pruned decode instance.

Per request: (1) the prefill instance runs the prompt with max_tokens=1 and returns the prompt token ids and
the full model's first token t1 (vLLM's `return_token_ids`); its connector stores the KV of every prompt
token; (2) the decode instance gets prompt P + [t1] as token ids and max_tokens-1: its connector loads the
full model's KV for P, it computes t1 with the pruned weights and generates the rest. The client sees one
completion. A missing instance answers 503 with the URL at fault, never a hang.

Client input is checked before anything is forwarded, with vLLM's own request models plus strict JSON: a
malformed request gets a 400 with an OpenAI-style JSON error, and an instance's own 4xx answer reaches the
client unchanged. Fields that steer the KV connector are dropped from client requests. Each prompt's KV folder
in the shared directory is reference-counted and deleted on every path, and the directory has a size cap.

Modules: `checks` (the proxy's request checks, on top of `slimwise.serving.validation`), `kv_folders` (KV
folder naming, reference counting, size cap and sweep), `upstream` (the bounded, retrying client to the two
instances), `pipeline` (prefill -> hold the folder -> decode -> one answer), `relay` (the streamed answer),
`app` (the routes and `build_app`). The names below are re-exported for reading; a test that patches a
constant patches it in the module that reads it (`upstream.RETRY_BACKOFF_S`).
"""

from slimwise.serving.proxy.app import build_app
from slimwise.serving.proxy.checks import MAX_BODY_BYTES, STRIPPED, check_request, strip_client_steering
from slimwise.serving.proxy.kv_folders import (
    KV_DIR_MAX_BYTES,
    KV_GRACE_S,
    KV_STALE_S,
    Full,
    KVFolders,
    kv_folder,
)
from slimwise.serving.proxy.upstream import (
    KEEPALIVE_S,
    SERVER_KEEPALIVE_S,
    TIMEOUT,
    UPSTREAM_CONCURRENCY,
    Unavailable,
    Upstream,
)

__all__ = [
    "KEEPALIVE_S", "KV_DIR_MAX_BYTES", "KV_GRACE_S", "KV_STALE_S", "MAX_BODY_BYTES", "SERVER_KEEPALIVE_S",
    "STRIPPED", "TIMEOUT", "UPSTREAM_CONCURRENCY", "Full", "KVFolders", "Unavailable", "Upstream",
    "build_app", "check_request", "kv_folder", "strip_client_steering",
]
