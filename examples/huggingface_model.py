#!/usr/bin/env python
"""Getting started: a Hugging Face GPT-2 built from its config (random weights, nothing is
downloaded), compiled for a forward pass and for `generate`.

    python examples/huggingface_model.py
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ferrocore


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=128, bos_token_id=1,
                        eos_token_id=2)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    compiled = torch.compile(model, backend="ferrocore")
    with torch.no_grad():
        logits = compiled(ids).logits
        expected = model(ids).logits
        error = (logits - expected).abs().max().item()
        print(f"logits {tuple(logits.shape)}, max abs error against eager: {error:.2e}")
        assert error < 1e-3, error
        # generate() calls the model once per new token, with a growing cache
        model.forward = torch.compile(model.forward, backend="ferrocore")
        tokens = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False, pad_token_id=0)
    print(f"generated {tokens.shape[1] - 8} tokens: {tokens[0, 8:].tolist()}")
    print(f"graphs compiled: {ferrocore.metrics.total['graphs']}, ATen fallbacks: {ferrocore.metrics.total['fallbacks']}")
    print("OK")


if __name__ == "__main__":
    main()
