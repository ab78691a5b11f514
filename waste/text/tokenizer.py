"""Tokenizers: `tokenizer.json` through `tokenizers`, `tiktoken.model` through `tiktoken`.

Both kinds share one interface. Added tokens (control markers such as `<|im_end|>`) are matched
here rather than inside the backend, so that a caller's text can never produce one: `encode`
treats special tokens in text as text unless `allow_special`, and `encode_segments` takes them
only from markup segments (see segments.py).
"""

from __future__ import annotations

import base64
import codecs
import json
from bisect import bisect_right
from pathlib import Path

from .errors import TextError
from .segments import BREAK, MARKUP, QUOTED, TEXT, Segment, token_regex

# Moonshot's pre-tokenization (tokenization_kimi.py): Han runs are their own pre-tokens. `&&` is class
# intersection, which tiktoken's Rust regex supports (Python `regex` needs VERSION1 for it).
KIMI_PATTERN_BRANCHES = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
KIMI_PATTERN = "|".join(KIMI_PATTERN_BRANCHES)
KIMI_RESERVED = 256  # special ids follow the BPE ranks: [n_ranks, n_ranks + 256)
KIMI_MAX_CHARS = 400_000  # tiktoken panics on longer inputs; Moonshot encodes in pieces of this size
KIMI_MAX_RUN = 25_000  # ...and cuts runs of whitespace / non-whitespace longer than this

# Classes whose behaviour is exactly their tokenizer.json (no Python-side rewriting of the text).
FAST_CLASSES = {
    "PreTrainedTokenizerFast", "TokenizersBackend", "GPT2Tokenizer", "GPT2TokenizerFast",
    "Qwen2Tokenizer", "Qwen2TokenizerFast", "LlamaTokenizerFast", "CodeLlamaTokenizerFast",
    "GemmaTokenizerFast", "CohereTokenizerFast", "BloomTokenizerFast",
}  # fmt: skip
TIKTOKEN_CLASSES = {"TikTokenTokenizer"}


