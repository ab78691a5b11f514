"""Engine: one loaded model and the API the CLI and the server share (`waste.load(...).generate(...)`)."""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from .container import Container, open_container
from .errors import WasteError
from .models import build_model, check_family
from .quant.linear import assemble_trunk
from .random_model import RandomModel, is_random
from .runtime.cache import ExpertCache
from .runtime.dtype import resolve_dtype
from .runtime.plan import MemoryPlan, expert_room, plan_memory
from .runtime.vram import vram_budget
from .units import parse_size
from .runtime.sampling import Sampler, SamplingParams
from .vision import RUNS as VISION_RUNS, Vision

def set_experts_per_token(model, k: int) -> None:
    """Route each token to k experts (seed 0.6.7 §56: fewer experts per token is a speed/quality trade left to
    the user; docs/LEARNED.md records its KL on the bundled model). Only lowering is allowed."""
    check_experts_per_token(model.cfg, k)
    model.top_k = k


def check_experts_per_token(cfg: dict, k: int) -> None:
    release = (cfg.get("moe") or {}).get("top_k")
    if not release:
        raise WasteError("--experts-per-token: this model has no routed experts")
    if not 1 <= k <= release:
        raise WasteError(f"--experts-per-token {k}: choose 1 to {release} (the release routes each token to "
                         f"{release} experts)")


def _print_lines(lines: list[str]) -> None:
    print("\n".join(lines), file=sys.stderr, flush=True)


def resolve_device(name: str) -> str:
    if name in ("cpu", None):
        return "cpu"
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise WasteError(f"--device {name}: this torch sees no CUDA GPU (torch {torch.__version__}); use --device cpu")
        return name
    raise WasteError(f"unknown device {name!r}; choose cpu, cuda or auto")



def spread_experts(model, experts, device) -> None:
    """Streaming on the CPU (the bank does not fit): a decode row's routed experts are computed on as many threads as
    torch has (layers/moe.py spread: this thread and one pool thread per extra core), since the numba kernel runs
    on one and a streamed layer's compute is what its reads wait behind (docs/LEARNED.md §3j). Not under expert
    parallel (its ranks compute the pairs)."""
    n = torch.get_num_threads()
    if device != "cpu" or n < 2 or getattr(experts, "fits", True) or model.bank is None or hasattr(experts, "exchange"):
        return
    from concurrent.futures import ThreadPoolExecutor

    from .runtime.affinity import pool_pinner

    # each worker and the decoding thread on a CPU of its own during a step, where the process has enough
    # (runtime/affinity.py; WASTE_PIN=0 leaves them to the scheduler)
    pin = pool_pinner(n - 1) if os.environ.get("WASTE_PIN", "1") != "0" else None
    model.pin_cpus = pin is not None

    def init() -> None:       # its kernels on one thread each (torch's count, which numba follows, is per thread)
        torch.set_num_threads(1)
        if pin is not None:
            pin()
    model.expert_pool = ThreadPoolExecutor(n - 1, thread_name_prefix="waste-experts", initializer=init)


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


class Decoding:
    """One sequence's decoding, a token at a time; Generation (a request alone) and the server's scheduler
    (requests batched) both drive it. `sample(logits)` picks the next token (recording its log-probabilities
    when `logprobs` is set: None off, else how many alternatives per token); `feed(token)` returns the text
    that token decides (held back while a stop string or a UTF-8 sequence may be forming) and sets
    `finish_reason` when the sequence ends ("stop": an end id or a stop string; "length": max_tokens);
    `finish()` returns the text still held. End ids are not part of `text`."""

    def __init__(self, tokenizer, max_tokens: int, sampling: SamplingParams, stop: list[str], stop_ids=(),
                 logprobs: int | None = None):
        self.tokenizer, self.max_tokens, self.logprobs = tokenizer, max_tokens, logprobs
        self.sampler, self.stop = Sampler(sampling), [s for s in stop if s]
        self.stop_ids = set(stop_ids)
        self.token_ids: list[int] = []
        self.token_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []   # (id, logprob, top)
        self.text = ""
        self.finish_reason: str | None = None
        self._body: list[int] = []          # generated ids, end ids excluded
        self._shown = 0                     # characters of text already handed out
        self._hold = max((len(s) for s in self.stop), default=1) - 1   # a stop string may be forming
        self.images = None                  # the prompt's image rows (models.vision.EmbeddedRows), spliced at prefill
        self.prompt_ids: list[int] = []     # what repetition_penalty counts besides the output
        self.constraint = None              # a waste.text.grammar.Constraint, or None
        self.stop_string: str | None = None  # the stop string that ended the text, if one did

    def sample(self, logits: torch.Tensor) -> int:
        raw, logits = logits, self.sampler.adjust(logits, self.prompt_ids, self.token_ids)
        tok = self.sampler(logits)
        c = self.constraint
        if c is not None:
            if not c.allows(tok):       # the grammar refuses the unconstrained draw: draw again from what it allows
                masked = c.mask(logits)
                tok = self.sampler(masked) if bool(torch.isfinite(masked).any()) else next(iter(self.stop_ids), tok)
            if tok not in self.stop_ids or c.allows(tok):
                c.advance(tok)
        logits = raw
        self.token_ids.append(tok)
        if self.logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(lp, self.logprobs) if self.logprobs else None
            alts = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            self.token_logprobs.append((tok, float(lp[tok]), alts))
        return tok

    def feed(self, tok: int) -> str:
        if self.finish_reason is not None:
            return ""
        if tok in self.stop_ids:
            self.finish_reason = "stop"
            return ""
        self._body.append(tok)
        self.text = self.tokenizer.decode(self._body)
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stop_string = next(s for s in self.stop if self.text.find(s) == cut)   # which one (Anthropic's API)
            self.text, self.finish_reason = self.text[:cut], "stop"
            return ""
        if self.constraint is not None and self.constraint.done:    # the grammar is complete: nothing may follow
            self.finish_reason = "stop"
            return ""
        if len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
            return ""
        ready = len(self.text) - self._hold
        while ready > self._shown and self.text[ready - 1] == "\ufffd":   # an unfinished UTF-8 sequence
            ready -= 1
        if ready <= self._shown:
            return ""
        piece, self._shown = self.text[self._shown:ready], ready
        return piece

    def finish(self) -> str:
        if self.finish_reason is None:
            self.finish_reason = "length"
        piece, self._shown = self.text[self._shown:], len(self.text)
        return piece


