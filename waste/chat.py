"""Chat on an Engine: the container's chat format renders the conversation, generation stops on the format's
end of turn, and the reply is parsed into content, reasoning and tool calls as it streams. `waste chat` and
the server share it; `Engine.chat` is the entry point.

The chat format is the container's `chat_template.jinja` (rendered as transformers renders it) or else its
`chat.json` (validated against the vocabulary). A container with neither, or with one that does not load,
raises UnsupportedChatFormat with every reason. What the format cannot express (tools on a chat.json, a
reasoning_effort the template has no knob for, an image...) raises ChatRequestError naming the request field
in `param`: it is refused, never dropped. Two exceptions only, both WasteErrors, so the CLI prints them and the
server maps them to 400s (`code` "unsupported_chat_format" and "invalid_request", with `param`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

from .errors import WasteError
from .runtime.sampling import SamplingParams
from .text.chat_format import ChatFormat, encode_chat_format, load_chat_json
from .text.chat_template import ChatTemplate, chat_segments, prepare_messages, template_arguments_as_dicts
from .text.errors import TextError
from .text.parsers import Content, Markup, OutputParser, Reasoning, ToolCall, collect, markup_for, new_parser
from .text.segments import joined, token_regex

THINKING_SWITCHES = ("enable_thinking", "thinking")  # template variables that turn reasoning on and off
RESERVED_KWARGS = {"messages", "tools", "documents", "add_generation_prompt"}
ROLES = ("system", "user", "assistant", "tool")
_SENTINEL = ("WASTE0SENTINEL0ASSISTANT", "WASTE0SENTINEL0USER")


class ChatRequestError(WasteError):
    """A chat request the container's format cannot express, or a malformed one. `param` names the field."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnsupportedChatFormat(WasteError):
    """The container has no usable chat format; `reasons` says why, one reason per candidate file."""

    code = "unsupported_chat_format"

    def __init__(self, reasons: list[str]):
        super().__init__("this model has no usable chat format: " + "; ".join(reasons)
                         + " (`waste run` generates from plain text)")
        self.reasons = list(reasons)


@dataclass
class RenderedChat:
    """A rendered conversation: the prompt ids and text, and a fresh parser for the reply."""

    ids: list[int]
    text: str
    parser: OutputParser