class Tokenizer:
    """One tokenizer interface; built by `load_tokenizer`.

    added_tokens: every atomic token outside the BPE (content -> id), special or not.
    special_tokens: the added tokens that `encode` keeps as text unless `allow_special`.
    """

    kind = "?"

    def __init__(self, added: dict[str, int], special, config: dict, strip_flags=None):
        self.added_tokens = dict(added)
        self.special_tokens = frozenset(special)
        self._strip = strip_flags or {}  # content -> (lstrip, rstrip), HF AddedToken flags
        self._added_re = token_regex(self.added_tokens)
        self.config = config  # tokenizer_config.json, or {}
        names = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.bos_token, self.eos_token = names["bos_token"], names["eos_token"]
        self.pad_token, self.unk_token = names["pad_token"], names["unk_token"]
        self.bos_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.token_to_id(self.eos_token) if self.eos_token else None

    # backend hooks -------------------------------------------------------------------------------
    def _encode_plain(self, text: str, first: bool) -> list[int]:
        """Encode text with no added token matched; `first` says it starts the whole input."""
        raise NotImplementedError

    def _cuts(self, text: str) -> list[int]:
        """Positions where the backend restarts BPE regardless of content (Kimi's long-run rule)."""
        return []

    def decode(self, ids, skip_special: bool = False) -> str:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    # shared --------------------------------------------------------------------------------------
    def special_tokens_map(self) -> dict:
        """bos/eos/pad/unk strings, passed to chat templates the way HF passes them."""
        out = {k: getattr(self, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return {k: v for k, v in out.items() if v is not None}

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes (what OpenAI's logprobs report): a byte-level vocabulary's piece read through GPT-2's
        byte table, else the token decoded alone as UTF-8."""
        piece = self.id_to_token(token_id)
        if piece is not None and piece not in self.added_tokens and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self.decode([token_id]).encode()

    def control_tokens(self, template: str | None = None) -> frozenset[str]:
        """Tokens that caller text may never produce: the special ones, plus the non-special added
        tokens that a template writes as markup (Qwen's `<tool_call>`, `<think>`)."""
        if template is None:
            return self.special_tokens
        extra = {t for t in self.added_tokens if t in template and not t.isspace()}
        return self.special_tokens | extra

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Encode text; special-token strings in it stay text unless allow_special."""
        return self.encode_segments([Segment(MARKUP if allow_special else TEXT, text)])

    def encode_segments(self, segments, control=None) -> list[int]:
        """Encode rendered segments. A control token is taken only inside one markup segment;
        BPE runs join markup and text but restart at control tokens, quoted text and breaks."""
        control = self.special_tokens if control is None else frozenset(control)
        full = "".join(s.text for s in segments)
        hard, markup, quoted, pos = {0, len(full)}, [], [], 0
        for s in segments:
            end = pos + len(s.text)
            if s.kind in (QUOTED, BREAK):
                hard.update((pos, end))
                quoted.extend(range(pos, end))  # caller's control-token text: a handful of chars
            elif s.kind == MARKUP and s.text:
                if markup and markup[-1][1] == pos:
                    markup[-1] = (markup[-1][0], end)
                else:
                    markup.append((pos, end))
            pos = end
        hard.update(self._cuts(full))
        starts = [a for a, _ in markup]

        def in_markup(a, b):
            i = bisect_right(starts, a) - 1
            return i >= 0 and markup[i][1] >= b

        quoted, ids, bounds = set(quoted), [], sorted(hard)
        for a, b in zip(bounds, bounds[1:]):
            if a in quoted:  # a caller's control-token text (or a cut piece of it): plain text, alone
                ids += self._encode_plain(full[a:b], a == 0)
            else:
                ids += self._encode_run(full, a, b, control, in_markup)
        return ids

    def _encode_run(self, full, a, b, control, in_markup) -> list[int]:
        ids, run, pos, rx = [], a, a, self._added_re
        while rx is not None:
            m = rx.search(full, pos, b)
            if m is None:
                break
            s, e = m.span()
            tok = m.group()
            if tok in control and not in_markup(s, e):
                pos = s + 1  # not allowed here: its text stays text
                continue
            lstrip, rstrip = self._strip.get(tok, (False, False))
            while lstrip and s > run and full[s - 1].isspace():
                s -= 1
            while rstrip and e < b and full[e].isspace():
                e += 1
            if s > run:
                ids += self._encode_plain(full[run:s], run == 0)
            ids.append(self.added_tokens[tok])
            run = pos = e
        if b > run:
            ids += self._encode_plain(full[run:b], run == 0)
        return ids

    def stream(self, skip_special: bool = False) -> "StreamDecoder":
        """An incremental detokenizer: push ids, get back only complete text."""
        return StreamDecoder(self, skip_special)


class HFTokenizer(Tokenizer):
    """tokenizer.json through the `tokenizers` library."""

    kind = "tokenizers"

    def __init__(self, data: dict, config: dict):
        from tokenizers import Tokenizer as Backend

        self._full = Backend.from_str(json.dumps(data))
        # The same pipeline without added tokens: text that must not produce them.
        plain = dict(data, added_tokens=[])
        self._plain_first = Backend.from_str(json.dumps(plain))
        # Metaspace(prepend_scheme="first") prepends "▁" only at offset 0 of the whole input, so a
        # run that follows a control token is encoded by a copy that never prepends.
        rest = _never_prepend(plain)
        self._plain_rest = Backend.from_str(json.dumps(rest)) if rest is not plain else self._plain_first
        tokens = data.get("added_tokens") or []
        for t in tokens:
            # matched on the raw text here: refuse what would match differently in the library
            if t.get("single_word"):
                raise TextError(f"added token {t['content']!r} is single_word, which this engine does not match")
            norm = self._full.normalizer
            if t.get("normalized") and norm is not None and norm.normalize_str(t["content"]) != t["content"]:
                raise TextError(f"added token {t['content']!r} is matched after normalization, which changes it")
        added = {t["content"]: t["id"] for t in tokens}
        special = {t["content"] for t in tokens if t.get("special")}
        flags = {t["content"]: (bool(t.get("lstrip")), bool(t.get("rstrip"))) for t in tokens}
        super().__init__(added, special, config, flags)

    def _encode_plain(self, text, first):
        if not text:
            return []
        return (self._plain_first if first else self._plain_rest).encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special=False):
        return self._full.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_token(self, token_id):
        return self._full.id_to_token(int(token_id))

    def token_to_id(self, token):
        return self._full.token_to_id(token)

    @property
    def vocab_size(self):
        return self._full.get_vocab_size(with_added_tokens=True)


class TiktokenTokenizer(Tokenizer):
    """tiktoken.model (base64 token, rank per line) with the release's own pattern and specials."""

    kind = "tiktoken"

    def __init__(self, ranks: dict[bytes, int], pattern: str, config: dict, name="tiktoken.model"):
        import tiktoken

        n = len(ranks)
        named = {int(i): t["content"] for i, t in config.get("added_tokens_decoder", {}).items()}
        specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + KIMI_RESERVED)}
        self._enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        self._n_ranks = n
        self._id_to_special = {i: t for t, i in specials.items()}
        # skip_special drops what the config marks special (Kimi's tool markers are not)
        self._skip = {i for i in specials.values() if config.get("added_tokens_decoder", {}).get(str(i), {}).get("special", True)}
        self._vocab: dict[str, int] | None = None
        # Every tiktoken special is atomic and, as in Moonshot's encode, text unless allowed.
        super().__init__(specials, specials.keys(), config)

    def _encode_plain(self, text, first):
        return self._enc.encode_ordinary(text) if text else []

    def _cuts(self, text):
        return kimi_cuts(text)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes; b"" for an id outside the vocabulary (a padded lm_head can emit one)."""
        if token_id in self._id_to_special:
            return self._id_to_special[token_id].encode()
        return self._enc.decode_single_token_bytes(token_id) if 0 <= token_id < self._n_ranks else b""

    def decode(self, ids, skip_special=False):
        n = self._enc.n_vocab
        ids = [int(i) for i in ids if 0 <= int(i) < n and not (skip_special and int(i) in self._skip)]
        return self._enc.decode_bytes(ids).decode("utf-8", "replace")

    def id_to_token(self, token_id):
        token_id = int(token_id)
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        if 0 <= token_id < self._n_ranks:
            return "".join(_BYTE_CHARS[b] for b in self._enc.decode_single_token_bytes(token_id))
        return None

    def token_to_id(self, token):
        if token in self.added_tokens:
            return self.added_tokens[token]
        if self._vocab is None:  # byte-level strings, as HF shows tiktoken vocabularies
            self._vocab = {"".join(_BYTE_CHARS[b] for b in k): v for k, v in self._enc._mergeable_ranks.items()}
        return self._vocab.get(token)

    @property
    def vocab_size(self):
        return self._enc.n_vocab


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns only text that is complete UTF-8."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self.tok, self.skip = tok, skip_special
        self.ids: list[int] = []
        self._prefix = self._read = 0
        # tiktoken gives exact bytes per token; a byte decoder needs no re-decoding
        self._bytes = codecs.getincrementaldecoder("utf-8")("replace") if isinstance(tok, TiktokenTokenizer) else None

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self._bytes is not None:
            if self.skip and int(token_id) in self.tok._skip:
                return ""
            return self._bytes.decode(self.tok.token_bytes(int(token_id)))
        # Decode with the previous piece as context (decoders treat a leading "▁" or space by
        # position), and hold back while the tail is an incomplete byte sequence.
        before = self.tok.decode(self.ids[self._prefix : self._read], self.skip)
        now = self.tok.decode(self.ids[self._prefix :], self.skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete sequence decodes with U+FFFD)."""
        if self._bytes is not None:
            return self._bytes.decode(b"", final=True)
        before = self.tok.decode(self.ids[self._prefix : self._read], self.skip)
        now = self.tok.decode(self.ids[self._prefix :], self.skip)
        self._prefix = self._read = len(self.ids)
        return now[len(before) :]


# loading ---------------------------------------------------------------------------------------


def load_tokenizer(directory) -> Tokenizer:
    """Load the tokenizer a release or container ships; refuses (TextError) one we cannot reproduce."""
    d = Path(directory)
    config = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    kind = _choose(d, config)
    if kind == "tiktoken":
        pattern = _tiktoken_pattern(d, config)
        ranks = read_ranks(d / "tiktoken.model")
        return TiktokenTokenizer(ranks, pattern, config)
    data = _read_json(d / "tokenizer.json")
    try:
        return HFTokenizer(data, config)
    except TextError as e:
        raise TextError(f"{d / 'tokenizer.json'}: {e}") from None
    except Exception as e:  # the tokenizers library's own parse errors
        raise TextError(f"{d / 'tokenizer.json'}: the tokenizers library cannot load it ({e})") from e


def check_reproducible(src_dir) -> None:
    """Raise TextError, naming the reason, unless this release's tokenizer can be reproduced exactly."""
    tok = load_tokenizer(src_dir)
    for name in (tok.bos_token, tok.eos_token):
        if name and tok.token_to_id(name) is None:
            raise TextError(f"{src_dir}: tokenizer_config.json names {name!r}, which the vocabulary lacks")


def tokenizer_files(src_dir) -> list[Path]:
    """The files a container must carry to load the same tokenizer."""
    d = Path(src_dir)
    config = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    kind = _choose(d, config)
    main = "tiktoken.model" if kind == "tiktoken" else "tokenizer.json"
    files = [d / n for n in (main, "tokenizer_config.json", "special_tokens_map.json") if (d / n).is_file()]
    # tokenization_*.py is where a tiktoken release's pattern is recognised (never executed)
    return files + (sorted(d.glob("tokenization_*.py")) if kind == "tiktoken" else [])


def read_ranks(path) -> dict[bytes, int]:
    """Parse a tiktoken rank file (our own reader: tiktoken's caches files by path)."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except Exception as e:
            raise TextError(f"{path}:{n}: not a 'base64 rank' line") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TextError(f"{path}: ranks are not the contiguous range 0..{len(ranks) - 1}")
    return ranks


def kimi_cuts(text: str) -> list[int]:
    """Moonshot's encode cuts: every 400k chars, then runs of > 25k (non-)whitespace chars."""
    cuts = []
    for base in range(0, len(text), KIMI_MAX_CHARS):
        chunk = text[base : base + KIMI_MAX_CHARS]
        if base:
            cuts.append(base)
        run, is_space = 0, chunk[:1].isspace()
        for i, ch in enumerate(chunk):
            now = ch.isspace()
            if now != is_space:
                run, is_space = 1, now
            else:
                run += 1
                if run > KIMI_MAX_RUN:
                    cuts.append(base + i)
                    run = 1
    return cuts


def _choose(d: Path, config: dict) -> str:
    cls = config.get("tokenizer_class")
    has_json, has_tt = (d / "tokenizer.json").is_file(), (d / "tiktoken.model").is_file()
    if cls in TIKTOKEN_CLASSES and has_tt:
        return "tiktoken"
    if has_json:
        if cls is not None and cls not in FAST_CLASSES:
            where = " (custom code in auto_map)" if config.get("auto_map") else ""
            raise TextError(f"{d}: tokenizer_class {cls!r}{where} is not one whose behaviour tokenizer.json fully describes")
        return "tokenizers"
    if has_tt:
        raise TextError(f"{d}: tiktoken.model with tokenizer_class {cls!r}: no known pre-tokenization pattern for it")
    if (d / "tokenizer.model").is_file():
        raise TextError(f"{d}: only a SentencePiece tokenizer.model; a tokenizer.json is needed")
    raise TextError(f"{d}: no tokenizer.json or tiktoken.model")


def _tiktoken_pattern(d: Path, config: dict) -> str:
    """Kimi's pattern when the release is Moonshot's TikTokenTokenizer; otherwise refuse."""
    sources = sorted(d.glob("tokenization_*.py"))
    if sources:
        text = "\n".join(p.read_text(errors="replace") for p in sources)
        if all(branch in text for branch in KIMI_PATTERN_BRANCHES):
            return KIMI_PATTERN
        raise TextError(f"{d}: {sources[0].name} uses a pre-tokenization pattern other than Kimi's")
    if "tokenization_kimi" in json.dumps(config.get("auto_map", {})):
        return KIMI_PATTERN
    raise TextError(f"{d}: tiktoken.model without tokenization_kimi: its pre-tokenization pattern is unknown")


def _never_prepend(data: dict) -> dict:
    """`data` with Metaspace prepend_scheme "first" made "never" (or `data` itself if none)."""

    def fix(node):
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                return dict(node, prepend_scheme="never"), True
            changed, out = False, {}
            for k, v in node.items():
                out[k], c = fix(v)
                changed |= c
            return out, changed
        if isinstance(node, list):
            items = [fix(v) for v in node]
            return [v for v, _ in items], any(c for _, c in items)
        return node, False

    pre, changed = fix(data.get("pre_tokenizer"))
    return dict(data, pre_tokenizer=pre) if changed else data


def _token_content(value):
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TextError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise TextError(f"{path}: not readable JSON ({e})") from e


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, how byte-level vocabularies are spelled."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


_BYTE_CHARS = _byte_chars()
_BYTE_OF = {c: b for b, c in enumerate(_BYTE_CHARS)}
