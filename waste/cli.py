"""`waste` command line: thin verbs over the Engine API and the container tools."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import params
from .version import __version__
from .errors import WasteError
from .units import fmt_bytes as _fmt_bytes

# waste/params.py names a parameter as the server does; the CLI says it as its flag
FLAGS = {"max_tokens": "-n", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
         "seed": "--seed", "context": "--context", "threads": "--threads", "repetition_penalty": "--repeat-penalty",
         "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}


def check(fn, *args, **kw):
    """Call a waste/params.py check; its ParamError comes back as a WasteError naming the flag."""
    try:
        return fn(*args, **kw)
    except params.ParamError as e:
        raise WasteError(e.message(FLAGS.get(e.param))) from None


def check_run_args(a) -> None:
    """The sampling and engine flags of run and chat, before anything loads: the server's own limits."""
    check(params.max_tokens, a.n)
    check(params.sampling, a.temperature, a.top_p, a.top_k, a.min_p, a.seed)
    check(params.engine, a.context, a.threads)
    if a.top_k:
        print(f"waste: note: --top-k {a.top_k} samples from the {a.top_k} most likely tokens; routing each token to K "
              "experts is --experts-per-token K (it was --top-k before waste 0.2)", file=sys.stderr)


def model_path(model, check: bool = True):
    """MODEL as given, or the default model's container (converted into the user cache on first use; rebuilt when
    it fails its checks, unless `check` is off: `waste verify` reports what it finds instead)."""
    if model is not None:
        return model
    from .default_model import default_model_path

    return default_model_path(check=check)


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


def _open(path):
    """The container at path, refused by name when its family is not one waste runs."""
    from .container import open_container
    from .models import check_family

    c = open_container(path)
    try:
        check_family(c.family)
    except WasteError:
        c.close()
        raise
    return c


def cmd_info(a):
    from .container.info import describe
    from .models import family

    if a.convert_only:
        return _convert_only(a, a.model)
    c = _open(model_path(_model(a, a.model)))
    d = describe(c, family(c.family).features_of(c.config))
    if d["vision"]:
        from .vision import RUNS

        d["vision"]["runs"] = c.family in RUNS      # image parts accepted (else converted, not run yet)
    if a.model is None:
        d["default_model"] = True
    if a.json:
        print(json.dumps(d, indent=1))
        return
    where = " (the default model: the user cache; WASTE_CACHE_DIR moves it)" if a.model is None else ""
    rows = [("model", str(c.root) + where), ("family", d["family"]), ("layers", d["layers_summary"]),
            ("experts", d["experts_summary"]),
            *[("features" if i == 0 else "", f) for i, f in enumerate(d["features"])],
            ("parameters", f"{_fmt_count(d['params']['total'])} total, {_fmt_count(d['params']['active'])} active per token"),
            ("trunk", f"{_fmt_bytes(d['trunk_bytes'])} on disk ({d['trunk_format']}, norms/router/gates in f32; "
                      "`waste plan` gives its size in memory, in the compute dtype)"),
            ("expert banks", f"{_fmt_bytes(d['bank_bytes'])} on disk in {d['moe_layers']} files ({d['expert_format']}, "
                             f"{_fmt_bytes(d['record_bytes'])} per expert record)"),
            *([("vision tower", f"{_fmt_count(d['vision']['params'])} parameters, {_fmt_bytes(d['vision']['bytes'])} "
                                f"on disk ({d['vision']['format']}); "
                                + ("runs on image parts, loaded on the first image" if d["vision"]["runs"]
                                   else "not run by waste yet: text only"))] if d["vision"] else []),
            ("tokenizer", d["tokenizer"] or "none"), ("chat", d["chat"] or "none"),
            ("converted", d["provenance"])]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


def cmd_verify(a):
    from .container.verify import verify

    path = model_path(a.model, check=False)
    notes: list[str] = []
    problems = verify(path, progress=not a.quiet, notes=notes)
    for n in notes:
        print(f"note: {n}")
    if problems:
        for p in problems:
            print(f"DAMAGED: {p}")
        if a.model is None:
            from .default_model import rebuild_hint

            print(f"{len(problems)} problem(s) found in {path}: {rebuild_hint(path)}")
        else:
            print(f"{len(problems)} problem(s) found in {path}: re-convert the model from its release "
                  f"(waste convert SRC {path} --force)")
        sys.exit(1)
    print(f"OK: every checksum in {path} matches")


def _load(a, model):
    from .engine import Engine

    model = _model(a, model)
    ep = getattr(a, "ep", None)

    def load():
        return Engine.load(model, dtype=a.dtype, budget=a.budget, context=a.context, threads=a.threads,
                           preload=False if a.no_preload else None, experts_per_token=a.experts_per_token,
                           device=a.device, prefetch=a.prefetch, ram=a.ram, vram=a.vram,
                           expert_parallel=ep, prefill_chunk=a.prefill_chunk)
    return load() if ep is None else ep.load(load)


