"""One registry type for everything chosen by name: losses, calibrators, meters and datasets.

A :class:`Registry` is a read-only mapping from names to objects (classes, builders) with one way
to add an entry (:meth:`Registry.register`, also a decorator) and one error for a misspelt name,
which lists the registered ones::

    LOSSES = Registry("loss")

    @LOSSES.register("ce")
    class CrossEntropyLoss(SegLoss): ...

    LOSSES["ce"]          # the class
    "ce" in LOSSES        # True
    sorted(LOSSES)        # the names
    LOSSES["cee"]         # UnknownNameError: Unknown loss 'cee'; valid names are ['ce', ...].
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar, overload

from cals_seg.errors import UserError

T = TypeVar("T")


class UnknownNameError(UserError, KeyError):
    """A name that is not registered; the message lists the registered names. A
    :class:`~cals_seg.errors.UserError` (so the tools print it as one line) and a ``KeyError``
    (so dict-style code that catches a missing key keeps working)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class Registry(Mapping[str, T], Generic[T]):
    """Names -> objects, in registration order; read-only except through :meth:`register`.

    Args:
        what: what an entry is, for the messages (``"loss"``: "Unknown loss 'x'; valid names
            are [...]").
        error: the type of the unknown-name error of :meth:`lookup` (a
            :class:`~cals_seg.errors.UserError` subclass, e.g. ``ConfigError``).
        discover: a package whose modules register entries where they are defined; they are
            all imported (:func:`import_submodules`) the first time the names are read, so a
            new file in that folder is an entry without any list naming it, and importing the
            registry alone stays cheap.
        beside: names that a module of ``cals_seg/contrib/`` registers when imported (name ->
            module): an unknown-name error for one of them says how to opt in
            (:meth:`beside_hint`).
    """

    def __init__(self, what: str, error: type[UserError] = UserError,
                 discover: str | None = None, beside: Mapping[str, str] | None = None) -> None:
        self.what = what
        self.error = error
        self.discover = discover
        self.beside = dict(beside or {})
        self._discovered = discover is None
        self._entries: dict[str, T] = {}

    @property
    def _all(self) -> dict[str, T]:
        """The entries, after importing the :attr:`discover` package's modules once."""
        if not self._discovered:
            self._discovered = True  # set first: the modules register while being imported
            try:
                import_submodules(self.discover)  # type: ignore[arg-type]
            except BaseException:
                self._discovered = False
                raise
        return self._entries

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T) -> T: ...

    def register(self, name: str, obj: Any = None) -> Any:
        """Add ``obj`` under ``name`` and return it; without ``obj``, a decorator that does.

        Raises:
            ValueError: ``name`` is already registered (or not a non-empty string).
        """

        def add(entry: T) -> T:
            if not isinstance(name, str) or not name:
                raise ValueError(f"Expected a non-empty {self.what} name, but got {name!r}.")
            if name in self._entries:
                raise ValueError(f"{self.what} {name!r} is registered twice.")
            self._entries[name] = entry
            return entry

        return add if obj is None else add(obj)

    def unregister(self, name: str) -> T:
        """Remove ``name`` and return its entry (e.g. an entry a test registered for itself).

        Raises:
            UnknownNameError: ``name`` is not registered.
        """
        if name not in self._all:
            raise UnknownNameError(self._unknown(name))
        return self._entries.pop(name)

    def lookup(self, name: str) -> T:
        """The entry of ``name``; for an unknown one, :attr:`error` naming the valid names."""
        if name not in self._all:
            raise self.error(self._unknown(name))
        return self._entries[name]

    def beside_hint(self, name: object) -> str | None:
        """For a name of :attr:`beside` not registered yet: where it lives and how to opt in;
        None otherwise."""
        module = self.beside.get(name) if isinstance(name, str) else None
        if module is None or name in self._all:
            return None
        return (f"{self.what} {name!r} is kept beside the core in the contrib module "
                f"{module!r}: opt in with `contrib: [{module}]` in the config (or `import "
                f"{CONTRIB_PACKAGE}.{module}` in Python)")

    def _unknown(self, name: object) -> str:
        hint = self.beside_hint(name)
        if hint is not None:
            return f"{hint[0].upper()}{hint[1:]}."
        return f"Unknown {self.what} {name!r}; valid names are {sorted(self._all)}."

    def __getitem__(self, name: str) -> T:
        if name not in self._all:
            raise UnknownNameError(self._unknown(name))
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._all

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._all))

    def __len__(self) -> int:
        return len(self._all)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {list(self._all)})"


def import_submodules(package: str) -> list[str]:
    """Import every module of ``package`` (one level, in name order) and return their names.

    A package whose classes register themselves where they are defined (``@LOSSES.register``)
    calls this at the end of its ``__init__.py``, so that a new file in the folder is all it takes
    to add an entry: nothing else lists the modules. Only the package's own files are imported
    (the folder of ``package``), never anything named by data.
    """
    pkg = importlib.import_module(package)
    names = sorted(info.name for info in pkgutil.iter_modules(pkg.__path__))
    for name in names:
        importlib.import_module(f"{package}.{name}")
    return names


# The package of experiments kept beside the core (docs/studies/): the core never imports it;
# a user opts in with ``import cals_seg.contrib.NAME`` or ``contrib: [NAME]`` in a config, which
# :func:`enable_contrib` imports (its modules register into the core's registries).
CONTRIB_PACKAGE = "cals_seg.contrib"


def contrib_modules() -> list[str]:
    """The names of the modules in ``cals_seg/contrib/`` (read from the folder; nothing is
    imported)."""
    spec = importlib.util.find_spec(CONTRIB_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(info.name for info in pkgutil.iter_modules(spec.submodule_search_locations)
                  if not info.name.startswith("_"))


def enable_contrib(names: list[str] | tuple[str, ...], where: str = "contrib") -> list[str]:
    """Opt in to experiments of ``cals_seg/contrib/``: import each named module, which
    registers its entries (a loss, a calibrator, a margin rule) into the core's registries.

    Only modules of that folder can be named (a name is checked against the folder's listing
    before anything is imported), so a config cannot import code of its own choosing.

    Args:
        names: module names, e.g. ``["auto_margin"]``.
        where: the key that named them, for the message.

    Returns:
        The names imported.

    Raises:
        UserError: a name that is not a module of ``cals_seg/contrib/`` (the valid ones are
            listed).
    """
    available = contrib_modules()
    for name in names:
        if not isinstance(name, str) or name not in available:
            raise UserError(f"{where}: unknown contrib module {name!r}; valid names are "
                            f"{available}.")
    for name in names:
        importlib.import_module(f"{CONTRIB_PACKAGE}.{name}")
    return list(names)
