"""`random:` models: a family's real shape with seeded random weights generated in memory on the compute device,
no release, no container, no disk (benchmarks of shapes that no disk here holds; expert parallel across GPUs).

    MODEL = random:NAME[,layers=N][,experts=FMT][,seed=S]
    NAME  = a preset (qwen3-30b-a3b, kimi-k3, kimi-linear-48b-a3b, glm-5.3-flash) or the path of a Hugging Face
            config.json (any family whose adapter lists its trunk shapes: qwen3_moe, kimi_k3, kimi_linear, mixtral,
            glm4_moe, gpt_oss, glm5_next)

layers: the first N of the release's layers (its layer lists cut to them); experts: the expert record format (bf16
default; q8, q4, mxfp4 ... as runtime/generated.py says); seed: 0 default. The family's adapter normalises the config
and names every trunk tensor, exactly as `waste convert` does; the trunk is bf16 (float32 where a converted
container keeps float32), generated tensor by tensor from seeds of (seed, name); the routed experts from seeds of
(seed, layer, id) (runtime/generated.py), so every rank of `--expert-parallel` builds the same trunk and its own
experts, bit for bit those of one process. The tokenizer is a byte-level one made in memory (the vocabulary beyond
it is never produced by encoding; the model may emit those ids).
"""
from __future__ import annotations

import json
import math
from pathlib import PurePath

import torch

from .container.manifest import FORMAT_NAME, FORMAT_VERSION
from .convert.adapter_base import shape_ok
from .convert.adapters import adapter_for
from .convert.convert import expert_layout
from .convert.source import unwrap_config
from .convert.synthetic import SPECIALS, byte_level_tokenizer_json, kimi_k3_text_config, qwen3_moe_config
from .errors import WasteError
from .runtime.generated import GeneratedExperts, check_format, generator
from .runtime.plan import CEILING
from .runtime.vram import GPU_RESERVE

PREFIX = "random:"


def _qwen3_30b() -> dict:
    return qwen3_moe_config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1000000.0,
                            max_position_embeddings=40960)


def _kimi_k3() -> dict:
    """../shared/reference/kimi-k3.md: 93 layers, the first dense, MLA at 1-indexed 4, 8, ..., 92 and 93."""
    full = list(range(4, 93, 4)) + [93]
    text = kimi_k3_text_config(num_hidden_layers=93, vocab_size=163840, first_k_dense_replace=1)
    text["linear_attn_config"] = dict(text["linear_attn_config"], full_attn_layers=full,
                                      kda_layers=[i for i in range(1, 94) if i not in full])
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text}


def _kimi_linear_48b() -> dict:
    """../shared/reference/architectures.md §1.1: 27 layers, MLA at 1-indexed 4, 8, ..., 24 and 27, the rest KDA."""
    full = [4, 8, 12, 16, 20, 24, 27]
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
            "hidden_size": 2304, "num_hidden_layers": 27, "intermediate_size": 9216, "num_attention_heads": 32,
            "num_key_value_heads": 32, "head_dim": 72, "q_lora_rank": None, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
            "rope_theta": 10000.0, "linear_attn_config": {"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
                                                          "kda_layers": [i for i in range(1, 28) if i not in full],
                                                          "full_attn_layers": full},
            "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
            "moe_layer_freq": 1, "first_k_dense_replace": 1, "moe_router_activation_func": "sigmoid",
            "moe_renormalize": True, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
            "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-5, "model_max_length": 1048576,
            "max_position_embeddings": 1048576, "bos_token_id": 163584, "eos_token_id": 163586,
            "pad_token_id": 163839, "tie_word_embeddings": False}


def _glm53_flash() -> dict:
    """../shared/reference/architectures.md §4.4 (transformers 5.24's Glm5NextTextConfig defaults, its checkpoint
    docstring's zai-org/GLM-5.3-Flash): 45 layers, KDA but every 4th (0-based 3, 7, ...) DSA-MLA, 3 dense then
    288 experts top-8 + 1 shared, mHC over 4 streams."""
    n = 45
    text = {"vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
            "num_hidden_layers": n, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 288,
            "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "n_group": 1, "topk_group": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 256,
            "qk_rope_head_dim": 0, "v_head_dim": 256, "linear_head_dim": 128, "linear_num_heads": 64,
            "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "index_topk": 2048, "index_head_dim": 128,
            "index_n_heads": 32, "index_kpool": 16, "index_kpool_always_select_tail": True,
            "layer_types": ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
            "indexer_types": ["full"] * n, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * (n - 3), "hc_mult": 4,
            "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1048576, "pad_token_id": 154820, "tie_word_embeddings": False}
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text}


