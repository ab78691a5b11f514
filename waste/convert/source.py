"""Reading a Hugging Face release: config.json (nested text_config too), a sharded safetensors index or
single files, and tensors in bf16/fp16/fp32, fp8 e4m3 with 128x128 `weight_scale_inv` blocks, or compressed-tensors
mxfp4 and int4 (symmetric or with zero points); NVFP4 and other packed widths are refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import WasteError

SCALE_SUFFIX = ".weight_scale_inv"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# compressed-tensors releases: `X.weight_packed` (+ companions) stands for the matrix `X.weight`
PACKED_SUFFIX = ".weight_packed"
CT_COMPANIONS = (".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_global_scale")


def read_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise WasteError(f"{src} has no config.json: give the directory of a Hugging Face release")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WasteError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise WasteError(f"{path} must hold a JSON object (a model config), not {type(cfg).__name__}")
    return unwrap_config(cfg, path)


def unwrap_config(cfg: dict, path="config.json") -> dict:
    """The language model's config, checked: a multimodal release nests it under text_config."""
    if isinstance(cfg.get("text_config"), dict):   # multimodal wrappers keep the language model here
        inner = dict(cfg["text_config"])
        inner.setdefault("model_type", cfg.get("model_type"))
        inner["outer_model_type"] = cfg.get("model_type")   # Kimi K3's text config says kimi_linear
        inner.setdefault("quantization_config", cfg.get("quantization_config"))
        for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "vision_config", "image_token_id",
                  "image_start_token_id", "image_end_token_id", "media_placeholder_token_id"):
            if k not in inner and k in cfg:
                inner[k] = cfg[k]
        cfg = inner
    check_config(cfg, path)
    return cfg


REQUIRED = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
         "moe_intermediate_size", "num_experts_per_tok", "num_experts_per_token", "max_position_embeddings",
         "decoder_sparse_step")
COUNTS = ("num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "n_routed_experts", "kv_lora_rank",
          "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_shared_experts",
          "num_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "num_expert_group",
          "num_nextn_predict_layers")   # 0 is meaningful (GLM-5.3's qk_rope_head_dim, a dense model's experts)
REALS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")


