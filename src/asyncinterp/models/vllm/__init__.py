"""vLLM in process: the driver (``VLLM``), its engine and live jobs, the worker-side run, the flat token layout and TP.

``driver`` is what users touch (``ai.VLLM``); ``engine`` checks invokes and
makes their results (``VLLMInvoke``); ``jobs`` is a job in the live engine
loop (``LiveJob``, stepped by ``loop``); ``worker`` is the run that lives with
the model (in process, or in each tensor-parallel worker); ``layout`` slices
vLLM's flat ``[tokens, hidden]`` batch per request; ``tp`` gathers and
re-shards tensor-parallel values.
"""

from ...moved import old_name
from .driver import VLLM, VLLMEngine, VLLMInvoke, LiveJob, HooksUnavailableError

__all__ = ["VLLM", "VLLMEngine", "VLLMInvoke", "LiveJob", "HooksUnavailableError"]


def __getattr__(name):   # old names (VLLMRun): the compatibility table, asyncinterp.moved.RENAMED
    return old_name(__name__, name)
