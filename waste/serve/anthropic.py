"""Anthropic's Messages API on the same engine: POST /v1/messages (blocking, or its SSE events) and
POST /v1/messages/count_tokens. A request is translated into the chat layer's OpenAI-shaped messages (system,
text blocks, tool_use / tool_result, thinking) and rendered by the model's own chat format; the reply's parser
events come back as content blocks (thinking, text, tool_use). As on the OpenAI routes, a field the engine cannot
honour is refused with a 400 naming it, never dropped; errors have Anthropic's shape
({"type": "error", "error": {"type", "message"}}, app.py picks it by path)."""
from __future__ import annotations

import json
import uuid
from typing import Any, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..text.parsers import Content, Reasoning, ToolCall
from .errors import APIError, bad_request, from_exception, unsupported
from .schemas import _Body, log, param_errors, stop_list
from .scheduler import Delta, Done
from .state import ServerState
from .stream import Stream

router = APIRouter()
PATHS = ("/v1/messages",)           # app.py answers errors on these paths in Anthropic's shape
STOP_REASONS = {"length": "max_tokens"}


class MessagesRequest(_Body):
    model: str | None = None
    max_tokens: int
    messages: list[Any]
    system: Union[str, list[Any], None] = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None      # a caching hint: changes no output, accepted


class CountRequest(_Body):
    model: str | None = None
    messages: list[Any]
    system: Union[str, list[Any], None] = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


REFUSED = {"container": "code execution containers are not supported", "mcp_servers": "MCP servers are not supported"}


def output_config(req) -> tuple[dict | None, str | None]:
    """output_config -> (the JSON schema the text must match, reasoning_effort)."""
    oc = req.output_config or {}
    extra = sorted(set(oc) - {"format", "effort"})
    if extra:
        raise unsupported(f"output_config.{extra[0]}", "not supported")
    schema, fmt = None, oc.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_request("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                              "output_config.format")
        schema = fmt["schema"] or {"type": "object"}
    effort = oc.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("output_config.effort must be a string", "output_config.effort")
    return schema, effort


# -- request -> chat arguments -----------------------------------------------------------------------------------
def _text_of(blocks, where: str) -> str:
    """A string, or text blocks joined (cache_control, a caching hint, changes no output: accepted)."""
    if isinstance(blocks, str):
        return blocks
    out = []
    for i, b in enumerate(blocks if isinstance(blocks, list) else [blocks]):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise unsupported(where, f"a {kind!r} block is not supported here (text blocks only)")
        _no_extra(b, ("type", "text", "cache_control", "citations"), where)
        out.append(b["text"])
    return "\n".join(out)


def _no_extra(block: dict, known, where: str) -> None:
    extra = sorted(set(block) - set(known))
    if extra:
        raise unsupported(where, f"{extra[0]!r} in a {block.get('type')!r} block is not supported")


def to_chat(req) -> tuple[list[dict], list[dict] | None, Any, bool | None]:
    """(messages, tools, tool_choice, thinking) for Engine.chat, or a 400 naming what cannot be expressed."""
    msgs = []
    if req.system is not None:
        msgs.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where} must be an object with role 'user' or 'assistant'", "messages")
        content = m.get("content")
        if isinstance(content, str):
            msgs.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
        texts, calls, thinking = [], [], []
        for b in content:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(_text_of([b], "messages"))
            elif kind == "tool_use" and m["role"] == "assistant":
                _no_extra(b, ("type", "id", "name", "input", "cache_control"), "messages")
                if not isinstance(b.get("input"), dict) or not isinstance(b.get("name"), str):
                    raise bad_request(f"{where}: a tool_use block needs a name and an input object", "messages")
                calls.append({"id": b.get("id") or f"toolu_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
            elif kind == "tool_result" and m["role"] == "user":
                _no_extra(b, ("type", "tool_use_id", "content", "is_error", "cache_control"), "messages")
                result = b.get("content", "")
                msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                             "content": _text_of(result, "messages") if result else ""})
            elif kind == "thinking" and m["role"] == "assistant":
                thinking.append(b.get("thinking") or "")
            else:
                raise unsupported("messages", f"{where}: a {kind!r} block is not supported"
                                  + (" (images and documents are not supported yet)"
                                     if kind in ("image", "document") else ""))
        if m["role"] == "assistant":
            out = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                out["tool_calls"] = calls
            if thinking:
                out["reasoning_content"] = "\n".join(thinking)
            msgs.append(out)
        elif texts:
            msgs.append({"role": "user", "content": "\n".join(texts)})
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if not isinstance(t, dict) or t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
                kind = t.get("type") if isinstance(t, dict) else None
                raise unsupported("tools", f"tools[{i}]: only client tools ({{name, description, input_schema}}) are "
                                           f"supported, not {kind!r}")
            _no_extra(t, ("type", "name", "description", "input_schema", "cache_control"), "tools")
            fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
            if t.get("description"):
                fn["description"] = t["description"]
            tools.append({"type": "function", "function": fn})
    choice = None
    tc = req.tool_choice
    if tc is not None:
        kind = tc.get("type")
        parallel = not tc.get("disable_parallel_tool_use", False)
        if kind == "auto":
            choice = "auto"
        elif kind == "none":
            choice = "none"
        elif kind == "any":
            choice = "required"
            if not parallel and len(tools or []) == 1:
                choice = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        elif kind == "tool":
            choice = {"type": "function", "function": {"name": tc.get("name")}}
        else:
            raise bad_request(f"tool_choice.type must be auto, any, tool or none, not {kind!r}", "tool_choice")
        if not parallel and kind in ("auto", "any") and not isinstance(choice, dict):
            raise unsupported("tool_choice.disable_parallel_tool_use", "enforced only when one call is forced "
                                                                       "(type 'tool', or 'any' with one tool)")
    think = None
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad_request(f"thinking.type must be enabled, disabled or adaptive, not {kind!r}", "thinking")
        if req.thinking.get("display") is not None:
            raise unsupported("thinking.display", "thinking is returned whole, not summarized or omitted")
        think = None if kind == "adaptive" else kind == "enabled"   # adaptive: the model's own default
        budget = req.thinking.get("budget_tokens")
        if think and (not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget < req_max(req)):
            raise bad_request("thinking.budget_tokens must be a positive integer below max_tokens",
                              "thinking.budget_tokens")
    return msgs, tools, choice, think


