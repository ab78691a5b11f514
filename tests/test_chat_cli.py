"""`waste chat` driven through a pseudo-terminal, as a person meets it: the reply on screen is the one the API
gives, history and /system and /reset show in the prompt's token count, multi-line input, Ctrl-C stops a
reply and keeps the session, reasoning is dimmed or hidden, /exit and Ctrl-D leave."""
import json
import os
import re
import shutil
import sys

import pytest

import waste
from chat_util import waste_chat_session
from fixtures import TOKENIZER_TEXT
from waste.chat import load_chat_format, normalise_messages
from waste.chat_cli import DIM, RESET, visible
from waste.container import open_container
from waste.convert.convert import convert
from waste.convert.synthetic import write_tokenizer
from waste.text.tokenizer import load_tokenizer

pexpect = pytest.importorskip("pexpect")

STATS = re.compile(r"\[prompt (\d+) tok, [\d.]+ tok/s \| generated (\d+) tok, [\d.]+ tok/s \| experts [^\]]*\]")
THINK_CHAT = {
    "roles": {r: {"prefix": f"<|im_start|>{r}\n", "suffix": "<|im_end|>\n"} for r in ("system", "user", "assistant")},
    "stop": ["<|im_end|>", "<|endoftext|>"],
    "think": {"open": "<think>", "close": "</think>", "prompt": "open", "off": "<think>\n\n</think>\n\n",
              "history": "drop"},
}


def spawn(container, *args):
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    # one compute thread: the tiny model gains nothing from more, and idle OpenMP threads spin on a busy machine
    env.update(LANG="C.UTF-8", LC_ALL="C.UTF-8", PYTHONIOENCODING="utf-8", OMP_NUM_THREADS="1")
    c = pexpect.spawn(sys.executable, ["-m", "waste", "chat", str(container), *map(str, args)], env=env,
                      encoding="utf-8", timeout=120, dimensions=(50, 400))
    c.expect("/help for commands")
    c.expect_exact(">>> ")
    return c


def ask(c, *lines):
    """Type a message (several lines for multi-line input); returns (what the reply looked like, prompt tokens,
    generated tokens)."""
    for line in lines:
        c.sendline(line)
    c.expect_exact(lines[-1] + "\r\n")
    c.expect(STATS)
    shown = c.before
    assert shown.endswith("\r\n" + DIM), repr(shown[-40:])   # the reply, a newline, then the dimmed stats line
    prompt, generated = int(c.match.group(1)), int(c.match.group(2))
    c.expect_exact(">>> ")
    return shown[: -len("\r\n" + DIM)], prompt, generated


def on_screen(text):
    return visible(text).replace("\n", "\r\n")


class Reference:
    """What the API says for the same container: prompt sizes and greedy replies."""

    def __init__(self, container, n):
        self.fmt = load_chat_format(open_container(container), load_tokenizer(container))
        self.container, self.n, self.engine = container, n, None

    def tokens(self, msgs):
        return len(self.fmt.render(normalise_messages(msgs)).ids)

    def reply(self, msgs):
        self.engine = self.engine or waste.load(self.container)
        return self.engine.chat(msgs, max_tokens=self.n)

    def close(self):
        if self.engine is not None:
            self.engine.close()


