"""Engine: one loaded model and the API the CLI and the server share (`waste.load(...).generate(...)`)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .container import Container, open_container
from .errors import WasteError
from .models import build_model
from .runtime.cache import ExpertCache
from .runtime.plan import MemoryPlan, plan_memory
from .units import parse_size
from .runtime.sampling import Sampler, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
AUTO_F32_TRUNK_BYTES = 2 << 30   # below this the trunk is kept in float32: exact, and small enough


def resolve_dtype(name: str, container: Container) -> torch.dtype:
    if name == "auto":
        return torch.float32 if container.manifest["trunk"]["bytes"] < AUTO_F32_TRUNK_BYTES else torch.bfloat16
    if name not in DTYPES:
        raise WasteError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    expert_hits: int = 0
    expert_misses: int = 0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes out of the prefill; decode steps make the rest
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0

    def line(self) -> str:
        total = self.expert_hits + self.expert_misses
        rate = f" = {100 * self.expert_hits / total:.0f}% hit" if total else ""
        return (f"[prompt {self.prompt_tokens} tok, {self.prefill_tps:.1f} tok/s | generated {self.generated_tokens} tok, "
                f"{self.decode_tps:.1f} tok/s | experts {self.expert_hits} hit / {self.expert_misses} miss{rate}]")


class Generation:
    """One request. Iterate it for text deltas as they are decided; afterwards `text`, `token_ids`,
    `finish_reason` ("stop" or "length") and `stats` hold the result."""

    def __init__(self, engine: "Engine", prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                 stop: list[str]):
        if not prompt_ids:
            raise WasteError("the prompt is empty: give at least one token of text")
        self.engine, self.prompt_ids, self.max_tokens = engine, prompt_ids, max_tokens
        self.sampler, self.stop = Sampler(sampling), [s for s in stop if s]
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stats = Stats(prompt_tokens=len(prompt_ids))
        self._iter = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._iter

    def __next__(self) -> str:
        return next(self._iter)

    def _tokens(self) -> Iterator[int]:
        e = self.engine
        model, stats0 = e.model, e.experts.stats.snapshot()
        state = model.new_state()
        t0 = time.perf_counter()
        logits = model.forward(torch.tensor(self.prompt_ids), state, 0, last_only=True)[-1]
        self.stats.prefill_seconds = time.perf_counter() - t0
        pos = len(self.prompt_ids)
        t1 = time.perf_counter()
        try:
            for n in range(self.max_tokens):
                tok = self.sampler(logits)
                self.token_ids.append(tok)
                self.stats.generated_tokens += 1
                yield tok
                if tok in e.eos_ids or n + 1 == self.max_tokens:
                    break
                logits = model.forward(torch.tensor([tok]), state, pos, last_only=True)[-1]
                pos += 1
        finally:
            self.stats.decode_seconds = time.perf_counter() - t1
            s = e.experts.stats
            self.stats.expert_hits = s.hits - stats0.hits
            self.stats.expert_misses = s.misses - stats0.misses

    def _run(self) -> Iterator[str]:
        tok, eos = self.engine.tokenizer, self.engine.eos_ids
        body: list[int] = []             # generated ids, the end-of-sequence token excluded
        shown = 0                        # characters of self.text already handed out
        hold = max((len(s) for s in self.stop), default=1) - 1   # a stop string may be forming
        self.finish_reason = "length"
        tokens = self._tokens()
        try:
            for t in tokens:
                if t in eos:
                    self.finish_reason = "stop"
                    break
                body.append(t)
                self.text = tok.decode(body)
                cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
                if cut >= 0:
                    self.text, self.finish_reason = self.text[:cut], "stop"
                    break
                ready = len(self.text) - hold
                while ready > shown and self.text[ready - 1] == "\ufffd":   # an unfinished UTF-8 sequence
                    ready -= 1
                if ready > shown:
                    yield self.text[shown:ready]
                    shown = ready
        finally:
            tokens.close()          # settles the timing and expert counters even when cut short
        if len(self.text) > shown:
            yield self.text[shown:]


class Engine:
    def __init__(self, container: Container, model, tokenizer, experts, dtype: torch.dtype, plan: MemoryPlan | None = None):
        self.container, self.model, self.tokenizer, self.experts, self.dtype = container, model, tokenizer, experts, dtype
        self.plan = plan
        self.eos_ids = set(container.config.get("eos_token_ids") or [])
        gen = container.text_file("generation_config")
        if gen and gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            self.eos_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    @classmethod
    def load(cls, path=None, dtype: str = "auto", budget=None, context: int = 4096, ram=None,
             preload: bool | None = None, threads: int = 4, verify: bool = True, direct: bool = True) -> "Engine":
        """Open a container and plan its memory. budget/ram: bytes or "8G"-style sizes; preload None follows
        WASTE_PRELOAD (default on: fill the cache in the background when the whole bank fits)."""
        if path is None:
            from .default_model import default_model_path

            path = default_model_path()
        container = open_container(path)
        try:
            dt = resolve_dtype(dtype, container)
            plan = plan_memory(container, dt, context, None if ram is None else parse_size(ram),
                               None if budget is None else parse_size(budget))
            from .text.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(container.root)
            trunk = container.load_trunk(verify=verify)
            experts = ExpertCache(container, plan.budget_bytes, dt, threads=threads, preload=preload, verify=verify,
                                  direct=direct)
            f32 = set(container.manifest["trunk"].get("f32_tensors", [])) if dt != torch.float64 else set()
            model = build_model(container.family, container.config, trunk, experts, dt, f32)
        except BaseException:
            container.close()
            raise
        return cls(container, model, tokenizer, experts, dt, plan)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def generate(self, prompt: str | list[int], max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float = 0.0, seed: int | None = None, stop: list[str] | None = None,
                 stream: bool = False):
        """stream=True: a Generation to iterate for text deltas. stream=False: the finished Generation."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        g = Generation(self, ids, max_tokens, SamplingParams(temperature, top_p, top_k, min_p, seed), stop or [])
        if not stream:
            for _ in g:
                pass
        return g

    def close(self) -> None:
        self.experts.close()
        self.container.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
