"""`waste` command line: thin verbs over the Engine API and the container tools."""
from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .errors import WasteError
from .units import fmt_bytes as _fmt_bytes


def _fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def cmd_convert(a):
    from .convert.convert import convert

    from .container.manifest import read_manifest
    from .convert.text_files import describe_chat

    from .quant.formats import DEFAULT_TRUNK

    out = convert(a.src, a.out, experts=a.experts, trunk=a.trunk or DEFAULT_TRUNK, force=a.force, chat=a.chat)
    print(f"wrote {out}")
    print(f"chat format: {describe_chat(read_manifest(out)['text'])}")


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
            *[("features" if i == 0 else "", f) for i, f in enumerate(d["features"])],
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


def _load(a, model):
    from .engine import Engine

    return Engine.load(model, dtype=a.dtype, budget=a.budget, context=a.context, threads=a.threads,
                       preload=False if a.no_preload else None, top_k=a.top_k)


def _engine_args(p):
    p.add_argument("--budget", default=None, help="expert cache size (bytes or K/M/G suffix); default: the memory plan")
    p.add_argument("--context", type=int, default=4096, help="context length the memory plan reserves (default 4096)")
    p.add_argument("--threads", type=int, default=4, help="expert reader threads (default 4)")
    p.add_argument("--no-preload", action="store_true",
                   help="no background fill of the cache when the whole bank fits (also WASTE_PRELOAD=0)")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="route each token to K experts instead of the release's top_k (fewer: faster, at a quality "
                        "cost; docs/LEARNED.md measures it)")


def cmd_plan(a):
    import torch

    from .container import open_container
    from .engine import resolve_dtype
    from .runtime.plan import plan_memory
    from .units import parse_size

    c = open_container(a.model)
    p = plan_memory(c, resolve_dtype(a.dtype, c), a.context, None if a.ram is None else parse_size(a.ram),
                    None if a.budget is None else parse_size(a.budget))
    if a.json:
        print(json.dumps(p.to_json(), indent=1))
    else:
        print("\n".join(p.lines()))
    if p.warning:
        print(f"waste: warning: {p.warning}", file=sys.stderr)
    del torch


def cmd_bench(a):
    from .runtime.bench import bench, report_lines

    eng = _load(a, a.model)
    try:
        r = bench(eng, n=a.n, prompt_len=a.prompt_len, feed=a.feed, routing=a.routing)
    finally:
        eng.close()
    print(json.dumps(r, indent=1) if a.json else "\n".join(report_lines(r)))


def cmd_chat(a):
    from .chat_cli import cmd_chat as chat

    chat(a, _load)


def cmd_serve(a):
    from .serve.app import serve

    if a.max_queue < 0 or a.max_batch < 1:
        raise WasteError("--max-queue must be 0 or more and --max-batch 1 or more")
    import os

    if a.model is not None:   # a bad path or a damaged manifest is refused before the port is bound
        from .container import open_container

        open_container(a.model).close()
    key = a.api_key or os.environ.get("WASTE_API_KEY") or None
    serve(a.model, host=a.host, port=a.port, api_key=key, max_queue=a.max_queue, max_batch=a.max_batch,
          model_name=a.model_name, load=lambda model: _load(a, model))


