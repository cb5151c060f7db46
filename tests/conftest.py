"""Shared fixtures: small torch models built in-process (no downloads)."""

import pytest
import torch


class MLP(torch.nn.Module):
    """A 6-block MLP whose blocks are named like a transformer's layers."""

    def __init__(self, width=16, depth=6):
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(depth))
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return MLP().eval()


@pytest.fixture(scope="session")
def gpt2_hf():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=3, n_head=4,
                     attn_implementation="eager")
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="session")
def llama_hf():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


def hooked(module, fn, kind="output"):
    """Context manager-ish helper: register a hand-written hook, return handle."""
    if kind == "output":
        return module.register_forward_hook(fn)
    return module.register_forward_pre_hook(fn)


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(autouse=True)
def _restore_grad_mode():
    """Examples run in-process may switch autograd off globally; never let that leak into other tests."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


@pytest.fixture(scope="module", autouse=True)
def _no_ray_left_connected():
    """A test module that connected this process to Ray leaves it disconnected: a driver left behind keeps
    Ray's background threads (stats, autoscaling) busy on the shared cores during later, timing-sensitive
    tests."""
    yield
    import sys
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
