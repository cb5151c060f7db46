"""vLLM in process: the driver (``VLLM``), the worker-side run, the flat token layout and tensor parallelism.

``driver`` is what users touch (``ai.VLLM``); ``worker`` is the run that lives
with the model (in process, or in each tensor-parallel worker); ``layout``
slices vLLM's flat ``[tokens, hidden]`` batch per request; ``tp`` gathers and
re-shards tensor-parallel values.
"""

from .driver import VLLM, VLLMInvoke, VLLMRun, HooksUnavailableError

__all__ = ["VLLM", "VLLMInvoke", "VLLMRun", "HooksUnavailableError"]