def cmd_run(a):
    model, prompt = (None, a.args[0]) if len(a.args) == 1 else (a.args[0], " ".join(a.args[1:]))
    eng = _load(a, model)
    if eng.plan.warning:
        print(f"waste: warning: {eng.plan.warning}", file=sys.stderr)
    g = eng.generate(prompt, max_tokens=a.n, temperature=a.temperature, top_p=a.top_p, min_p=a.min_p,
                     seed=a.seed, stop=a.stop, stream=True)
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
    c.add_argument("--experts", default="auto", help="storage format of the routed experts: auto (as released when the "
                   "release is mxfp4 or int4, else q4), bf16, f16, f32, q8, q4 (q4g32, q4g128: other group sizes), "
                   "vq3 (3 bits, for disk-bound machines), mxfp4")
    c.add_argument("--trunk", default=None, help="storage format of the trunk's projections: q8 (default), bf16, f16, "
                   "f32, q4; embeddings, norms and routers keep their own")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.add_argument("--chat", choices=("auto", "require", "none"), default="auto",
                   help="for a release without a chat template: install waste's chat.json for the family when the "
                        "tokenizer carries its markup (auto, default), refuse the conversion when it cannot "
                        "(require), or install none")
    c.set_defaults(fn=cmd_convert)

    r = sub.add_parser("run", help="generate text from a prompt", description=(
        "waste run [MODEL] PROMPT: with one argument it is the prompt and the default model is used."))
    r.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    r.add_argument("-n", type=int, default=128, help="tokens to generate (default 128)")
    # Sampling by default, with a fixed seed: small models loop under greedy decoding, and a fixed seed keeps
    # the same command printing the same text (docs/LEARNED.md §4). --temperature 0 is greedy.
    r.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (default 0.7)")
    r.add_argument("--top-p", type=float, default=0.9, help="default 0.9")
    r.add_argument("--min-p", type=float, default=0.05, help="default 0.05")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (default 0: the same text every run)")
    r.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _engine_args(r)
    r.set_defaults(fn=cmd_run)

    ch = sub.add_parser("chat", help="chat with a model in the terminal", description=(
        "waste chat [MODEL]: an interactive chat through the model's chat format (the default model when MODEL is "
        "omitted). /help inside lists the commands."))
    ch.add_argument("model", nargs="?", default=None)
    ch.add_argument("-n", type=int, default=512, help="most tokens per reply (default 512; the context caps it)")
    ch.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    ch.add_argument("--top-p", type=float, default=1.0)
    ch.add_argument("--min-p", type=float, default=0.0)
    ch.add_argument("--seed", type=int, default=None)
    ch.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ch.add_argument("--system", default=None, help="the system prompt to start with (/system changes it)")
    ch.add_argument("--hide-reasoning", action="store_true", help="do not show the model's reasoning")
    ch.add_argument("--no-thinking", action="store_true", help="ask the chat format to turn reasoning off")
    ch.add_argument("--reasoning-effort", default=None, help="passed to the chat format (e.g. low, high, max)")
    ch.add_argument("--tools", default=None, metavar="FILE",
                    help="a JSON list of OpenAI tool declarations offered to the model; answer its calls with "
                         "/result TEXT")
    _engine_args(ch)
    ch.set_defaults(fn=cmd_chat)

    sv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API", description=(
        "waste serve [MODEL]: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, /tokenize, "
        "/detokenize (the default model when MODEL is omitted). The port is bound at once; /health answers 503 "
        "until the model is loaded."))
    sv.add_argument("model", nargs="?", default=None)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (also WASTE_API_KEY)")
    sv.add_argument("--max-queue", type=int, default=64,
                    help="requests that may wait for a turn; past it the server answers 503 with Retry-After "
                         "(default 64)")
    sv.add_argument("--max-batch", type=int, default=8,
                    help="requests generated at once; their decode steps share expert reads (default 8)")
    sv.add_argument("--model-name", default=None, help="the model id /v1/models reports (default: the container's "
                    "name without .waste)")
    _engine_args(sv)
    sv.set_defaults(fn=cmd_serve)

    pl = sub.add_parser("plan", help="print the memory plan: floor, working set, bank, the chosen expert budget")
    pl.add_argument("model")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--ram", default=None, help="plan as if the machine had this much memory")
    pl.add_argument("--context", type=int, default=4096)
    pl.add_argument("--budget", default=None, help="check a budget instead of choosing one")
    pl.add_argument("--dtype", default="auto")
    pl.set_defaults(fn=cmd_plan)

    b = sub.add_parser("bench", help="measure prefill and decode speed, cache hit rate and bytes read")
    b.add_argument("model")
    b.add_argument("-n", type=int, default=64, help="tokens to decode (default 64)")
    b.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    b.add_argument("--json", action="store_true")
    b.add_argument("--feed", choices=["greedy", "random"], default="greedy",
                   help="decode steps take the model's greedy token (default) or seeded random tokens (a random-"
                        "weight model's greedy output repeats, and so does its routing)")
    b.add_argument("--routing", choices=["model", "uniform"], default="model",
                   help="the router's choice (default) or top_k experts uniformly at random per token: the cache's "
                        "worst case for a balanced model")
    _engine_args(b)
    b.set_defaults(fn=cmd_bench)

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
