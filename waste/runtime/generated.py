"""Random expert records generated in place (`random:` models, waste/random_model.py): every expert this process
holds is written straight into one slab on the compute device, from a seed of its own (the run's seed, its layer,
its id), so a rank of expert parallel builds exactly the experts of those ids that one process builds, and no
record ever touches a disk or the host.

The store is the expert cache with every record resident from the start (no banks, no reads, no eviction): its
lookups, its bank views and the GPU's graphed path are the cache's own, so the kernels see what they see for a
converted model held whole.

A record's parts: a float format's matrix is N(0, 1 / columns); a packed format's codes (q8's int8, q4's nibbles,
mxfp4's E2M1 pairs) are uniform random bits, its scales (and q4's zero points) those of one real pack of a random
matrix of the same shape, shared by every expert: values that mean nothing in a range a model of the format has.
"""
from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..container.bank import RecordLayout
from ..errors import WasteError
from ..layers.gpu import cuda_kernels
from ..layers.moe import layout_for
from ..quant.formats import get_format
from .cache import ExpertCache
from .experts import ExpertStats, expert_act, matrix_parts, prepare_record
from .policy import LFRU

CODE_PARTS = {"q": None, "blocks": None}      # packed parts whose every bit pattern is a valid value
GENERATED = ("bf16", "f16", "f32", "q8", "q4", "q4g32", "q4g64", "q4g128", "q4g256", "mxfp4")


def seed_of(*key) -> int:
    """A 63-bit seed from the run's seed and a name (a trunk tensor's, or a layer and expert id): the same on every
    rank and machine."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 1


def generator(device: torch.device, *key) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed_of(*key))


def check_format(name: str) -> None:
    if name not in GENERATED:
        raise WasteError(f"random model: experts={name} cannot be generated in place; choose one of "
                         f"{', '.join(GENERATED)}")


class GeneratedExperts(ExpertCache):
    """Every owned record (`owned`: layer -> expert ids; None: all of them) generated into a slab on `device`."""
    read_mode = "none (generated in place)"     # waste bench's report

    def __init__(self, layout: RecordLayout, cfg: dict, fmt_name: str, layers: dict[int, int], dtype: torch.dtype,
                 device: str, seed: int, owned: dict[int, list[int]] | None = None):
        check_format(fmt_name)
        moe = cfg.get("moe") or {}
        self.device, self.dtype, self.verify = torch.device(device), dtype, False
        self.banks, self.readers, self.format, self.fmt = {}, {}, fmt_name, get_format(fmt_name)
        self.layout, self.record_bytes = layout, layout.record_bytes
        h, inter = moe.get("expert_hidden", cfg["hidden_size"]), moe.get("intermediate_size", 0)
        self.shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
        self.repack = self.fmt.needs_prepare()
        self.swiglu_limit, self.act = cfg.get("swiglu_limit"), expert_act(moe)
        self.owned = {l: list(owned[l]) if owned is not None else list(range(n)) for l, n in layers.items()}
        keys = [(l, e) for l in sorted(self.owned) for e in self.owned[l]]
        self.n_records = self.n_slots = self.n_dev = len(keys)
        self.budget_bytes = self.vram_bytes = self.n_slots * self.record_bytes
        slab = torch.zeros(self.budget_bytes, dtype=torch.uint8, device=self.device)     # padding too: whole records
        on_gpu = self.device.type != "cpu"
        self.slab, self.dev_slab = (None, slab) if on_gpu else (slab, None)
        self._mm, self.tiered, self.pinned, self.fits, self.direct = None, False, False, True, False
        self.tier, self.tier_prefetch, self._tier_next = None, False, None       # no VRAM tier: all in the slab
        self._dirty, self._dev_map, self._parts_of_slot, self._up_event = set(), None, {}, None
        self.slot_of, self.key_of, self.free = {}, [None] * self.n_slots, []
        self._held = torch.zeros(self.n_slots, dtype=torch.bool).numpy()     # ExpertCache._take_slots's mask
        self._flight_lock, self._in_flight, self._busy_since = threading.Lock(), 0, 0.0   # (no reads: never busy)
        # ExpertCache's slot map: written through its numpy view
        self._slots = np.full((max(layers, default=-1) + 1, max(layers.values(), default=0)), -1, dtype=np.int64)
        self.slot_map = torch.from_numpy(self._slots)
        self.layer_slots = list(self.slot_map)
        self.half_life, self.policy, self.step = 0.0, LFRU(self.n_slots, 0.0), 1.0 / max(len(layers), 1)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="waste-generated")
        self.aio = None                                # ExpertCache's Linux AIO context: nothing is ever read
        self.lock, self.loading, self.stats, self.fill_bytes = threading.Lock(), {}, ExpertStats(), 0
        self.damage, self.prefetch, self.wants_prefetch, self._predicted, self.precision = None, False, False, {}, 1.0
        self._stop, self.fill_thread = threading.Event(), None
        rows = slab.view(max(self.n_slots, 1), self.record_bytes) if self.n_slots else None
        template = self._template()
        for s, key in enumerate(keys):
            self._assign(key, s)
            self._generate(rows[s], key, seed, template)
        # the stored bytes rewritten into the GPU's own layout, as the store does for a record landing there
        self.dev_layout = layout_for(self.fmt, self.device, self.layout) if on_gpu and cuda_kernels() else None
        if self.dev_layout is not None and self.n_slots:
            self.dev_layout(rows, range(self.n_slots))

    def _template(self) -> dict[str, torch.Tensor]:
        """One real pack of a seeded random matrix per shape: the non-code parts every generated record shares."""
        out = {}
        if self.fmt.kind == "float" or not self.n_slots:
            return out
        for m, shape in self.shapes.items():
            w = torch.randn(shape, generator=torch.Generator().manual_seed(seed_of("template", m))) * shape[1] ** -0.5
            for suffix, t in self.fmt.pack(w).items():
                if suffix not in CODE_PARTS:
                    out[f"{m}.{suffix}"] = t.to(self.device)
        return out

    def _generate(self, row: torch.Tensor, key: tuple[int, int], seed: int, template: dict) -> None:
        g = generator(self.device, seed, "expert", *key)
        views = self.layout.views(row)
        for p in self.layout.parts:
            v = views[p.name]
            m, _, suffix = p.name.partition(".")
            if p.name in template:
                v.copy_(template[p.name].view(v.shape))
            elif suffix in CODE_PARTS:
                info = torch.iinfo(v.dtype)
                v.copy_(torch.randint(info.min, info.max + 1, v.shape, generator=g, device=self.device, dtype=v.dtype))
            elif suffix in ("", "bias") and v.dtype.is_floating_point:
                scale = 0.1 if suffix else self.shapes[m][1] ** -0.5
                v.copy_(torch.randn(v.shape, generator=g, device=self.device, dtype=v.dtype) * scale)
            else:
                raise WasteError(f"random model: the {self.format} part {p.name} has no generation rule")
        if self.repack and self.device.type == "cpu":     # the form the CPU kernel takes, as a cache slot fill makes
            prepare_record(matrix_parts(views), self.fmt, self.shapes)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