class TemplateChat:
    """chat_template.jinja (plus additional_chat_templates/tool_use.jinja, used for requests with tools, as
    transformers uses it)."""

    kind = "chat_template"

    def __init__(self, tokenizer, family: str, source: str, tool_source: str | None, eos_ids: set[int]):
        self.tokenizer, self.family = tokenizer, family
        self.template = ChatTemplate(source)
        self.tool_template = ChatTemplate(tool_source) if tool_source else None
        self.markup = markup_for(source)
        self.stop_ids = frozenset(eos_ids | _turn_end_ids(tokenizer, self.template))
        self.description = "chat_template.jinja"

    def render(self, messages, tools=None, tool_choice=None, thinking=None, reasoning_effort=None,
               chat_template_kwargs=None) -> RenderedChat:
        tpl = self.tool_template if tools and self.tool_template else self.template
        names = tpl.variables
        markup = self.markup if tpl is self.template else markup_for(tpl.source)
        if tools and "tools" not in names:
            raise ChatRequestError("tools: this model's chat template does not declare tools", "tools")
        if tools and not markup.call_open:
            raise ChatRequestError("tools: no tool-call parser is known for this chat template's markup", "tools")
        kwargs = dict(chat_template_kwargs or {})
        for key in kwargs:
            if key in RESERVED_KWARGS:
                raise ChatRequestError(f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
            if key not in names:
                raise ChatRequestError(f"chat_template_kwargs: this model's chat template does not read {key!r}",
                                       "chat_template_kwargs")
        switches = [k for k in THINKING_SWITCHES if k in names]
        if reasoning_effort is not None:
            if "reasoning_effort" in names:
                kwargs["reasoning_effort"] = reasoning_effort
            elif "thinking_effort" in names and reasoning_effort != "none":
                kwargs["thinking_effort"] = reasoning_effort  # Kimi K3's name for it
            elif reasoning_effort == "none" and switches and thinking is not True:
                thinking = False
            else:
                raise ChatRequestError(f"reasoning_effort: this model's chat template has no reasoning effort "
                                       f"setting for {reasoning_effort!r}", "reasoning_effort")
        if thinking is not None:
            if not switches:
                raise ChatRequestError("thinking: this model's chat template has no switch for reasoning", "thinking")
            kwargs.update({k: bool(thinking) for k in switches})
        msgs = prepare_messages(messages, template_arguments_as_dicts(tpl.source))
        if "message.thinking" in tpl.source:     # gpt-oss's template reads a reply's reasoning as `thinking`
            msgs = [_as_thinking(m) for m in msgs]
        try:
            segments, control = chat_segments(self.tokenizer, tpl, msgs, tools=tools or None,
                                              add_generation_prompt=True, **kwargs)
        except TextError as e:
            raise ChatRequestError(str(e), _param_of(str(e), tools)) from None
        ids, text = self.tokenizer.encode_segments(segments, control), joined(segments)
        markup = markup if tools else _without_calls(markup)
        opened = bool(markup.think and text.rstrip().endswith(markup.think[0]))
        return RenderedChat(ids, text, new_parser(markup, tools=tools, start_in_reasoning=opened))


class JsonChat:
    """chat.json: plain system / user / assistant turns (waste/text/chat_format.py)."""

    kind = "chat.json"

    def __init__(self, tokenizer, family: str, data: dict, eos_ids: set[int]):
        self.tokenizer, self.family = tokenizer, family
        self.format = ChatFormat(data, vocab_tokens=set(tokenizer.added_tokens))
        stop = {tokenizer.token_to_id(s) for s in self.format.stop}
        self.stop_ids = frozenset(eos_ids | {i for i in stop if i is not None})
        think = self.format.think
        self.markup = Markup("chat.json", think=(think["open"], think["close"]) if think else None)
        self.description = "chat.json"

    def render(self, messages, tools=None, tool_choice=None, thinking=None, reasoning_effort=None,
               chat_template_kwargs=None) -> RenderedChat:
        if tools and tool_choice != "none":
            raise ChatRequestError("tools: this model's chat.json has plain turns only and cannot declare tools",
                                   "tools")
        for key, value in (chat_template_kwargs or {}).items():
            if key in THINKING_SWITCHES and isinstance(value, bool):
                thinking = value if thinking is None else thinking
            elif key == "reasoning_effort":
                reasoning_effort = value if reasoning_effort is None else reasoning_effort
            else:
                raise ChatRequestError(f"chat_template_kwargs: this model's chat.json cannot express {key!r}",
                                       "chat_template_kwargs")
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                raise ChatRequestError(f"messages[{i}]: this model's chat.json cannot express a tool-result turn",
                                       "messages")
        try:
            ids = encode_chat_format(self.tokenizer, self.format, messages, thinking=thinking,
                                     reasoning_effort=reasoning_effort)
            text = joined(self.format.render_segments(messages, thinking=thinking, reasoning_effort=reasoning_effort))
        except TextError as e:
            msg = str(e)
            param = "reasoning_effort" if "effort" in msg else "thinking" if "'thinking'" in msg else "messages"
            raise ChatRequestError(msg, param) from None
        parser = OutputParser(self.markup, start_in_reasoning=self.format.starts_in_reasoning(thinking))
        return RenderedChat(ids, text, parser)


def load_chat_format(container, tokenizer, eos_ids=()) -> TemplateChat | JsonChat:
    """The container's chat format, or UnsupportedChatFormat with the reason for each file it has or lacks."""
    eos = set(eos_ids) | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set())
    reasons = []
    template = container.text_file("chat_template")
    if template is not None and template.is_file():
        named = container.manifest["text"].get("chat_templates") or {}
        tool = container.root / named["tool_use"] if "tool_use" in named else None
        try:
            return TemplateChat(tokenizer, container.family, template.read_text(encoding="utf-8"),
                                tool.read_text(encoding="utf-8") if tool else None, eos)
        except (OSError, TextError) as e:
            reasons.append(f"chat_template.jinja does not load ({e})")
    else:
        reasons.append("no chat_template.jinja")
    chat_json = container.text_file("chat") or container.root / "chat.json"
    if chat_json.is_file():
        try:
            return JsonChat(tokenizer, container.family, load_chat_json(chat_json), eos)
        except TextError as e:
            reasons.append(str(e))
    else:
        note = container.manifest["text"].get("chat_note")
        reasons.append(f"no chat.json ({note.removeprefix('no chat format: ')})" if note else "no chat.json")
    raise UnsupportedChatFormat(reasons)


