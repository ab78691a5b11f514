"""Per-token cost of a grammar engine's token mask against one decode step of the bundled model, one thread.

Walks a JSON-schema grammar along a fixed valid document (tokenized by the model's tokenizer): per token, the mask
computed and the token committed, for llguidance (waste's dependency) and xgrammar (when importable), and the
schema's compile time; the decode step is timed on the same process. Medians of the steps, ms.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/grammar_mask.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                      "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
       "address": {"city": "London", "zip": "12345"}}


def ms(xs) -> float:
    return 1e3 * statistics.median(xs)


def llguidance_walk(eng, ids, stop):
    from waste.text.grammar import json_grammar

    t0 = time.perf_counter()
    c = eng.constraint(json_grammar(SCHEMA), stop)
    compile_s = time.perf_counter() - t0
    masks, commits = [], []
    for t in ids:
        t0 = time.perf_counter()     # the raw mask, as xgrammar's is timed (allowed() then unpacks it for torch)
        c.matcher.unsafe_compute_mask_ptr(c._bits.data_ptr(), c._bits.numel() * 4)
        t1 = time.perf_counter()
        assert bool((c._bits[t // 32] >> (t % 32)) & 1), "the document leaves the grammar"
        t1b = time.perf_counter()
        c.advance(t)
        commits.append(time.perf_counter() - t1b)
        masks.append(t1 - t0)
    return compile_s, masks, commits


def xgrammar_walk(eng, ids, stop, vocab):
    import xgrammar as xgr

    tok = eng.tokenizer
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([tok.token_bytes(i) for i in range(vocab)], xgr.VocabType.RAW, vocab_size=vocab,
                             stop_token_ids=sorted(stop))
    table_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    m = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    bits = xgr.allocate_token_bitmask(1, vocab)
    masks, commits = [], []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bits)
        t1 = time.perf_counter()
        assert bool((bits[0, t // 32] >> (t % 32)) & 1), "the document leaves the grammar"
        t2 = time.perf_counter()
        assert m.accept_token(t)
        commits.append(time.perf_counter() - t2)
        masks.append(t1 - t0)
    return table_s, compile_s, masks, commits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import waste

    eng = waste.load()
    vocab = int(eng.container.config["vocab_size"])
    stop = frozenset(eng.eos_ids)
    ids = eng.encode(json.dumps(DOC))
    # a decode step of the bundled model (resident, warm)
    st = eng.model.take_state()
    eng.model.step([(torch.tensor(eng.encode("def f(x):")), st, 0)])
    pos, steps = 4, []
    for i in range(40):
        t0 = time.perf_counter()
        eng.model.step([(torch.tensor([ids[i % len(ids)]]), st, pos)])
        steps.append(time.perf_counter() - t0)
        pos += 1
    step = ms(steps[5:])
    print(f"bundled model: vocab {vocab}, decode step {step:.2f} ms (1 thread); document {len(ids)} tokens")
    t0 = time.perf_counter()
    eng.constraint(json_grammar_any(), stop)
    print(f"llguidance token table + first grammar: {1e3 * (time.perf_counter() - t0):.0f} ms")
    rows = []
    for r in range(a.repeats):
        comp, masks, commits = llguidance_walk(eng, ids, stop)
        rows.append(("llguidance", comp, ms(masks), max(masks) * 1e3, ms(commits), 1e3 * statistics.mean(masks)))
        try:
            table, comp, masks, commits = xgrammar_walk(eng, ids, stop, vocab)
        except ImportError:
            continue
        rows.append(("xgrammar", comp, ms(masks), max(masks) * 1e3, ms(commits), 1e3 * statistics.mean(masks)))
    for name in ("llguidance", "xgrammar"):
        mine = [r for r in rows if r[0] == name]
        if not mine:
            print(f"{name}: not importable")
            continue
        comp = statistics.median(r[1] for r in mine) * 1e3
        mask = statistics.median(r[2] for r in mine)
        worst = max(r[3] for r in mine)
        commit = statistics.median(r[4] for r in mine)
        mean = statistics.median(r[5] for r in mine)
        print(f"{name}: compile {comp:.1f} ms, mask median {mask:.3f} ms/token, mean {mean:.3f} (worst {worst:.2f}), "
              f"commit {commit:.3f} ms; mean mask = {100 * mean / step:.2f}% of a decode step")


def json_grammar_any():
    from waste.text.grammar import json_grammar

    return json_grammar(None)


if __name__ == "__main__":
    main()
