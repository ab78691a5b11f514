"""Images in a prompt, for one engine: image parts' bytes decoded and processed as the release's processor does,
its placeholder token expanded to one token per tower row, and the tower (models/vision.py) run to make those rows.
Families: GLM-5.3-Flash, Kimi K3.
The tower is loaded on the first image and kept (docs/LEARNED.md §13 measured the choice); `waste plan` counts it."""
from __future__ import annotations

import threading

import torch

from .errors import WasteError
from .images.decode import open_image
from .images.glm5 import Glm5ImageProcessor
from .images.kimi_k3 import KimiK3ImageProcessor
from .images.sources import FetchPolicy, image_bytes
from .models.vision import EmbeddedRows, build_vision

RUNS = ("glm5_next", "kimi_k3")    # families whose tower runs
PLACEHOLDER = {"glm5_next": "<|image|>", "kimi_k3": "<|kimi_image_placeholder|>"}   # what the template writes
PROCESSOR = {"glm5_next": Glm5ImageProcessor, "kimi_k3": KimiK3ImageProcessor}
# Kimi K3: the template's placeholder becomes `<|media_begin|>image WxH<|media_content|>` + one pad per row +
# `<|media_end|>` (the release's processor; WxH is the image as sent); the rows replace the pads
K3_MEDIA = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")


class Vision:
    def __init__(self, container, tokenizer, dtype: torch.dtype):
        self.container, self.tokenizer, self.dtype = container, tokenizer, dtype
        self.manifest = container.manifest.get("vision")
        self._tower, self._lock = None, threading.Lock()

    @property
    def available(self) -> bool:
        return bool(self.manifest) and self.container.family in RUNS

    def why_not(self) -> str:
        if not self.manifest:
            return "this model has no vision tower: it takes text only"
        return f"the {self.container.family} vision tower does not run in waste yet: this model takes text only here"

    @property
    def processor(self):
        return PROCESSOR[self.container.family].from_config(self.manifest.get("preprocessor"))

    def _id(self, tok: str) -> int:
        tid = self.tokenizer.token_to_id(tok)
        if tid is None:
            raise WasteError(f"the tokenizer has no {tok} token: this model cannot place images")
        return tid

    @property
    def token_id(self) -> int:
        """The placeholder the chat format writes once per image (the processor's token); it must be the id the
        release's config names, when it names one."""
        tok = PLACEHOLDER[self.container.family]
        tid = self._id(tok)
        cfg = (self.manifest.get("tokens") or {}).get("image_token_id")
        if cfg is not None and cfg != tid:
            raise WasteError(f"config.json's image_token_id {cfg} is not the tokenizer's {tok} ({tid})")
        return tid

    def _k3_ids(self) -> tuple[int, int, int, int]:
        """begin, content, pad, end; config.json's media_placeholder_token_id names the pad (or the placeholder
        the template writes: both count as image tokens in the release's code)."""
        ids = tuple(self._id(t) for t in K3_MEDIA)
        cfg = (self.manifest.get("tokens") or {}).get("media_placeholder_token_id")
        if cfg is not None and cfg not in (ids[2], self.token_id):
            raise WasteError(f"config.json's media_placeholder_token_id {cfg} is neither the tokenizer's "
                             f"<|media_pad|> ({ids[2]}) nor its {PLACEHOLDER['kimi_k3']} ({self.token_id})")
        return ids

    def _tokens(self, image, n: int, markers) -> tuple[list[int], list[int]]:
        """(the ids that replace one image's placeholder, the offsets among them that take its n rows)."""
        if markers is None:
            return [self.token_id] * n, list(range(n))
        begin, content, pad, end = markers
        w, h = image.size
        head = [begin, *self.tokenizer.encode(f"image {w}x{h}"), content]
        return head + [pad] * n + [end], list(range(len(head), len(head) + n))

    def tower(self):
        with self._lock:
            if self._tower is None:
                if not self.available:
                    raise WasteError(self.why_not())
                self._tower = build_vision(self.container.family, self.manifest, self.container.config["hidden_size"],
                                           self.container.load_vision(), self.dtype)
            return self._tower

    def load(self, parts: list[tuple[str, dict]], policy: FetchPolicy | None = None) -> list:
        """[(where, part)] -> decoded Pillow images, each error naming the part it is about."""
        policy = policy or FetchPolicy()
        composite = self.container.family != "kimi_k3"       # K3's processor fills transparency itself
        return [open_image(image_bytes(part, policy, where), f"{where}: the image", composite)
                for where, part in parts]

    def expand(self, ids: list[int], images: list) -> tuple[list[int], EmbeddedRows]:
        """The rendered prompt's ids with each image's placeholder expanded to one token per tower row (in the
        release's markup: _tokens), and those rows."""
        tid, proc = self.token_id, self.processor
        found = [i for i, t in enumerate(ids) if t == tid]
        if len(found) != len(images):
            raise WasteError(f"the chat format placed {len(found)} image placeholders for {len(images)} images (a "
                             "template that writes images as text cannot show them to the model)")
        markers = self._k3_ids() if self.container.family == "kimi_k3" else None
        done = [proc(img) for img in images]
        rows = self.tower()(torch.cat([p for p, _ in done]), [g for _, g in done])
        counts = [proc.tokens(g) for _, g in done]
        out, at, last = [], [], 0
        for pos, n, img in zip(found, counts, images):
            out += ids[last:pos]
            toks, rows_at = self._tokens(img, n, markers)
            at += [len(out) + i for i in rows_at]
            out += toks
            last = pos + 1
        out += ids[last:]
        return out, EmbeddedRows(torch.tensor(at, dtype=torch.long), rows)