def _engine_args(p):
    p.add_argument("--budget", default=None, help="expert cache size (bytes or K/M/G suffix); default: the memory plan")
    p.add_argument("--context", type=int, default=4096, help="context length the memory plan reserves (default 4096; "
                   "the model's own max_position_embeddings caps it)")
    p.add_argument("--threads", type=int, default=4, help="expert reader threads (default 4)")
    p.add_argument("--no-preload", action="store_true",
                   help="no background fill of the cache when the whole bank fits (also WASTE_PRELOAD=0)")
    p.add_argument("--prefetch", dest="prefetch", action="store_true", default=False,
                   help="read the next MoE layer's predicted experts ahead of its router (next-layer prefetch; off "
                        "by default: it did not measure faster, docs/LEARNED.md §3j; the same output bits either way)")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false", help="no next-layer prefetch (the default)")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16")
    _prefill_chunk_arg(p)
    p.add_argument("--device", default="auto",
                   help="auto (default: cuda when torch sees a GPU, else cpu), cpu to force the CPU, or cuda: trunk and "
                        "expert slab in GPU memory (bf16 / f16 / f32 / q8 experts; q4 / mxfp4 with triton installed)")
    p.add_argument("--vram", default=None,
                   help="with --device cuda: expert records kept in GPU memory (bytes or K/M/G suffix); the rest of "
                        "the expert budget is a pinned host tier below them (default: what the GPU's free memory "
                        "holds, at most the budget)")
    p.add_argument("--ram", default=None, help="plan the expert budget as if the machine had this much memory")
    p.add_argument("--experts-per-token", type=int, default=None, metavar="K",
                   help="route each token to K experts instead of the release's number (fewer: faster, at a quality "
                        "cost; docs/LEARNED.md measures it)")
    p.add_argument("--expert-parallel", type=int, default=None, metavar="N",
                   help="split the routed experts over N processes started by torchrun (`torchrun --nproc-per-node N "
                        "-m waste VERB ... --expert-parallel N`): each holds the trunk and its share of the experts "
                        "in its own budget (--budget is per process); rank 0 answers, the same bits as one process")
    p.add_argument("--placement", default="id", metavar="id|trace:FILE",
                   help="with --expert-parallel: experts in blocks of ids (default) or spread by the frequency "
                        "measured in a routing trace (`waste bench --record-trace FILE`)")


def _prefill_chunk_arg(p):
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="run a prompt through the model N tokens at a time (default: the memory plan's, 512 or less "
                        "where memory is tight); bounds a long prompt's activations, and a chunk's tokens share its "
                        "expert reads")


