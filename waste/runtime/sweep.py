"""`waste sweep MODEL --arm NAME:FLAGS ...`: several arms of one model measured in one process, interleaved.

An arm changes what can change without reloading the trunk: the expert budget, reader threads, compute threads,
experts per token, prefetch, the prefill chunk; `--model PATH` points an arm at another container of the same
model (another expert format), loaded once beside the first. Every run of an arm gets a fresh, empty expert store
(cold, no background fill), runs `waste bench`'s prefill and decode on the same tokens as every other arm (decode
fed seeded random tokens or a text, never the arm's own output, so the arms route the same inputs), and records
its routing. Runs go round the arms `repeat` times, starting one arm later each round, so that load on a shared
machine falls on every arm alike. Routing is compared with the first arm's: set agreement (the same experts,
in any order) and rank agreement (the same expert at each rank) apart, over the first min(k) ranks when the arms
route to different numbers of experts.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
from dataclasses import dataclass

import torch

from ..errors import WasteError
from ..layers.moe import kernel_for
from ..units import fmt_bytes, parse_size
from .bench import bench
from .cache import ExpertCache
from .plan import plan_memory


@dataclass
class Arm:
    name: str
    flags: str
    budget: str | None = None
    threads: int | None = None
    compute_threads: int | None = None
    experts_per_token: int | None = None
    prefetch: bool | None = None
    prefill_chunk: int | None = None
    model: str | None = None


class _Refuse(argparse.ArgumentParser):
    def error(self, message):
        raise WasteError(message)


def _arm_parser(name: str) -> argparse.ArgumentParser:
    p = _Refuse(prog=f"--arm {name}:", add_help=False)
    p.add_argument("--budget")
    p.add_argument("--threads", type=int)
    p.add_argument("--compute-threads", type=int)
    p.add_argument("--experts-per-token", type=int)
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false", default=None)
    p.add_argument("--prefetch", dest="prefetch", action="store_true")
    p.add_argument("--prefill-chunk", type=int)
    p.add_argument("--model")
    return p


ARM_FLAGS = ("--budget SIZE, --threads N (reader threads), --compute-threads N, --experts-per-token K, "
             "--prefetch / --no-prefetch, --prefill-chunk N, --model PATH (another container of this model)")


def parse_arm(text: str) -> Arm:
    name, sep, flags = text.partition(":")
    if not sep or not name.strip():
        raise WasteError(f"--arm {text!r}: write NAME:FLAGS, e.g. --arm base: --arm small:'--budget 1G' "
                         f"(flags: {ARM_FLAGS})")
    try:
        ns = _arm_parser(name).parse_args(shlex.split(flags))
    except WasteError as e:
        raise WasteError(f"--arm {name}: {e} (an arm takes {ARM_FLAGS})") from None
    for flag, v in (("--threads", ns.threads), ("--compute-threads", ns.compute_threads),
                    ("--experts-per-token", ns.experts_per_token), ("--prefill-chunk", ns.prefill_chunk)):
        if v is not None and v < 1:
            raise WasteError(f"--arm {name}: {flag} {v}: give a positive number")
    if ns.budget is not None:
        try:
            parse_size(ns.budget)
        except (WasteError, ValueError):
            raise WasteError(f"--arm {name}: --budget {ns.budget!r}: give bytes or a K/M/G size") from None
    return Arm(name=name.strip(), flags=flags.strip(), **vars(ns))


def _same_model(a, b) -> None:
    ca, cb = a.container.config, b.container.config
    keys = ("num_layers", "hidden_size", "vocab_size")
    if a.container.family != b.container.family or any(ca.get(k) != cb.get(k) for k in keys) or \
            (ca.get("moe") or {}).get("num_experts") != (cb.get("moe") or {}).get("num_experts"):
        raise WasteError(f"{b.container.root} is not a container of the same model as {a.container.root} "
                         "(family, layers, widths, vocabulary or expert count differ): an arm's --model must be "
                         "another format of the first model")


def run_arm(engine, arm: Arm, defaults: dict, bench_kw: dict) -> dict:
    """One run of one arm on a fresh, empty expert store swapped into the engine; the engine is left as it was."""
    m, c = engine.model, engine.container
    budget = arm.budget if arm.budget is not None else defaults.get("budget")
    chunk = arm.prefill_chunk or defaults.get("prefill_chunk")
    plan = plan_memory(c, engine.dtype, defaults["context"], None, None if budget is None else parse_size(budget),
                       prefill_chunk=chunk, baseline=engine.plan.baseline_bytes)     # the process as it was before loading
    prefetch = arm.prefetch if arm.prefetch is not None else defaults["prefetch"]
    store = ExpertCache(c, plan.budget_bytes, engine.dtype, threads=arm.threads or defaults["threads"],
                        preload=False, verify=defaults["verify"], direct=defaults["direct"],
                        device=str(m.device), prefetch=prefetch)
    saved = (engine.experts, engine.plan, m.experts, m.bank, m.kernel, m.top_k, m.prefill_chunk,
             torch.get_num_threads())
    try:
        engine.experts, engine.plan, m.experts = store, plan, store
        m.bank = store.make_bank(m.device) if m.moe else None
        m.kernel = kernel_for(m.bank.fmt, m.device) if m.bank is not None else None
        if arm.experts_per_token is not None:
            release = (m.cfg.get("moe") or {}).get("top_k") or 0
            if not 1 <= arm.experts_per_token <= release:
                raise WasteError(f"--arm {arm.name}: --experts-per-token {arm.experts_per_token}: choose 1 to "
                                 f"{release} (the release's experts per token)")
            m.top_k = arm.experts_per_token
        m.prefill_chunk = plan.prefill_chunk
        if arm.compute_threads:
            torch.set_num_threads(arm.compute_threads)
        m.route_trace = []
        r = bench(engine, **bench_kw)
        routes: dict[int, list] = {}
        for layer, idx in m.route_trace:
            routes.setdefault(layer, []).append(idx)
        r["routes"] = {layer: torch.cat(v) for layer, v in routes.items()}
        r["prefill_chunk"] = plan.prefill_chunk
        return r
    finally:
        m.route_trace = None
        (engine.experts, engine.plan, m.experts, m.bank, m.kernel, m.top_k, m.prefill_chunk, threads) = saved
        torch.set_num_threads(threads)
        store.close()


def agreement(ref: dict, got: dict) -> dict:
    """Set and rank agreement of `got`'s routing with `ref`'s, over every (token, layer) and the first min(k)
    ranks of both."""
    if sorted(ref) != sorted(got):
        raise WasteError("the arms route different layers: not one model")
    same_set = same_rank = total = 0
    for layer in ref:
        x, y = ref[layer], got[layer]
        if x.shape[0] != y.shape[0]:
            raise WasteError(f"layer {layer}: the arms routed {x.shape[0]} and {y.shape[0]} rows")
        k = min(x.shape[1], y.shape[1])
        x, y = x[:, :k], y[:, :k]
        same_set += int((x.unsqueeze(-1) == y.unsqueeze(-2)).any(-1).sum())
        same_rank += int((x == y).sum())
        total += x.numel()
    return {"set": same_set / total if total else 1.0, "rank": same_rank / total if total else 1.0}


def sweep(engines: dict, arms: list[Arm], defaults: dict, repeat: int = 3, progress=None, **bench_kw) -> dict:
    """engines: container path (None: the first) -> Engine; every arm runs `repeat` times, interleaved."""
    if not arms:
        raise WasteError("give at least one --arm NAME:FLAGS (the first is what the others are compared with)")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise WasteError(f"arm names must differ: {names}")
    runs: dict[str, list[dict]] = {a.name: [] for a in arms}
    for r in range(repeat):
        for j in range(len(arms)):
            arm = arms[(j + r) % len(arms)]
            res = run_arm(engines[arm.model], arm, defaults, bench_kw)
            runs[arm.name].append(res)
            if progress:
                d = res["decode"]
                per = 1e3 / max(d["tokens"], 1)
                progress(f"round {r + 1}/{repeat} {arm.name}: prefill {res['prefill']['tok_per_s']:.2f} tok/s, decode "
                         f"{d['tok_per_s']:.2f} tok/s ({per * d['cpu_seconds']:.0f} CPU ms a token, "
                         f"{per * d['wait_seconds']:.0f} ms waiting for reads), hit {100 * d['hit_rate']:.1f}%, read "
                         f"{fmt_bytes(d['bytes_read'])} + ahead {fmt_bytes(d['prefetch_bytes'])}, I/O bound "
                         f"{d['io_bound_tok_per_s'] or 0:.1f} tok/s")
    ref = runs[arms[0].name]
    out = []
    for arm in arms:
        rs = runs[arm.name]
        agree = [agreement(a["routes"], b["routes"]) for a, b in zip(ref, rs)]

        def med(key, phase="decode"):
            v = [x[phase][key] for x in rs]
            return {"median": statistics.median(v), "min": min(v), "max": max(v)}

        last = rs[-1]
        out.append({
            "name": arm.name, "flags": arm.flags, "model": last["model"], "budget_bytes": last["budget_bytes"],
            "prefetch": last["prefetch"], "prefill_chunk": last["prefill_chunk"],
            "experts_per_token": arm.experts_per_token, "runs": len(rs),
            "prefill_tok_per_s": med("tok_per_s", "prefill"), "decode_tok_per_s": med("tok_per_s"),
            "decode_hit_rate": med("hit_rate"),
            "decode_bytes_read": med("bytes_read"), "decode_prefetch_bytes": med("prefetch_bytes"),
            "prefill_bytes_read": med("bytes_read", "prefill"),
            "decode_io_bound_tok_per_s": [x["decode"]["io_bound_tok_per_s"] for x in rs],
            "decode_cpu_ms_per_token": statistics.median(1e3 * x["decode"]["cpu_seconds"] / max(x["decode"]["tokens"], 1)
                                                         for x in rs),
            "decode_wait_ms_per_token": statistics.median(1e3 * x["decode"]["wait_seconds"] / max(x["decode"]["tokens"], 1)
                                                          for x in rs),
            "prefetch_precision": _median_or_none(x["decode"]["prefetch_precision"] for x in rs),
            "prefetch_recall": _median_or_none(x["decode"]["prefetch_recall"] for x in rs),
            "set_agreement": statistics.median(a["set"] for a in agree),
            "rank_agreement": statistics.median(a["rank"] for a in agree),
        })
    first = ref[-1]
    return {"arms": out, "repeat": repeat, "feed": first["feed"], "routing": first["routing"],
            "prompt_tokens": first["prefill"]["tokens"], "decode_tokens": first["decode"]["tokens"],
            "disk_bandwidth_gb_per_s": first["disk_bandwidth_gb_per_s"]}


def _median_or_none(values):
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def report_lines(r: dict) -> list[str]:
    out = [f"{r['prompt_tokens']} prompt + {r['decode_tokens']} decode tokens fed {r['feed']}, routing {r['routing']}; "
           f"{r['repeat']} interleaved runs per arm, each from an empty cache; medians (min-max); routing agreement "
           f"with arm {r['arms'][0]['name']!r}; cpu / wait ms: per decode token, CPU time (readers too) / blocked on reads",
           f"{'arm':<12} {'budget':>9} {'prefill tok/s':>22} {'decode tok/s':>22} {'hit':>6} {'read':>9} "
           f"{'ahead':>9} {'cpu ms':>7} {'wait ms':>7} {'set':>7} {'rank':>7}"]
    for a in r["arms"]:
        p, d = a["prefill_tok_per_s"], a["decode_tok_per_s"]
        out.append(f"{a['name']:<12} {fmt_bytes(a['budget_bytes']):>9} "
                   f"{p['median']:>8.2f} ({p['min']:.2f}-{p['max']:.2f}) {d['median']:>8.2f} "
                   f"({d['min']:.2f}-{d['max']:.2f}) {100 * a['decode_hit_rate']['median']:>5.1f}% "
                   f"{fmt_bytes(a['decode_bytes_read']['median']):>9} {fmt_bytes(a['decode_prefetch_bytes']['median']):>9} "
                   f"{a['decode_cpu_ms_per_token']:>7.1f} {a['decode_wait_ms_per_token']:>7.1f} "
                   f"{100 * a['set_agreement']:>6.2f}% {100 * a['rank_agreement']:>6.2f}%")
    return out
