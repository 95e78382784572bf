"""The disaggregated proxy's own checks of a client request, on top of the shared ones in
`slimwise.serving.validation` (strict JSON, `--max-n`).

Invariants: a request is checked with vLLM's own request models (the same types and limits as vLLM's server)
plus the proxy's limits (one prompt, n = 1, no prompt embeddings, a body of at most MAX_BODY_BYTES) before
anything is forwarded, and a refusal is a `BadRequest` (an OpenAI-style 400, or 413 for the size), never a
500. Fields that steer the KV connector are the proxy's business: they never pass from a client to an
instance.
"""

from __future__ import annotations

import warnings

from fastapi import Request

from slimwise.serving.routing import REQUEST_PLAN_ARG
from slimwise.serving.validation import BadRequest

MAX_BODY_BYTES = 32 << 20  # a larger request body gets 413 before it is read into memory
# connector-steering fields: set by the proxy only (NIXL transfer params), never taken from a client
STRIPPED = ("kv_transfer_params", "ec_transfer_params", "request_id")


def _validation_message(exc: Exception) -> tuple[str, str | None]:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        found = errors(include_url=False)
        if found:
            first = found[0]
            loc = ".".join(str(p) for p in first.get("loc", ())
                           if not str(p).startswith(("function-", "list[", "str")))
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            return f"{loc or 'body'}: {first.get('msg', 'invalid')}{more}", loc or None
    return str(exc)[:500], getattr(exc, "parameter", None)


def request_models() -> tuple[type, type]:
    """vLLM's (CompletionRequest, ChatCompletionRequest): imported once, by build_app (seconds), not by a
    request."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest, ChatCompletionRequest


def _check_prompt(req) -> None:
    """A completion request's prompt: one prompt, as text or token ids."""
    prompt = req.prompt
    if req.prompt_embeds is not None:
        raise BadRequest("the disaggregated proxy takes token or text prompts, not prompt_embeds",
                         "prompt_embeds")
    single = isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                         and all(isinstance(t, int) for t in prompt))
    if not single:
        raise BadRequest("the disaggregated proxy takes one prompt per request (a string or a token-id "
                         "list); send batches as separate requests", "prompt")


def check_request(body: dict, chat: bool) -> tuple[int | None, str, bool]:
    """(max_tokens or None when the client set none, its field's name, stream) after vLLM's own validation, or
    BadRequest.

    Mirrors vLLM's OpenAI server: the request model types every field (max_tokens 2.5 or "abc", n "x" are
    refused), SamplingParams refuses max_tokens < 1 (0 included: vLLM answers 400 "max_tokens must be at least
    1, got 0."), and the proxy's own limits come on top (one prompt, n = 1, no prompt embeddings)."""
    from vllm.exceptions import VLLMValidationError

    Model = request_models()[chat]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # chat's max_tokens, deprecated yet accepted
            req = Model.model_validate(body)
    except VLLMValidationError as exc:  # vLLM's own validators (empty prompt, ...): vLLM answers 400
        raise BadRequest(str(exc)[:1000], exc.parameter) from None
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        message, param = _validation_message(exc)
        raise BadRequest(message, param) from None
    if chat:
        max_tokens, param = ((req.max_completion_tokens, "max_completion_tokens")
                             if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
    else:
        max_tokens, param = req.max_tokens, "max_tokens"
        _check_prompt(req)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"{param} must be at least 1, got {max_tokens}.", param)
    if req.n != 1:
        raise BadRequest("n > 1 is not supported by the disaggregated proxy", "n")
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and REQUEST_PLAN_ARG in xargs:
        # the decode instance is one pruned checkpoint: no other plan (nor `full`) can be served here
        raise BadRequest(f"vllm_xargs.{REQUEST_PLAN_ARG} {xargs[REQUEST_PLAN_ARG]!r}: a disaggregated server "
                         "serves the one plan it was started with; drop the field (several plans: colocated "
                         "slimwise serve --plan NAME=PLAN ...)", f"vllm_xargs.{REQUEST_PLAN_ARG}")
    return max_tokens, param, bool(req.stream)


def strip_client_steering(body: dict) -> dict:
    """The request without fields that steer the KV connector: only the proxy sets them."""
    body = {k: v for k, v in body.items() if k not in STRIPPED}
    # vLLM copies kv_transfer_params from vllm_xargs into the request too
    if isinstance(body.get("vllm_xargs"), dict):
        body["vllm_xargs"] = {k: v for k, v in body["vllm_xargs"].items() if k not in STRIPPED}
    return body


async def read_body(request: Request) -> bytes:
    """The request body, or BadRequest 413 as soon as it is known to exceed MAX_BODY_BYTES (its declared
    length, else the bytes received so far): no more than that is ever held in memory."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BadRequest(f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", status=413)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", status=413)
        parts.append(part)
    return b"".join(parts)