def _routing_top_k(verb: str):
    """`serve` and `bench` have no sampling --top-k: the flag that routed before waste 0.2 is named, not guessed."""
    class Refuse(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            raise WasteError(f"waste {verb} has no --top-k: route each token to K experts with --experts-per-token K "
                             "(--top-k meant that before waste 0.2)"
                             + ("; a request sets its own sampling top_k" if verb == "serve" else ""))
    return Refuse


def cmd_plan(a):
    from .random_model import is_random
    from .runtime.dtype import resolve_dtype
    from .runtime.plan import plan_memory
    from .runtime.vram import vram_lines, vram_plan
    from .units import parse_size

    check(params.engine, a.context, 1)
    if _is_hub(a.model):
        return _hub_plan(a)
    from .vision import RUNS

    if is_random(a.model):        # random:NAME,...: planned from its shape, nothing generated
        from .random_model import RandomModel

        c = RandomModel(a.model, "cpu")
    else:
        c = _open(model_path(a.model))
    if a.expert_parallel is not None:
        return _plan_ranks(a, c)
    p = plan_memory(c, resolve_dtype(a.dtype, c), a.context, None if a.ram is None else parse_size(a.ram),
                    None if a.budget is None else parse_size(a.budget), prefill_chunk=a.prefill_chunk,
                    vision=c.family in RUNS)
    dev = a.device
    if dev == "auto":
        import torch
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    elif dev != "cpu" and not dev.startswith("cuda"):
        raise WasteError(f"unknown device {dev!r}; choose cpu, cuda or auto")
    vp = vram_plan(p, dev, None if a.vram is None else parse_size(a.vram))     # planned here even without a GPU
    if a.json:
        print(json.dumps({**p.to_json(), **vp}, indent=1))
    else:
        lines = p.lines()      # the floor counts the trunk in memory; `waste info` gives its size on disk
        at = next((i + 1 for i, l in enumerate(lines) if l.startswith("floor")), len(lines))
        dt = str(resolve_dtype(a.dtype, c)).removeprefix("torch.")
        lines.insert(at, f"{'trunk':<16}{_fmt_bytes(p.trunk_bytes)} in memory ({dt} compute, f32 norms/routers), "
                         f"{_fmt_bytes(c.manifest['trunk']['bytes'])} on disk ({c.manifest['trunk']['format']})")
        print("\n".join(lines + vram_lines(vp)))
    if p.warning:
        print(f"waste: warning: {p.warning}", file=sys.stderr)


def _plan_ranks(a, c):
    """waste plan --expert-parallel N: every rank's experts, its share of the routed pairs (with a trace) and its
    memory plan (the ranks on one machine split its memory)."""
    from .runtime import parallel
    from .runtime.dtype import resolve_dtype
    from .runtime.plan import expert_room, plan_memory
    from .units import parse_size

    n = a.expert_parallel
    parallel.check_placement(a.placement)
    layers, top_k = parallel.moe_layers(c), (c.config.get("moe") or {}).get("top_k")
    dt, ram = resolve_dtype(a.dtype, c), None if a.ram is None else parse_size(a.ram)
    gpu = _random_on_gpu(a, c)
    if gpu is not None:       # a random: model lives on the GPUs: each process plans against one GPU's memory
        ram = c.plan_ram(n, gpu)
    # rank 0 holds the trunk, the others experts alone: a rank without room for an even share gets fewer
    rooms = [parse_size(a.budget) if a.budget is not None else
             expert_room(c, dt, a.context, ram, n, a.prefill_chunk, r == 0) for r in range(n)]
    rec = c.manifest["experts"]["record_bytes"]
    weights = parallel.weights_for(rooms, sum(layers.values()) * rec, len(layers) * rec)
    owner = parallel.place(layers, n, a.placement, top_k, weights)
    shares = by_id = None
    if a.placement.startswith("trace:"):
        count = parallel.frequencies(layers, parallel.traces.load(a.placement[len("trace:"):]), top_k)
        shares, peak = parallel.shares(owner, count, n)
        by_id, peak_id = parallel.shares(parallel.place(layers, n, "id"), count, n)
    ranks = []
    for r in range(n):
        per_layer = [o.count(r) for o in owner.values()]
        try:
            p = plan_memory(c, dt, a.context, ram, None if a.budget is None else parse_size(a.budget), per_layer, n,
                            a.prefill_chunk, trunk=r == 0)
        except WasteError as e:
            raise WasteError(f"rank {r} ({'the trunk and ' if r == 0 else ''}{sum(per_layer)} expert records): {e}")
        ranks.append({"rank": r, "experts_per_layer": per_layer, "pair_share": None if shares is None else shares[r],
                      "trunk": r == 0, "plan": p.to_json(), "lines": p.lines()})
    # a random model keeps every expert resident; a container streams what its budget does not hold
    fits = all(x["plan"]["resident"] for x in ranks)
    where = f"{n} GPUs of {_fmt_bytes(gpu)}" if gpu is not None else "one machine"
    verdict = (f"fits: every rank holds all its experts resident ({where})" if fits else
               "does not fit resident: " + ", ".join(f"rank {x['rank']} holds {_fmt_bytes(x['plan']['budget_bytes'])} "
                                                     f"of its {_fmt_bytes(x['plan']['bank_bytes'])}"
                                                     for x in ranks if not x["plan"]["resident"]) +
               (" (a random model needs them all: refused)" if gpu is not None or _is_random_model(c) else
                " (the rest streams from disk)"))
    if a.json:
        print(json.dumps({"expert_parallel": n, "placement": a.placement, "gpu_bytes": gpu, "fits": fits,
                          "weights": weights, "layer_peak": None if shares is None else peak,
                          "by_id": None if shares is None else {"pair_share": by_id, "layer_peak": peak_id},
                          "ranks": [{k: v for k, v in x.items() if k != "lines"} for x in ranks]}, indent=1))
        return
    print(f"expert parallel {n} processes on {where} ({a.placement} placement"
          + (", experts weighed by each rank's room: rank 0 holds the trunk" if weights else "") +
          f"; torchrun --nproc-per-node {n} -m waste VERB ... --expert-parallel {n})")
    if shares is not None:
        print(f"routed pairs per rank in the trace: {' / '.join(f'{100 * s:.1f}%' for s in shares)}; busiest rank "
              f"per layer {peak:.2f}x an even share (blocks of ids: "
              f"{' / '.join(f'{100 * s:.1f}%' for s in by_id)}; {peak_id:.2f}x)")
    for x in ranks:
        e = x["experts_per_layer"]
        print(f"-- rank {x['rank']}: {sum(e)} expert records ({min(e)} to {max(e)} per MoE layer)"
              + ("" if x["trunk"] else ", no trunk (it computes experts only)"))
        print("\n".join(x["lines"]))
    print(verdict)


def _is_random_model(c) -> bool:
    from .random_model import RandomModel

    return isinstance(c, RandomModel)


def _random_on_gpu(a, c) -> int | None:
    """For a random: model planned for GPUs (--device cuda, or auto with one here): the bytes of one GPU, from
    --vram SIZE or this machine's first GPU; else None."""
    from .units import parse_size

    if not _is_random_model(c) or a.device == "cpu":
        return None
    import torch

    if a.vram is not None:
        return parse_size(a.vram)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    if a.device == "auto":
        return None
    raise WasteError("waste plan random:... --device cuda: no GPU here to size from; give --vram SIZE, one GPU's "
                     "memory (141G for an H200)")


def cmd_bench(a):
    from .runtime.bench import bench, report_lines

    check(params.max_tokens, a.n)
    check(params.engine, a.context, a.threads)
    if a.prompt_len < 1:
        raise WasteError("--prompt-len must be a positive number of tokens")
    if a.routing.startswith("trace:"):
        from .runtime.trace import load as load_trace

        load_trace(a.routing[len("trace:"):])          # a bad file is refused before the model loads
    elif a.routing not in ("model", "uniform"):
        raise WasteError(f"--routing {a.routing!r}: use model, uniform or trace:FILE")
    text = None
    if a.text is not None:
        try:
            text = Path(a.text).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise WasteError(f"--text {a.text}: cannot read it as text ({exc})")
    eng = _load(a, a.model)
    try:
        r = bench(eng, n=a.n, prompt_len=a.prompt_len, feed=a.feed, routing=a.routing, profile=a.profile,
                  text=text, record_trace=a.record_trace)
        if hasattr(eng.experts, "rank_stats"):   # --expert-parallel: every rank's cache and exchanges
            r["expert_parallel"] = {**eng.experts.report(), "ranks": eng.experts.rank_stats()}
    finally:
        eng.close()
    print(json.dumps(r, indent=1) if a.json else "\n".join(report_lines(r) + _ep_lines(r)))


def _ep_lines(r: dict) -> list[str]:
    ep = r.get("expert_parallel")
    if not ep:
        return []
    n = max(ep["rounds"], 1)
    lines = [f"expert parallel {ep['processes']} processes ({ep['placement']} placement): {ep['rounds']} MoE-layer "
             f"exchanges of {ep['exchange_seconds'] / n * 1e3:.2f} ms (rows out, compute, pairs back), "
             f"{ep['comm_seconds'] / n * 1e3:.2f} ms of it in all-to-all (waits for the slowest rank included)"]
    for x in ep["ranks"]:
        lines.append(f"  rank {x['rank']}: experts {x['hits']} hit / {x['misses']} miss, "
                     f"{_fmt_bytes(x['bytes_read'])} read, {_fmt_bytes(x['bytes_sent'])} sent")
    return lines


def cmd_route_diff(a):
    from .runtime.trace import agreement, routes

    engines = []
    try:
        for path in (a.a, a.b):
            engines.append(_load(a, path))
        ids = [e.encode(a.prompt) for e in engines]
        if ids[0] != ids[1]:
            raise WasteError("the two containers tokenize the prompt differently: they are not one model")
        if not ids[0]:
            raise WasteError("the prompt is empty: give some text")
        r = agreement(*(routes(e, ids[0]) for e in engines))
    finally:
        for e in engines:
            e.close()
    r = {"a": a.a, "b": a.b, "tokens": len(ids[0]), **r}
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"{len(ids[0])} tokens; per MoE layer: set agreement (same experts, any order) / rank agreement")
    for layer, v in r["layers"].items():
        print(f"layer {layer:<4} set {100 * v['set']:6.2f}%  rank {100 * v['rank']:6.2f}%")
    print(f"mean       set {100 * r['set']:6.2f}%  rank {100 * r['rank']:6.2f}%")


