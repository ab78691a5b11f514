"""A tiny GLM-5.3-Flash release with a real-format vision tower (transformers 5.24.0's own save_pretrained), its
GLM tokenizer markers and the chat template revision that places images, for the image tests."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.modules.setdefault("fla", None)

import torch  # noqa: E402
from fixtures import TOKENIZER_TEXT, _randomise  # noqa: E402
from test_oracle_glm5 import text_config  # noqa: E402

from waste.convert.synthetic import write_tokenizer  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent / "data" / "templates" / "GLM-5.3-Flash-0xSero-EXL3.jinja"
GLM_SPECIALS = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>", "<tool_response>", "</tool_response>", "<|begin_of_image|>", "<|image|>",
                "<|end_of_image|>", "<|begin_of_video|>", "<|video|>", "<|end_of_video|>")
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
              projection_intermediate_size=40, swiglu_limit=1.5)
# a budget small enough that ordinary images are scaled down (the default is 8000 tokens)
PREPROCESSOR = {"image_processor_type": "Glm5NextImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "min_image_tokens": 4, "max_image_tokens": 24, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "do_convert_rgb": True}


def token_ids(dst: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    return {s: tok.token_to_id(s) for s in GLM_SPECIALS}


def vision_model(ids: dict[str, int], seed: int = 0):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config=text_config(eos_token_id=[ids["<|endoftext|>"]]), vision_config=VISION,
                         image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
                         image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
                         video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"])
    m = Glm5NextForConditionalGeneration._from_config(cfg, attn_implementation="eager",
                                                      experts_implementation="eager").float().eval()
    _randomise(m, seed)
    return m


def write_release(dst: Path):
    """The release directory and the transformers model it holds."""
    dst.mkdir(parents=True, exist_ok=True)
    write_tokenizer(dst, TOKENIZER_TEXT, vocab_size=300, specials=GLM_SPECIALS)
    model = vision_model(token_ids(dst))
    model.save_pretrained(dst)
    (dst / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE.read_text()
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst, model


def hf_processor(src: Path):
    """transformers' own Glm5NextProcessor (the Pillow image processor, the release's tokenizer), assembled by hand:
    its constructor insists on a video processor, which needs torchvision, and images need none of it."""
    from transformers import AutoTokenizer, Glm5NextProcessor
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(src))
    ip = Glm5NextImageProcessorPil(**{k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"})
    p = Glm5NextProcessor.__new__(Glm5NextProcessor)
    p.image_processor, p.tokenizer, p.chat_template = ip, tok, TEMPLATE.read_text()
    p.image_token, p.video_token = "<|image|>", "<|video|>"
    p.image_token_id, p.video_token_id = tok.convert_tokens_to_ids("<|image|>"), tok.convert_tokens_to_ids("<|video|>")
    p.video_start_id = tok.convert_tokens_to_ids("<|begin_of_video|>")
    p.video_end_id = tok.convert_tokens_to_ids("<|end_of_video|>")
    return p


def build(root: Path):
    """(release dir, transformers model, converted container) under root."""
    from waste.convert.convert import convert

    src, hf = write_release(root / "src")
    return src, hf, convert(src, root / "glm5v.waste", experts="bf16", trunk="bf16", progress=False)


def copy_without_vision(container: Path, dst: Path) -> Path:
    shutil.copytree(container, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m.pop("vision")
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst
