"""The endpoints: operations (/health, /metrics, /v1/models), tokens (/tokenize, /detokenize) and generation
(/v1/completions, /v1/chat/completions). A handler validates and renders the request whole (every refusal a 400
before any 200), queues its job through a Stream and hands the stream a response shaper."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from .. import params
from ..runtime.sampling import SamplingParams
from .errors import APIError, bad_request, from_exception, unsupported
from .metrics import MEDIA_TYPE
from ..text.grammar import json_grammar
from .schemas import (MAX_TOP_LOGPROBS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                      TokenizeRequest, choice_seeds, common_checks, max_tokens_of, param_errors, sampling_args,
                      stop_list)
from .shapes import ChatChunks, CompletionChunks
from .state import RETRY_AFTER, ServerState
from .stream import Stream

CHARS_PER_TOKEN = 8        # a long prompt's first (context + 1) * 8 characters are tokenized first (_encode)

router = APIRouter()


def server_state(request: Request) -> ServerState:
    return request.app.state.waste


State = Depends(server_state)


# -- operations ------------------------------------------------------------------------------------------
@router.get("/health")
async def health(state: ServerState = State):
    if state.error is not None:
        return APIError(503, f"the model failed to load: {state.error}", None, "model_load_failed").response()
    if not state.ready:
        return APIError(503, "the model is loading", None, "model_loading",
                        headers={"Retry-After": RETRY_AFTER}).response()
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(state: ServerState = State):
    return Response(state.metrics.render(), media_type=MEDIA_TYPE)


def model_card(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "waste",
            "max_model_len": state.context}


@router.get("/v1/models")
async def models(state: ServerState = State):
    state.require_ready()
    return {"object": "list", "data": [model_card(state)]}


@router.get("/v1/models/{name:path}")
async def model(name: str, state: ServerState = State):
    state.require_ready()
    state.check_model(name)
    return model_card(state)


# -- tokens ----------------------------------------------------------------------------------------------
@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: ServerState = State):
    state.require_ready()
    state.check_model(req.model)
    eng = state.engine
    if req.messages is not None:
        if state.chat_reasons:
            raise no_chat(state)
        if not req.add_generation_prompt:
            raise unsupported("add_generation_prompt", "only true (the prompt a reply would continue)")
        try:
            c = await run_in_threadpool(eng.chat, req.messages, tools=req.tools, stream=True,
                                        chat_template_kwargs=req.chat_template_kwargs, image_policy=state.image_policy)
        except Exception as e:
            raise from_exception(e) from None
        ids = c.prompt_ids
    else:
        text = req.prompt if req.prompt is not None else req.content
        if text is None:
            raise bad_request("give prompt (text) or messages", "prompt")
        ids = await _encode(eng, text, state.context)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.context}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: ServerState = State):
    state.require_ready()
    state.check_model(req.model)
    _check_ids(req.tokens, state.engine.tokenizer.vocab_size, "tokens")
    text = state.engine.tokenizer.decode(req.tokens)
    return {"prompt": text, "content": text}


# -- generation ------------------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, state: ServerState = State):
    state.require_open()
    state.check_model(req.model)
    common_checks(req)
    eng = state.engine
    if req.echo:
        raise unsupported("echo", "not supported yet")
    if req.suffix:
        raise unsupported("suffix", "fill-in-the-middle is not supported")
    if req.best_of not in (None, 1):
        raise unsupported("best_of", "only 1 is supported")
    schema = json_schema_of(req.response_format)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be 0 to {MAX_TOP_LOGPROBS}", "logprobs")
    want = max_tokens_of(req, "max_tokens")
    choices = choice_seeds(req, sampling_args(req, state.defaults, eng.tokenizer.vocab_size))
    ids = await _prompt_ids(eng, req.prompt, state.context)
    with param_errors():
        room = params.room(len(ids), None, state.context)
    try:
        grammar = None if schema is None else json_grammar(schema or None)
        gens = [eng.generation(ids, room if want is None else min(want, room), SamplingParams(**sampling),
                               stop_list(req.stop), logprobs=req.logprobs, grammar=grammar) for sampling in choices]
    except Exception as e:
        raise from_exception(e) from None
    stream = Stream(state, request, "cmpl", "text_completion",
                     bool(req.stream_options and req.stream_options.include_usage))
    job = await stream.submit(ids, *(g.decoding for g in gens))
    tok = eng.tokenizer
    shapers = [CompletionChunks(stream, tok, req.logprobs, i) for i in range(len(gens))]
    if req.stream:
        return await stream.respond(job, *shapers)
    return await stream.collect(job, *shapers)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request,
                           state: ServerState = State):
    state.require_open()
    state.check_model(req.model)
    common_checks(req)
    if state.chat_reasons:
        raise no_chat(state)
    eng = state.engine
    kwargs = dict(req.chat_template_kwargs or {})
    schema = _response_format(req.response_format, eng, kwargs)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
    want = max_tokens_of(req, "max_completion_tokens", "max_tokens")
    choices = choice_seeds(req, sampling_args(req, state.defaults, eng.tokenizer.vocab_size))
    stop = stop_list(req.stop)
    tool_choice = req.tool_choice
    if req.parallel_tool_calls is False and tool_choice == "required" and len(req.tools or []) == 1:
        tool_choice = {"type": "function", "function": {"name": req.tools[0]["function"]["name"]}}
    elif req.parallel_tool_calls is False and not isinstance(tool_choice, dict) and tool_choice != "none":
        raise unsupported("parallel_tool_calls", "false is enforced only with a forced call of one function "
                          "(tool_choice naming it)")
    try:
        cs = [await run_in_threadpool(eng.chat, req.messages, tools=req.tools, max_tokens=want, stop=stop,
                                      stream=True, reasoning_effort=req.reasoning_effort,
                                      chat_template_kwargs=kwargs or None, tool_choice=tool_choice,
                                      image_policy=state.image_policy, json_schema=schema, **sampling)
              for sampling in choices]
    except Exception as e:
        raise from_exception(e) from None
    for c in cs:
        c.generation.decoding.logprobs = (req.top_logprobs or 0) if req.logprobs else None
    stream = Stream(state, request, "chatcmpl", "chat.completion",
                     bool(req.stream_options and req.stream_options.include_usage))
    job = await stream.submit(cs[0].prompt_ids, *(c.generation.decoding for c in cs))
    shapers = [ChatChunks(stream, eng.tokenizer, c.rendered.parser, bool(req.logprobs), i) for i, c in enumerate(cs)]
    if req.stream:
        return await stream.respond(job, *shapers)
    return await stream.collect(job, *shapers)


def no_chat(state: ServerState) -> APIError:
    return APIError(400, "this model has no usable chat format: " + "; ".join(state.chat_reasons)
                    + " (/v1/completions serves it)", "messages", "unsupported_chat_format",
                    extra={"reasons": list(state.chat_reasons)})


def json_schema_of(rf) -> dict | None:
    """response_format -> the JSON schema the output must match ({}: any JSON object), or None (free text).
    json_schema takes OpenAI's {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; both JSON
    kinds are enforced by the grammar (waste/text/grammar.py) on every model."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {}
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                          "response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name", ""), str):
        raise bad_request("response_format.json_schema must be an object with a name and a schema",
                          "response_format.json_schema")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                          "response_format.json_schema.schema")
    return schema or {"type": "object"}


def _response_format(rf, engine, kwargs: dict) -> dict | None:
    """The schema the reply must match (None: free). A chat template that reads `response_format` is also handed
    it, so that it can ask the model for JSON in its own words."""
    schema = json_schema_of(rf)
    if schema is not None:
        template = getattr(engine.chat_format(), "template", None)
        if template is not None and "response_format" in template.variables:
            kwargs["response_format"] = dict(rf)
    return schema


async def _encode(engine, text: str, context: int | None = None) -> list[int]:
    """A text's token ids, tokenized on a worker thread. With a context: a text much longer than the context can
    hold is refused once a prefix of (context + 1) * CHARS_PER_TOKEN characters, cut at a space, is over it by a
    margin (the tokens of a prefix cut at a space are the whole text's but for the last word or two)."""
    cut = None if context is None else (context + 1) * CHARS_PER_TOKEN
    if cut is not None and len(text) > cut:
        space = text.rfind(" ", cut // 2, cut)
        head = text[:space if space > 0 else cut]
        n = len(await run_in_threadpool(engine.tokenizer.encode, head, True))
        if n > context + 16:
            raise APIError(400, f"the prompt is more than {n - 16} tokens and the context is {context}", "prompt",
                           "context_length_exceeded")
    return await run_in_threadpool(engine.tokenizer.encode, text, True)


async def _prompt_ids(engine, prompt, context: int | None = None) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await _encode(engine, prompt, context)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        _check_ids(prompt, engine.tokenizer.vocab_size, "prompt")
        ids = list(prompt)
    else:
        raise unsupported("prompt", "one prompt per request (a string or a list of token ids); send a batch as "
                          "several requests")
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    return ids


def _check_ids(ids, vocab: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})", param)