PRESETS = {"qwen3-30b-a3b": _qwen3_30b, "kimi-k3": _kimi_k3, "kimi-linear-48b-a3b": _kimi_linear_48b,
           "glm-5.3-flash": _glm53_flash}


def is_random(path) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def parse(spec: str) -> tuple[dict, dict]:
    """random:NAME[,key=value ...] -> (the release's config, its options: layers, experts, seed)."""
    name, *opts = spec[len(PREFIX):].split(",")
    o = {"layers": None, "experts": "bf16", "seed": 0}
    for kv in opts:
        k, eq, v = kv.partition("=")
        if not eq or k not in o:
            raise WasteError(f"{spec}: {kv!r} is not an option of a random model; give layers=N, experts=FMT or "
                             "seed=S after the name, comma-separated")
        if k != "experts":
            if not v.isdigit():
                raise WasteError(f"{spec}: {k} must be a whole number, not {v!r}")
            v = int(v)
        o[k] = v
    check_format(o["experts"])
    if name in PRESETS:
        cfg = PRESETS[name]()
    elif name.endswith(".json"):
        try:
            cfg = json.loads(open(name).read())
        except (OSError, json.JSONDecodeError) as e:
            raise WasteError(f"{spec}: cannot read {name} as a config.json ({e})") from None
    else:
        raise WasteError(f"{spec}: {name!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json path")
    cfg = unwrap_config(cfg, name)
    if o["layers"] is not None:
        cfg = cut_layers(cfg, o["layers"], spec)
    return cfg, o


def cut_layers(cfg: dict, n: int, spec: str) -> dict:
    """The config of the release's first n layers: its per-layer lists cut to them."""
    if not 1 <= n <= cfg["num_hidden_layers"]:
        raise WasteError(f"{spec}: layers={n}: choose 1 to {cfg['num_hidden_layers']}")
    cfg = dict(cfg, num_hidden_layers=n)
    lac = cfg.get("linear_attn_config")
    if lac:      # 1-indexed lists (Kimi)
        cfg["linear_attn_config"] = {k: [i for i in v if i <= n] if k.endswith("_layers") and isinstance(v, list)
                                     else v for k, v in lac.items()}
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):     # per-layer lists (GLM-5.3: all three)
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:n]
    if isinstance(cfg.get("mlp_only_layers"), list):
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < n]
    return cfg


def _shape(name: str, want, cfg: dict) -> tuple[int, ...]:
    """A trunk tensor's shape: expected_shapes' entry, its ("numel", n) forms in the layout a release stores."""
    if isinstance(want, tuple) and want and want[0] in ("numel", "numel>="):
        if name.endswith("conv1d.weight"):
            k = cfg["kda"]["conv_kernel"]
            return (want[1] // k, 1, k)
        return (want[1],)
    return tuple(want)


def _tokenizer(cfg: dict):
    from .text.tokenizer import HFTokenizer

    data = json.loads(byte_level_tokenizer_json(None, 512))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[0], "pad_token": SPECIALS[0],
              "bos_token": None, "model_max_length": cfg.get("max_position_embeddings") or 4096}
    return HFTokenizer(data, config)