def chat_support(engine) -> list[str]:
    """[] when the engine can chat, else the reasons it cannot (a server holds them rather than dying)."""
    try:
        engine.chat_format()
    except UnsupportedChatFormat as e:
        return e.reasons
    return []


class ChatCompletion:
    """One reply. Iterate it for Content, Reasoning and ToolCall events as they are decided (waste.text.parsers);
    afterwards (or after stream=False) `content`, `reasoning_content`, `tool_calls`, `finish_reason` ("stop",
    "length", "tool_calls"; "cancelled" when closed or interrupted part way), `usage` and `stats` hold it."""

    def __init__(self, generation, rendered: RenderedChat):
        self.generation, self.rendered = generation, rendered
        self.prompt_ids = rendered.ids
        self.events: list = []
        self.finish_reason: str | None = None
        self._iter = self._run()

    def __iter__(self) -> Iterator:
        return self._iter

    def __next__(self):
        return next(self._iter)

    def close(self) -> None:
        """Stop generating (the partial reply stays readable)."""
        self._iter.close()

    def _run(self):
        parser, done = self.rendered.parser, False
        try:
            for delta in self.generation:
                for event in parser.feed(delta):
                    self.events.append(event)
                    yield event
            for event in parser.finish():
                self.events.append(event)
                yield event
            done = True
        finally:
            if not done:  # closed or interrupted: keep what was held back, settle the generation's counters
                self.events += parser.finish()
                self.generation._iter.close()
                self.finish_reason = "cancelled"
        reason = self.generation.finish_reason
        self.finish_reason = "tool_calls" if reason == "stop" and self.tool_calls else reason

    @property
    def content(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Content))

    @property
    def reasoning_content(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Reasoning))

    @property
    def tool_calls(self) -> list[dict]:
        return [e.as_openai() for e in self.events if isinstance(e, ToolCall)]

    @property
    def stats(self):
        return self.generation.stats

    @property
    def usage(self) -> dict:
        p, c = len(self.prompt_ids), self.generation.stats.generated_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def message(self) -> dict:
        """The reply as an OpenAI assistant message (also what a conversation's history takes back)."""
        m = {"role": "assistant", **collect(self.events)}
        return {k: v for k, v in m.items() if v is not None or k == "content"}


