"""LoRA through peft on the plain decoder: identity at init, exact merge, trainable selection."""

import torch

from tapetrain.model import Transformer, preset_config
from tapetrain.train.lora import apply_lora, merge_lora_state_dict
from tapetrain.train.optim import apply_trainable


def test_lora_starts_as_identity_and_merges_exactly():
    torch.manual_seed(0)
    base = Transformer(preset_config("tiny", pe="rope")).eval()
    tokens = torch.randint(0, 512, (2, 16))
    reference = base(tokens).logits
    adapted = apply_lora(Transformer(preset_config("tiny", pe="rope")), r=4, alpha=8, dropout=0.0,
                         targets=["q_proj", "v_proj"]).eval()
    adapted.load_state_dict({k.replace(".weight", ".base_layer.weight") if ("q_proj" in k or "v_proj" in k)
                             else k: v for k, v in base.state_dict().items()}, strict=False)
    torch.testing.assert_close(adapted(tokens).logits, reference)  # B = 0 at init
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    tuned = adapted(tokens).logits
    assert (tuned - reference).abs().max() > 1e-3
    plain = Transformer(preset_config("tiny", pe="rope")).eval()
    plain.load_state_dict(merge_lora_state_dict(adapted.state_dict(), r=4, alpha=8))
    torch.testing.assert_close(plain(tokens).logits, tuned, atol=1e-5, rtol=0)


def test_lora_trainable_modes_select_adapters_embeddings_and_norms():
    model = apply_lora(Transformer(preset_config("tiny", pe="rope")), 4, 8, 0.0, ["q_proj", "k_proj"])
    trainable, total = apply_trainable(model, "lora")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names) and trainable < total
    apply_trainable(model, "lora+embed+norm")
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "embed.weight" in names and "norm.weight" in names and "layers.0.attn.q_proj.base_layer.weight" not in names
