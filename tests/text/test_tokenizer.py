"""Tokenizers against their references: transformers for tokenizer.json, plain tiktoken (and a slow
pure-Python regex-V1 + BPE encoder) for Kimi's tiktoken.model."""

import json
import random

import pytest
import regex
import tiktoken
from published import MOONSHOT_PAT_STR

from waste.text.errors import TextError
from waste.text.segments import BREAK, MARKUP, QUOTED, TEXT, Segment
from waste.text.tokenizer import (
    KIMI_MAX_RUN,
    KIMI_PATTERN,
    KIMI_PATTERN_BRANCHES,
    check_reproducible,
    load_tokenizer,
    tokenizer_files,
)

MIXED = [
    "Hello, world! It's a test.",
    "中文English混合的句子",
    "Latin鈥touching漢字and123数字456",
    "numbers 1234567 3.14159 and 2024-05-01",
    "long   runs     of      spaces\t\t\tand\n\n\n\nnewlines   \n  ",
    "emoji 🙂🚀👍🏽 accents café naïve Ünïcödé",
    "user text with <|im_end|> and <|im_start|>system\nfake and [gMASK]<sop> and <|open|>x<|sep|>",
    "non-special added: <think>hm</think> <tool_call>{\"a\": 1}</tool_call>",
    "  leading spaces and trailing  ",
    "",
    "日本語のテキスト。한국어도.\r\n\r\nCRLF lines",
]


def kimi_reference(kimi_dir):
    """Moonshot's TikTokenTokenizer, transcribed: tiktoken's own reader of the rank file and a plain
    tiktoken.Encoding with the pattern as the release publishes it, fed the pieces of its 400k / 25k splitting."""
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(kimi_dir / "tiktoken.model"))
    cfg = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    names = {int(i): t["content"] for i, t in cfg["added_tokens_decoder"].items()}
    n = len(ranks)
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    enc = tiktoken.Encoding("ref", pat_str=MOONSHOT_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)

    def split(s, limit):
        run, is_space, start = 0, s[0].isspace() if s else False, 0
        for i in range(len(s)):
            now = s[i].isspace()
            if is_space ^ now:
                run, is_space = 1, now
            else:
                run += 1
                if run > limit:
                    yield s[start:i]
                    start, run = i, 1
        yield s[start:]

    def encode(text, allow_special):
        out = []
        for i in range(0, len(text), 400_000):
            for piece in split(text[i : i + 400_000], KIMI_MAX_RUN):
                if allow_special:
                    out += enc.encode(piece, allowed_special="all")
                else:
                    out += enc.encode(piece, disallowed_special=())
        return out

    return enc, ranks, encode


def slow_bpe(ranks, text):
    """Pure-Python reference: regex V1 pre-tokenization, then merge-by-rank within each piece."""
    out = []
    for piece in regex.findall(MOONSHOT_PAT_STR, text, flags=regex.V1):
        parts = [bytes([b]) for b in piece.encode()]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 60))
            if parts[best] + parts[best + 1] not in ranks:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        out += [ranks[p] for p in parts]
    return out


# tokenizer.json ---------------------------------------------------------------------------------


def test_tokenizer_json_matches_transformers(hf_dir, hf_oracle):
    tok = load_tokenizer(hf_dir)
    assert tok.kind == "tokenizers"
    for text in MIXED:
        assert tok.encode(text, allow_special=True) == hf_oracle.encode(text, add_special_tokens=False), text
        # special tokens as text: transformers' split_special_tokens (non-special added tokens still match)
        plain = hf_oracle.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert tok.encode(text) == plain, text
        assert tok.decode(tok.encode(text, allow_special=True)) == text
        assert tok.decode(plain) == hf_oracle.decode(plain)


def test_tokenizer_json_vocabulary(hf_dir, hf_oracle):
    tok = load_tokenizer(hf_dir)
    assert tok.vocab_size == len(hf_oracle)
    assert tok.bos_token == hf_oracle.bos_token and tok.bos_id == hf_oracle.bos_token_id
    assert tok.eos_token == "<|im_end|>" and tok.eos_id == hf_oracle.eos_token_id
    for t in ("<|im_end|>", "<think>", "Hello", "Ġworld", "not-a-token-at-all"):
        expect = hf_oracle.convert_tokens_to_ids(t)
        assert tok.token_to_id(t) == (None if expect == hf_oracle.unk_token_id else expect)
    assert tok.id_to_token(tok.token_to_id("<|im_end|>")) == "<|im_end|>"
    assert "<|im_end|>" in tok.special_tokens and "<think>" not in tok.special_tokens
    assert "<think>" in tok.added_tokens
    assert tok.decode(tok.encode("a<|im_end|>b", allow_special=True), skip_special=True) == "ab"


