"""The family registry (waste/models/family.py): one record per family, read by the engine, the converter and
`waste info`; every model_type goes to exactly one adapter."""
from __future__ import annotations

import pytest

from waste.convert.adapters import adapter_class, adapter_for, convertible
from waste.errors import WasteError
from waste.models import build_model, families, family
from waste.text.chat_format import default_chat_json


def test_every_family_names_its_own_adapter_and_a_known_chat_format():
    assert {"qwen3_moe", "kimi_linear", "glm5_next", "deepseek_v3", "kimi_k3", "deepseek_v32"} <= set(families())
    for name, f in families().items():
        assert f.name == name and adapter_class(f).family == name and f.title
        assert f.chat is None or default_chat_json(f.chat) is not None, (name, f.chat)


@pytest.mark.parametrize("hf,want", [
    ({"model_type": "kimi_linear"}, "kimi_linear"),
    ({"model_type": "kimi_linear", "attn_res_block_size": 4}, "kimi_k3"),    # K3's flat text config
    ({"model_type": "kimi_linear", "outer_model_type": "kimi_k3"}, "kimi_k3"),
    ({"model_type": "kimi_k2"}, "deepseek_v3"),
    ({"model_type": "glm5_next_text"}, "glm5_next"),
])
def test_each_model_type_is_claimed_by_one_family(hf, want):
    got = [f.name for f in families().values() if hf["model_type"] in f.converts and adapter_class(f).claims(hf)]
    assert got == [want]


def test_every_convertible_model_type_has_one_default_claimant():
    for mt in convertible():
        got = [f.name for f in families().values() if mt in f.converts and adapter_class(f).claims({"model_type": mt})]
        assert len(got) == 1, (mt, got)


def test_unknown_families_are_refused_by_name():
    with pytest.raises(WasteError, match=r"unsupported model family 'llama'.*qwen3_moe"):
        family("llama")
    with pytest.raises(WasteError, match=r"unsupported model family 'llama'"):
        build_model("llama", {}, {}, None, None)
    with pytest.raises(WasteError, match=r"unsupported model_type 'llama'; waste can convert: .*kimi_k2"):
        adapter_for({"model_type": "llama"})
