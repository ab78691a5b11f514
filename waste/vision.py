"""Images in a prompt, for one engine: image parts' bytes decoded and processed as the release's processor does,
its placeholder token expanded to one token per tower row, and the tower (models/vision.py) run to make those rows.
The tower is loaded on the first image and kept (docs/LEARNED.md §13 measured the choice); `waste plan` counts it."""
from __future__ import annotations

import threading

import torch

from .errors import WasteError
from .images.decode import open_image
from .images.glm5 import Glm5ImageProcessor
from .images.sources import FetchPolicy, image_bytes
from .models.vision import EmbeddedRows, build_vision

RUNS = ("glm5_next",)              # families whose tower runs
PLACEHOLDER = {"glm5_next": "<|image|>"}


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
        return Glm5ImageProcessor.from_config(self.manifest.get("preprocessor"))

    @property
    def token_id(self) -> int:
        """The placeholder the chat format writes once per image (the processor's token); it must be the id the
        release's config names, when it names one."""
        tok = PLACEHOLDER[self.container.family]
        tid = self.tokenizer.token_to_id(tok)
        cfg = (self.manifest.get("tokens") or {}).get("image_token_id")
        if tid is None:
            raise WasteError(f"the tokenizer has no {tok} token: this model cannot place images")
        if cfg is not None and cfg != tid:
            raise WasteError(f"config.json's image_token_id {cfg} is not the tokenizer's {tok} ({tid})")
        return tid

    def tower(self):
        with self._lock:
            if self._tower is None:
                if not self.available:
                    raise WasteError(self.why_not())
                self._tower = build_vision(self.container.family, self.manifest, self.container.config["hidden_size"],
                                           self.container.load_vision(), self.dtype)
            return self._tower

    def load(self, parts: list[tuple[str, dict]], policy: FetchPolicy | None = None) -> list:
        """[(where, part)] -> decoded RGB images, each error naming the part it is about."""
        policy = policy or FetchPolicy()
        return [open_image(image_bytes(part, policy, where), f"{where}: the image") for where, part in parts]

    def expand(self, ids: list[int], images: list) -> tuple[list[int], EmbeddedRows]:
        """The rendered prompt's ids with each image's placeholder repeated once per tower row, and those rows."""
        tid, proc = self.token_id, self.processor
        found = [i for i, t in enumerate(ids) if t == tid]
        if len(found) != len(images):
            raise WasteError(f"the chat format placed {len(found)} image placeholders for {len(images)} images (a "
                             "template that writes images as text cannot show them to the model)")
        done = [proc(img) for img in images]
        rows = self.tower()(torch.cat([p for p, _ in done]), [g for _, g in done])
        counts = [proc.tokens(g) for _, g in done]
        out, at, last = [], [], 0
        for pos, n in zip(found, counts):
            out += ids[last:pos]
            at += range(len(out), len(out) + n)
            out += [tid] * n
            last = pos + 1
        out += ids[last:]
        return out, EmbeddedRows(torch.tensor(at, dtype=torch.long), rows)
