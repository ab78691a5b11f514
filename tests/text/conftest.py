"""Tokenizer files built in tmp dirs for the text tests: nothing is downloaded.

A small byte-level BPE is trained deterministically (pure Python) on a fixed mixed-script corpus,
then written as a `tokenizer.json` (read by `tokenizers` and by transformers, the oracle) and as a
Kimi-style `tiktoken.model` + `tokenizer_config.json` (oracle: a plain `tiktoken.Encoding`).
"""

import base64
import json
import os
from pathlib import Path

import pytest
from fixtures import bpe_merges
from published import MOONSHOT_PAT_STR

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"   # release chat templates (SOURCES.md)

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = """
Hello, world! The quick brown fox jumps over the lazy dog. It's what we've said: they'll go, I'd stay.
def main(argv): return [x ** 2 for x in range(10)]  # comment
The weather in Beijing is sunny; 北京的天气很好。我们明天去上海。中文English混合的句子很常见。
Numbers: 1234567890, 3.14159, 2024-05-01, 100% of 42 items cost $19.99.
Emoji: 🙂🚀👍🏽 and accents: café naïve résumé Ünïcödé ß. 日本語のテキストも少し。한국어도 조금.
    indented    with     many      spaces		and tabs
line one
line two

tool calls: {"city": "Paris", "unit": "celsius"} <tool_call> functions.get_weather:0
""" * 3

SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "[BOS]", "[EOS]", "[EOT]",
    "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<|media_start|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
    "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>", "<|kimi_image_placeholder|>",
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>", "]~b]", "]~!b[", "[e~[", "<|begin_of_image|>", "<|image|>", "<|end_of_image|>",
]  # fmt: skip
PLAIN_ADDED = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<minimax:tool_call>", "</minimax:tool_call>",
]  # fmt: skip

# Kimi's tokenizer_config.json layout: offsets from the first special id.
KIMI_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    20: "<|open|>", 21: "<|sep|>", 22: "<|close|>", 23: "<|end_of_msg|>", 254: "[PAD]",
}  # fmt: skip
KIMI_NOT_SPECIAL = {11, 12, 13, 14, 15}


def byte_chars():
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


BYTE_CHARS = byte_chars()


def train_merges(pattern: str, n_merges: int, version1: bool) -> list[tuple[bytes, bytes]]:
    """Deterministic byte-level BPE training on CORPUS (tests/fixtures.py bpe_merges)."""
    return bpe_merges(CORPUS, pattern, n_merges, version1)


def spell(b: bytes) -> str:
    return "".join(BYTE_CHARS[x] for x in b)


def write_hf_tokenizer(d: Path, special=SPECIAL, plain_added=PLAIN_ADDED, config=None, pre=None, extra=()) -> Path:
    """A Qwen2-style tokenizer.json (NFC, Split(pattern) + ByteLevel) and tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    merges = train_merges(QWEN_PATTERN, 300, version1=False)
    vocab = {spell(bytes([b])): b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(spell(a + b), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(spell(a), spell(b)) for a, b in merges], ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre or pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_added])
    tok.add_special_tokens(list(extra))  # AddedToken objects with their own flags
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **(config or {})}, ensure_ascii=False))
    return d


def kimi_ranks() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in train_merges(MOONSHOT_PAT_STR, 400, version1=True):
        ranks.setdefault(a + b, len(ranks))
    return ranks


def write_kimi_tokenizer(d: Path, config=None) -> Path:
    """tiktoken.model + a Kimi tokenizer_config.json (TikTokenTokenizer, auto_map tokenization_kimi)."""
    ranks = kimi_ranks()
    n = len(ranks)
    d.mkdir(parents=True, exist_ok=True)
    (d / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1]))
    )
    decoder = {
        str(n + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": off not in KIMI_NOT_SPECIAL}
        for off, name in KIMI_SPECIALS.items()
    }  # fmt: skip
    cfg = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
    }
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return d


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    return write_hf_tokenizer(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="session")
def kimi_dir(tmp_path_factory):
    return write_kimi_tokenizer(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="session")
def hf_oracle(hf_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(hf_dir))


@pytest.fixture(scope="session")
def make_hf_tokenizer():
    return write_hf_tokenizer


@pytest.fixture(scope="session")
def make_kimi_tokenizer():
    return write_kimi_tokenizer
