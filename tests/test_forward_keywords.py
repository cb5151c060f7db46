"""Unknown forward keywords are refused with the accepted names, on transformers models too (issue 33, item 6b).

They used to be dropped silently: every transformers forward ends in ``**kwargs``, and the check gave up on
it, so ``trace(prompt, fn, images=[img])`` on a text-only model and a misspelled ``imagez=`` ran and gave the
logits of a run without them. Now the names are read from the signature, from ``**kwargs: Unpack[TypedDict]``
(transformers 5's ``TransformersKwargs``), and for an untyped ``**kwargs`` of a transformers model (GPT-2) or
a peft wrapper (its base model) from what transformers passes them on as. Every keyword used by the test
suite and the docs still works; a plain module's untyped ``forward(**kwargs)`` still takes anything.
"""

from typing import TypedDict

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import asyncinterp as ai
from asyncinterp.hooks.keywords import accepted_keywords
from asyncinterp.models.hf.bundled import tiny_llama

try:
    from typing import Unpack
except ImportError:  # Python 3.10
    from typing_extensions import Unpack

PROMPT = "The quick brown fox"


async def logits(m):
    return (await m.lm_head.output).clone()


@pytest.fixture(scope="module")
def llama():
    model, tok = tiny_llama()
    return ai.LanguageModel(model, tok), model, tok


@pytest.mark.parametrize("kwargs, word", [({"images": [object()]}, "images"), ({"imagez": 1}, "imagez"),
                                          ({"attention_mask_": 1}, "attention_mask_")])
def test_unknown_keywords_on_a_language_model_are_refused(llama, kwargs, word):
    lm, _, _ = llama
    with pytest.raises(TypeError, match=word) as info:
        lm.trace(PROMPT, logits, **kwargs)
    message = str(info.value)
    assert "LlamaForCausalLM.forward" in message and "'logits_to_keep'" in message and "'use_cache'" in message
    if word == "images":
        assert "VisionLanguageModel" in message
    with pytest.raises(TypeError, match=word):       # and through invokes
        with lm.trace() as tr:
            tr.invoke(PROMPT, logits, **kwargs)


def test_unknown_keywords_on_a_wrapped_transformers_model_are_refused(llama):
    _, model, tok = llama
    m = ai.wrap(model)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with pytest.raises(TypeError, match="imagez"):
        m.trace(ids, logits, imagez=1)
    assert m.trace(ids, logits, use_cache=False).shape == (1, ids.shape[1], model.config.vocab_size)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_legitimate_keywords_reach_forward(arch, llama):
    """Named parameters, TransformersKwargs keys (typed: Llama; untyped **kwargs: GPT-2) and return_dict."""
    if arch == "llama":
        lm, model, tok = llama
    else:
        from asyncinterp.models.hf.bundled import gpt2_tokenizer
        torch.manual_seed(0)
        tok = gpt2_tokenizer()
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4,
                                           attn_implementation="eager")).eval()
        lm = ai.LanguageModel(model, tok)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        full = model(ids).logits
        assert lm.trace(PROMPT, logits, logits_to_keep=1).shape[1] == 1               # a named parameter
        torch.testing.assert_close(lm.trace(PROMPT, logits, use_cache=False), full)
        torch.testing.assert_close(lm.trace(PROMPT, logits, return_dict=True), full)  # transformers' decorator

        async def attentions(m):
            return (await m.output).attentions                                         # TransformersKwargs key
        att = lm.trace(PROMPT, attentions, output_attentions=True)
    assert att is not None and len(att) == model.config.num_hidden_layers
    assert {"output_attentions", "output_hidden_states", "return_dict"} <= accepted_keywords(model)


def test_moe_router_logits_keyword():
    from asyncinterp.models.hf.tiny_moe import tiny_moe
    model, tok = tiny_moe("mixtral")
    lm = ai.LanguageModel(model, tok)

    async def router_logits(m):
        return (await m.output).router_logits

    with torch.no_grad():
        assert lm.trace(PROMPT, router_logits, output_router_logits=True) is not None
    with pytest.raises(TypeError, match="output_router_logit'"):
        lm.trace(PROMPT, router_logits, output_router_logit=True)


def test_plain_modules_keep_their_rules():
    class Open(torch.nn.Module):                      # untyped **kwargs: cannot be read, anything goes (as before)
        def forward(self, x, **kwargs):
            return x * kwargs.get("scale", 1.0)

    class Keys(TypedDict, total=False):
        scale: float

    class Typed(torch.nn.Module):                     # typed **kwargs: the TypedDict's keys
        def forward(self, x, **kwargs: Unpack[Keys]):
            return x * kwargs.get("scale", 1.0)

    x = torch.ones(2)
    assert torch.equal(ai.wrap(Open()).trace(x, scale=3.0, anything=1), torch.full((2,), 3.0))
    assert accepted_keywords(Open()) is None
    typed = ai.wrap(Typed())
    assert torch.equal(typed.trace(x, scale=2.0), torch.full((2,), 2.0))
    with pytest.raises(TypeError, match=r"takes no keyword argument\(s\) \['scael'\].*\['scale', 'x'\]"):
        typed.trace(x, scael=2.0)


def test_peft_model_takes_its_base_models_keywords():
    pytest.importorskip("peft")
    from asyncinterp.models.hf.lora import tiny_lora_llama
    peft_model, tok = tiny_lora_llama()
    lm = ai.LanguageModel(peft_model, tok)
    with torch.no_grad():
        assert lm.trace(PROMPT, logits, adapter="blue", logits_to_keep=1).shape[1] == 1
    with pytest.raises(TypeError, match="imagez"):
        lm.trace(PROMPT, logits, adapter="blue", imagez=1)


def test_vision_language_model_refuses_unknown_keywords():
    from asyncinterp.models.hf.tiny_vision import random_image, tiny_llava
    hf, processor = tiny_llava()
    vlm = ai.LanguageModel(hf, processor)
    text = f"{vlm.image_placeholder} What is in the picture?"
    img = [random_image(20, 30, seed=1)]
    with torch.no_grad():
        assert vlm.trace(text, logits, images=img).shape[0] == 1                       # images= still works
        with pytest.raises(TypeError, match="imagez"):
            vlm.trace(text, logits, images=img, imagez=img)


def test_generation_refuses_unknown_keywords(llama):
    """Generation options go to transformers' generate, which refuses model keywords it does not know."""
    lm, _, _ = llama
    with pytest.raises((TypeError, ValueError), match="imagez"):
        lm.generate(PROMPT, logits, max_new_tokens=2, imagez=1)


def test_a_forward_swapped_by_a_plain_wrapper_keeps_the_models_names(llama):
    """Device-map style hooks replace ``forward`` with a ``(*args, **kwargs)`` wrapper: the model's class still
    says what it accepts, so named parameters keep working and unknown names are still refused."""
    _, _, tok = llama
    model, _ = tiny_llama()
    inner = model.forward

    def forward(*args, **kwargs):
        return inner(*args, **kwargs)

    model.forward = forward
    lm = ai.LanguageModel(model, tok)
    with torch.no_grad():
        assert lm.trace(PROMPT, logits, logits_to_keep=1).shape[1] == 1
    with pytest.raises(TypeError, match="imagez"):
        lm.trace(PROMPT, logits, imagez=1)
