"""Code that must run eagerly inside a torch.compile'd block, as under torch.compiler.disable: marked here, disabled by
trnrecipes/parallel/compile.py when it compiles. Not disabled at import: torch.compiler.disable imports torch._dynamo,
about 1.5 s of CPU at every rank's start (as much again as `import torch`), which a run that does not compile never
needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)
MARK = "_eager_under_compile"


def eager_under_compile(fn: F) -> F:
    """Mark `fn` (a function or method) to run outside the graph when a block that calls it is compiled."""
    setattr(fn, MARK, True)
    return fn