class Generation:
    """One request. Iterate it for text deltas as they are decided; afterwards `text`, `token_ids`,
    `finish_reason` ("stop" or "length") and `stats` hold the result. `stop_ids` end it as the end-of-sequence
    ids do (a chat format's end of turn); like them, they are not part of `text`. The per-token work is a
    `Decoding` (`self.decoding`), which the server's scheduler drives directly when it batches requests."""

    def __init__(self, engine: "Engine", prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                 stop: list[str], stop_ids=(), logprobs: int | None = None, images=None):
        if not prompt_ids:
            raise WasteError("the prompt is empty: give at least one token of text")
        self.engine, self.prompt_ids, self.max_tokens = engine, prompt_ids, max_tokens
        self.decoding = Decoding(engine.tokenizer, max_tokens, sampling, stop, set(engine.eos_ids) | set(stop_ids),
                                 logprobs)
        self.decoding.images = images
        self.decoding.prompt_ids = prompt_ids
        self.token_ids: list[int] = self.decoding.token_ids
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
        state = model.take_state()
        t0 = time.perf_counter()
        logits = model.step([(torch.tensor(self.prompt_ids), state, 0, self.decoding.images)])[0][-1]
        self.stats.prefill_seconds = time.perf_counter() - t0
        pos = len(self.prompt_ids)
        t1 = time.perf_counter()
        try:
            for n in range(self.max_tokens):
                tok = self.decoding.sample(logits)
                self.stats.generated_tokens += 1
                yield tok
                if tok in self.decoding.stop_ids or n + 1 == self.max_tokens:
                    break
                logits = model.step([(torch.tensor([tok]), state, pos)])[0][-1]
                pos += 1
        finally:
            model.give_state(state)
            self.stats.decode_seconds = time.perf_counter() - t1
            s = e.experts.stats
            self.stats.expert_hits = s.hits - stats0.hits
            self.stats.expert_misses = s.misses - stats0.misses

    def _run(self) -> Iterator[str]:
        d = self.decoding
        self.finish_reason = "length"
        tokens = self._tokens()
        try:
            for t in tokens:
                piece = d.feed(t)
                self.text = d.text
                if d.finish_reason is not None:
                    self.finish_reason = d.finish_reason
                    break
                if piece:
                    yield piece
        finally:
            tokens.close()          # settles the timing and expert counters even when cut short
        rest = d.finish()
        self.text = d.text
        if rest:
            yield rest



def aio_reads() -> bool:
    """Demand reads through Linux AIO where the banks take O_DIRECT (runtime/cache.py); WASTE_AIO=0 keeps them on the
    reader threads (the same bytes: for measuring one against the other)."""
    return os.environ.get("WASTE_AIO", "1") != "0"

