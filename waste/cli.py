"""`waste` command line: thin verbs over the Engine API and the container tools."""
from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .errors import WasteError


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000


def _fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def cmd_convert(a):
    from .convert.convert import convert

    out = convert(a.src, a.out, experts=a.experts, trunk=a.trunk, force=a.force)
    print(f"wrote {out}")


def cmd_info(a):
    from .container import open_container
    from .container.info import describe

    c = open_container(a.model)
    d = describe(c)
    if a.json:
        print(json.dumps(d, indent=1))
        return
    rows = [("model", str(c.root)), ("family", d["family"]), ("layers", d["layers_summary"]),
            ("experts", d["experts_summary"]),
            ("parameters", f"{_fmt_count(d['params']['total'])} total, {_fmt_count(d['params']['active'])} active per token"),
            ("trunk", f"{_fmt_bytes(d['trunk_bytes'])} ({d['trunk_format']}, norms/router/gates in f32)"),
            ("expert banks", f"{_fmt_bytes(d['bank_bytes'])} in {d['moe_layers']} files ({d['expert_format']}, "
                             f"{_fmt_bytes(d['record_bytes'])} per expert record)"),
            ("tokenizer", d["tokenizer"] or "none"), ("chat", d["chat"] or "none"),
            ("converted", d["provenance"])]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


def cmd_verify(a):
    from .container.verify import verify

    problems = verify(a.model, progress=not a.quiet)
    if problems:
        for p in problems:
            print(f"DAMAGED: {p}")
        print(f"{len(problems)} problem(s) found in {a.model}: re-convert the model from its release")
        sys.exit(1)
    print(f"OK: every checksum in {a.model} matches")


def cmd_run(a):
    from .engine import Engine

    model, prompt = (None, a.args[0]) if len(a.args) == 1 else (a.args[0], " ".join(a.args[1:]))
    eng = Engine.load(model, dtype=a.dtype)
    g = eng.generate(prompt, max_tokens=a.n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                     min_p=a.min_p, seed=a.seed, stop=a.stop, stream=True)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    try:
        for piece in g:
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        sys.stdout.write("\n")
        print(g.stats.line(), file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="waste", description="Run Mixture-of-Experts models larger than memory.")
    p.add_argument("--version", action="version", version=f"waste {__version__}")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    c = sub.add_parser("convert", help="convert a Hugging Face release into a .waste container")
    c.add_argument("src", help="directory of the release (config.json + safetensors)")
    c.add_argument("out", help="the container to write, e.g. model.waste")
    c.add_argument("--experts", default="bf16", help="storage format of the routed experts (bf16, f16, f32)")
    c.add_argument("--trunk", default="bf16", help="storage format of the trunk matrices (bf16, f16, f32)")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.set_defaults(fn=cmd_convert)

    r = sub.add_parser("run", help="generate text from a prompt", description=(
        "waste run [MODEL] PROMPT: with one argument it is the prompt and the default model is used."))
    r.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    r.add_argument("-n", type=int, default=128, help="tokens to generate (default 128)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--min-p", type=float, default=0.0)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    r.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16")
    r.set_defaults(fn=cmd_run)

    i = sub.add_parser("info", help="describe a container")
    i.add_argument("model")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_info)

    v = sub.add_parser("verify", help="check every checksum of a container and name what is damaged")
    v.add_argument("model")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    v.set_defaults(fn=cmd_verify)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except WasteError as e:
        print(f"waste: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:   # text-layer errors (bad template, tokenizer) are ValueErrors with readable text
        from .text.errors import TextError

        if not isinstance(e, TextError):
            raise
        print(f"waste: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nwaste: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
