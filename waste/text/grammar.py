"""Constrained decoding: a grammar (a JSON schema, any JSON object, or a forced tool call in the model's own markup)
turned into a per-token mask by llguidance (docs/LEARNED.md §14 measured it against xgrammar on this machine).

A `Constraint` follows one sequence: `allows(token)` asks whether the grammar accepts a token next, `mask(logits)`
sets every token it does not accept to -inf, `advance(token)` commits one. The sampler draws from the raw logits
first and masks only when the grammar refuses that draw, so where the grammar allows the unconstrained choice the
output is the unconstrained output, bit for bit (and the mask, the costly part, is computed only on a refusal).

JSON is compact: no free whitespace between tokens (llguidance's default, any run of whitespace, lets a greedy
random model spend the whole budget on blanks), and json.dumps' own separators `", "` and `": "`, the form the
chat templates' `tojson` writes tool calls in.
"""
from __future__ import annotations

import json

import torch

from ..errors import WasteError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(WasteError):
    """A schema or tool set that cannot be turned into a grammar; `param` names the request field."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _llg():
    try:
        import llguidance
    except ImportError:     # a dependency: only a broken install lacks it
        raise WasteError("constrained decoding needs the llguidance package: pip install llguidance") from None
    return llguidance


def token_table(tokenizer, n_vocab: int, stop_ids) -> object:
    """llguidance's view of the vocabulary (built once per engine and stop set: it costs ~0.1-1 s). A tokenizer.json
    is handed over whole (llguidance reads its byte-level or byte-fallback pieces); a tiktoken vocabulary as the
    bytes of each token. `stop_ids` are what ends a sequence: the grammar allows them once it is complete."""
    llg = _llg()
    eos = sorted(stop_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    if not eos:
        raise WasteError("constrained decoding needs an end-of-sequence token, and this model declares none")
    full = getattr(tokenizer, "_full", None)
    if full is not None:
        return llg.LLTokenizer(full.to_str(), n_vocab=n_vocab, eos_token=eos)
    from llguidance._tokenizer import TokenizerWrapper

    class _Vocab:      # TokenizerWrapper's duck type: eos / bos ids, each token's bytes, an encoder
        eos_token_id, bos_token_id = eos[0], tokenizer.bos_id
        tokens = [tokenizer.token_bytes(i) for i in range(n_vocab)]
        special_token_ids = [i for i in range(n_vocab) if tokenizer.id_to_token(i) in tokenizer.special_tokens]

        def __call__(self, s):
            return tokenizer.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)

    return llg.LLTokenizer(TokenizerWrapper(_Vocab()), n_vocab=n_vocab, eos_token=eos)


# -- grammars -------------------------------------------------------------------------------------------------
def json_grammar(schema: dict | None) -> str:
    """A JSON value matching `schema` (None: any JSON object), compact; in lark, so that it composes."""
    if schema is not None and not isinstance(schema, dict):
        raise GrammarError("the JSON schema must be an object", "response_format")
    schema = schema if schema else {"type": "object"}
    grammar = f"start: body\nbody: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"
    error = _llg().LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"the JSON schema cannot be used: {_why(error)}", "response_format")
    return grammar


def _why(error: str) -> str:
    """llguidance's error without the source excerpt it appends (which repeats the whole schema)."""
    why = " ".join(line.strip() for line in error.split("\n   1 | ")[0].splitlines() if line.strip())
    return why.split("failed to compile JSON schema: ")[-1]


def after_reasoning(grammar: str, close: str, tokenizer, param: str) -> str:
    """`grammar` once the reasoning the prompt opened is closed: free text up to the close marker (a token of the
    vocabulary, or its text), a few blanks, then the grammar."""
    if not close:
        raise GrammarError(f"{param}: this model's reasoning has no close marker to end it", param)
    rules = grammar.replace("start:", "answer:", 1)
    marker = _literal(tokenizer, close)
    blanks = r"/[ \t\n]{0,4}/"
    if marker.startswith("<["):     # a token: text cannot spell it, so the free text ends where it comes
        return f"start: REASONING {marker} {blanks} answer\nREASONING: /(?s:.*)/\n{rules}"
    # text: a lazy lexeme that ends with (and includes) the marker's text
    return f"start: reasoning {blanks} answer\nreasoning[stop={marker}]: /(?s:.*)/\n{rules}"


