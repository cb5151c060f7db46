"""Shared by the example scripts: pick the model from the command line.

``python examples/<script>.py`` uses the bundled SmolLM2-135M-Instruct;
``--model tiny`` uses a tiny random Llama (fast, meaningless outputs: for smoke
tests); any other value is a local transformers model directory.
"""

import argparse

import torch

import asyncinterp as ai


def load_model(description: str):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2", help="'smollm2' (default), 'tiny', or a model directory")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.model == "smollm2":
        return ai.models.smollm2()
    if args.model == "tiny":
        return ai.models.tiny("llama")
    return ai.LanguageModel.from_pretrained(args.model)
