"""Progress bars: tqdm's where its convention says a bar is seen, else one that does nothing."""

from __future__ import annotations

import sys
from typing import Any

# Imported with the package, not at an epoch's start: tqdm.auto takes 20-50 ms to import
# (it looks for IPython), which would block the consumer's event loop (issue 13, start lag).
from tqdm.auto import tqdm


class NoBar:
    """What a quiet loader's bars are: not a disabled tqdm, whose construction starts
    tqdm's monitor thread in the user's process and costs the loop ~0.1 ms an epoch."""

    disable = True

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


NO_BAR = NoBar()


def shows_bars(quiet: bool | None) -> bool:
    """Whether a bar is drawn now: ``quiet=None`` follows tqdm's convention (a terminal or a
    notebook, not a log file or CI), asked as each bar is built so a redirected stderr counts.

    torch's loader prints nothing; a script ported by its import must not fill logs (issue 19).
    Public as ``aioloader.shows_bars``, so that a script's own bars follow the same rule.

    Example:
        bar = tqdm(total=steps, disable=not aioloader.shows_bars(None))
    """
    if quiet is not None:
        return not quiet
    isatty = getattr(sys.stderr, "isatty", None)  # stderr is None under pythonw, or a stand-in
    try:
        if isatty is not None and isatty():
            return True
    except (OSError, ValueError):  # a closed stderr
        pass
    return _in_notebook()


def _in_notebook() -> bool:
    """A Jupyter kernel, whose stderr is no TTY but shows bars; asked without importing
    IPython (a fraction of a second), which a kernel has imported already."""
    app = getattr(sys.modules.get("ipykernel.kernelapp"), "IPKernelApp", None)
    initialized = getattr(app, "initialized", None)  # traitlets' SingletonConfigurable
    return callable(initialized) and bool(initialized())


def progress_bar(quiet: bool | None, **options: Any) -> Any:
    """``tqdm(**options)`` where bars are shown (:func:`shows_bars`), else a bar that does
    nothing."""
    return tqdm(**options) if shows_bars(quiet) else NO_BAR
