"""The type labels of ``--help``: typer labels each option with the type of its value, a flag too (``--help
<bool>``), though a flag takes no value. ``drop_flag_labels`` leaves a flag's label out and keeps the others'
(``<str>``, ``<int>``, a choice's values), in every command's help."""

from __future__ import annotations

from typer import _click  # typer's own copy of click, whose context its options take
from typer.core import TyperOption

_typed = TyperOption.display_type_rich


def _label(option: TyperOption, ctx: _click.Context) -> str | None:
    return None if option.is_flag else _typed(option, ctx)


def drop_flag_labels() -> None:
    """Once, before any help is shown (the ``mpserve`` command line does it on import)."""
    setattr(TyperOption, "display_type_rich", _label)  # noqa: B010 (mypy refuses an assignment to a method)