def cmd_sweep(a):
    from .runtime.sweep import parse_arm, report_lines, sweep, _same_model

    check(params.max_tokens, a.n)
    check(params.engine, a.context, a.threads)
    if a.prompt_len < 1 or a.repeat < 1:
        raise WasteError("--prompt-len and --repeat must be positive numbers")
    arms = [parse_arm(t) for t in a.arm or []]
    if not arms:
        raise WasteError("give at least one --arm NAME:FLAGS, e.g. --arm base: --arm nopf:--no-prefetch")
    text = None
    if a.text is not None:
        try:
            text = Path(a.text).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise WasteError(f"--text {a.text}: cannot read it as text ({exc})")
    if a.routing.startswith("trace:"):
        from .runtime.trace import load as load_trace

        load_trace(a.routing[len("trace:"):])
    elif a.routing not in ("model", "uniform"):
        raise WasteError(f"--routing {a.routing!r}: use model, uniform or trace:FILE")
    a.no_preload = True          # every run starts from an empty store of its own; the loaded one stays untouched
    engines = {}
    try:
        engines[None] = _load(a, a.model)
        for arm in arms:
            if arm.model is not None and arm.model not in engines:
                engines[arm.model] = _load(a, arm.model)
                _same_model(engines[None], engines[arm.model])
        defaults = dict(budget=a.budget, context=a.context, threads=a.threads, prefetch=a.prefetch,
                        prefill_chunk=a.prefill_chunk, verify=True, direct=True)
        r = sweep(engines, arms, defaults, repeat=a.repeat, n=a.n, prompt_len=a.prompt_len,
                  feed="random", routing=a.routing, text=text,
                  progress=lambda s: print(s, file=sys.stderr, flush=True))
    finally:
        for e in engines.values():
            e.close()
    print(json.dumps(r, indent=1) if a.json else "\n".join(report_lines(r)))


