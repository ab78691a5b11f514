"""Reading a Hugging Face release: config.json (nested text_config too), a sharded safetensors index or
single files, and tensors in bf16/fp16/fp32 or fp8 e4m3 with 128x128 `weight_scale_inv` blocks."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import WasteError

SCALE_SUFFIX = ".weight_scale_inv"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise WasteError(f"{src} has no config.json: give the directory of a Hugging Face release")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WasteError(f"{path} is not valid JSON: {e}") from None
    if isinstance(cfg.get("text_config"), dict):   # multimodal wrappers keep the language model here
        inner = dict(cfg["text_config"])
        inner.setdefault("model_type", cfg.get("model_type"))
        inner.setdefault("quantization_config", cfg.get("quantization_config"))
        for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
            if k not in inner and k in cfg:
                inner[k] = cfg[k]
        cfg = inner
    return cfg


def dequant_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W = W_fp8 * s[i // bm, j // bn]; the last block row/column may be partial (ragged edges)."""
    m, n = w.shape
    bm, bn = block
    s = scale_inv.float().repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return w.float() * s


class Checkpoint:
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

    def _open(self, f: str):
        try:
            return safe_open(str(self.src / f), "pt")
        except Exception as e:   # safetensors raises its own error types for damaged files
            raise WasteError(f"cannot read {self.src / f}: {e}") from None

    def weight_names(self) -> list[str]:
        """Every tensor that is a parameter (fp8 scale companions and ignorable buffers excluded)."""
        return [k for k in self._meta if not k.endswith(SCALE_SUFFIX) and not k.endswith(IGNORED_SUFFIXES)]

    def shape(self, name: str) -> list[int]:
        return self._meta[name][1]

    def dtype(self, name: str) -> str:
        return self._meta[name][0]

    def nbytes(self, name: str) -> int:
        n = 1
        for d in self.shape(name):
            n *= d
        return n * {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8}.get(self.dtype(name), 4)

    def names_in(self, shard: str) -> list[str]:
        return sorted(k for k in self.weight_names() if self.where[k] == shard)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as float32 (fp8 blocks dequantized with their scale companion)."""
        t = self._handle(self.where[name]).get_tensor(name)
        if t.dtype == torch.float8_e4m3fn:
            comp = name.removesuffix(".weight") + SCALE_SUFFIX
            if comp not in self.where:
                raise WasteError(f"{name} is fp8 but its scale {comp} is not in the checkpoint")
            return dequant_fp8_blocks(t, self._handle(self.where[comp]).get_tensor(comp), self.fp8_block)
        if not t.is_floating_point():
            raise WasteError(f"{name} has dtype {t.dtype}, which this converter does not read yet")
        return t.float()

    def _handle(self, f: str):
        if f not in self._handles:
            if len(self._handles) > 4:     # bound open mmaps: the converter walks shards in order
                self._handles.pop(next(iter(self._handles)))
            self._handles[f] = self._open(f)
        return self._handles[f]
