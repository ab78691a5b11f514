"""HF release -> .waste container. Checks everything before writing, writes to a temporary directory,
renames at the end: an interrupted conversion never leaves a container that opens."""
from __future__ import annotations

import datetime
import os
import shutil
import threading
from pathlib import Path

import torch
from tqdm import tqdm

from ..version import __version__
from ..container.bank import BankWriter, RecordLayout
from ..container.manifest import FORMAT_NAME, FORMAT_VERSION, TRUNK_FILE, bank_file, file_table, write_manifest
from ..container.trunk import TrunkWriter
from ..errors import WasteError
from ..quant.formats import DEFAULT_EXPERTS, DEFAULT_TRUNK, get_format
from ..quant.linear import part_name, quantizable
from ..quant.parallel import ParallelQuantizer
from .adapter_base import EXPERT_MATRICES, Adapter, shape_ok, shape_text
from .adapters import adapter_for
from .aside import VisionWriter, drop_notes
from .source import Checkpoint
from .text_files import plan_text


def adapter_of(cfg: dict, src: Path) -> Adapter:
    """The family's adapter; a key it needs that config.json lacks, or holds in another type, named."""
    try:
        return adapter_for(cfg)
    except KeyError as e:
        raise WasteError(f"{src / 'config.json'} has no {e.args[0]!r}, which a {cfg.get('model_type')} release "
                         "needs") from None
    except (TypeError, ValueError, AttributeError, IndexError) as e:
        raise WasteError(f"{src / 'config.json'} has a value of the wrong type or shape for a "
                         f"{cfg.get('model_type')} release ({type(e).__name__}: {e})") from None


def check_names(ckpt: Checkpoint, adapter: Adapter) -> None:
    """Name every missing or unexpected tensor before a byte is written."""
    expected = set(adapter.trunk_names()) | set(adapter.expected_expert_names())
    original = {adapter.canonical(n): n for n in ckpt.weight_names()
                if not adapter.dropped(n) and adapter.vision_target(n) is None}   # both set aside (aside.py)
    have = set(original)
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
    for name, want_shape in adapter.expected_shapes().items():
        got = ckpt.shape(original[name])
        if not shape_ok(got, want_shape):
            raise WasteError(f"{name} has shape {got}, expected {shape_text(want_shape)} from config.json")
    h, inter = expert_dims(c)
    want = {"gate": [inter, h], "up": [inter, h], "down": [h, inter],
            "gate.bias": [inter], "up.bias": [inter], "down.bias": [h]}     # biases: gpt-oss
    for name in adapter.expected_expert_names():
        _, _, mat = adapter.classify_expert(name)
        if ckpt.shape(original[name]) != want[mat]:
            raise WasteError(f"{name} has shape {ckpt.shape(original[name])}, expected {want[mat]} from config.json")


def expert_dims(cfg: dict) -> tuple[int, int]:
    """(the width routed experts read and write, their intermediate width): `moe.expert_hidden` is the latent
    width of a latent MoE (Kimi K3), else the model's hidden_size."""
    moe = cfg.get("moe") or {}
    return moe.get("expert_hidden", cfg["hidden_size"]), moe.get("intermediate_size") or 0


def expert_layout(fmt_name: str, cfg: dict) -> RecordLayout:
    fmt = get_format(fmt_name)
    h, inter = expert_dims(cfg)
    shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    tensors = {}
    for m in EXPERT_MATRICES:
        for suffix, (dt, shape) in fmt.part_specs(shapes[m]).items():
            tensors[f"{m}.{suffix}" if suffix else m] = torch.empty(shape, dtype=dt)
    if (cfg.get("moe") or {}).get("expert_bias"):     # gpt-oss: float32 biases after the matrices (gate, up adjacent)
        for m in EXPERT_MATRICES:
            tensors[f"{m}.bias"] = torch.empty(shapes[m][0], dtype=torch.float32)
    return RecordLayout.from_tensors(tensors)


def released_expert_format(ckpt: Checkpoint, adapter: Adapter) -> str | None:
    """The container format that keeps the release's quantized experts exactly (mxfp4; int4 -> q4gNN), or None."""
    names = adapter.expected_expert_names()
    if not names:
        return None
    original = {adapter.canonical(n): n for n in ckpt.weight_names()}
    return ckpt.released_format(original.get(names[0], names[0]))