def cmd_chat(a):
    from .chat_cli import cmd_chat as chat

    if a.convert_only:
        return _convert_only(a, a.model)
    check_run_args(a)
    chat(a, _load)


def cmd_serve(a):
    from .units import parse_size

    if a.max_queue < 0 or a.max_batch < 1:
        raise WasteError("--max-queue must be 0 or more and --max-batch 1 or more")
    check(params.engine, a.context, a.threads)
    max_body = parse_size(a.max_body)
    if max_body < 1024:
        raise WasteError("--max-body must be at least 1K (a request is a JSON body)")
    if not a.shutdown_grace >= 0:
        raise WasteError("--shutdown-grace must be 0 or more seconds")
    from .serve.listen import bind

    if a.convert_only:
        return _convert_only(a, a.model)
    if _is_hub(a.model):          # fetched and converted (once) before the port is bound
        a.model_name, a.model = a.model_name or a.model, _model(a, a.model)
    sock = bind(a.host, a.port)   # before the slow imports: connections wait in the backlog, never refused
    if a.model is not None:       # a bad path or a damaged manifest: an error now, not a server that fails later
        _open(a.model).close()
    from .serve.app import serve

    key = a.api_key or os.environ.get("WASTE_API_KEY") or None
    serve(a.model, host=a.host, port=a.port, api_key=key, max_queue=a.max_queue, max_batch=a.max_batch,
          model_name=a.model_name, load=lambda model: _load(a, model), sock=sock, max_body=max_body,
          grace=a.shutdown_grace, image_urls=not a.no_image_urls)


def cmd_run(a):
    import shlex
    from pathlib import Path

    if a.convert_only:
        return _convert_only(a, a.args[0])
    model, prompt = (None, a.args[0]) if len(a.args) == 1 else (a.args[0], " ".join(a.args[1:]))
    if model is not None and not Path(model).expanduser().exists() and "/" not in model \
            and not model.endswith(".waste"):
        raise WasteError(f"no such model: {model}. If {' '.join(a.args)!r} is the prompt, quote it: "
                         f"waste run {shlex.quote(' '.join(a.args))}")
    check_run_args(a)
    penalties = check(params.penalties, a.presence_penalty, a.frequency_penalty, a.repeat_penalty)
    schema = _json_schema_file(a.json_schema) if a.json_schema else None
    eng = _load(a, model)
    if eng.plan.warning:
        print(f"waste: warning: {eng.plan.warning}", file=sys.stderr)
    from .chat import context_length

    if a.image:
        return _run_with_images(a, eng, prompt)
    ids = eng.encode(prompt)
    ctx = context_length(eng)
    try:
        params.room(len(ids), a.n, ctx, strict=True)
    except params.ParamError as e:
        positions = eng.container.config.get("max_position_embeddings")
        why = ("the model's max_position_embeddings" if positions and positions <= a.context
               else "--context")
        raise WasteError(f"{e.message(FLAGS.get(e.param))} ({why}): lower -n, shorten the prompt"
                         + (" or raise --context" if why == "--context" else "")) from None
    g = eng.generate(ids, max_tokens=a.n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                     seed=a.seed, stop=a.stop, stream=True, json_schema=schema, **penalties)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    try:
        for piece in g:
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        sys.stdout.write("\n")
        print(g.stats.line(), file=sys.stderr)


def _run_with_images(a, eng, prompt: str) -> None:
    """`waste run MODEL --image PATH PROMPT`: one user turn (the images, then the prompt) through the model's chat
    format; the reply is printed as it streams."""
    from .images.sources import file_part
    from .text.parsers import Content, Reasoning

    if not eng.vision.available:
        raise WasteError(f"--image: {eng.vision.why_not()}")
    parts = [{"type": "image", "image": file_part(p)["image"]} for p in a.image]
    c = eng.chat([{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}], max_tokens=a.n,
                 temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, seed=a.seed,
                 stop=a.stop or None, stream=True)
    try:
        for event in c:
            if isinstance(event, (Content, Reasoning)):
                sys.stdout.write(event.text)
                sys.stdout.flush()
    finally:
        sys.stdout.write("\n")
        print(c.stats.line(), file=sys.stderr)


