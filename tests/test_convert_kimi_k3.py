"""Converting Kimi K3 releases (tests/k3_release.py writes them in the release's layout): what is refused, and how
it is named, before anything is written. The oracle comparisons are in test_oracle_kimi_k3.py."""
import json

import pytest
from fixtures import TOKENIZER_TEXT
from k3_release import TEXT, write_release

from waste.convert.convert import convert
from waste.convert.synthetic import write_tokenizer
from waste.errors import WasteError


def _edit_config(src, **text):
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"].update(text)
    (src / "config.json").write_text(json.dumps(cfg))


def test_refusals_name_the_problem(tmp_path):
    src = write_release(tmp_path / "src", "bf16")
    write_tokenizer(src, TOKENIZER_TEXT, vocab_size=300)
    lac = dict(TEXT["linear_attn_config"], kda_layers=[0, 1, 3, 4], full_attn_layers=[2, 5])   # 0-indexed: wrong
    _edit_config(src, linear_attn_config=lac)
    with pytest.raises(WasteError, match="1-indexed"):
        convert(src, tmp_path / "a.waste", progress=False)
    _edit_config(src, linear_attn_config=TEXT["linear_attn_config"], routed_expert_hidden_size=48)
    with pytest.raises(WasteError, match=r"routed_expert_down_proj.weight has shape \[64, 80\], expected \[48, 80\]"):
        convert(src, tmp_path / "b.waste", progress=False)
    _edit_config(src, routed_expert_hidden_size=64, mla_use_output_gate=False)
    with pytest.raises(WasteError, match=r"unexpected tensors: model\.layers\.2\.self_attn\.g_proj\.weight"):
        convert(src, tmp_path / "c.waste", progress=False)
    assert not list(tmp_path.glob("*.waste*"))      # nothing written


def test_command_line_names_the_problem_without_a_traceback(tmp_path):
    import subprocess
    import sys

    src = write_release(tmp_path / "src", "bf16", linear_attn_config=dict(TEXT["linear_attn_config"], kda_layers=[1, 2]))
    write_tokenizer(src, TOKENIZER_TEXT, vocab_size=300)
    p = subprocess.run([sys.executable, "-m", "waste", "convert", str(src), str(tmp_path / "o.waste")],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.startswith("waste: error: kimi_k3 linear_attn_config") and "1-indexed" in p.stderr