class Engine:
    def __init__(self, container: Container, model, tokenizer, experts, dtype: torch.dtype, plan: MemoryPlan | None = None):
        self.container, self.model, self.tokenizer, self.experts, self.dtype = container, model, tokenizer, experts, dtype
        self.plan = plan
        self._chat_format = None    # loaded on first use (chat_format()): the format, or why there is none
        self.vision = Vision(container, tokenizer, dtype)    # images in prompts; the tower loads on the first one
        self.eos_ids = set(container.config.get("eos_token_ids") or [])
        gen = container.text_file("generation_config")
        if gen and gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            self.eos_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    @classmethod
    def load(cls, path=None, dtype: str = "auto", budget=None, context: int = 4096, ram=None,
             preload: bool | None = None, threads: int = 4, verify: bool = True, direct: bool = True,
             experts_per_token: int | None = None, dump_dsa: bool | None = None, device: str = "cpu",
             prefetch: bool = False, vram=None, expert_parallel=None, prefill_chunk: int | None = None) -> "Engine":
        """Open a container and plan its memory. budget/ram: bytes or "8G"-style sizes; preload None follows
        WASTE_PRELOAD (default on: fill the cache in the background when the whole bank fits). experts_per_token:
        route each token to this many experts instead of the release's number (1 .. that; a quality trade).
        dump_dsa (None follows WASTE_DUMP_DSA): print each DSA indexer selection to stderr (GLM-5.3).
        device: "cpu", "auto", or "cuda" (the trunk and the expert slab in GPU memory; float and q8 expert formats,
        q4 and mxfp4 with triton). vram (cuda): bytes or "8G" of expert records in GPU memory, the rest of the
        budget a pinned host tier below them (runtime/vram.py; default: what the GPU's free memory holds). prefetch: read the next MoE layer's predicted experts while this one
        computes (the same bits either way; off by default: it did not measure faster, docs/LEARNED.md §3j).
        expert_parallel: this process's runtime.parallel.ExpertParallel (it
        holds and plans for its share of the experts; the others' are computed by their ranks). prefill_chunk: a
        prompt runs through the model this many tokens at a time (None: the plan's choice); each chunk's tokens
        share its expert reads."""
        if preload is None:
            preload = os.environ.get("WASTE_PRELOAD", "1") != "0"
        if dump_dsa is None:
            dump_dsa = os.environ.get("WASTE_DUMP_DSA", "0") not in ("", "0")
        if path is None:
            from .default_model import default_model_path

            path = default_model_path()
        random = is_random(path)      # random:NAME: generated in memory on the device (waste/random_model.py)
        container = RandomModel(path, resolve_device(device)) if random else open_container(path)
        experts = None
        try:
            check_family(container.family)
            dt = resolve_dtype(dtype, container)
            if experts_per_token is not None:
                check_experts_per_token(container.config, experts_per_token)   # before the cache's fill thread
            ep, owned = expert_parallel, None
            only = ep is not None and ep.experts_only     # a rank other than 0 holds no trunk: it computes experts
            if resolve_device(device) == "cpu":
                from .layers.cpu_prefill import warm

                warm()       # the CPU kernels' runtime is part of the process the plan measures
            if random and ram is None:
                ram = container.plan_ram(ep.local_world if ep else 1)
            ram = None if ram is None else parse_size(ram)
            vision = container.family in VISION_RUNS and not only
            if ep is not None:       # the ranks weigh their shares of the experts by the room each has for them
                owned = ep.owned(container, parse_size(budget) if budget is not None else expert_room(
                    container, dt, context, ram, ep.local_world, prefill_chunk, not only, vision))
            plan = plan_memory(container, dt, context, ram, None if budget is None else parse_size(budget),
                               None if ep is None else [len(o) for o in owned.values()], ep.local_world if ep else 1,
                               prefill_chunk=prefill_chunk, vision=vision, trunk=not only)
            from .text.tokenizer import load_tokenizer

            tokenizer = container.tokenizer if random else load_tokenizer(container.root)
            dev = resolve_device(device)
            if only:
                return cls._experts_only(container, tokenizer, dt, plan, dev, owned, ep, budget, vram, threads,
                                         preload, verify, direct)
            trunk = assemble_trunk(container.load_trunk(verify=verify), container.manifest["trunk"])
            if random:
                experts = container.expert_store(dt, owned, plan)
            else:
                vb = vram_budget(plan, dev, None if vram is None else parse_size(vram))
                experts = ExpertCache(container, plan.budget_bytes, dt, threads=threads, preload=preload,
                                      verify=verify, direct=direct, device=dev, prefetch=prefetch, vram=vb, owned=owned,
                                      aio=aio_reads())
            if ep is not None:
                experts = ep.store(experts)
            f32 = set(container.manifest["trunk"].get("f32_tensors", [])) if dt != torch.float64 else set()
            model = build_model(container.family, container.config, trunk, experts, dt, f32, capacity=context,
                                device=dev)
            if experts_per_token is not None:
                set_experts_per_token(model, experts_per_token)
            model.prefill_chunk = plan.prefill_chunk
            spread_experts(model, experts, dev)
            if dump_dsa and hasattr(model, "dsa_dump"):
                model.dsa_dump = _print_lines
        except BaseException:
            if experts is not None:      # its background fill reads the banks: stop it before they close
                experts.close()
            container.close()
            raise
        return cls(container, model, tokenizer, experts, dt, plan)

    @classmethod
    def _experts_only(cls, container, tokenizer, dt, plan, dev, owned, ep, budget, vram, threads, preload, verify,
                      direct) -> "Engine":
        """An expert-parallel rank other than 0: its experts' store and the exchange, no trunk and no model (it only
        ever answers rank 0's MoE layers: ParallelExperts.follow)."""
        if isinstance(container, RandomModel):
            experts = container.expert_store(dt, owned, plan)
        else:
            vb = vram_budget(plan, dev, None if vram is None else parse_size(vram))
            experts = ExpertCache(container, plan.budget_bytes, dt, threads=threads, preload=preload, verify=verify,
                                  direct=direct, device=dev, vram=vb, owned=owned, aio=aio_reads())
        experts = ep.store(experts)
        experts.make_bank(dev)
        return cls(container, None, tokenizer, experts, dt, plan)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def generation(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, stop: list[str],
                   stop_ids=(), logprobs: int | None = None, images=None,
                   grammar: str | None = None) -> Generation:
        """A request not started yet: iterating it generates (what generate() and chat() hand out). images: the
        rows that replace the prompt's image placeholders (Vision.expand). grammar: an llguidance grammar
        (waste/text/grammar.py) the output must follow."""
        g = Generation(self, prompt_ids, max_tokens, sampling, stop, stop_ids, logprobs, images)
        if grammar is not None:
            g.decoding.constraint = self.constraint(grammar, g.decoding.stop_ids)
        return g

    def constraint(self, grammar: str, stop_ids, param: str = "response_format"):
        """A fresh Constraint for one sequence; the vocabulary's table is built once per set of end ids."""
        from .text.grammar import Constraint, token_table

        key = frozenset(stop_ids)
        tables = self.__dict__.setdefault("_grammar_tables", {})
        if key not in tables:
            tables[key] = token_table(self.tokenizer, int(self.container.config["vocab_size"]), key)
        return Constraint(tables[key], grammar, param)

    def generate(self, prompt: str | list[int], max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, min_p: float = 0.0, seed: int | None = None, stop: list[str] | None = None,
                 stream: bool = False, json_schema: dict | None = None, **penalties):
        """stream=True: a Generation to iterate for text deltas. stream=False: the finished Generation.
        json_schema: the output is JSON matching it ({} or {"type": "object"}: any object). penalties:
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias ({token id: bias})."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        grammar = None
        if json_schema is not None:
            from .text.grammar import json_grammar

            grammar = json_grammar(json_schema or None)
        g = self.generation(ids, max_tokens, SamplingParams(temperature, top_p, top_k, min_p, seed, **penalties),
                            stop or [], grammar=grammar)
        if not stream:
            for _ in g:
                pass
        return g

    def chat(self, messages: list[dict], tools: list[dict] | None = None, max_tokens: int | None = None,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
             stop: list[str] | None = None, stream: bool = False, reasoning_effort: str | None = None,
             thinking: bool | None = None, chat_template_kwargs: dict | None = None, tool_choice=None,
             image_policy=None, json_schema: dict | None = None, **penalties):
        """A chat turn through the container's chat format (waste/chat.py): stream=True gives a ChatCompletion to
        iterate for Content / Reasoning / ToolCall events; stream=False the finished one (content,
        reasoning_content, tool_calls, finish_reason, usage). Raises UnsupportedChatFormat or ChatRequestError.
        Image parts (`image_url` with a data: or http(s) URL, or `{"type": "image", "image": bytes}`) need a model
        whose tower runs; image_policy (waste.images.sources.FetchPolicy) limits URL fetches."""
        from .chat import chat

        return chat(self, messages, tools=tools, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                    top_k=top_k, min_p=min_p, seed=seed, stop=stop, stream=stream, reasoning_effort=reasoning_effort,
                    thinking=thinking, chat_template_kwargs=chat_template_kwargs, tool_choice=tool_choice,
                    image_policy=image_policy, json_schema=json_schema, **penalties)

    def chat_format(self):
        """The container's chat format (waste/chat.py), loaded once; raises UnsupportedChatFormat, the same one
        each time, when it has none."""
        from .chat import UnsupportedChatFormat, load_chat_format

        if self._chat_format is None:
            try:
                self._chat_format = load_chat_format(self.container, self.tokenizer, self.eos_ids)
            except UnsupportedChatFormat as e:
                self._chat_format = e
        if isinstance(self._chat_format, UnsupportedChatFormat):
            raise self._chat_format
        return self._chat_format

    def close(self) -> None:
        if self.model is not None and self.model.expert_pool is not None:
            self.model.expert_pool.shutdown()
        self.experts.close()
        self.container.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
