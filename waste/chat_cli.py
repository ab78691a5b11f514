"""`waste chat [MODEL]`: an interactive terminal chat over Engine.chat (waste/chat.py).

The conversation is kept and sent whole each turn. Replies stream as they are decided; reasoning is shown
dimmed on a terminal (hidden with --hide-reasoning); one stats line follows each reply on stderr, as after
`waste run`. Ctrl-C while a reply streams stops that reply and keeps the session: the partial reply stays in
the conversation (one stopped before its first word is dropped together with its question). Ctrl-C at the
prompt clears the line; /exit or Ctrl-D leaves.
"""
from __future__ import annotations

import os
import sys

HELP = '''commands:
  /system TEXT   set the system prompt (it survives /reset); /system alone removes it
  /reset         start the conversation over
  /result TEXT   answer the model's next unanswered tool call with TEXT (with --tools FILE)
  /image PATH    attach an image file to your next message (a model with a vision tower)
  /exit, /quit   leave (Ctrl-D on an empty prompt too)
  /help          this text
input:
  a line ending in \\ continues on the next line;
  a line starting with """ opens a block that ends at the next line ending with """;
  //text sends /text as a message.
Ctrl-C stops the reply being written (the partial reply stays in the conversation).'''

PROMPT, MORE = ">>> ", "... "
DIM, RESET = "\x1b[2m", "\x1b[0m"
# model text is shown, never obeyed: C0/C1 controls (an escape sequence...) become visible symbols
_VISIBLE = {c: 0x2400 + c for c in range(32) if chr(c) not in "\n\t"}
_VISIBLE.update({0x7F: 0x2421, **{c: 0xFFFD for c in range(0x80, 0xA0)}})


def visible(text: str) -> str:
    return text.translate(_VISIBLE)