def test_a_session(releases):
    container = releases["qwen3_moe"][2]
    ref = Reference(container, 6)
    c = spawn(container, "-n", 6)
    try:
        hello = [{"role": "user", "content": "hello"}]
        first = ref.reply(hello)
        shown, prompt, generated = ask(c, "hello")
        assert shown == on_screen(first.content) and shown and not shown.startswith(DIM)
        assert prompt == ref.tokens(hello) and generated == first.usage["completion_tokens"]

        history = [*hello, first.message(), {"role": "user", "content": "again"}]
        shown, prompt, _ = ask(c, "again")
        assert prompt == ref.tokens(history) and shown == on_screen(ref.reply(history).content)

        c.sendline("/reset")
        c.expect("conversation cleared")
        assert ask(c, "hello")[:2] == (on_screen(first.content), ref.tokens(hello))

        c.sendline("/reset")
        c.sendline("/system Be brief.")
        c.expect(r"system prompt set")
        system = [{"role": "system", "content": "Be brief."}]
        assert ask(c, "hello")[1] == ref.tokens([*system, *hello])

        c.sendline("/reset")   # the system prompt survives it
        c.expect("the system prompt stays")
        joined = {"role": "user", "content": "first line \nsecond line"}   # the backslash joins with a newline
        assert ask(c, "first line \\", "second line")[1] == ref.tokens([*system, joined])
        c.sendline("/reset")
        assert ask(c, '"""', "alpha", 'beta"""')[1] == ref.tokens([*system, {"role": "user", "content": "alpha\nbeta"}])

        c.sendline("/help")
        c.expect("/reset")
        c.sendline("/nonsense")
        c.expect("unknown command /nonsense")
        c.sendline("/exit")
        c.expect(pexpect.EOF)
    finally:
        c.close()
        ref.close()
    assert c.exitstatus == 0, c.before


def test_ctrl_c_stops_the_reply_and_keeps_the_session(releases):
    container = releases["qwen3_moe"][2]
    ref = Reference(container, 400)
    c = spawn(container, "-n", 400)   # greedy on this fixture runs to the end of the context: a long reply
    try:
        for message in ("hello", "again"):
            c.sendline(message)
            c.expect_exact(message + "\r\n")
            c.expect(r"[\s\S]{12}")     # the reply is streaming...
            c.sendintr()                # ...and Ctrl-C (\x03) stops it
            c.expect_exact("[interrupted]")
            c.expect(STATS)
            prompt, generated = int(c.match.group(1)), int(c.match.group(2))
            assert 0 < generated < 400
            c.expect_exact(">>> ")
        # the session went on, and the partial first reply is in the history the second turn was sent with
        without_reply = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""},
                         {"role": "user", "content": "again"}]
        assert prompt > ref.tokens(without_reply)
        c.sendeof()                     # Ctrl-D leaves
        c.expect(pexpect.EOF)
    finally:
        c.close()
        ref.close()
    assert c.exitstatus == 0


@pytest.fixture(scope="module")
def thinking(releases, tmp_path_factory):
    """The fixture release with <think> in its tokenizer and a chat.json whose prompt opens the reasoning."""
    src = tmp_path_factory.mktemp("think") / "src"
    shutil.copytree(releases["qwen3_moe"][1], src)
    write_tokenizer(src, TOKENIZER_TEXT, vocab_size=300,
                    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"))
    (src / "chat.json").write_text(json.dumps(THINK_CHAT))
    return convert(src, src.parent / "think.waste", progress=False)


def test_reasoning_is_dimmed(thinking):
    ref = Reference(thinking, 8)
    c = spawn(thinking, "-n", 8)
    try:
        want = ref.reply([{"role": "user", "content": "hello"}])
        assert want.reasoning_content   # the prompt opened the channel: the reply starts as reasoning
        shown, _, _ = ask(c, "hello")
        body = "\r\n\r\n" + on_screen(want.content) if want.content else ""
        assert shown == DIM + on_screen(want.reasoning_content) + RESET + body
        c.sendline("/exit")
        c.expect(pexpect.EOF)
    finally:
        c.close()
        ref.close()


def test_hidden_reasoning_and_a_plain_pipe(thinking, monkeypatch):
    """--hide-reasoning, in process (the same Session the command runs) with input from a list and stdout not
    a terminal: no escape codes, only the content; EOF leaves."""
    ref = Reference(thinking, 8)
    try:
        want = ref.reply([{"role": "user", "content": "hello"}])
        for hide in (True, False):
            argv = ["chat", str(thinking), "-n", "8", *(["--hide-reasoning"] if hide else [])]
            s, shown = waste_chat_session(ref.engine, monkeypatch, argv, ["hello"])
            if hide:
                assert shown == visible(want.content) + "\n\n"
            else:
                body = "\n\n" + visible(want.content) if want.content else ""
                assert shown == visible(want.reasoning_content) + body + "\n\n"
            assert STATS.search(s.err.getvalue()) and DIM not in s.err.getvalue() + shown
    finally:
        ref.close()