def req_max(req) -> int:
    return getattr(req, "max_tokens", None) or 2 ** 31


# -- reply -> content blocks ---------------------------------------------------------------------------------------
def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class MessageShaper:
    """Scheduler events -> a Message (blocking) or Anthropic's stream events."""

    done_line = False        # Anthropic's stream ends with message_stop, not [DONE]

    def __init__(self, model: str, parser, decoding, prompt_tokens: int):
        self.model, self.parser, self.decoding, self.prompt_tokens = model, parser, decoding, prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.events: list = []
        self.block: str | None = None     # the open block's type while streaming
        self.index = -1

    def _message(self, content, stop_reason, stop_sequence, output_tokens) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens}}

    def _stop(self, done: Done) -> tuple[str, str | None]:
        if any(isinstance(e, ToolCall) for e in self.events):
            return "tool_use", None
        if done.finish_reason == "stop" and self.decoding.stop_string is not None:
            return "stop_sequence", self.decoding.stop_string
        return STOP_REASONS.get(done.finish_reason, "end_turn"), None

    def feed(self, ev: Delta) -> list:
        evs = self.parser.feed(ev.text) if ev.text else []
        self.events += evs
        return evs

    # blocking
    def whole(self, done: Done) -> dict:
        self.events += self.parser.finish()
        blocks = []
        for e in self.events:
            kind = {Content: "text", Reasoning: "thinking"}.get(type(e))
            if kind and blocks and blocks[-1]["type"] == kind:
                blocks[-1][kind] += e.text
            elif kind == "text":
                blocks.append({"type": "text", "text": e.text})
            elif kind == "thinking":
                blocks.append({"type": "thinking", "thinking": e.text, "signature": ""})
            elif isinstance(e, ToolCall):
                blocks.append({"type": "tool_use", "id": _tool_id(e.id), "name": e.name,
                               "input": json.loads(e.arguments)})
        blocks = [b for b in blocks if b["type"] != "text" or b["text"].strip() or len(blocks) == 1]
        return self._message(blocks, *self._stop(done), done.completion_tokens)

    # streaming
    def opening(self) -> str:
        return _sse("message_start", {"type": "message_start", "message": self._message([], None, None, 0)})

    def _open(self, kind: str, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.block = kind
        return out + [_sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                   "content_block": block})]

    def _close(self) -> list[str]:
        if self.block is None:
            return []
        self.block = None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> str:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _lines(self, evs) -> list[str]:
        out = []
        for e in evs:
            if isinstance(e, Content):
                if self.block != "text":
                    if not e.text.strip():
                        continue          # blanks between blocks open no text block
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, Reasoning):
                if self.block != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, ToolCall):
                out += self._open("tool_use", {"type": "tool_use", "id": _tool_id(e.id), "name": e.name, "input": {}})
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.arguments}))
                out += self._close()
        return out

    def delta(self, ev: Delta) -> list[str]:
        return self._lines(self.feed(ev))

    def closing(self, done: Done) -> list[str]:
        evs = self.parser.finish()
        self.events += evs
        out = self._lines(evs) + self._close()
        reason, seq = self._stop(done)
        out.append(_sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                            "stop_sequence": seq},
                                          "usage": {"output_tokens": done.completion_tokens}}))
        out.append(_sse("message_stop", {"type": "message_stop"}))
        return out

    def error(self, err) -> str:
        return _sse("error", anthropic_error(err))