class RandomModel:
    """What Engine.load reads of a container, for a random model: manifest, config, the trunk (generated on the
    device), a tokenizer, and the expert store (generated in place)."""

    def __init__(self, spec: str, device: str):
        hf, self.opts = parse(spec)
        self.device = torch.device(device)
        adapter = adapter_for(hf)
        shapes = adapter.expected_shapes()
        if not shapes:
            raise WasteError(f"{spec}: the {adapter.family} adapter does not list its trunk shapes, so its model "
                             "cannot be generated; random models cover qwen3_moe, kimi_k3, kimi_linear, mixtral, glm4_moe, gpt_oss, "
                             "glm5_next")
        cfg = adapter.config
        self.root, self.banks = PurePath(spec), {}
        self.spec = [(adapter.trunk_target(n), _shape(n, shapes[n], cfg)) for n in adapter.trunk_names()]
        for n, (_, s) in zip(adapter.trunk_names(), self.spec):
            assert shape_ok(list(s), shapes[n]), n
        self.f32 = {d for d, s in self.spec if adapter.is_f32(d, len(s))}
        moe_layers = adapter.moe_layers()
        n_exp = cfg["moe"]["num_experts"] if moe_layers else 0
        self.layout = expert_layout(self.opts["experts"], cfg) if moe_layers else None
        rec = self.layout.record_bytes if self.layout else 0
        trunk_bytes = sum(math.prod(s) * (4 if d in self.f32 else 2) for d, s in self.spec)
        self.manifest = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "family": adapter.family, "config": cfg,
            "trunk": {"file": None, "format": "bf16", "bytes": trunk_bytes, "f32_tensors": sorted(self.f32),
                      "quantized": {}},
            "experts": {"format": self.opts["experts"], "record_bytes": rec,
                        "layout": self.layout.to_json() if self.layout else None,
                        "layers": {str(i): {"num_experts": n_exp} for i in moe_layers}, "bytes": rec * n_exp *
                        len(moe_layers)},
            "text": {}, "random": {"spec": spec, **self.opts}}
        self.tokenizer = _tokenizer(cfg)

    family = property(lambda self: self.manifest["family"])
    config = property(lambda self: self.manifest["config"])

    def trunk_bytes(self, dtype: torch.dtype) -> int:
        """The trunk in memory in the compute dtype, float32 where kept (runtime/plan.py's trunk_resident_bytes)."""
        size = torch.empty(0, dtype=dtype).element_size()
        return sum(math.prod(s) * (4 if d in self.f32 else size) for d, s in self.spec)

    def text_file(self, key: str):
        return None

    def load_trunk(self, verify: bool = True) -> dict:
        """Every trunk tensor, generated on the device: a norm's weight 1 + N(0, 0.01), another vector N(0, 0.25),
        a matrix N(0, 1 / columns); bf16, float32 where a converted container keeps float32."""
        out, seed = {}, self.opts["seed"]
        for name, shape in self.spec:
            g = generator(self.device, seed, "trunk", name)
            dt = torch.float32 if name in self.f32 else torch.bfloat16
            t = torch.randn(shape, generator=g, device=self.device, dtype=dt)
            if len(shape) > 1:
                t.mul_(shape[-1] ** -0.5)
            elif "norm" in name:
                t.mul_(0.1).add_(1.0)
            else:
                t.mul_(0.5)
            out[name] = t
        return out

    def plan_ram(self, local_world: int, gpu_bytes: int | None = None) -> int | None:
        """The memory a plan sizes against: on a GPU its memory (gpu_bytes: that of the GPUs planned for, where
        there is none here) less the allocator's reserve (the model lives there), given so that the plan's ceiling
        (3/4 of what it is given, split among the processes of a host) is that; else None: the host's."""
        if self.device.type == "cpu" and gpu_bytes is None:
            return None
        gpu = (gpu_bytes or torch.cuda.get_device_properties(self.device).total_memory) - GPU_RESERVE
        return int(gpu / CEILING) * local_world

    def expert_store(self, dtype: torch.dtype, owned: dict | None, plan) -> GeneratedExperts:
        """Every expert this process holds, resident; refused by name where the plan cannot hold them all."""
        if plan.budget_bytes < plan.bank_bytes:
            raise WasteError(f"{self.root}: its experts ({plan.bank_bytes / 2**30:.1f} GiB here) do not fit beside "
                             f"the trunk: the memory plan holds {plan.budget_bytes / 2**30:.1f} GiB of them and a random "
                             "model keeps every expert resident; give fewer layers=N, more --expert-parallel "
                             "processes, or a --budget of the whole bank to force it")
        layers = {int(l): v["num_experts"] for l, v in self.manifest["experts"]["layers"].items()}
        return GeneratedExperts(self.layout, self.config, self.opts["experts"], layers, dtype, str(self.device),
                                self.opts["seed"], owned)

    def close(self) -> None:
        pass
