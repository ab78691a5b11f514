"""Read one tool call's body in each family's markup.

Each reader takes the text between the call's opening and closing markers and the request's tools,
and returns (id or None, name, arguments as a JSON-object string), or None when the body is
malformed (the parser then keeps it as content).
"""

from __future__ import annotations

import json
import re

_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_NAME = re.compile(r"[^\s<>\"']+")
_XTML_OPEN = re.compile(r"<\|open\|>(\w+)((?:\s+\w+=\"[^\"]*\")*)\s*<\|sep\|>")
_XTML_ATTR = re.compile(r"(\w+)=\"([^\"]*)\"")
_DSML_HEAD = re.compile(r"\s+name=\"([^\"]+)\">")
_DSML_PARAM = re.compile(r"<｜DSML｜parameter\s+name=\"([^\"]+)\"\s+string=\"(true|false)\">(.*?)"
                         r"</｜DSML｜parameter>", re.S)


def hermes(body: str, tools=None):
    """Qwen / Hermes: `{"name": ..., "arguments": {...}}` in JSON."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the object already as a string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return None, obj["name"], json.dumps(args, ensure_ascii=False)


def glm(body: str, tools=None):
    """GLM-4.5 (`name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n`) and 4.7 / 5.x (no newlines).
    Values are raw text: a parameter the schema declares a string stays text, others are read as
    JSON when they parse (the template writes non-strings with tojson)."""
    head, sep, _ = body.partition("<arg_key>")
    name = head.strip()
    if not _NAME.fullmatch(name):
        return None
    rest = body[len(head) :]
    args, pos = {}, 0
    for m in _GLM_PAIR.finditer(rest):
        if rest[pos : m.start()].strip():
            return None  # text between pairs: not the format
        key = m.group(1).strip()
        args[key] = _typed(m.group(2), _param_type(tools, name, key))
        pos = m.end()
    if rest[pos:].strip():
        return None
    return None, name, json.dumps(args, ensure_ascii=False)


def kimi_k2(body: str, tools=None):
    """Kimi K2: `functions.NAME:IDX<|tool_call_argument_begin|>{json}`; the id is the model's own."""
    head, sep, args = body.partition("<|tool_call_argument_begin|>")
    call_id = head.strip()
    name = call_id.split(":")[0].split(".")[-1]
    if not sep or not name or not _NAME.fullmatch(call_id):
        return None
    try:
        parsed = json.loads(args) if args.strip() else {}
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    return call_id, name, args.strip() or "{}"


def xtml(body: str, tools=None):
    """Kimi K3: ` tool="NAME" index="N"<|sep|>` then typed `argument` elements or one `json` block."""
    m = _XTML_OPEN.match("<|open|>call" + body)
    if m is None:
        return None
    name = _attrs(m.group(2)).get("tool")
    if not name:
        return None
    rest, args, pos = body[m.end() - len("<|open|>call") :], {}, 0
    while pos < len(rest):
        gap = len(rest[pos:]) - len(rest[pos:].lstrip())
        pos += gap
        if pos >= len(rest):
            break
        el = _XTML_OPEN.match(rest, pos)
        if el is None or el.group(1) not in ("argument", "json"):
            return None
        close = f"<|close|>{el.group(1)}<|sep|>"
        end = rest.find(close, el.end())
        if end < 0:
            return None
        value, attrs = rest[el.end() : end], _attrs(el.group(2))
        if el.group(1) == "json":
            try:
                obj = json.loads(value)
            except ValueError:
                return None
            if not isinstance(obj, dict):
                return None
            args.update(obj)
        else:
            if "key" not in attrs:
                return None
            kind = attrs.get("type", "string")
            if kind == "string":
                args[attrs["key"]] = value
            else:
                try:
                    args[attrs["key"]] = json.loads(value)
                except ValueError:
                    return None
        pos = end + len(close)
    return None, name, json.dumps(args, ensure_ascii=False)


def _attrs(text: str) -> dict:
    # the template escapes exactly these two
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _XTML_ATTR.findall(text)}


def dsml(body: str, tools=None):
    """DeepSeek-V3.2: ` name="NAME">` then `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`
    elements; string="true" keeps V as text, "false" reads it as JSON (the template writes those with tojson)."""
    m = _DSML_HEAD.match(body)
    if m is None or not _NAME.fullmatch(m.group(1)):
        return None
    rest, args, pos = body[m.end() :], {}, 0
    for p in _DSML_PARAM.finditer(rest):
        if rest[pos : p.start()].strip():
            return None  # text between parameters: not the format
        key, is_str, value = p.groups()
        if is_str == "true":
            args[key] = value
        else:
            try:
                args[key] = json.loads(value)
            except ValueError:
                return None
        pos = p.end()
    if rest[pos:].strip():
        return None
    return None, m.group(1), json.dumps(args, ensure_ascii=False)


def _param_type(tools, name, key):
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if fn.get("name") == name:
            prop = ((fn.get("parameters") or {}).get("properties") or {}).get(key) or {}
            return prop.get("type")
    return None


def _typed(value: str, declared):
    if declared == "string" or (isinstance(declared, list) and "string" in declared):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
