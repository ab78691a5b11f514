"""HF release -> .waste container. Checks everything before writing, writes to a temporary directory,
renames at the end: an interrupted conversion never leaves a container that opens."""
from __future__ import annotations

import datetime
import os
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from .. import __version__
from ..container.bank import BankWriter, RecordLayout
from ..container.manifest import FORMAT_NAME, FORMAT_VERSION, TRUNK_FILE, bank_file, write_manifest
from ..container.trunk import TrunkWriter
from ..errors import WasteError
from ..quant.formats import get_format
from .adapters import EXPERT_MATRICES, Adapter, adapter_for
from .source import Checkpoint

TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "special_tokens_map.json",
              "chat_template.jinja", "generation_config.json", "chat.json")


def check_names(ckpt: Checkpoint, adapter: Adapter) -> None:
    """Name every missing or unexpected tensor before a byte is written."""
    expected = set(adapter.trunk_names()) | set(adapter.expected_expert_names())
    have = {adapter.canonical(n) for n in ckpt.weight_names()}
    if adapter.config["tie_word_embeddings"]:
        have.discard("lm_head.weight")
    missing, unexpected = sorted(expected - have), sorted(have - expected)
    msgs = []
    if missing:
        msgs.append(f"{len(missing)} missing tensors: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    if unexpected:
        msgs.append(f"{len(unexpected)} unexpected tensors: {', '.join(unexpected[:6])}{' ...' if len(unexpected) > 6 else ''}")
    if msgs:
        raise WasteError(f"{ckpt.src} does not match the {adapter.family} layout: " + "; ".join(msgs))
    c = adapter.config
    h, inter = c["hidden_size"], c["moe"]["intermediate_size"] if c.get("moe") else 0
    want = {"gate": [inter, h], "up": [inter, h], "down": [h, inter]}
    for name in adapter.expected_expert_names():
        _, _, mat = adapter.classify_expert(name)
        if ckpt.shape(name) != want[mat]:
            raise WasteError(f"{name} has shape {ckpt.shape(name)}, expected {want[mat]} from config.json")


def expert_layout(fmt_name: str, cfg: dict) -> RecordLayout:
    fmt = get_format(fmt_name)
    h, inter = cfg["hidden_size"], cfg["moe"]["intermediate_size"]
    shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    tensors = {}
    for m in EXPERT_MATRICES:
        for suffix, t in fmt.pack(torch.zeros(shapes[m])).items():
            tensors[f"{m}.{suffix}" if suffix else m] = t
    return RecordLayout.from_tensors(tensors)


def convert(src: str | os.PathLike, out: str | os.PathLike, experts: str = "bf16", trunk: str = "bf16",
            force: bool = False, progress: bool = True) -> Path:
    src, out = Path(src).expanduser(), Path(out).expanduser()
    ckpt = Checkpoint(src)
    adapter = adapter_for(ckpt.config)
    check_names(ckpt, adapter)
    efmt, tfmt = get_format(experts), get_format(trunk)
    if out.exists() and not force:
        raise WasteError(f"{out} already exists: remove it or pass --force")
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "experts").mkdir(parents=True)
    try:
        manifest = _write(ckpt, adapter, efmt, tfmt, tmp, progress)
        manifest["provenance"] = {"source": str(src), "converter": f"waste {__version__}",
                                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        write_manifest(tmp, manifest)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write(ckpt: Checkpoint, adapter: Adapter, efmt, tfmt, root: Path, progress: bool) -> dict:
    cfg = adapter.config
    trunk_src = {adapter.trunk_target(n): n for n in adapter.trunk_names()}
    specs = {}
    original = {adapter.canonical(n): n for n in ckpt.weight_names()}
    for dst, n in trunk_src.items():
        shape = ckpt.shape(original[n])
        specs[dst] = (torch.float32 if adapter.is_f32(dst, len(shape)) else tfmt.dtype, shape)
    tw = TrunkWriter(str(root / TRUNK_FILE), specs, {"format": FORMAT_NAME, "trunk_format": tfmt.name})
    layout = expert_layout(efmt.name, cfg) if adapter.moe_layers() else None
    n_exp = cfg["moe"]["num_experts"] if layout else 0
    banks = {i: BankWriter(str(root / bank_file(i)), i, n_exp, layout) for i in adapter.moe_layers()}
    dst_of = {n: d for d, n in trunk_src.items()}
    pending: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    total = sum(ckpt.nbytes(n) for n in ckpt.weight_names())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not progress)
    try:
        for shard in ckpt.shards:
            for name in ckpt.names_in(shard):
                bar.update(ckpt.nbytes(name))
                hit = adapter.classify_expert(name)
                if hit is None:
                    if adapter.canonical(name) in dst_of:
                        tw.write(dst_of[adapter.canonical(name)], ckpt.get(name))
                    continue
                layer, e, mat = hit
                slot = pending.setdefault((layer, e), {})
                for suffix, t in efmt.pack(ckpt.get(name)).items():
                    slot[f"{mat}.{suffix}" if suffix else mat] = t
                if len(slot) == len(layout.parts):
                    banks[layer].write(e, pending.pop((layer, e)))
        tw.close()
        for b in banks.values():
            b.close()
    finally:
        bar.close()
    trunk_params = sum(torch.Size(s).numel() for _, s in specs.values())
    expert_params = 3 * cfg["hidden_size"] * cfg["moe"]["intermediate_size"] if layout else 0
    n_moe = len(banks)
    text = {}
    for f in TEXT_FILES:
        if (ckpt.src / f).is_file():
            shutil.copy2(ckpt.src / f, root / f)
            text[f.split(".")[0]] = f
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "family": adapter.family, "config": cfg,
        "trunk": {"file": TRUNK_FILE, "format": tfmt.name, "bytes": tw.bytes, "crc32": tw.crc32,
                  "f32_tensors": sorted(d for d, (dt, _) in specs.items() if dt == torch.float32)},
        "experts": {"format": efmt.name, "record_bytes": layout.record_bytes if layout else 0,
                    "layout": layout.to_json() if layout else None,
                    "layers": {str(i): {"file": bank_file(i), "num_experts": n_exp} for i in banks},
                    "bytes": sum(b.header_bytes + n_exp * layout.record_bytes for b in banks.values())},
        "text": text,
        "params": {"total": trunk_params + n_moe * n_exp * expert_params,
                   "active": trunk_params + n_moe * (cfg["moe"]["top_k"] if layout else 0) * expert_params,
                   "trunk": trunk_params, "experts": n_moe * n_exp * expert_params},
    }
