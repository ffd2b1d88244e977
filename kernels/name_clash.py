"""Refuse to run beside another installed distribution that also provides the import name ``kernels``.

This project's import packages are ``kernels`` and ``autopar`` (the layout the API contract names);
its distribution is ``coc-overlap``. Hugging Face's ``kernels`` distribution installs a top-level
``kernels`` package too: with both in one environment, whichever was installed last overwrites the
other's files in site-packages and imports turn into a mix of the two. That must not pass
silently, so importing ``kernels`` reads the installed distributions' metadata:

* another distribution's files inside this package's directory (the two were installed into one
  site-packages): ``ImportError`` naming both;
* another distribution providing ``kernels`` elsewhere (this one shadows it, e.g. through
  ``PYTHONPATH``): a warning naming both, since code importing that one gets this one.

``autopar`` checks that the ``kernels`` it imports is this one (the other may have overwritten it).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import warnings

DISTRIBUTION = "coc-overlap"
IMPORT_NAME = "kernels"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def foreign_distributions(import_name: str = IMPORT_NAME) -> list[str]:
    """Installed distributions other than this one whose metadata claims the top-level ``import_name``."""
    claimants = importlib.metadata.packages_distributions().get(import_name, [])
    return sorted({name for name in claimants if _normalized(name) != DISTRIBUTION})


def _files_inside(distribution: str, directory: str) -> bool:
    files = importlib.metadata.distribution(distribution).files or []
    root = os.path.realpath(directory) + os.sep
    return any(os.path.realpath(str(f.locate())).startswith(root) for f in files)


def clash_message(others: list[str]) -> str:
    return (
        f"the import name {IMPORT_NAME!r} is provided by two installed distributions: {DISTRIBUTION} (CoC's fused "
        f"tensor-parallel ops) and {', '.join(others)} (for example Hugging Face's 'kernels'). Installing both in "
        "one environment overwrites one package's files with the other's. Use separate virtual environments, or "
        f"uninstall one: pip uninstall {' '.join(others)}"
    )


def check(package_dir: str) -> None:
    """Raise ImportError if another distribution's files are mixed into ``package_dir`` (our ``kernels``);
    warn if another distribution provides ``kernels`` elsewhere (shadowed by this one)."""
    others = foreign_distributions()
    mixed = [name for name in others if _files_inside(name, package_dir)]
    if mixed:
        raise ImportError(clash_message(mixed))
    if others:
        warnings.warn(
            f"{clash_message(others)}. Here this package shadows the other one (code importing "
            f"{IMPORT_NAME!r}, such as transformers' hub kernels, gets CoC's)",
            stacklevel=3,
        )
