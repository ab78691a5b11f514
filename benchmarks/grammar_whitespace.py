"""Tokens a JSON-schema reply takes under llguidance's default flexible whitespace and under waste's compact JSON,
on the bundled model and on a chat container (greedy and three seeds at temperature 0.7, 200 tokens at most).

    OMP_NUM_THREADS=1 PYTHONPATH=. python3 benchmarks/grammar_whitespace.py [CHAT_CONTAINER]
"""
import sys

import json, llguidance as llg, waste
from waste.runtime.sampling import SamplingParams
SCHEMA = {"type":"object","properties":{"name":{"type":"string","maxLength":12},"age":{"type":"integer","minimum":0,"maximum":150}},"required":["name","age"],"additionalProperties":False}
for path in (None, *sys.argv[1:2]):
    eng = waste.load(path)
    ids = eng.encode("def f(x):") if path is None else eng.chat([{"role":"user","content":"Who are you?"}], stream=True).prompt_ids
    for label, opts in (("flexible (llguidance default)", {}), ("compact (waste)", {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})):
        g = llg.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=opts)
        done = 0; used = []
        for seed, t in ((0, 0.0), (1, 0.7), (2, 0.7), (3, 0.7)):
            gen = eng.generation(ids, 200, SamplingParams(t, seed=seed), [], grammar=g)
            list(gen)
            ok = gen.finish_reason == "stop"
            try: json.loads(gen.text); 
            except ValueError: ok = False
            done += ok; used.append(len(gen.token_ids))
        print(path or "bundled", label, f"complete {done}/4, tokens {used}")
