"""Models from the Hugging Face Hub: `waste fetch ORG/NAME`, MODEL=ORG/NAME on run / chat / serve / plan / info,
and the cache `waste list` / `waste rm` manage.

Cache layout (under WASTE_CACHE_DIR, default the user cache dir):
  hub/ORG--NAME/                      the release as downloaded (only what conversion reads), .waste-fetch.json
                                      (commit, verified files), .waste-partial/ (downloads to resume)
  ORG--NAME-COMMIT12-EXPERTS-TRUNK.waste   a container converted from it (manifest provenance.hub names the repo)
remote.py talks to the Hub (huggingface_hub), fetch.py downloads and checks, estimate.py plans before downloading,
cache.py resolves a name to a container, lists and removes.
"""
from __future__ import annotations

import re
from pathlib import Path

_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_repo_id(model) -> bool:
    """ORG/NAME that is not a path on this machine (a local directory always wins)."""
    return (isinstance(model, str) and bool(_REPO.fullmatch(model)) and not model.endswith(".waste")
            and not Path(model).exists())