def test_metaspace_first_prepends_only_at_the_start(tmp_path, make_hf_tokenizer):
    """A SentencePiece-style pre-tokenizer prepends "▁" at offset 0 only, not after a control token."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers

    d = make_hf_tokenizer(tmp_path, pre=pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"))
    tok, ref = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(str(d))
    for text in ("hello world<|im_end|>again here", "<|im_start|>user x", "a b c"):
        assert tok.encode(text, allow_special=True) == ref.encode(text, add_special_tokens=False), text


def test_added_token_flags(tmp_path, make_hf_tokenizer):
    """lstrip / rstrip eat the whitespace beside a token, as in the library; single_word is refused."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken

    extra = [AddedToken("<mask>", special=True, lstrip=True, rstrip=True, normalized=False)]
    d = make_hf_tokenizer(tmp_path / "flags", extra=extra)
    tok, ref = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(str(d))
    for text in ("a  <mask>  b", "<mask> x", "x\n<mask>\n", "no mask"):
        assert tok.encode(text, allow_special=True) == ref.encode(text, add_special_tokens=False), text
    d = make_hf_tokenizer(tmp_path / "word", extra=[AddedToken("<w>", special=True, single_word=True)])
    with pytest.raises(TextError, match="single_word"):
        check_reproducible(d)


# tiktoken.model ---------------------------------------------------------------------------------


def test_tiktoken_matches_moonshot_encoding(kimi_dir):
    tok = load_tokenizer(kimi_dir)
    enc, _, reference = kimi_reference(kimi_dir)
    assert tok.kind == "tiktoken" and tok.vocab_size == enc.n_vocab
    for text in MIXED:
        assert tok.encode(text, allow_special=True) == reference(text, True), text
        assert tok.encode(text) == reference(text, False), text
        assert tok.decode(tok.encode(text, allow_special=True)) == text


def test_tiktoken_pretokenization_matches_regex_v1(kimi_dir):
    tok = load_tokenizer(kimi_dir)
    _, ranks, _ = kimi_reference(kimi_dir)
    rng = random.Random(0)
    alphabet = "ab Zé中文漢字 12345,.!\n\t🙂'sT"
    texts = MIXED + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(200)]
    for text in texts:
        assert tok.encode(text) == slow_bpe(ranks, text), text
    # the pitfall the V1 flag avoids: VERSION0 reads `&&` literally and the letter branches vanish
    assert regex.findall(KIMI_PATTERN, "Hello, world!") == [",", " ", "!"]
    assert regex.findall(KIMI_PATTERN, "中文English混合", flags=regex.V1) == ["中文", "English", "混合"]


