"""Consent for code: a run folder is data, and the factory it names is imported only with consent.

A run's ``config.yaml`` may name ``model.factory`` as ``package.module:function``: building the
network imports that module and calls that function, i.e. runs code. A run folder can come from
anyone (a colleague, an archive shipped with a paper), so the toolkit imports such a factory only
when one of these holds:

1. it is one of the **known model builders**: ``torchvision:NAME`` / ``smp:NAME`` /
   ``transformers:NAME`` (the toolkit's own short forms), a builder registered in torchvision
   (``torchvision.models.list_models()``), a model registered in timm (``timm.list_models()``), or
   an smp architecture (``segmentation_models_pytorch.MODEL_ARCHITECTURES_MAPPING``) spelt as
   ``module:NAME`` inside those libraries. They are decided from the string alone, before any
   import; the library is then imported and the object checked to be that builder;
2. the user allowed it on their own command line (``--trust-code``) or in Python
   (``load_run(..., trust_code=True)``, or ``with code_consent(True):``);
3. the user named the config themselves: ``train_seg CONFIG``, ``import_model CONFIG``,
   ``compare CONFIG``: the file on the command line is the user's own choice;
4. consent remembered on this machine for this folder and this factory: ``import_model`` and
   ``train_seg`` record it (:func:`remember`) for the runs they make from a config the user
   named. The record lives in the user's configuration folder (``$CALS_SEG_CONSENT_FILE``, else
   ``$XDG_CONFIG_HOME/cals_seg/consent.json``, else ``~/.config/cals_seg/consent.json``), never
   inside a run folder: a folder cannot vouch for itself.

Anything else is refused before anything is imported, in one line naming the file, the callable
and the flag (:class:`UntrustedCodeError`).

The decision of the command being run is held in a context variable (:func:`code_consent`):
``None`` outside any command (Python code of the user's own: their configs are theirs), ``True``
or ``False`` inside one.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from cals_seg.errors import ConfigError

# The short forms the toolkit builds itself, with every weight set to None.
SHORT_FORMS = ("torchvision", "smp", "transformers")
# Libraries whose registered builders are known: (module prefix, registry reader).
KNOWN_LIBRARIES = ("torchvision", "timm", "segmentation_models_pytorch")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

_CONSENT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("cals_seg_code_consent",
                                                                       default=None)


class UntrustedCodeError(ConfigError):
    """A ``model.factory`` outside the known model builders, read from a file the user did not
    name, without consent: nothing was imported."""


@contextlib.contextmanager
def code_consent(allowed: bool | None) -> Iterator[None]:
    """Within the block, a factory outside the known builders is imported only when ``allowed``
    is true (``None``: keep the decision of the enclosing block)."""
    if allowed is None:
        yield
        return
    token = _CONSENT.set(bool(allowed))
    try:
        yield
    finally:
        _CONSENT.reset(token)


def consent_given() -> bool | None:
    """The decision of the enclosing :func:`code_consent` block (None outside any)."""
    return _CONSENT.get()


def _registered(library: str, name: str) -> bool:
    """Whether ``name`` is a builder registered in ``library`` (imports the library only)."""
    if library == "torchvision":
        from torchvision.models import list_models

        return name in list_models()
    if library == "timm":
        import timm

        return name in timm.list_models()
    import segmentation_models_pytorch as smp

    return name.lower() in smp.MODEL_ARCHITECTURES_MAPPING or name in {
        cls.__name__ for cls in smp.MODEL_ARCHITECTURES_MAPPING.values()}


def known_library(factory: str) -> str | None:
    """The library of ``factory`` when it is spelt inside one whose builders are known
    (``torchvision``, ``timm``, ``segmentation_models_pytorch``, or a short form), from the string
    alone; None otherwise."""
    if not isinstance(factory, str) or not _FACTORY.match(factory):
        return None
    module = factory.rsplit(":", 1)[0]
    if module in SHORT_FORMS:
        return module
    top = module.split(".", 1)[0]
    return top if top in KNOWN_LIBRARIES else None


def is_known_builder(factory: str) -> bool:
    """Whether ``factory`` is one of the known model builders (the module docstring, 1). The
    short forms are checked where they are built; a ``module:NAME`` inside a known library must
    name a builder registered there. Nothing outside those libraries is imported."""
    library = known_library(factory)
    if library is None:
        return False
    module, name = factory.rsplit(":", 1)
    if module in SHORT_FORMS:
        return True
    return _registered(library, name)


# ----------------------------------------------------------------------------- remembered
def consent_file() -> Path:
    """Where consent given on this machine is remembered (the module docstring, 4)."""
    given = os.environ.get("CALS_SEG_CONSENT_FILE")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "cals_seg" / "consent.json"


def _read_consent() -> dict[str, list[str]]:
    try:
        data = json.loads(consent_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): [str(f) for f in v] for k, v in data.items() if isinstance(v, list)}


def remember(folder: str | os.PathLike, factory: str) -> None:
    """Remember that the user allowed ``folder``'s config to import ``factory`` (called by the
    commands that make a run from a config the user named). A failure to write is ignored: the
    user is then asked for ``--trust-code`` later."""
    if is_known_builder(factory):
        return
    key = str(Path(folder).resolve())
    data = _read_consent()
    if factory in data.get(key, []):
        return
    data.setdefault(key, []).append(factory)
    path = consent_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def remembered(folder: str | os.PathLike, factory: str) -> bool:
    """Whether consent for ``factory`` in ``folder`` was remembered on this machine."""
    return factory in _read_consent().get(str(Path(folder).resolve()), [])


# ----------------------------------------------------------------------------- the gate
def check_consent(factory: str, source: str | os.PathLike | None = None,
                  trust_code: bool | None = None, folder: str | os.PathLike | None = None
                  ) -> None:
    """Refuse to import ``factory`` unless it is a known builder or consent was given.

    Args:
        factory: the ``model.factory`` value.
        source: the file that names it, for the message (e.g. ``RUN/config.yaml``).
        trust_code: the caller's explicit decision (None: the enclosing :func:`code_consent`;
            outside any block, the user's own Python code: allowed).
        folder: a run folder whose remembered consent counts.

    Raises:
        UntrustedCodeError: one line naming the file, the callable and the flag.
    """
    if is_known_builder(factory):
        return
    allowed = trust_code if trust_code is not None else consent_given()
    if allowed is None or allowed:
        return
    if folder is not None and remembered(folder, factory):
        return
    where = f"{source} names" if source else "the config names"
    raise UntrustedCodeError(
        f"{where} model.factory {factory!r}, code outside the known model builders "
        "(torchvision, timm, smp, transformers); it was not imported. If you trust where this "
        "run folder comes from, run again with --trust-code (in Python: "
        "load_run(..., trust_code=True))."
    )


__all__ = ["KNOWN_LIBRARIES", "SHORT_FORMS", "UntrustedCodeError", "check_consent",
           "code_consent", "consent_file", "consent_given", "is_known_builder", "known_library",
           "remember", "remembered"]
