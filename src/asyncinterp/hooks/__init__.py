"""The hooks layer: envoys over modules and every kind of awaitable hook point.

Module points (``envoy``), gradient points (``grad``), source-level points
(``source``), standard-name aliases, the views that slice a batched value per
invoke (``views``, ``batching``) and the recorded module call order
(``order``). Imports only the kernel; the run (one layer down) implements the
host interface these points are written against (``host``).
"""

from . import grad  # noqa: E402,F401  (registers point.grad)
from . import semantic  # noqa: E402,F401  (registers the semantic points of transformers models)
from . import tl_names  # noqa: E402,F401  (registers TransformerLens's hook names: blocks.3.hook_resid_post)
