"""OpenAI (and vLLM server) compatibility: the shapes of completions, chat, logprobs, choices and model names.

:mod:`.openai_compat` (request fields and answers), :mod:`.choices` (``n`` and
prompt lists), :mod:`.logprobs`, :mod:`.structured` (``response_format``),
:mod:`.tokenize_api` (``/tokenize``, ``/detokenize``, ``/version``),
:mod:`.model_names` (``MODEL:edit`` and adapters) and :mod:`.receipts`.
Below the HTTP floor, above workers, jobs and scheduling.
"""