def _json_schema_file(path) -> dict:
    """--json-schema FILE: a JSON schema object, read and compiled before the model loads."""
    from pathlib import Path

    from .text.grammar import json_grammar

    try:
        schema = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as e:
        raise WasteError(f"--json-schema {path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise WasteError(f"--json-schema {path}: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise WasteError(f"--json-schema {path}: a JSON schema is an object, not {type(schema).__name__}")
    try:
        json_grammar(schema)
    except WasteError as e:
        raise WasteError(f"--json-schema {path}: {e}") from None
    return schema


# ---- models from the Hub (waste/hub): MODEL may be ORG/NAME; fetch, list, rm ----
def _is_hub(model) -> bool:
    from .hub import is_repo_id

    return is_repo_id(model)


def _model(a, model):
    """MODEL as given, or for ORG/NAME the container in the cache (fetched and converted once)."""
    if not _is_hub(model):
        return model
    from .hub.cache import ensure_container
    from .units import parse_size

    budget = getattr(a, "budget", None)
    return str(ensure_container(model, getattr(a, "revision", None), getattr(a, "dir", None),
                                getattr(a, "experts", None), getattr(a, "trunk", None), getattr(a, "context", 4096),
                                None if budget is None else parse_size(budget), getattr(a, "dtype", "auto")))


def _convert_only(a, model):
    if not _is_hub(model):
        raise WasteError(f"--convert-only takes MODEL = ORG/NAME, a model on the Hub (got {model!r})")
    print(_model(a, model))


def _hub_plan(a):
    from .hub.cache import plan
    from .units import fmt_bytes, parse_size

    p, est, remote = plan(a.model, a.revision, a.experts, a.trunk, a.dtype, a.context,
                          None if a.ram is None else parse_size(a.ram), None if a.budget is None else parse_size(a.budget),
                          a.prefill_chunk)
    src = {"repo": remote.repo, "commit": remote.commit, "family": est.family, "release_bytes": est.release_bytes,
           "container_bytes": est.container_bytes, "experts_format": est.experts, "trunk_format": est.trunk}
    if a.json:
        print(json.dumps({**p.to_json(), "hub": src}, indent=1))
    else:
        print("\n".join([f"model           {remote.repo}@{remote.commit[:12]} ({est.family}), from the Hub's metadata "
                         f"(nothing downloaded)",
                         f"disk            release {fmt_bytes(est.release_bytes)} + container about "
                         f"{fmt_bytes(est.container_bytes)} (experts {est.experts}, trunk {est.trunk})"] + p.lines()))
    if p.warning:
        print(f"waste: warning: {p.warning}", file=sys.stderr)


def cmd_fetch(a):
    from .hub import is_repo_id
    from .hub.cache import fetch

    if not is_repo_id(a.repo):
        raise WasteError(f"{a.repo!r} is not a Hub model name: give ORG/NAME, e.g. moonshotai/Kimi-Linear-48B-A3B-Instruct")
    print(fetch(a.repo, a.revision, a.dir, a.experts, a.trunk))


def cmd_list(a):
    from .hub.cache import describe, list_cache

    entries = list_cache()
    if a.json:
        print(json.dumps([{**e.__dict__, "path": str(e.path)} for e in entries], indent=1))
    else:
        print("\n".join(describe(entries)))


def cmd_rm(a):
    from .hub.cache import remove

    total = 0
    for name in a.names:
        for path, n in remove(name, a.release_only):
            print(f"removed {path} ({_fmt_bytes(n)})")
            total += n
    print(f"freed {_fmt_bytes(total)}")


def _hub_args(p, convert_only: bool = True, download: bool = True):
    g = p.add_argument_group("models from the Hub (MODEL = ORG/NAME)")
    g.add_argument("--revision", default=None, help="branch, tag or commit of the Hub repository (default main)")
    if download:
        g.add_argument("--dir", default=None, help="download the release here instead of WASTE_CACHE_DIR/hub")
    if "--experts" not in p._option_string_actions:
        g.add_argument("--experts", default=None, help="container format of the routed experts (as `waste convert`; "
                       "default auto)")
        g.add_argument("--trunk", default=None, help="container format of the trunk (as `waste convert`; default q8)")
    if convert_only:
        g.add_argument("--convert-only", action="store_true", help="fetch and convert if needed, print the "
                       "container's path, stop")


def _hub_parsers(sub, parsers):
    for p in parsers:
        plan = p.prog.split()[-1] == "plan"
        _hub_args(p, convert_only=not plan, download=not plan)
    f = sub.add_parser("fetch", help="download a model from the Hub, resumable, every file checked", description=(
        "waste fetch ORG/NAME: refuses first, with the numbers, when the disk cannot hold release + container or "
        "this machine cannot run the model; then downloads what conversion needs (resumes an interrupted fetch) "
        "and checks every file's size and hash. HF_TOKEN (or `hf auth login`) for private and gated models."))
    f.add_argument("repo", metavar="ORG/NAME")
    _hub_args(f, convert_only=False)
    f.set_defaults(fn=cmd_fetch)
    ls = sub.add_parser("list", help="the models in the cache: releases and containers, sizes, formats, family")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_list)
    rm = sub.add_parser("rm", help="remove a model from the cache and say what it frees", description=(
        "waste rm NAME...: NAME as `waste list` shows it. ORG/NAME removes the downloaded release and every "
        "container converted from it; a container's name removes that container."))
    rm.add_argument("names", nargs="+", metavar="NAME")
    rm.add_argument("--release-only", action="store_true",
                    help="for ORG/NAME: remove the downloaded release only; its containers run without it")
    rm.set_defaults(fn=cmd_rm)


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

    r = sub.add_parser("run", help="generate text from a prompt", usage="waste run [MODEL] PROMPT [options]",
                       description="waste run [MODEL] PROMPT: with one argument it is the prompt and the default model "
                                   "is used. Quote a prompt of several words.")
    r.add_argument("args", nargs="+", metavar="MODEL PROMPT", help="the model's container (optional) and the prompt")
    r.add_argument("-n", type=int, default=128, help="tokens to generate (default 128)")
    # Sampling by default, with a fixed seed: small models loop under greedy decoding, and a fixed seed keeps
    # the same command printing the same text (docs/LEARNED.md §4). --temperature 0 is greedy.
    r.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (default 0.7)")
    r.add_argument("--top-p", type=float, default=0.9, help="default 0.9")
    r.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K most likely tokens (default 0: off)")
    r.add_argument("--min-p", type=float, default=0.05, help="default 0.05")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (default 0: the same text every run)")
    r.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    r.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image file (repeatable): the prompt becomes one chat turn with the images before it "
                        "(a model with a vision tower)")
    r.add_argument("--repeat-penalty", type=float, default=None, metavar="P",
                   help="divide the logit of every token of the prompt and the output by P (times P if negative); "
                        "1 is off (default)")
    r.add_argument("--presence-penalty", type=float, default=None, metavar="P", help="-2 to 2 (default 0)")
    r.add_argument("--frequency-penalty", type=float, default=None, metavar="P", help="-2 to 2 (default 0)")
    r.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the output is JSON matching the schema in FILE (constrained decoding)")
    _engine_args(r)
    r.set_defaults(fn=cmd_run)

    ch = sub.add_parser("chat", help="chat with a model in the terminal", description=(
        "waste chat [MODEL]: an interactive chat through the model's chat format (the default model when MODEL is "
        "omitted). /help inside lists the commands."))
    ch.add_argument("model", nargs="?", default=None)
    ch.add_argument("-n", type=int, default=512, help="most tokens per reply (default 512; the context caps it)")
    ch.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    ch.add_argument("--top-p", type=float, default=1.0)
    ch.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K most likely tokens (0: off)")
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
        "/detokenize (the default model when MODEL is omitted). The port is bound at once (a connection waits a few "
        "seconds for the server to start, never refused); /health answers 503 until the model is loaded. SIGTERM "
        "drains: see --shutdown-grace."))
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
    sv.add_argument("--max-body", default="4M", metavar="SIZE",
                    help="largest request body (bytes or K/M suffix); a larger one gets 413 unread (default 4M)")
    sv.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                    help="on SIGTERM, how long running requests may finish before they are ended with an error "
                         "event (default 30)")
    sv.add_argument("--no-image-urls", action="store_true",
                    help="refuse http(s) image URLs in image_url parts (data: URLs still work); by default they are "
                         "fetched, up to 20 MB and 10 s each")
    _engine_args(sv)
    sv.add_argument("--top-k", action=_routing_top_k("serve"), help=argparse.SUPPRESS)
    sv.set_defaults(fn=cmd_serve)

    pl = sub.add_parser("plan", help="print the memory plan: floor, working set, bank, the chosen expert budget")
    pl.add_argument("model", nargs="?", default=None, help="default: the bundled default model")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--ram", default=None, help="plan as if the machine had this much memory")
    pl.add_argument("--context", type=int, default=4096)
    pl.add_argument("--budget", default=None, help="check a budget instead of choosing one")
    pl.add_argument("--dtype", default="auto")
    pl.add_argument("--expert-parallel", type=int, default=None, metavar="N",
                    help="plan every process of N (`--expert-parallel N` under torchrun): its experts and memory")
    pl.add_argument("--placement", default="id", metavar="id|trace:FILE",
                    help="with --expert-parallel: experts in blocks of ids (default) or spread by a routing trace's "
                         "measured frequency (then each rank's share of the routed pairs is printed)")
    pl.add_argument("--device", default="auto", help="auto (default: cuda when a GPU is present), cpu or cuda: "
                    "with cuda, the two-tier plan (VRAM budget over the host budget)")
    pl.add_argument("--vram", default=None, help="with --device cuda: plan this much GPU memory for expert records "
                    "(default: what this machine's GPU has free)")
    _prefill_chunk_arg(pl)
    pl.set_defaults(fn=cmd_plan)

    b = sub.add_parser("bench", help="measure prefill and decode speed, cache hit rate and bytes read")
    b.add_argument("model", nargs="?", default=None, help="default: the bundled default model")
    b.add_argument("-n", type=int, default=64, help="tokens to decode (default 64)")
    b.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    b.add_argument("--json", action="store_true")
    b.add_argument("--feed", choices=["greedy", "random"], default="greedy",
                   help="decode steps take the model's greedy token (default) or seeded random tokens (a random-"
                        "weight model's greedy output repeats, and so does its routing)")
    b.add_argument("--routing", default="model", metavar="model|uniform|trace:FILE",
                   help="the router's choice (default), top_k experts uniformly at random per token (the cache's "
                        "worst case for a balanced model), or a routing trace recorded by --record-trace replayed "
                        "(scaled to this model's expert count; its recorded predictions drive prefetch)")
    b.add_argument("--record-trace", default=None, metavar="FILE",
                   help="write this run's routing per token and layer (and prefetch's predictions) to FILE")
    b.add_argument("--text", default=None, metavar="FILE",
                   help="prompt and decode feed from this text file's tokens (e.g. held-out code, to record a trace)")
    b.add_argument("--profile", action="store_true",
                   help="per-token time in buckets (attention, router, expert compute, expert wait, trunk matvec, "
                        "sampling, other) and the torch operators of one decode step")
    _engine_args(b)
    b.add_argument("--top-k", action=_routing_top_k("bench"), help=argparse.SUPPRESS)
    b.set_defaults(fn=cmd_bench)

    rd = sub.add_parser("route-diff", help="per-layer routing agreement of two containers (formats) of one model")
    rd.add_argument("a")
    rd.add_argument("b")
    rd.add_argument("prompt")
    rd.add_argument("--json", action="store_true")
    _engine_args(rd)
    rd.set_defaults(fn=cmd_route_diff)

    sw = sub.add_parser("sweep", help="several arms (budget, experts per token, threads, prefetch, format) of one "
                        "model in one process, interleaved: speed, hit rate, bytes read, routing agreement")
    sw.add_argument("model", nargs="?", default=None, help="default: the bundled default model")
    sw.add_argument("--arm", action="append", metavar="NAME:FLAGS",
                    help="an arm: a name and its flags (--budget SIZE, --threads N, --compute-threads N, "
                         "--experts-per-token K, --prefetch / --no-prefetch, --prefill-chunk N, --model PATH: another "
                         "container of this model); repeat it; the first is what routing is compared with")
    sw.add_argument("-n", type=int, default=32, help="tokens to decode per run (default 32)")
    sw.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    sw.add_argument("--repeat", type=int, default=3, help="runs per arm, interleaved (default 3)")
    sw.add_argument("--routing", default="model", metavar="model|uniform|trace:FILE", help="as waste bench's")
    sw.add_argument("--text", default=None, metavar="FILE", help="prompt and decode feed from this text's tokens "
                    "(default: the bench prompt and seeded random tokens; never an arm's own output)")
    sw.add_argument("--json", action="store_true")
    _engine_args(sw)
    sw.set_defaults(fn=cmd_sweep)

    i = sub.add_parser("info", help="describe a container")
    i.add_argument("model", nargs="?", default=None, help="default: the bundled default model (says where it lives)")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_info)

    v = sub.add_parser("verify", help="check every checksum of a container and name what is damaged")
    v.add_argument("model", nargs="?", default=None, help="default: the bundled default model")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    v.set_defaults(fn=cmd_verify)
    _hub_parsers(sub, [r, ch, sv, pl, i])
    return p