def _literal(tokenizer, text: str) -> str:
    """A marker in lark: the token itself where the vocabulary has it as one token (the model writes it so), else
    its text."""
    tid = tokenizer.token_to_id(text)
    if tid is not None and text in tokenizer.added_tokens:
        return f"<[{tid}]>"
    return json.dumps(text)


def _params(tool: dict) -> dict:
    p = tool["function"].get("parameters")
    return p if isinstance(p, dict) and p else {"type": "object"}


def tool_call_grammar(markup, tools: list[dict], tokenizer, name: str | None = None) -> str:
    """One or more calls (`name`: exactly one call of that function) in the markup of the model's tool-call parser,
    each call's arguments matching its tool's `parameters` schema. Markups whose arguments are not one JSON object
    (GLM's key/value pairs, K3's XTML elements) are refused."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise GrammarError(f"tool_choice names {name!r}, which is not among the request's tools", "tool_choice")
    lines = []
    if markup.name == "hermes":
        bodies = []
        for i, t in enumerate(chosen):
            schema = {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "arguments": _params(t)},
                      "required": ["name", "arguments"], "additionalProperties": False}
            lines.append(f"body{i}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
            bodies.append(f"body{i}")
        lines.append("body: " + " | ".join(bodies))
        open_, close = _literal(tokenizer, markup.call_open[0]), _literal(tokenizer, markup.call_close)
        lines.append(f'call: {open_} "\\n" body "\\n" {close}')
        lines.insert(0, "start: call" if name else 'start: call ("\\n" call)*')
    elif markup.name == "kimi_k2":
        calls = []
        for i, t in enumerate(chosen):
            fn = t["function"]["name"]
            lines.append(f"args{i}: %json {json.dumps({**_params(t), 'x-guidance': JSON_OPTIONS})}")
            lines.append(f'call{i}: {_literal(tokenizer, "<|tool_call_begin|>")} "functions.{_lark_text(fn)}:0" '
                         f'{_literal(tokenizer, "<|tool_call_argument_begin|>")} args{i} '
                         f'{_literal(tokenizer, "<|tool_call_end|>")}')
            calls.append(f"call{i}")
        lines.insert(0, f'start: {_literal(tokenizer, "<|tool_calls_section_begin|>")} ({" | ".join(calls)}) '
                        f'{_literal(tokenizer, "<|tool_calls_section_end|>")}')
    else:
        raise GrammarError(f"tool_choice: forcing a call is not implemented for this model's tool-call markup "
                           f"({markup.name}); use 'auto'", "tool_choice")
    return "\n".join(lines)


def _lark_text(s: str) -> str:
    return json.dumps(s)[1:-1]


# -- one sequence ----------------------------------------------------------------------------------------------
class Constraint:
    """One sequence's grammar state over a token table (token_table)."""

    def __init__(self, table, grammar: str, param: str = "response_format"):
        llg = _llg()
        self.n_vocab, self.eos = table.vocab_size, frozenset(table.eos_tokens)
        self.matcher = llg.LLMatcher(table, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"{param}: a schema cannot be used: {_why(self.matcher.get_error())}", param)
        self._bits = torch.zeros((self.n_vocab + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allows(self, token: int) -> bool:
        if token in self.eos:           # validate_tokens never passes an end id: it is allowed where the grammar is done
            return self.matcher.is_accepting()
        return 0 <= token < self.n_vocab and self.matcher.validate_tokens([token]) == 1

    def allowed(self) -> torch.Tensor:
        """A bool [n_vocab] of the tokens the grammar accepts next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        return ((self._bits[:, None] >> self._shifts) & 1).flatten()[:self.n_vocab].bool()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits with every token the grammar refuses (and any past its vocabulary) at -inf; a new tensor."""
        out = torch.full_like(logits, float("-inf"))
        n = min(self.n_vocab, logits.shape[-1])
        ok = self.allowed()[:n]
        out[..., :n] = torch.where(ok, logits[..., :n], out[..., :n])
        return out

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise WasteError(f"the grammar refused token {token} after allowing it: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more."""
        return self.matcher.is_stopped()