def trunk_specs(ckpt: Checkpoint, adapter: Adapter, tfmt) -> tuple[dict, dict, object]:
    """What the trunk file will hold, from names and shapes alone: (specs: stored name -> (dtype, shape),
    quantized: matrix -> shape for those stored as tfmt's parts, the float format of everything else)."""
    specs = {}
    quantized: dict[str, list[int]] = {}      # trunk matrices stored in the quantized trunk format, as parts
    ffmt = tfmt if hasattr(tfmt, "dtype") else get_format("bf16")   # the float format of everything else
    original = {adapter.canonical(n): n for n in ckpt.weight_names()}
    for n in adapter.trunk_names():
        dst, shape = adapter.trunk_target(n), ckpt.shape(original[n])
        if adapter.is_f32(dst, len(shape)):
            specs[dst] = (torch.float32, shape)
        elif tfmt is not ffmt and quantizable(dst, shape, tfmt, adapter.keep_float):
            quantized[dst] = list(shape)
            for suffix, (dt, pshape) in tfmt.part_specs(tuple(shape)).items():
                specs[part_name(dst, suffix)] = (dt, list(pshape))
        else:
            specs[dst] = (ffmt.dtype, shape)
    return specs, quantized, ffmt


def convert(src: str | os.PathLike, out: str | os.PathLike, experts: str = "auto", trunk: str = DEFAULT_TRUNK,
            force: bool = False, progress: bool = True, chat: str = "auto", workers: int | None = None,
            provenance: dict | None = None) -> Path:
    """chat: "auto" installs waste's chat.json for the family when the release has no template and its tokenizer
    carries the markup (else the container is completion-only, and its manifest says why); "require" refuses
    the conversion instead; "none" installs no chat.json (text_files.py).
    experts: a format name, or "auto": as released when the release ships quantized experts (mxfp4 kept as is,
    int4 as q4 nibbles holding the same values), else DEFAULT_EXPERTS. trunk: a format name (docs/LEARNED.md
    says why the defaults). Matrices are quantized by `workers` threads (default one per core). provenance: extra
    keys for the manifest's provenance (waste/hub adds `hub`: repo, revision, commit)."""
    src, out = Path(src).expanduser(), Path(out).expanduser()
    ckpt = Checkpoint(src)
    adapter = adapter_of(ckpt.config, src)
    ckpt = adapter.view(ckpt)
    check_names(ckpt, adapter)
    text = plan_text(src, adapter.family, chat)   # tokenizer and chat format: refused here, before writing
    released = released_expert_format(ckpt, adapter) if adapter.moe_layers() else None
    if experts == "auto":
        experts = released or DEFAULT_EXPERTS
    efmt, tfmt = get_format(experts), get_format(trunk)
    if adapter.moe_layers():
        h, inter = expert_dims(adapter.config)
        for shape in ((inter, h), (h, inter)):
            if not efmt.supports(shape):
                raise WasteError(f"the {efmt.name} format cannot store this model's experts ({shape[0]} x {shape[1]} "
                                 f"matrices, docs/FORMAT.md says which shapes each format takes): choose another --experts")
    if out.exists() and not force:
        raise WasteError(f"{out} already exists: remove it or pass --force")
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "experts").mkdir(parents=True)
    try:
        manifest = _write(ckpt, adapter, efmt, tfmt, tmp, progress, released == efmt.name, workers)
        manifest["text"] = text.install(tmp)
        manifest["provenance"] = {"source": str(src), "converter": f"waste {__version__}",
                                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                  **(provenance or {})}
        manifest["files"] = file_table(tmp, manifest)
        write_manifest(tmp, manifest)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write(ckpt: Checkpoint, adapter: Adapter, efmt, tfmt, root: Path, progress: bool, keep_released: bool = False,
           workers: int | None = None) -> dict:
    cfg = adapter.config
    trunk_src = {adapter.trunk_target(n): n for n in adapter.trunk_names()}
    specs, quantized, ffmt = trunk_specs(ckpt, adapter, tfmt)
    tw = TrunkWriter(str(root / TRUNK_FILE), specs, {"format": FORMAT_NAME, "trunk_format": tfmt.name})
    vision = VisionWriter(ckpt, adapter, ffmt, root, {"format": FORMAT_NAME, "trunk_format": ffmt.name})
    layout = expert_layout(efmt.name, cfg) if adapter.moe_layers() else None
    n_exp = cfg["moe"]["num_experts"] if layout else 0
    banks = {i: BankWriter(str(root / bank_file(i)), i, n_exp, layout) for i in adapter.moe_layers()}
    dst_of = {n: d for d, n in trunk_src.items()}
    pending: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    lock = threading.Lock()
    total = sum(ckpt.nbytes(n) for n in ckpt.weight_names())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"converting (experts {efmt.name}, trunk {tfmt.name})",
               disable=not progress)

    def trunk_job(name, dst, nbytes):      # runs on a quantizer thread
        def job():
            t = ckpt.get(name)
            if dst in quantized:
                for suffix, part in tfmt.pack(t).items():
                    tw.write(part_name(dst, suffix), part)
            else:
                tw.write(dst, t)
            bar.update(nbytes)
        return job

    def expert_job(name, layer, e, mat, nbytes):
        def job():
            if mat.endswith(".bias"):           # an expert's bias (gpt-oss): float32 whatever the format
                parts = {"": ckpt.get(name).float().contiguous()}
            else:
                got = ckpt.released_parts(name) if keep_released else None
                parts = got[1] if got else efmt.pack(ckpt.get(name))
            with lock:
                slot = pending.setdefault((layer, e), {})
                for suffix, t in parts.items():
                    slot[f"{mat}.{suffix}" if suffix else mat] = t
                done = pending.pop((layer, e)) if len(slot) == len(layout.parts) else None
            if done is not None:
                banks[layer].write(e, done)
            bar.update(nbytes)
        return job

    pool = ParallelQuantizer(workers)
    try:
        for shard in ckpt.shards:
            for name in ckpt.names_in(shard):
                nbytes = ckpt.nbytes(name)
                if vision.take(name, lambda: ckpt.get(name)):
                    bar.update(nbytes)
                    continue
                hit = adapter.classify_expert(name)
                if hit is None:
                    if adapter.canonical(name) in dst_of:
                        pool.run(trunk_job(name, dst_of[adapter.canonical(name)], nbytes), 4 * _numel(ckpt, name))
                    else:
                        bar.update(nbytes)
                    continue
                layer, e, mat = hit
                pool.run(expert_job(name, layer, e, mat, nbytes), 4 * _numel(ckpt, name))
        pool.close()
        tw.close()
        vision_info = vision.close()
        for b in banks.values():
            b.close()
    finally:
        pool.close(raise_error=False)
        bar.close()
    stored_parts = {part_name(d, x) for d, shp in quantized.items() for x in tfmt.part_specs(tuple(shp))}
    trunk_params = sum(torch.Size(s).numel() for d, (_, s) in specs.items() if d not in stored_parts)
    trunk_params += sum(torch.Size(s).numel() for s in quantized.values())
    expert_params = 3 * expert_dims(cfg)[0] * expert_dims(cfg)[1] if layout else 0
    n_moe = len(banks)
    text = {}   # convert() installs the text files (text_files.py)
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "family": adapter.family, "config": cfg,
        "trunk": {"file": TRUNK_FILE, "format": tfmt.name, "bytes": tw.bytes, "crc32": tw.crc32,
                  "f32_tensors": sorted(d for d, (dt, _) in specs.items() if dt == torch.float32 and d not in stored_parts),
                  "quantized": quantized},
        "experts": {"format": efmt.name, "kept_as_released": bool(keep_released and layout),
                    "record_bytes": layout.record_bytes if layout else 0,
                    "layout": layout.to_json() if layout else None,
                    "layers": {str(i): {"file": bank_file(i), "num_experts": n_exp} for i in banks},
                    "bytes": sum(b.header_bytes + n_exp * layout.record_bytes for b in banks.values())},
        "text": text,
        "params": {"total": trunk_params + n_moe * n_exp * expert_params,
                   "active": trunk_params + n_moe * (cfg["moe"]["top_k"] if layout else 0) * expert_params,
                   "trunk": trunk_params, "experts": n_moe * n_exp * expert_params},
        **({"vision": vision_info} if vision_info else {}),
        **({"notes": notes} if (notes := drop_notes(ckpt.weight_names(), adapter)) else {}),
    }


def _numel(ckpt: Checkpoint, name: str) -> int:
    n = 1
    for d in ckpt.shape(name):
        n *= d
    return n