def _dispatch(args) -> None:
    """The verb; under --expert-parallel, on rank 0, while the other ranks answer its MoE layers."""
    n = getattr(args, "expert_parallel", None)
    if n is None or args.verb == "plan":       # plan sizes the processes without being one of them
        return args.fn(args)
    from .runtime.parallel import ExpertParallel

    model = args.args[0] if args.verb == "run" and len(args.args) > 1 else getattr(args, "model", None)
    if args.verb == "route-diff":
        raise WasteError("waste route-diff has no --expert-parallel: compare the two containers in one process")
    if _is_hub(model):
        raise WasteError(f"--expert-parallel takes a local container: convert {model} first "
                         f"(waste run {model} --convert-only prints its path)")
    args.ep = ExpertParallel.start(os.environ, n, args.placement, args.device,
                                   report=lambda m: print(f"waste: error: {m}", file=sys.stderr, flush=True))
    try:
        if args.ep.rank == 0:
            args.fn(args)
        else:
            eng = _load(args, model)
            try:
                eng.experts.follow()
            finally:
                eng.close()
    finally:
        args.ep.close()


def _uses_default(args) -> bool:
    if args.verb == "run":
        return len(args.args) == 1
    return getattr(args, "model", "") is None


def main(argv=None) -> int:
    # before numpy loads (verbs import it): its spinning BLAS threads would starve numba's vq3 / mxfp4 kernels
    # (shared/reference/machine.md §C); a value the user set is kept
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and getattr(args, "verb", None) == "run" and not any(x.startswith("-") for x in extra):
            args.args += extra       # `waste run MODEL --image PATH PROMPT`: the prompt after an option
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except WasteError as e:          # a flag refused by name (a renamed one)
        print(f"waste: error: {e}", file=sys.stderr)
        return 1
    try:
        _dispatch(args)
    except WasteError as e:
        from .errors import DamagedContainer

        hint = ""
        if isinstance(e, DamagedContainer) and _uses_default(args):
            from .default_model import default_container, rebuild_hint

            hint = f" ({rebuild_hint(default_container())})"
        print(f"waste: error: {e}{hint}", file=sys.stderr)
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