def chat(engine, messages, tools=None, max_tokens=None, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None,
         stop=None, stream=False, reasoning_effort=None, thinking=None, chat_template_kwargs=None,
         tool_choice=None, image_policy=None, json_schema=None, **penalties) -> ChatCompletion:
    """Render, validate and start one reply (see Engine.chat). Every refusal is raised here, before a token
    is generated. max_tokens: None, or more than the context has left, means up to the end of the context.
    json_schema: the reply is JSON matching it ({}: any JSON object); tool_choice "required" or
    {"type": "function", "function": {"name": ...}}: the reply is a call in the model's tool-call markup whose
    arguments match the tool's schema (waste/text/grammar.py). penalties: SamplingParams' penalty fields.
    image_policy: how image URLs are fetched (waste.images.sources.FetchPolicy; None: its defaults)."""
    fmt = engine.chat_format()
    images: list = []
    msgs = normalise_messages(messages, images)
    vision = getattr(engine, "vision", None)
    if images:
        if vision is None or not vision.available:
            why = vision.why_not() if vision is not None else "this engine takes text only"
            raise ChatRequestError(f"{images[0][0]}: {why}; send text parts only", "messages")
        try:
            images = vision.load(images, image_policy)
        except WasteError as e:
            raise ChatRequestError(str(e), "messages") from None
    tools = _check_tools(tools)
    choice = _check_tool_choice(tool_choice, tools)
    if choice == "none":
        tools = None  # the caller forbade calls: none are declared, none are parsed
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ChatRequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    if thinking is not None and not isinstance(thinking, bool):
        raise ChatRequestError("thinking must be true or false", "thinking")
    if reasoning_effort is not None and not isinstance(reasoning_effort, str):
        raise ChatRequestError("reasoning_effort must be a string", "reasoning_effort")
    rendered = fmt.render(msgs, tools=tools, tool_choice=choice, thinking=thinking, reasoning_effort=reasoning_effort,
                          chat_template_kwargs=chat_template_kwargs)
    rows = None
    if images:
        try:
            ids, rows = vision.expand(rendered.ids, images)
        except WasteError as e:
            raise ChatRequestError(f"messages: {e}", "messages") from None
        rendered = dataclasses.replace(rendered, ids=ids)
    context = context_length(engine)
    room = context - len(rendered.ids)
    if room < 1:
        raise ChatRequestError(f"the conversation is {len(rendered.ids)} tokens and the context is {context}: "
                               "shorten it (or load with a larger context)", "messages")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ChatRequestError("max_tokens must be a positive integer", "max_tokens")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise ChatRequestError("stop must be a list of strings", "stop")
    n = room if max_tokens is None else min(max_tokens, room)
    sampling = SamplingParams(temperature, top_p, top_k, min_p, seed, **penalties)
    grammar, param = _grammar(engine, rendered, tools, choice, json_schema)
    generation = engine.generation(rendered.ids, n, sampling, stop or [], fmt.stop_ids,
                                   **({"images": rows} if rows is not None else {}))
    if grammar is not None:
        try:
            generation.decoding.constraint = engine.constraint(grammar, generation.decoding.stop_ids, param)
        except WasteError as e:
            raise ChatRequestError(str(e), getattr(e, "param", None) or param) from None
    completion = ChatCompletion(generation, rendered)
    if not stream:
        for _ in completion:
            pass
    return completion


def context_length(engine) -> int:
    """Tokens a conversation may reach: the context the memory plan reserved, within the model's positions."""
    limits = [engine.plan.context] if getattr(engine, "plan", None) is not None else []
    if engine.container.config.get("max_position_embeddings"):
        limits.append(int(engine.container.config["max_position_embeddings"]))
    return min(limits) if limits else 4096


