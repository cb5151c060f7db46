"""Which keyword arguments a model's ``forward`` accepts, so that an unknown one is refused, not dropped.

Why this module exists: keyword arguments of ``trace``/``invoke`` go to the
model's forward (docs/semantics.md: "an unknown keyword is a TypeError
listing what forward accepts"). Reading only the named parameters gives up on
every ``forward(..., **kwargs)``, and every transformers model has one, which
then passes the keywords on to its layers, where an unknown one (a misspelled
``imagez=``, or ``images=`` on a text-only model) is silently ignored.

:func:`accepted_keywords` reads what the keywords really are:

* the named parameters of ``forward`` (through ``functools.wraps`` decorators;
  for a transformers model also those of its class's ``forward``, in case a
  device-map hook swapped it for a plain ``(*args, **kwargs)`` wrapper);
* ``**kwargs: Unpack[SomeTypedDict]`` (transformers 5 types them as
  ``TransformersKwargs``, which includes the flash-attention keys): the keys
  of the TypedDict, inherited ones included;
* a transformers ``PreTrainedModel`` whose ``**kwargs`` are untyped (GPT-2):
  the keys of ``TransformersKwargs``, which is what transformers passes them
  on as; and ``return_dict``, which transformers' decorators take;
* a wrapper whose ``forward(**kwargs)`` hands them to ``get_base_model()``
  (a peft ``PeftModel``): its own names and the base model's;

and ``None`` (anything goes: today's behaviour) for a plain module with an
untyped ``forward(**kwargs)``, which cannot be read.
"""

from __future__ import annotations

import inspect
import sys
import typing

__all__ = ["accepted_keywords", "check_forward_kwargs"]

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_UNPACK = tuple(u for u in (getattr(typing, "Unpack", None),
                            getattr(sys.modules.get("typing_extensions"), "Unpack", None)) if u is not None)
#: keywords transformers' forward decorators (``can_return_tuple``) take besides the signature's
_HF_DECORATOR_KEYWORDS = ("return_dict",)


def _typed_dict_keys(annotation):
    """The keys of ``Unpack[TD]`` / ``TD`` when ``TD`` is a TypedDict, else ``None``."""
    if typing.get_origin(annotation) in _UNPACK:
        args = typing.get_args(annotation)
        annotation = args[0] if args else None
    if isinstance(annotation, type) and hasattr(annotation, "__optional_keys__"):   # a TypedDict
        return set(annotation.__required_keys__) | set(annotation.__optional_keys__)
    return None


def _var_keyword_keys(forward, param):
    """The accepted names of a ``**kwargs`` parameter when it is typed with a TypedDict, else ``None``."""
    keys = _typed_dict_keys(param.annotation)
    if keys is not None:
        return keys
    if isinstance(param.annotation, str):              # ``from __future__ import annotations``: resolve it
        try:
            hints = typing.get_type_hints(forward, include_extras=True)
        except Exception:  # noqa: BLE001 - an unresolvable annotation: treat as untyped
            return None
        return _typed_dict_keys(hints.get(param.name))
    return None


def _transformers_kwargs(module):
    """``TransformersKwargs``' keys plus the decorators' keywords, for a transformers model; else ``None``."""
    tf = sys.modules.get("transformers")               # never imported here: a transformers model brought it
    if tf is None or not isinstance(module, getattr(tf, "PreTrainedModel", ())):
        return None
    generic = sys.modules.get("transformers.utils.generic")
    td = getattr(generic, "TransformersKwargs", None)
    keys = _typed_dict_keys(td) if td is not None else None
    return (keys or set()) | set(_HF_DECORATOR_KEYWORDS)


def _class_names(module) -> set:
    """The named parameters of the forward the module's class defines."""
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return set()
    return {n for n, p in params.items() if p.kind in _NAMED} - {"self"}


def accepted_keywords(module, _depth: int = 0):
    """The keyword names ``module.forward`` accepts (a set), or ``None`` when any name may be accepted."""
    forward = module.forward
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return None
    params = sig.parameters
    names = {n for n, p in params.items() if p.kind in _NAMED}
    var_kw = next((p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if var_kw is None:
        return names
    hf = _transformers_kwargs(module)
    if hf is not None:
        names |= hf
        names |= _class_names(module)    # forward swapped for a wrapper without __wrapped__ (device-map hooks)
    typed = _var_keyword_keys(forward, var_kw)
    if typed is not None:
        return names | typed
    if hf is not None:                                  # untyped **kwargs of a transformers model (GPT-2)
        return names
    base = getattr(module, "get_base_model", None)      # a peft wrapper: **kwargs go to the base model
    if callable(base) and _depth < 3:
        try:
            inner = base()
        except Exception:  # noqa: BLE001 - not a wrapper after all
            inner = None
        if inner is not None and inner is not module and hasattr(inner, "forward"):
            more = accepted_keywords(inner, _depth + 1)
            return None if more is None else names | more
    return None


def check_forward_kwargs(module, kwargs: dict) -> None:
    """Raise a clear ``TypeError`` if ``module.forward`` cannot take these keyword arguments."""
    if not kwargs:
        return
    accepted = accepted_keywords(module)
    if accepted is None:
        return
    unknown = [k for k in kwargs if k not in accepted]
    if not unknown:
        return
    hint = ""
    if "images" in unknown:
        hint = (" images= is taken by ai.VisionLanguageModel (an image-text-to-text model with its processor); "
                "this model's forward has no image input.")
    raise TypeError(
        f"{type(module).__name__}.forward takes no keyword argument(s) {unknown}: keyword arguments of "
        f"trace/invoke go to the model's forward, which accepts {sorted(accepted)}.{hint} Pass interventions "
        "positionally, e.g. model.trace(x, fn)")