def check_config(cfg: dict, path) -> None:
    """The keys every family reads, present and of the right type, before an adapter indexes them (a family's own
    keys are checked where its adapter reads them: convert.adapter_of)."""
    missing = [k for k in REQUIRED if cfg.get(k) is None]
    if missing:
        raise WasteError(f"{path} has no {', '.join(missing)}: a Hugging Face model config names "
                         f"{', '.join(REQUIRED)}")
    if not isinstance(cfg["model_type"], str):
        raise WasteError(f"{path}: model_type must be a string, not {cfg['model_type']!r}")
    for keys, ok, what in ((SIZES, lambda v: _is_int(v) and v > 0, "a positive integer"),
                           (COUNTS, lambda v: _is_int(v) and v >= 0, "an integer of 0 or more"),
                           (REALS, lambda v: _is_int(v) or isinstance(v, float), "a number")):
        for k in keys:
            if cfg.get(k) is not None and not ok(cfg[k]):
                raise WasteError(f"{path}: {k} must be {what}, not {cfg[k]!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def dequant_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W = W_fp8 * s[i // bm, j // bn]; the last block row/column may be partial (ragged edges)."""
    m, n = w.shape
    bm, bn = block
    s = scale_inv.float().repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return w.float() * s


class Checkpoint:
    @classmethod
    def from_metadata(cls, src: str, config: dict, meta: dict[str, tuple[str, list[int]]], where: dict[str, str]):
        """A checkpoint known only by its safetensors headers (a release still on the Hub): names, dtypes and
        shapes answer as they would from the files; reading a tensor is not possible."""
        self = cls.__new__(cls)
        self.src, self.config, self._meta, self.where = Path(src), config, dict(meta), dict(where)
        self.shards, self._handles, self._remote = sorted(set(where.values())), {}, True
        self._packed_logical()
        return self

    _remote = False

    def __init__(self, src: Path):
        self.src = Path(src)
        if not self.src.is_dir():
            raise WasteError(f"no such release directory: {self.src}")
        self.config = read_config(self.src)
        qc = self.config.get("quantization_config") or {}
        self.fp8_block = tuple(qc.get("weight_block_size") or (128, 128))
        self.where: dict[str, str] = {}      # tensor name -> shard file name
        index = self.src / "model.safetensors.index.json"
        if index.is_file():
            self.where = dict(json.loads(index.read_text())["weight_map"])
            missing = sorted({f for f in self.where.values() if not (self.src / f).is_file()})
            if missing:
                raise WasteError(f"the index names shards that are not in {self.src}: {', '.join(missing[:5])}")
        else:
            files = sorted(p.name for p in self.src.glob("*.safetensors"))
            if not files:
                raise WasteError(f"{self.src} holds no .safetensors files")
            for f in files:
                with self._open(f) as h:
                    for k in h.keys():
                        self.where[k] = f
        self.shards = sorted(set(self.where.values()))
        self._meta: dict[str, tuple[str, list[int]]] = {}
        for f in self.shards:
            with self._open(f) as h:
                for k in h.keys():
                    if self.where.get(k) == f:
                        sl = h.get_slice(k)
                        self._meta[k] = (sl.get_dtype(), list(sl.get_shape()))
        lost = sorted(k for k in self.where if k not in self._meta)
        if lost:
            raise WasteError(f"the index lists tensors its shards do not hold: {', '.join(lost[:5])}")
        self._handles: dict[str, object] = {}
        self._packed_logical()

    def _open(self, f: str):
        try:
            return safe_open(str(self.src / f), "pt")
        except Exception as e:   # safetensors raises its own error types for damaged files
            raise WasteError(f"cannot read {self.src / f}: {e}") from None

    def _packed_logical(self) -> None:
        """Give each compressed-tensors matrix (`X.weight_packed` + `X.weight_scale` [+ `X.weight_shape`]) a
        logical entry `X.weight` with dtype MXFP4 (uint8 E2M1 pairs, uint8 E8M0 scales, groups of 32) or INT4
        (int32 words of eight offset-8 nibbles, float scales per group, with or without a `weight_zero_point`).
        Anything else packed (NVFP4's global scale, other bit widths) is refused here, before anything is written."""
        self._skip, self._asym = set(), set()
        for k in [k for k in self._meta if k.endswith(PACKED_SUFFIX)]:
            base = k[:-len("_packed")]
            dt, shape = self._meta[k]
            if base + "_scale" not in self._meta:
                raise WasteError(f"{k} has no {base}_scale companion")
            sdt, sshape = self._meta[base + "_scale"]
            if base + "_global_scale" in self._meta:
                raise WasteError(f"{base} is NVFP4 (fp4 with {sdt} group scales and a weight_global_scale): this "
                                 "converter does not read NVFP4 yet; convert the release's bf16 weights instead")
            if dt == "U8":
                kind, logical = "MXFP4", [shape[0], shape[1] * 2]
                if sdt != "U8" or sshape != [shape[0], logical[1] // 32]:
                    raise WasteError(f"{base} is packed fp4 with {sdt} scales of shape {sshape}: only mxfp4 (uint8 "
                                     f"E8M0 scales, one per 32 values: {[shape[0], logical[1] // 32]}) is read")
                if base + "_zero_point" in self._meta:
                    raise WasteError(f"{base} is mxfp4 with a weight_zero_point: asymmetric fp4 is not a format "
                                     "this converter reads")
            elif dt == "I32":
                kind, logical = "INT4", [shape[0], shape[1] * 8]
                if base + "_shape" in self._meta and not self._remote:
                    logical = [int(v) for v in self._handle(self.where[base + "_shape"]).get_tensor(base + "_shape")]
                if len(shape) != 2 or shape[1] != -(-logical[1] // 8):
                    raise WasteError(f"{base} packs {shape[1] if len(shape) == 2 else shape} int32 words per row for "
                                     f"{logical[1]} values: not 4-bit; this converter reads int4 pack-quantized "
                                     "weights only")
                if len(sshape) != 2 or sshape[0] != logical[0] or logical[1] % sshape[1]:
                    raise WasteError(f"{base}: scales of shape {sshape} do not divide a {logical} int4 matrix into "
                                     "groups")
                if base + "_zero_point" in self._meta:
                    self._asym.add(base)
            else:
                raise WasteError(f"{k} is {dt}: this converter reads packed uint8 (mxfp4) or int32 (int4) weights")
            self._meta[base], self.where[base] = (kind, logical), self.where[k]
            self._skip.add(k)
            self._skip.update(base + c[len(".weight"):] for c in CT_COMPANIONS)

    def weight_names(self) -> list[str]:
        """Every tensor that is a parameter (fp8 scale companions, packed companions and ignorable buffers excluded)."""
        return [k for k in self._meta if not k.endswith(SCALE_SUFFIX) and not k.endswith(IGNORED_SUFFIXES)
                and k not in self._skip]

    def shape(self, name: str) -> list[int]:
        return self._meta[name][1]

    def dtype(self, name: str) -> str:
        return self._meta[name][0]

    def nbytes(self, name: str) -> int:
        n = 1
        for d in self.shape(name):
            n *= d
        return int(n * {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "MXFP4": 0.53, "INT4": 0.53}.get(self.dtype(name), 4))

    def names_in(self, shard: str) -> list[str]:
        return sorted(k for k in self.weight_names() if self.where[k] == shard)

    def released_format(self, name: str) -> str | None:
        """The container format that holds a matrix the release ships quantized exactly (from the headers alone):
        mxfp4 as is; int4 with bf16 scales in groups of 32..256 as q4gNN. Else None."""
        kind = self.dtype(name)
        if kind == "MXFP4":
            return "mxfp4"
        if kind != "INT4":
            return None
        N, K = self.shape(name)
        sdt, sshape = self._meta[name + "_scale"]
        g = K // sshape[1]
        return (f"q4g{g}" if sdt == "BF16" and g in (32, 64, 128, 256) and not N % 2 and name not in self._asym
                else None)      # asymmetric int4 (zero points) is decoded to floats instead

    def released_parts(self, name: str):
        """(format name, parts) of a matrix the release ships quantized, in a container format that holds its
        values exactly: mxfp4 as is; int4 (bf16 scales, group 32..256) as q4 nibbles with zero 0. Else None."""
        fmt = self.released_format(name)
        if fmt is None:
            return None
        packed, scale = self._packed(name)
        N, K = self.shape(name)
        if fmt == "mxfp4":
            return "mxfp4", {"blocks": packed.contiguous(), "scales": scale.contiguous()}
        from ..quant.int4pack import pack_nibbles

        sz = torch.stack([scale.t(), torch.zeros_like(scale.t())], -1).contiguous()
        return fmt, {"q": pack_nibbles(_int4_nibbles(packed, N, K)), "sz": sz}

    def get(self, name: str) -> torch.Tensor:
        """The tensor in a float dtype: as stored for bf16 / f16 / f32 (the formats widen what they need, so a
        bf16 -> bf16 conversion copies bytes), float32 for fp8 blocks (dequantized with their scale companion) and
        packed weights (unpacked)."""
        if self.dtype(name) in ("MXFP4", "INT4"):
            packed, scale = self._packed(name)
            N, K = self.shape(name)
            if self.dtype(name) == "MXFP4":
                from ..quant.lowbit import mx_dequantize

                return mx_dequantize(packed, scale, N, K)
            q = _int4_nibbles(packed, N, K).float() - 8
            g = K // scale.shape[1]
            if name in self._asym:      # w = (q - zero) * scale, zeros as int4 packed down the rows
                q = q.view(N, K // g, g) - self._zero_points(name, N, K // g)[..., None]
            return (q.view(N, K // g, g) * scale.float()[..., None]).view(N, K)
        t = self._handle(self.where[name]).get_tensor(name)
        if t.dtype == torch.float8_e4m3fn:
            comp = name.removesuffix(".weight") + SCALE_SUFFIX
            if comp not in self.where:
                raise WasteError(f"{name} is fp8 but its scale {comp} is not in the checkpoint")
            return dequant_fp8_blocks(t, self._handle(self.where[comp]).get_tensor(comp), self.fp8_block)
        if not t.is_floating_point():
            raise WasteError(f"{name} has dtype {t.dtype}, which this converter does not read yet")
        return t if t.dtype in (torch.bfloat16, torch.float16, torch.float32) else t.float()

    def get_index(self, name: str, i: int) -> torch.Tensor:
        """name[i] as stored, read alone (one expert of a release's fused [experts, ...] tensor)."""
        return self._handle(self.where[name]).get_slice(name)[i]

    def _packed(self, name: str):
        """A compressed-tensors matrix's packed weight and scale, each from its own shard (an index may split them)."""
        return tuple(self._handle(self.where[name + c]).get_tensor(name + c) for c in ("_packed", "_scale"))

    def _zero_points(self, name: str, N: int, G: int) -> torch.Tensor:
        """compressed-tensors' asymmetric int4 zero points [N, G]: int32 words packed along dim 0 (eight rows a word,
        offset 8), or unpacked integers."""
        zp = self._handle(self.where[name + "_zero_point"]).get_tensor(name + "_zero_point")
        if zp.dtype == torch.int32 and list(zp.shape) == [-(-N // 8), G]:
            return _int4_nibbles(zp.t().contiguous(), G, N).t().float() - 8
        if list(zp.shape) == [N, G] and not zp.is_floating_point():
            return zp.float()
        raise WasteError(f"{name}_zero_point has shape {list(zp.shape)} ({zp.dtype}): expected int32 [{-(-N // 8)}, {G}] "
                         f"or integers [{N}, {G}]")

    def _handle(self, f: str):
        if f not in self._handles:
            if len(self._handles) > 4:     # bound open mmaps: the converter walks shards in order
                self._handles.pop(next(iter(self._handles)))
            self._handles[f] = self._open(f)
        return self._handles[f]


def _int4_nibbles(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """compressed-tensors pack-quantized int4: int32 words, element 8w + i in bits 4i..4i+3, stored as value + 8."""
    words = packed.view(N, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return ((words[..., None] >> shifts) & 15).view(N, -1)[:, :K].to(torch.uint8)
