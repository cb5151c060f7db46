"""Loads scripts/walkprobe.py in every Python process of a walk (scripts/walks.py sets ASYNCINTERP_WALK_DIR and
puts this folder first on PYTHONPATH); without ASYNCINTERP_WALK_DIR it does nothing."""

import os

if os.environ.get("ASYNCINTERP_WALK_DIR"):
    import importlib.util
    import sys
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "walkprobe.py")
    _spec = importlib.util.spec_from_file_location("walkprobe", _path)
    walkprobe = importlib.util.module_from_spec(_spec)
    sys.modules["walkprobe"] = walkprobe
    _spec.loader.exec_module(walkprobe)
    walkprobe.install(os.environ["ASYNCINTERP_WALK_DIR"])
