"""Compressor registry: name -> class, filled from the entry-point group ``kvcomp.compressors``.

A third-party package adds a method without touching kvcomp by declaring, in its pyproject::

    [project.entry-points."kvcomp.compressors"]
    my_method = "my_package.my_method:MyMethod"

or, at run time, ``kvcomp.register("my_method", MyMethod)``.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from kvcomp.compressor import Compressor, CompressorError

GROUP = "kvcomp.compressors"
_registry: dict[str, type[Compressor]] = {}
_loaded = False


def register(name: str, cls: type[Compressor] | None = None):
    """Register ``cls`` under ``name``; usable as a decorator (``@register("name")``)."""

    def add(c: type[Compressor]) -> type[Compressor]:
        if not (isinstance(c, type) and issubclass(c, Compressor)):
            raise CompressorError(f"register({name!r}, ...) needs a Compressor subclass, got {c!r}.")
        if not c.__dict__.get("name"):  # a class registered under two names keeps its first one
            c.name = name
        _registry[name] = c
        return c

    return add(cls) if cls is not None else add


def _load_entry_points() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for ep in entry_points(group=GROUP):
        if ep.name not in _registry:
            try:
                register(ep.name, ep.load())
            except Exception as err:  # a broken plug-in must not break the others
                print(f"kvcomp: could not load compressor {ep.name!r} from {ep.value}: {err}")


def available() -> dict[str, type[Compressor]]:
    _load_entry_points()
    return dict(sorted(_registry.items()))


def get(name: str) -> type[Compressor]:
    known = available()
    if name not in known:
        raise CompressorError(f"Unknown compressor {name!r}. Known compressors: {', '.join(known) or 'none'}.")
    return known[name]


def create(name: str, **params) -> Compressor:
    """Build a registered compressor from its name and hyper-parameters."""
    cls = get(name)
    try:
        return cls(**params)
    except TypeError as err:
        import dataclasses

        fields = [f.name for f in dataclasses.fields(cls)]
        raise CompressorError(f"Bad parameters for {name!r}: {err}. Its parameters are: {', '.join(fields)}.") from None


def name_of(compressor: Compressor) -> str:
    """The registered name of ``compressor``'s class (its class name if it was never registered).

    Loads the entry points first, so a class gets the same name whether or not anything was looked up by
    name before (results labelled "SnapKV" in one run and "snapkv" in the next would not compare)."""
    _load_entry_points()
    return type(compressor).__dict__.get("name") or type(compressor).__name__
