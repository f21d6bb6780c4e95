"""The OpenAI Batch API output format (`--output-format openai`), and logprobs as OpenAI
shapes them.

One line per request, as the OpenAI Batch API's output file (and `vllm run-batch`) has it:

    {"id": "batch_req_...", "custom_id": "...",
     "response": {"status_code": 200, "request_id": "req_...",
                  "body": {"id": "chatcmpl-...", "object": "chat.completion", "created": ...,
                           "model": "...", "choices": [{"index": 0, "message": {"role":
                           "assistant", "content": "..."}, "logprobs": null, "finish_reason":
                           "stop"}], "usage": {"prompt_tokens", "completion_tokens",
                           "total_tokens"}}},
     "error": null,
     "marscli": {...}}

A `messages` record answers as /v1/chat/completions (`chat.completion`, `message`); a `prompt`
record as /v1/completions (`text_completion`, `text`, completions-shaped logprobs). Everything
else of marscli's own line (spec, timing, warnings, token_ids, the per-choice spec, extra usage
figures) goes under the one extension key `marscli`. A failed record has `response` with
status 400 (the record is at fault) or 500 (generation failed) and an OpenAI error body, and
`error` = {"code", "message"}.

Determinism: the ids are derived from the request's id and the run's key (the sha256 of the run
fingerprint, the same on --resume and on every rank), never random; `created` is the wall
clock when --timing is on, and 0 under --no-timing, so that reruns and resumed runs are
byte-identical exactly when they are in marscli's own format.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

FORMAT_OPENAI = "openai"
#: The extension key holding marscli's own statistics in an OpenAI-format line.
EXTENSION_KEY = "marscli"
#: HTTP status of a failed record: the record's fault, or the generation's.
STATUS_OK = 200
STATUS_BAD_REQUEST = 400
STATUS_SERVER_ERROR = 500
SERVER_ERRORS = ("generation_failed", "out_of_memory")
#: Keys of marscli's line that the OpenAI body carries (the rest goes under EXTENSION_KEY).
_IN_BODY = ("output", "finish_reason", "logprobs", "choices", "error")
_CHOICE_IN_BODY = ("index", "output", "finish_reason", "completion_tokens", "logprobs")

Decode = Callable[[int], str]


def _entry(token: int, logprob: float, decode: Decode) -> dict[str, Any]:
    text = decode(token)
    # As vLLM: the token's text and its UTF-8 bytes (a token that ends inside a multi-byte
    # character decodes to U+FFFD, whose bytes are then those of U+FFFD).
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}


def logprobs_content(entries: list, decode: Decode) -> dict[str, Any]:
    """TokenLogprobs (marscli.engine.logprobs) -> OpenAI chat's `logprobs` object."""
    content = []
    for e in entries:
        item = _entry(e.token, e.logprob, decode)
        item["top_logprobs"] = [_entry(t, v, decode) for t, v in e.top]
        content.append(item)
    return {"content": content}


def completions_logprobs(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI chat's logprobs object -> the /v1/completions shape (tokens, token_logprobs,
    top_logprobs as {token: logprob}, text_offset from the start of the completion)."""
    if chat is None:
        return None
    content = chat["content"]
    offsets, at = [], 0
    for c in content:
        offsets.append(at)
        at += len(c["token"])
    return {"tokens": [c["token"] for c in content],
            "token_logprobs": [c["logprob"] for c in content],
            "top_logprobs": [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content],
            "text_offset": offsets}


def _ids(run_key: str, request_id: str) -> str:
    return hashlib.sha256(f"{run_key}\0{request_id}".encode()).hexdigest()


def render(item, result: dict, options) -> dict:
    """marscli's result line for `item` -> the line of `options.output_format`."""
    if options.output_format != FORMAT_OPENAI:
        return result
    h = _ids(options.run_key, item.id)
    created = int(time.time()) if options.timing else 0
    line: dict[str, Any] = {"id": f"batch_req_{h[:24]}", "custom_id": item.id}
    err = result.get("error")
    if err:
        status = STATUS_SERVER_ERROR if err["type"] in SERVER_ERRORS else STATUS_BAD_REQUEST
        line["response"] = {"status_code": status, "request_id": f"req_{h[24:48]}",
                            "body": {"error": {"message": err["message"], "type": err["type"],
                                               "param": None, "code": err["type"]}}}
        line["error"] = {"code": err["type"], "message": err["message"]}
        line[EXTENSION_KEY] = {"line": err["line"]}
        return line
    chat = getattr(item, "messages", None) is not None
    choices_in = result.get("choices") or [
        {"index": 0, "output": result["output"], "finish_reason": result["finish_reason"],
         "logprobs": result.get("logprobs")}]
    choices = []
    for c in choices_in:
        out: dict[str, Any] = {"index": c["index"]}
        if chat:
            out["message"] = {"role": "assistant", "content": c["output"]}
            out["logprobs"] = c.get("logprobs")
        else:
            out["text"] = c["output"]
            out["logprobs"] = completions_logprobs(c.get("logprobs"))
        out["finish_reason"] = c["finish_reason"]
        choices.append(out)
    usage = result["usage"]
    body = {"id": ("chatcmpl-" if chat else "cmpl-") + h[:24],
            "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": options.model, "choices": choices,
            "usage": {"prompt_tokens": usage["prompt_tokens"],
                      "completion_tokens": usage["completion_tokens"],
                      "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}}
    line["response"] = {"status_code": STATUS_OK, "request_id": f"req_{h[24:48]}", "body": body}
    line["error"] = None
    ext = {k: v for k, v in result.items() if k not in _IN_BODY and k != item.id_key}
    ext["usage"] = {k: v for k, v in usage.items() if k not in ("prompt_tokens", "completion_tokens")}
    if not ext["usage"]:
        del ext["usage"]
    if result.get("choices"):
        ext["choices"] = [{"index": c["index"], **{k: v for k, v in c.items() if k not in _CHOICE_IN_BODY}}
                          for c in result["choices"]]
    line[EXTENSION_KEY] = ext
    return line
