"""The limits of the generation and engine parameters, one set of checks for the CLI and the server.

Each check raises ParamError naming the parameter by its canonical name (the server's JSON field); the caller
spells it its own way (the CLI as its flag: `-n`, `--top-p`) through `ParamError.message(name)`."""
from __future__ import annotations

import math

from .errors import WasteError

SEED_RANGE = (-(2 ** 63), 2 ** 63)


class ParamError(WasteError):
    def __init__(self, param: str, rule: str, code: str = "invalid_request"):
        super().__init__(f"{param} {rule}")
        self.param, self.rule, self.code = param, rule, code

    def message(self, name: str | None = None) -> str:
        return f"{name or self.param} {self.rule}"


def _number(v, param: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ParamError(param, f"must be a number, not {type(v).__name__}")
    if not math.isfinite(v):
        raise ParamError(param, "must be a finite number")
    return v


def _integer(v, param: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ParamError(param, f"must be an integer, not {type(v).__name__}")
    return v


def sampling(temperature, top_p, top_k=0, min_p=0.0, seed=None) -> dict:
    """temperature >= 0 (0 is greedy), top_p in (0, 1], top_k -1 / 0 (off) or a count, min_p in [0, 1], a 64-bit
    seed: the SamplingParams fields, as floats and ints."""
    if not _number(temperature, "temperature") >= 0:
        raise ParamError("temperature", "must be 0 or more (0 is greedy)")
    if not 0 < _number(top_p, "top_p") <= 1:
        raise ParamError("top_p", "must be more than 0 and at most 1")
    if _integer(top_k, "top_k") < -1:
        raise ParamError("top_k", "must be -1 or 0 (off) or a positive number of tokens")
    if not 0 <= _number(min_p, "min_p") <= 1:
        raise ParamError("min_p", "must be in [0, 1]")
    if seed is not None and not SEED_RANGE[0] <= _integer(seed, "seed") < SEED_RANGE[1]:
        raise ParamError("seed", "must fit in 64 bits")
    return dict(temperature=float(temperature), top_p=float(top_p), top_k=max(int(top_k), 0), min_p=float(min_p),
                seed=seed)


def penalties(presence=None, frequency=None, repetition=None, logit_bias=None, vocab: int | None = None) -> dict:
    """presence_penalty and frequency_penalty in [-2, 2] (OpenAI's range), repetition_penalty more than 0 (1 is
    off), logit_bias {token id: bias in [-100, 100]} with ids in the vocabulary: SamplingParams' penalty fields."""
    out = {}
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if v is not None:
            if not -2 <= _number(v, name) <= 2:
                raise ParamError(name, "must be in [-2, 2]")
            out[name] = float(v)
    if repetition is not None:
        if not _number(repetition, "repetition_penalty") > 0:
            raise ParamError("repetition_penalty", "must be more than 0 (1 is off)")
        out["repetition_penalty"] = float(repetition)
    if logit_bias:
        bias = []
        for k, v in logit_bias.items():
            tid = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
            if isinstance(tid, bool) or not isinstance(tid, int) or (vocab is not None and not 0 <= tid < vocab):
                raise ParamError("logit_bias", f"key {k!r} is not a token id of this model's vocabulary"
                                               + (f" (0 to {vocab - 1})" if vocab else ""))
            if not -100 <= _number(v, "logit_bias") <= 100:
                raise ParamError("logit_bias", f"value for token {k} must be in [-100, 100]")
            bias.append((tid, float(v)))
        out["logit_bias"] = tuple(sorted(bias))
    return out


def max_tokens(v, param: str = "max_tokens") -> int | None:
    if v is not None and _integer(v, param) < 1:
        raise ParamError(param, "must be a positive integer")
    return v


def engine(context: int, threads: int) -> None:
    """What Engine.load takes from a command line: a context and a reader thread count of at least 1."""
    if _integer(context, "context") < 1:
        raise ParamError("context", "must be a positive number of tokens")
    if _integer(threads, "threads") < 1:
        raise ParamError("threads", "must be 1 or more")


def room(prompt_tokens: int, want: int | None, context: int, strict: bool = False) -> int:
    """Tokens a request may generate. The prompt must leave room for one; `want` past the end of the context is
    cut to it (the server's contract), or refused when `strict` (the CLI: a user who asked for N gets N or an
    error, never fewer in silence)."""
    left = context - prompt_tokens
    if left < 1:
        raise ParamError("prompt", f"is {prompt_tokens} tokens and the context is {context}: nothing is left to "
                                   "generate; shorten it", "context_length_exceeded")
    if want is None:
        return left
    if strict and want > left:
        raise ParamError("max_tokens", f"is {want}, but a {prompt_tokens}-token prompt leaves {left} of the "
                                       f"{context}-token context", "context_length_exceeded")
    return min(want, left)