def _tool_id(call_id: str) -> str:
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")


def anthropic_error(err) -> dict:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
    # Anthropic's shape, plus the field named and the code as the OpenAI routes give them (clients ignore extra keys)
    return {"type": "error", "error": {"type": kinds.get(err.status, "api_error"), "message": err.message,
                                       "param": err.param, "code": err.code}}


# -- the endpoints -------------------------------------------------------------------------------------------------
async def _chat(eng, req, msgs, tools, choice, think, **kw):
    try:
        return await run_in_threadpool(eng.chat, msgs, tools=tools, tool_choice=choice, thinking=think, stream=True,
                                       **kw)
    except Exception as e:
        raise from_exception(e) from None


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request):
    from .routes import no_chat

    state: ServerState = request.app.state.waste
    state.require_open()
    state.check_model(req.model)
    for name in req.unknown_fields():
        if name in REFUSED:
            raise unsupported(name, REFUSED[name])
        log.warning("ignoring unknown request field %r", name)
    if state.chat_reasons:
        raise no_chat(state)
    schema, effort = output_config(req)
    if req.max_tokens < 1:
        raise bad_request("max_tokens must be a positive integer", "max_tokens")
    if req.metadata and set(req.metadata) - {"user_id"}:
        raise unsupported("metadata", f"only user_id is known, not {sorted(set(req.metadata) - {'user_id'})[0]!r}")
    msgs, tools, choice, think = to_chat(req)
    from .. import params

    d = state.defaults
    with param_errors():
        sampling = params.sampling(1.0 if req.temperature is None else req.temperature,
                                   d.get("top_p", 1.0) if req.top_p is None else req.top_p,
                                   d.get("top_k", 0) if req.top_k is None else req.top_k, d.get("min_p", 0.0))
    eng = state.engine
    c = await _chat(eng, req, msgs, tools, choice, think, max_tokens=req.max_tokens, json_schema=schema,
                    reasoning_effort=effort, stop=stop_list(req.stop_sequences), **sampling)
    stream = Stream(state, request, "msg", "message", False)
    job = await stream.submit(c.prompt_ids, c.generation.decoding)
    shaper = MessageShaper(state.model_id, c.rendered.parser, c.generation.decoding, len(c.prompt_ids))
    if req.stream:
        return await stream.respond(job, shaper)
    resp = await stream.collect(job, shaper)
    if resp.status_code != 200:
        return resp
    body = json.loads(resp.body)      # collect answers in OpenAI's envelope: the Message alone is the body
    return JSONResponse({k: v for k, v in body.items() if k not in ("object", "created", "system_fingerprint")})


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountRequest, request: Request):
    state: ServerState = request.app.state.waste
    state.require_ready()
    state.check_model(req.model)
    if state.chat_reasons:
        from .routes import no_chat

        raise no_chat(state)
    msgs, tools, choice, think = to_chat(req)
    c = await _chat(state.engine, req, msgs, tools, choice, think)
    return {"input_tokens": len(c.prompt_ids)}


def reshape_errors(app) -> None:
    """Wrap the app's exception handlers: on PATHS, their OpenAI-shaped error body becomes Anthropic's."""
    for exc, handler in list(app.exception_handlers.items()):
        async def wrapped(request, e, handler=handler):
            resp = await handler(request, e)
            if not request.url.path.startswith(PATHS) or resp.status_code < 400:
                return resp
            err = json.loads(resp.body).get("error", {})
            body = anthropic_error(APIError(resp.status_code, err.get("message", "error"), err.get("param"),
                                            err.get("code")))
            headers = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "content-type")}
            return JSONResponse(body, status_code=resp.status_code, headers=headers)

        app.exception_handlers[exc] = wrapped
