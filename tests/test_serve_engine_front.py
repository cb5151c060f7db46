"""The server decides once per model what differs per engine kind (serve/scheduling/engine_front.py), and the end-of-sequence
ids come from one function (models.generating.eos_ids)."""

import pytest
import torch
from transformers import GenerationConfig

import asyncinterp as ai
from asyncinterp.models import tiny
from asyncinterp.models.generating import eos_ids
from asyncinterp.serve import Server
from asyncinterp.serve.scheduling.engine_front import EngineFront, VLLMFront, front_for
from asyncinterp.serve.workers.supervisor import check_forkable


class _Tokenizer:
    eos_token_id = 9


def test_eos_ids_from_every_source():
    assert eos_ids(None) == () and eos_ids(3) == (3,) and eos_ids([1, 2, 1]) == (1, 2)
    assert eos_ids(torch.tensor([4, 5])) == (4, 5)
    assert eos_ids(GenerationConfig(eos_token_id=[7, 8]), _Tokenizer()) == (7, 8, 9)
    assert eos_ids(torch.nn.Linear(1, 1), _Tokenizer()) == (9,)      # no generation config: the tokenizer's
    lm = tiny("gpt2")
    eos = lm.tokenizer.eos_token_id
    assert eos_ids(lm) == eos_ids(lm.module) == eos_ids(lm.module.generation_config) == (eos,)
    assert eos_ids(lm, lm.tokenizer) == (eos,)


def test_a_language_model_and_a_wrapped_module_get_the_in_process_front():
    lm = tiny("gpt2")
    front = front_for(lm)
    assert type(front) is EngineFront and front.kind == "transformers" and front.generates
    assert front.context_length == lm.context_length
    assert front.vocab_size() == lm.module.get_input_embeddings().num_embeddings
    assert front.eos_ids() == (lm.tokenizer.eos_token_id,)
    assert front.generation_input("a prompt", cache_salt="ignored") == "a prompt"   # no cache shared here
    assert front.fork_refusal() is None
    plain = front_for(ai.wrap(torch.nn.Linear(2, 2)))
    assert plain.kind == "transformers" and not plain.generates and plain.context_length is None
    server = Server(lm)
    assert isinstance(server.front, EngineFront) and server.is_lm


class _FakeEngine:
    """Stands for ai.VLLM: a live engine (it has submit) with a tokenizer and max_model_len."""

    max_model_len = 64

    def __init__(self):
        self.tokenizer = tiny("gpt2").tokenizer

    def submit(self, run):
        raise AssertionError("not called")

    def generate(self, *args, **kwargs):
        raise AssertionError("not called")


def test_a_live_engine_gets_the_vllm_front():
    engine = _FakeEngine()
    front = front_for(engine)
    assert type(front) is VLLMFront and front.kind == "vllm" and front.generates and front.context_length == 64
    ids = engine.tokenizer("hello there")["input_ids"]
    assert front.generation_input("hello there", cache_salt="s") == {"prompt_token_ids": ids, "cache_salt": "s"}
    assert front.generation_input([1, 2], cache_salt="s") == {"prompt_token_ids": [1, 2], "cache_salt": "s"}
    assert front.generation_input([1, 2]) == [1, 2]
    assert "does not support vLLM" in front.fork_refusal()
    with pytest.raises(ValueError) as refused:
        check_forkable(engine)
    assert str(refused.value) == front.fork_refusal()