class Session:
    """One conversation: history, system prompt, and the terminal it talks to."""

    def __init__(self, engine, args, out=None, err=None):
        self.engine, self.args = engine, args
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.system: str | None = args.system
        self.history: list[dict] = []
        self.images: list[dict] = []          # /image parts waiting for the next message
        self.tools = read_tools(args.tools) if getattr(args, "tools", None) else None
        color = not os.environ.get("NO_COLOR")
        self.dim_out = color and self.out.isatty()
        self.dim_err = color and self.err.isatty()

    # input ---------------------------------------------------------------------------------------
    def read(self) -> str:
        """One message: continued lines (trailing backslash) or a triple-quote block joined by newlines."""
        line = input(PROMPT)
        if line.lstrip().startswith('"""'):
            rest = line.lstrip()[3:]
            if rest.rstrip().endswith('"""'):
                return rest.rstrip()[:-3]
            lines = [rest] if rest else []
            while True:
                line = input(MORE)
                if line.rstrip().endswith('"""'):
                    last = line.rstrip()[:-3]
                    return "\n".join(lines + ([last] if last else []))
                lines.append(line)
        lines = []
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = input(MORE)
        return "\n".join(lines + [line])

    # commands ------------------------------------------------------------------------------------
    def command(self, text: str) -> bool:
        """Run a /command; False means leave."""
        name, _, arg = text.strip().partition(" ")
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/reset":
            self.history.clear()
            self.note("conversation cleared" + (" (the system prompt stays)" if self.system else ""))
        elif name == "/system":
            self.system = arg.strip() or None
            self.note(f"system prompt set ({len(self.system)} characters)" if self.system else "system prompt removed")
        elif name == "/result":
            self.result(arg)
        elif name == "/image":
            self.attach(arg.strip())
        elif name in ("/help", "/?"):
            self.note(HELP)
        else:
            self.note(f"unknown command {name} (/help lists them; //text sends /text)")
        return True

    def note(self, text: str) -> None:
        self.err.write(self._dim(text, self.dim_err) + "\n")
        self.err.flush()

    def _dim(self, text: str, on: bool) -> str:
        return f"{DIM}{text}{RESET}" if on and text else text

    # one turn ------------------------------------------------------------------------------------
    def attach(self, path: str) -> None:
        from .errors import WasteError
        from .images.sources import file_part

        if not path:
            self.note("usage: /image PATH")
            return
        if not self.engine.vision.available:
            self.note(f"refused: {self.engine.vision.why_not()}")
            return
        try:
            part = file_part(path)
        except WasteError as e:
            self.note(f"refused: {e}")
            return
        self.images.append({"type": "image", "image": part["image"]})
        w, h = part["size"]
        self.note(f"image attached ({w}x{h}); it goes with your next message")

    def turn(self, text: str) -> None:
        parts, self.images = self.images, []
        content = [*parts, {"type": "text", "text": text}] if parts else text
        self.history.append({"role": "user", "content": content})
        self.reply()

    def pending_calls(self) -> list[dict]:
        """The last reply's tool calls that no tool message answers yet."""
        for i in range(len(self.history) - 1, -1, -1):
            m = self.history[i]
            if m["role"] == "user":
                return []
            if m["role"] == "assistant":
                answered = {x.get("tool_call_id") for x in self.history[i + 1:] if x["role"] == "tool"}
                return [c for c in m.get("tool_calls") or [] if c["id"] not in answered]
        return []

    def result(self, text: str) -> None:
        """/result TEXT: the next pending call's result; the model replies once every call has one."""
        calls = self.pending_calls()
        if not calls:
            self.note("no tool call is waiting for a result")
            return
        self.history.append({"role": "tool", "tool_call_id": calls[0]["id"], "name": calls[0]["function"]["name"],
                             "content": text})
        if len(calls) > 1:
            self.note(f"{len(calls) - 1} more tool call(s) wait for /result")
        else:
            self.reply()

    def reply(self) -> None:
        """One reply of the model to the conversation as it stands (its last message: a user turn or a result)."""
        from .chat import ChatRequestError

        a = self.args
        convo = ([{"role": "system", "content": self.system}] if self.system else []) + self.history
        completion, shown, interrupted = None, "", False
        try:
            try:
                completion = self.engine.chat(
                    convo, max_tokens=a.n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, seed=a.seed,
                    stop=a.stop or None, stream=True, thinking=False if a.no_thinking else None,
                    reasoning_effort=a.reasoning_effort, tools=self.tools)
            except ChatRequestError as e:
                self.history.pop()
                self.note(f"refused: {e}" + (" (/reset starts over)" if e.param == "messages" else ""))
                return
            for event in completion:
                shown = self.show(event, shown)
        except KeyboardInterrupt:
            interrupted = True
            if completion is not None:
                completion.close()
        if shown == "reasoning" and self.dim_out:
            self.out.write(RESET)
        self.out.write("\n")
        self.out.flush()
        reply = completion.message() if completion is not None else {}
        if interrupted:
            self.note("[interrupted]")
        if reply.get("content") or reply.get("reasoning_content") or reply.get("tool_calls"):
            self.history.append(reply)
        else:
            self.history.pop()  # nothing came back: forget the question too
        if completion is not None:
            self.note(completion.stats.line())
        for call in self.pending_calls():
            self.note(f"the model calls {call['function']['name']}: answer with /result TEXT")

    def show(self, event, shown: str) -> str:
        """Write one event; returns what kind of text the screen ends with."""
        from .text.parsers import Content, Reasoning, ToolCall

        out = self.out
        if isinstance(event, Reasoning):
            if self.args.hide_reasoning:
                return shown
            if shown != "reasoning" and self.dim_out:
                out.write(DIM)
            out.write(visible(event.text))
            shown = "reasoning"
        elif isinstance(event, (Content, ToolCall)):
            if shown == "reasoning":
                out.write((RESET if self.dim_out else "") + "\n\n")
            if isinstance(event, Content):
                out.write(visible(event.text))
            else:
                out.write(visible(f"[tool call {event.name}({event.arguments})]"))
            shown = "content"
        out.flush()
        return shown

    # the loop ------------------------------------------------------------------------------------
    def loop(self) -> None:
        while True:
            try:
                text = self.read()
            except EOFError:
                self.out.write("\n")
                return
            except KeyboardInterrupt:
                self.out.write("\n")
                continue
            if not text.strip():
                continue
            if text.startswith("/") and not text.startswith("//") and "\n" not in text:
                if not self.command(text):
                    return
                continue
            self.turn(text[1:] if text.startswith("//") else text)


def read_tools(path: str) -> list:
    """--tools FILE: a JSON list of OpenAI tool declarations ({"type": "function", "function": {...}})."""
    import json

    from .errors import WasteError

    try:
        tools = json.loads(open(path, encoding="utf-8").read())
    except OSError as e:
        raise WasteError(f"cannot read --tools {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise WasteError(f"--tools {path} is not valid JSON: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" and
                                              isinstance(t.get("function"), dict) and t["function"].get("name")
                                              for t in tools):
        raise WasteError(f"--tools {path} must hold a JSON list of tools as OpenAI declares them: "
                         '[{"type": "function", "function": {"name": ..., "parameters": {...}}}, ...]')
    return tools


def cmd_chat(a, load) -> None:
    """The `waste chat` verb; `load(args, model)` opens the engine as `waste run` does."""
    eng = load(a, a.model)
    try:
        fmt = eng.chat_format()  # refuses here, with the reasons, before the first prompt
        if eng.plan is not None and eng.plan.warning:
            print(f"waste: warning: {eng.plan.warning}", file=sys.stderr)
        if sys.stdin.isatty():
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
        note = eng.container.manifest["text"].get("chat_note")
        session = Session(eng, a)
        session.note(f"waste chat: {eng.container.root.name} ({fmt.description}{'; ' + note if note else ''}). "
                     "/help for commands, /exit or Ctrl-D to leave.")
        session.loop()
    finally:
        eng.close()