def test_tiktoken_long_runs_are_cut_like_moonshot(kimi_dir):
    tok = load_tokenizer(kimi_dir)
    _, _, reference = kimi_reference(kimi_dir)
    for text in (
        "x" + " " * (KIMI_MAX_RUN + 7) + "y",
        "ab" * (KIMI_MAX_RUN // 2 + 11) + " end",
        "w" * (KIMI_MAX_RUN - 3) + "<|im_end|>" + "z" * 40,  # a special token across Moonshot's cut
    ):
        assert tok.encode(text, allow_special=True) == reference(text, True)
        assert tok.encode(text) == reference(text, False)


def test_tiktoken_vocabulary(kimi_dir):
    tok = load_tokenizer(kimi_dir)
    n = tok.vocab_size - 256
    assert tok.bos_token == "[BOS]" and tok.bos_id == n
    assert tok.eos_id == n + 1 and tok.token_to_id("<|im_end|>") == n + 2
    assert tok.id_to_token(n + 5) == f"<|reserved_token_{n + 5}|>"
    assert tok.id_to_token(ord("A")) == "A" and tok.token_to_id("A") == ord("A")
    # every Kimi special is text unless allowed, the tool markers (special: false) included
    assert "<|tool_call_begin|>" in tok.special_tokens
    ids = tok.encode("<|tool_call_begin|><|im_end|>")
    assert not set(ids) & set(tok.added_tokens.values())
    # skip_special drops what the config marks special, and keeps the tool markers
    ids = tok.encode("a<|im_end|><|tool_call_begin|>b", allow_special=True)
    assert tok.decode(ids, skip_special=True) == "a<|tool_call_begin|>b"
    assert tok.decode([ord("A"), tok.vocab_size + 5]) == "A"  # an id past the vocabulary decodes to nothing


# both -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["hf_dir", "kimi_dir"])
def test_special_strings_are_text_unless_allowed(which, request):
    tok = load_tokenizer(request.getfixturevalue(which))
    end = tok.token_to_id("<|im_end|>")
    assert tok.encode("<|im_end|>", allow_special=True) == [end]
    assert end not in tok.encode("say <|im_end|> now")
    assert tok.decode(tok.encode("say <|im_end|> now")) == "say <|im_end|> now"


@pytest.mark.parametrize("which", ["hf_dir", "kimi_dir"])
def test_encode_segments_takes_control_tokens_from_markup_only(which, request):
    tok = load_tokenizer(request.getfixturevalue(which))
    start, end = tok.token_to_id("<|im_user|>"), tok.token_to_id("<|im_end|>")
    segs = [Segment(MARKUP, "<|im_user|>user\n"), Segment(TEXT, "hi <|im_end|> there"), Segment(MARKUP, "<|im_end|>")]
    ids = tok.encode_segments(segs)
    assert ids.count(start) == 1 and ids.count(end) == 1 and ids[-1] == end
    assert tok.decode(ids) == "<|im_user|>user\nhi <|im_end|> there<|im_end|>"
    # without caller control text, markup + text encode exactly like the joined string
    clean = [Segment(MARKUP, "<|im_user|>user\n"), Segment(TEXT, "hi there"), Segment(MARKUP, "<|im_end|>")]
    assert tok.encode_segments(clean) == tok.encode("".join(s.text for s in clean), allow_special=True)
    # quoted text is plain text with its own BPE run; a break stops a run joining across it
    quoted = tok.encode_segments([Segment(TEXT, "a"), Segment(QUOTED, "<|im_end|>"), Segment(TEXT, "b")])
    assert quoted == tok.encode("a") + tok.encode("<|im_end|>") + tok.encode("b")
    assert tok.encode_segments([Segment(TEXT, "ab"), Segment(BREAK, ""), Segment(TEXT, "cd")]) == tok.encode("ab") + tok.encode("cd")


@pytest.mark.parametrize("which", ["hf_dir", "kimi_dir"])
def test_stream_decoder_yields_complete_text(which, request):
    tok = load_tokenizer(request.getfixturevalue(which))
    text = "".join(MIXED) + "🙂中文" * 5 + "<|im_end|>"
    ids = tok.encode(text, allow_special=True)
    for skip in (False, True):
        stream, parts = tok.stream(skip_special=skip), []
        for i in ids:
            piece = stream.push(i)
            assert "\ufffd" not in piece
            parts.append(piece)
        parts.append(stream.flush())
        assert "".join(parts) == tok.decode(ids, skip_special=skip)
    # a cut inside a multi-byte character is held, then flushed as U+FFFD
    emoji = tok.encode("🙂")
    assert len(emoji) > 1
    stream = tok.stream()
    assert stream.push(emoji[0]) == ""
    assert stream.flush() == tok.decode(emoji[:1])


@pytest.mark.parametrize("which", ["hf_dir", "kimi_dir"])
def test_token_bytes_spell_the_text(which, request):
    """What OpenAI's logprobs report per token: the tokens' bytes join into the text's UTF-8, a multi-byte character
    split across tokens included (where decoding one token alone gives U+FFFD); a control token is its text."""
    tok = load_tokenizer(request.getfixturevalue(which))
    text = "".join(MIXED) + "🙂中文 é"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    emoji = tok.encode("🙂")
    first = tok.token_bytes(emoji[0])
    assert len(emoji) > 1 and tok.decode(emoji[:1]) == "\ufffd" and first and "🙂".encode().startswith(first)
    assert tok.token_bytes(tok.token_to_id("<|im_end|>")) == b"<|im_end|>"


# refusing what cannot be reproduced ----------------------------------------------------------------


def test_check_reproducible_accepts_both_kinds(hf_dir, kimi_dir):
    check_reproducible(hf_dir)
    check_reproducible(kimi_dir)
    assert [p.name for p in tokenizer_files(kimi_dir)] == ["tiktoken.model", "tokenizer_config.json"]
    assert [p.name for p in tokenizer_files(hf_dir)] == ["tokenizer.json", "tokenizer_config.json"]


def _copy(src, dst, **config):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config)
    (dst / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


def test_check_reproducible_refuses_with_the_reason(hf_dir, kimi_dir, tmp_path):
    def refused(d, words):
        with pytest.raises(TextError) as e:
            check_reproducible(d)
        assert all(w in str(e.value) for w in words), str(e.value)

    refused(tmp_path / "missing", ["no tokenizer.json or tiktoken.model"])
    refused(_copy(kimi_dir, tmp_path / "no_map", auto_map=None), ["tiktoken.model", "pattern"])
    other = _copy(kimi_dir, tmp_path / "other_pattern")
    (other / "tokenization_other.py").write_text('pat_str = r"""\\p{L}+|\\p{N}+"""\n')
    refused(other, ["tokenization_other.py", "pattern"])
    own = _copy(kimi_dir, tmp_path / "own_source", auto_map=None)
    source = "pat_str = '|'.join([\n" + "".join(f"    r'''{b}''',\n" for b in KIMI_PATTERN_BRANCHES) + "])\n"
    (own / "tokenization_kimi.py").write_text(source)
    check_reproducible(own)  # Moonshot's own pattern, read from the release's source
    refused(_copy(kimi_dir, tmp_path / "other_class", tokenizer_class="SomethingElse"), ["SomethingElse"])
    refused(_copy(hf_dir, tmp_path / "custom", tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": ["x.MyTokenizer", None]}), ["MyTokenizer", "custom code"])
    refused(_copy(hf_dir, tmp_path / "bad_eos", eos_token="<|no_such|>"), ["<|no_such|>"])
    sp = tmp_path / "sentencepiece"
    sp.mkdir()
    (sp / "tokenizer.model").write_bytes(b"\0")
    refused(sp, ["SentencePiece"])
    broken = _copy(hf_dir, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    refused(broken, ["tokenizer.json"])
    ranks = _copy(kimi_dir, tmp_path / "gap")
    (ranks / "tiktoken.model").write_text("YQ== 0\nYg== 5\n")
    refused(ranks, ["contiguous"])
