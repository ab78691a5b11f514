"""OpenAI's response shapes: scheduler events -> chat.completion(.chunk) and text_completion bodies (content,
reasoning and tool calls split by the reply's parser; logprobs in each endpoint's shape), and the SSE data line."""
from __future__ import annotations

import json

from ..text.parsers import Content, Reasoning, ToolCall
from .scheduler import Delta, Done

ARG_PIECE = 24             # a tool call's arguments stream in pieces of this many characters


def sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def usage(done: Done, *more: Done) -> dict:
    """A request's usage; with n > 1 choices, the prompt counted once and every choice's completion."""
    completion = done.completion_tokens + sum(d.completion_tokens for d in more)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": completion,
            "total_tokens": done.prompt_tokens + completion}


class ChatChunks:
    """Scheduler events -> chat.completion(.chunk) bodies: the parser splits content, reasoning and tool calls."""

    def __init__(self, stream, tokenizer, parser, logprobs: bool, index: int = 0):
        self.s, self.tok, self.parser, self.want_lp, self.index = stream, tokenizer, parser, logprobs, index
        self.events: list = []
        self.lps: list = []          # logprob entries not yet sent (streaming)

    def _lp_entries(self, lps) -> list[dict]:
        out = []
        for tid, lp, alts in lps:
            out.append({"token": self.tok.decode([tid]), "logprob": lp, "bytes": list(self.tok.token_bytes(tid)),
                        "top_logprobs": [{"token": self.tok.decode([a]), "logprob": v,
                                          "bytes": list(self.tok.token_bytes(a))} for a, v in alts]})
        return out

    def feed(self, ev: Delta) -> list:
        evs = self.parser.feed(ev.text) if ev.text else []
        self.events += evs
        if self.want_lp:
            self.lps += self._lp_entries(ev.logprobs)
        return evs

    def finish(self) -> list:
        evs = self.parser.finish()
        self.events += evs
        return evs

    def _finish_reason(self, done: Done) -> str:
        if done.finish_reason == "stop" and any(isinstance(e, ToolCall) for e in self.events):
            return "tool_calls"
        return done.finish_reason

    # blocking
    def whole(self, done: Done) -> dict:
        self.finish()
        content = "".join(e.text for e in self.events if isinstance(e, Content))
        reasoning = "".join(e.text for e in self.events if isinstance(e, Reasoning))
        calls = [e.as_openai() for e in self.events if isinstance(e, ToolCall)]
        msg = {"role": "assistant", "content": content or (None if calls else "")}
        if reasoning:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        logprobs = {"content": self.lps, "refusal": None} if self.want_lp else None
        return {"choices": [{"index": self.index, "message": msg, "logprobs": logprobs,
                             "finish_reason": self._finish_reason(done)}], "usage": usage(done)}

    # streaming
    def _chunk(self, delta: dict, finish=None, with_lp: bool = False) -> str:
        lp = None
        if self.want_lp and with_lp:
            lp, self.lps = {"content": self.lps, "refusal": None}, []
        body = {**self.s.base(), "object": "chat.completion.chunk",
                "choices": [{"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
        if self.s.include_usage:
            body["usage"] = None
        return sse(body)

    def opening(self) -> str:
        return self._chunk({"role": "assistant", "content": ""})

    def _lines(self, evs) -> list[str]:
        out = []
        for e in evs:
            if isinstance(e, Content):
                out.append(self._chunk({"content": e.text}, with_lp=True))
            elif isinstance(e, Reasoning):
                out.append(self._chunk({"reasoning_content": e.text, "reasoning": e.text}, with_lp=True))
            elif isinstance(e, ToolCall):
                out.append(self._chunk({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                                        "function": {"name": e.name, "arguments": ""}}]}))
                for i in range(0, len(e.arguments), ARG_PIECE):
                    out.append(self._chunk({"tool_calls": [{"index": e.index, "function": {
                        "arguments": e.arguments[i:i + ARG_PIECE]}}]}, with_lp=True))
        return out

    def delta(self, ev: Delta) -> list[str]:
        return self._lines(self.feed(ev))

    def closing(self, done: Done) -> list[str]:
        out = self._lines(self.finish())
        out.append(self._chunk({}, self._finish_reason(done), with_lp=True))
        return out


class CompletionChunks:
    """Scheduler events -> text_completion bodies; logprobs in the legacy shape (tokens, token_logprobs,
    top_logprobs, text_offset)."""

    def __init__(self, stream, tokenizer, logprobs: int | None, index: int = 0):
        self.s, self.tok, self.want_lp, self.index = stream, tokenizer, logprobs, index
        self.text = ""
        self.lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self._offset = 0

    def _logprobs(self, lps) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp, alts in lps:
            piece = self.tok.decode([tid])
            out["tokens"].append(piece)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self.tok.decode([a]): v for a, v in alts})
            out["text_offset"].append(self._offset)
            self._offset += len(piece)
        return out

    def feed(self, ev: Delta):
        self.text += ev.text
        if self.want_lp is not None:
            part = self._logprobs(ev.logprobs)
            for k in self.lp:
                self.lp[k] += part[k]
            return part
        return None

    def whole(self, done: Done) -> dict:
        return {"choices": [{"index": self.index, "text": self.text, "logprobs": self.lp if self.want_lp is not None else None,
                             "finish_reason": done.finish_reason}], "usage": usage(done)}

    def _chunk(self, text: str, finish=None, lp=None) -> str:
        body = {**self.s.base(), "choices": [{"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}]}
        if self.s.include_usage:
            body["usage"] = None
        return sse(body)

    def opening(self) -> str:
        return ": waste\n\n"          # a completion stream has no role chunk: a comment commits the response

    def delta(self, ev: Delta) -> list[str]:
        part = self.feed(ev)
        return [self._chunk(ev.text, lp=part)] if ev.text or part else []

    def closing(self, done: Done) -> list[str]:
        return [self._chunk("", done.finish_reason)]