def normalise_messages(messages, images: list | None = None) -> list[dict]:
    """OpenAI messages -> what the renderers take: text parts joined, `developer` read as `system`; unknown roles
    refused by name. Image parts are refused too unless `images` is a list: then each is appended to it as
    (where, part) and the message keeps its parts in order, text as {"type": "text"}, images as {"type": "image"}
    (what chat templates and chat.json write their image markup for)."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatRequestError(f"messages[{i}] must be an object with a 'role'", "messages")
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        if m["role"] not in ROLES:
            raise ChatRequestError(f"messages[{i}]: unknown role {m['role']!r} (one of {', '.join(ROLES)})", "messages")
        content = m.get("content")
        if isinstance(content, list):
            texts, parts = [], []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in ("image", "image_url", "input_image"):
                    if images is None:
                        raise ChatRequestError(f"messages[{i}]: images are not supported here", "messages")
                    images.append((f"messages[{i}].content[{j}]", part))
                    parts.append({"type": "image"})
                else:
                    raise ChatRequestError(f"messages[{i}]: a {kind!r} content part is not supported", "messages")
            m["content"] = parts if len(parts) > len(texts) else "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ChatRequestError(f"messages[{i}].content must be a string, null or a list of parts", "messages")
        if m.get("reasoning") is not None and m.get("reasoning_content") is None:
            m["reasoning_content"] = m["reasoning"]  # read both names, as templates read one or the other
        out.append(m)
    return out


def _check_tools(tools):
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    return tools


def _check_tool_choice(choice, tools):
    if choice is None or choice == "auto":
        return "auto"
    if choice == "none":
        return "none"
    if choice == "required" or isinstance(choice, dict):
        if not tools:
            raise ChatRequestError("tool_choice: forcing a call needs tools", "tool_choice")
        if choice == "required":
            return choice
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatRequestError("tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if fn["name"] not in {t["function"]["name"] for t in tools}:
            raise ChatRequestError(f"tool_choice names {fn['name']!r}, which is not among the request's tools",
                                   "tool_choice")
        return ("function", fn["name"])
    raise ChatRequestError(f"tool_choice must be 'auto', 'none', 'required' or a function, not {choice!r}",
                           "tool_choice")


def _grammar(engine, rendered, tools, choice, json_schema) -> tuple[str | None, str]:
    """The grammar a reply must follow (None: free), and the request field it comes from."""
    from .text.grammar import after_reasoning, json_grammar, tool_call_grammar

    forced = choice == "required" or isinstance(choice, tuple)
    if forced and json_schema is not None:
        raise ChatRequestError("tool_choice: a forced tool call and a response_format schema cannot both hold",
                               "tool_choice")
    try:
        if forced:
            name = choice[1] if isinstance(choice, tuple) else None
            grammar, param = tool_call_grammar(rendered.parser.markup, tools, engine.tokenizer, name), "tool_choice"
        elif json_schema is not None:
            grammar, param = json_grammar(json_schema or None), "response_format"
        else:
            return None, ""
        p = rendered.parser
        if p.start_in_reasoning and p.markup.think:     # the prompt opened the reasoning: it comes first, free
            grammar = after_reasoning(grammar, p.markup.think[1], engine.tokenizer, param)
    except WasteError as e:
        raise ChatRequestError(str(e), getattr(e, "param", None)) from None
    return grammar, param


def _param_of(message: str, tools) -> str:
    low = message.lower()
    if "effort" in low:
        return "reasoning_effort"
    if tools and "tool" in low:
        return "tools"
    return "messages"


def _without_calls(markup: Markup) -> Markup:
    """No tools were declared: call markup stays text."""
    return dataclasses.replace(markup, call_open=(), call_close="", parse_call=None)


def _as_thinking(m: dict) -> dict:
    """An assistant message's reasoning_content as `thinking` (gpt-oss's template). Beside a tool call that template
    takes reasoning or content, not both (it raises): the reasoning that led to the call is kept, the preamble the
    user has already seen is left out of the prompt."""
    if m.get("role") != "assistant" or not m.get("reasoning_content") or "thinking" in m:
        return m
    m = {**m, "thinking": m["reasoning_content"]}
    if m.get("tool_calls") and m.get("content"):
        m["content"] = ""
    return m


def _turn_end_ids(tokenizer, template: ChatTemplate) -> set[int]:
    """The control token that ends an assistant turn in this template: the last one between a past reply
    and the end of the rendering, else (a format whose turns end where the next begins) the first one before
    the next user turn. Found by rendering, not guessed from the family."""
    a, u = _SENTINEL
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": a}, {"role": "user", "content": u}]
    control = tokenizer.control_tokens(template.literal_text)
    rx = token_regex(t for t in control if t in tokenizer.added_tokens)
    if rx is None:
        return set()

    def markup_after_reply(conversation, until=None) -> str:
        try:
            text = joined(chat_segments(tokenizer, template, conversation)[0])
        except TextError:
            return ""
        tail = text.split(a, 1)[1] if a in text else ""
        return tail.split(until, 1)[0] if until else tail

    found = rx.findall(markup_after_reply(msgs[:2]))
    token = found[-1] if found else next(iter(rx.findall(markup_after_reply(msgs, u))), None)
    tid = tokenizer.token_to_id(token) if token else None
    return {tid} if tid is not None else set()

