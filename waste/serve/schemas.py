"""Request bodies (pydantic, unknown fields accepted and logged) and the checks that turn them into engine
arguments. Every field is either honoured or refused with a 400 naming it: nothing is dropped silently.

Types are strict (JSON's own: `"stream": "yes"` is not true, `max_tokens: true` is not 1, `1.5` is not an int) and
numbers finite (Infinity and NaN, which Python's JSON reader takes, are refused); ranges are waste/params.py's,
the CLI's too."""
from __future__ import annotations

import logging
from typing import Any, Union

from pydantic import BaseModel, ConfigDict

from .. import params
from .errors import APIError, bad_request, unsupported

log = logging.getLogger("waste.serve")

MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
MAX_N = 16                 # choices per request (n)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Generate(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None


class ChatCompletionRequest(_Generate):
    messages: list[Any]
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Generate):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    content: str | None = None          # llama.cpp's name
    messages: list[Any] | None = None   # vLLM's: render the chat prompt and count it
    tools: list[Any] | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# -- checks shared by both generation endpoints ------------------------------------------------------------
def sampling_args(req: _Generate, defaults: dict, vocab: int | None = None) -> dict:
    """temperature / top_p / top_k / min_p / seed and the penalties / logit_bias, range-checked, with the model's
    generation_config defaults."""
    t = defaults.get("temperature", 1.0) if req.temperature is None else req.temperature
    p = defaults.get("top_p", 1.0) if req.top_p is None else req.top_p
    k = defaults.get("top_k", 0) if req.top_k is None else req.top_k
    m = defaults.get("min_p", 0.0) if req.min_p is None else req.min_p
    with param_errors():
        return {**params.sampling(t, p, k, m, req.seed),
                **params.penalties(req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
                                   req.logit_bias, vocab)}


def choice_seeds(req: _Generate, sampling: dict) -> list[dict]:
    """The sampling arguments of each of the request's n choices: choice i draws with seed + i (a seed makes
    every choice reproducible, and no two alike)."""
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be 1 to {MAX_N}", "n")
    n, seed = req.n or 1, sampling.get("seed")
    return [{**sampling, "seed": None if seed is None else (seed + i + 2 ** 63) % 2 ** 64 - 2 ** 63}
            for i in range(n)]


class param_errors:
    """A ParamError from waste/params.py as the API's 400 naming the field."""

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, params.ParamError):
            raise APIError(400, e.message(), e.param, e.code) from None
        return False


def common_checks(req: _Generate) -> None:
    """What both endpoints refuse by name."""
    for name in req.unknown_fields():
        log.warning("ignoring unknown request field %r", name)
    so = req.stream_options
    if so is not None:
        if not req.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if so.continuous_usage_stats:
            raise unsupported("stream_options.continuous_usage_stats", "not implemented; use include_usage")


def stop_list(stop) -> list[str]:
    out = [stop] if isinstance(stop, str) else list(stop or [])
    if len(out) > MAX_STOP:
        raise bad_request(f"stop takes at most {MAX_STOP} strings", "stop")
    return [s for s in out if s]


def max_tokens_of(req: _Generate, *names: str) -> int | None:
    """The first of `names` that is set (max_completion_tokens wins over max_tokens), checked positive."""
    for name in names:
        v = getattr(req, name, None)
        if v is not None:
            with param_errors():
                return params.max_tokens(v, name)
    return None
