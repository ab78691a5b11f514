"""Text: tokenizers, chat templates and chat.json formats, and model-output parsers."""

from .chat_format import ChatFormat, check_markup, default_chat_json, encode_chat_format
from .chat_template import ChatTemplate, chat_segments, encode_chat
from .errors import TextError
from .parsers import OutputParser, markup_for, parse_output, parser_for
from .segments import Segment
from .tokenizer import Tokenizer, check_reproducible, load_tokenizer

__all__ = [
    "ChatFormat", "ChatTemplate", "OutputParser", "Segment", "TextError", "Tokenizer", "chat_segments",
    "check_markup", "check_reproducible", "default_chat_json", "encode_chat", "encode_chat_format",
    "load_tokenizer", "markup_for", "parse_output", "parser_for",
]  # fmt: skip
