"""What the KDA and MLA layer tests share: a tiny Kimi-Linear config and transformers' attention code as a float64
oracle."""

import sys

sys.modules["fla"] = None  # keep transformers on its pure-torch fallbacks (fla's Triton kernels fail on CPU)

import inspect  # noqa: E402
import tempfile  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, KimiLinearConfig  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as hf  # noqa: E402

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}    # relative error a layer may show against the oracle


def f64_oracle_module() -> types.ModuleType:
    """transformers' attention code with every hard-coded float32 upcast turned into float64.

    The shipped code computes the recurrence, norms and softmax in float32 whatever the input dtype, so it cannot
    check anything below ~1e-7; the same source with float64 in their place is a float64 oracle.
    """
    src = inspect.getsource(hf)
    src = src[:src.index("\nclass KimiLinearTopkRouter")]  # attention code only; the model classes need a real file
    assert src.count("torch.float32") >= 8 and src.count(".float()") >= 3
    src = src.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    mod = types.ModuleType("transformers.models.kimi_linear._modeling_kimi_linear_f64")
    mod.__package__ = "transformers.models.kimi_linear"
    exec(compile(src, hf.__file__, "exec"), mod.__dict__)
    return mod


def tiny_config(**overrides) -> KimiLinearConfig:
    kw = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=4, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
        num_experts=8, num_experts_per_token=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kw.update(overrides)
    return KimiLinearConfig(**kw)


def tiny_checkpoint(randomize, seed: int):
    """(config, model, checkpoint): a tiny float32 Kimi-Linear randomised by randomize(model, seed), and the tensors
    its save_pretrained writes."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    randomize(model, seed=seed)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        ckpt = load_file(f"{d}/model.safetensors")
    return cfg, model, ckpt


def attention_weights(ckpt: dict, layer: int) -> dict:
    """Layer `layer`'s attention tensors, named without their prefix."""
    pre = f"model.layers.{layer}.self_attn."
    return {k[len(pre):]: v for k, v in ckpt.items() if k.startswith(pre)}
