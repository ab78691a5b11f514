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
from .schemas import (MAX_TOP_LOGPROBS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                      TokenizeRequest, common_checks, max_tokens_of, param_errors, sampling_args, stop_list)
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
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise unsupported("response_format", "structured output needs constrained decoding, which this engine "
                          "does not have (and a completion has no chat template to ask for JSON)")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be 0 to {MAX_TOP_LOGPROBS}", "logprobs")
    want = max_tokens_of(req, "max_tokens")
    sampling = sampling_args(req, state.defaults)
    ids = await _prompt_ids(eng, req.prompt, state.context)
    with param_errors():
        room = params.room(len(ids), None, state.context)
    try:
        gen = eng.generation(ids, room if want is None else min(want, room), SamplingParams(**sampling),
                             stop_list(req.stop), logprobs=req.logprobs)
    except Exception as e:
        raise from_exception(e) from None
    stream = Stream(state, request, "cmpl", "text_completion",
                     bool(req.stream_options and req.stream_options.include_usage))
    job = await stream.submit(ids, gen.decoding)
    tok = eng.tokenizer
    if req.stream:
        return await stream.respond(job, CompletionChunks(stream, tok, req.logprobs))
    return await stream.collect(job, CompletionChunks(stream, tok, req.logprobs))


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
    _response_format(req.response_format, eng, kwargs)
    if req.parallel_tool_calls is False:
        raise unsupported("parallel_tool_calls", "false cannot be enforced without constrained decoding; "
                          "leave it out (the model decides)")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
    want = max_tokens_of(req, "max_completion_tokens", "max_tokens")
    sampling = sampling_args(req, state.defaults)
    stop = stop_list(req.stop)
    try:
        c = await run_in_threadpool(eng.chat, req.messages, tools=req.tools, max_tokens=want, stop=stop,
                                    stream=True, reasoning_effort=req.reasoning_effort,
                                    chat_template_kwargs=kwargs or None, tool_choice=req.tool_choice,
                                    image_policy=state.image_policy, **sampling)
    except Exception as e:
        raise from_exception(e) from None
    c.generation.decoding.logprobs = (req.top_logprobs or 0) if req.logprobs else None
    stream = Stream(state, request, "chatcmpl", "chat.completion",
                     bool(req.stream_options and req.stream_options.include_usage))
    job = await stream.submit(c.prompt_ids, c.generation.decoding)
    shaper = ChatChunks(stream, eng.tokenizer, c.rendered.parser, bool(req.logprobs))
    if req.stream:
        return await stream.respond(job, shaper)
    return await stream.collect(job, shaper)


def no_chat(state: ServerState) -> APIError:
    return APIError(400, "this model has no usable chat format: " + "; ".join(state.chat_reasons)
                    + " (/v1/completions serves it)", "messages", "unsupported_chat_format",
                    extra={"reasons": list(state.chat_reasons)})


def _response_format(rf, engine, kwargs: dict) -> None:
    """text: nothing to do. json_object: handed to a chat template that reads `response_format` (it asks the
    model for JSON); refused where the template has no such setting. json_schema: needs constrained decoding."""
    if rf is None:
        return
    kind = rf.get("type")
    if kind in (None, "text"):
        return
    if kind == "json_schema":
        raise unsupported("response_format", "json_schema needs constrained decoding, which this engine does not "
                          "have yet")
    if kind != "json_object":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                          "response_format")

    fmt = engine.chat_format()
    template = getattr(fmt, "template", None)
    if template is None or "response_format" not in template.variables:
        raise unsupported("response_format", "json_object: this model's chat format has no response_format "
                          "setting, and without constrained decoding the engine cannot enforce JSON")
    kwargs["response_format"] = {"type": "json_object"}


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
