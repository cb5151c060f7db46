"""What every serving process does at start: load the user's intervention files, set up the request log.

Shared by the command (:mod:`.cli`) and the ranks of a tensor-parallel server
(:mod:`.tp_serve`), which run it in each rank process.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["load_interventions", "setup_logging"]


def load_interventions(server, path: str) -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"asyncinterp_user_interventions_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot load interventions from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    register = getattr(module, "register", None)
    if register is None:
        raise ValueError(f"{path} must define register(server), which adds interventions with "
                         "@server.intervention('name')")
    register(server)


def setup_logging(fmt: str, level: str) -> None:
    from .app import JsonFormatter
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(fields)s", defaults={"fields": ""}))
    logger = logging.getLogger("asyncinterp.serve")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
