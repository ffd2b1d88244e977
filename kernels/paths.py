"""Where the shipped configuration files are, in a checkout and in an installed wheel.

The top-level ``configs/`` of the repository is their source (``coc.yaml``, ``links.yaml``, the
benchmark suites ``bench/*.yaml`` and the tuned GEMM files ``tuned/*.yaml``). A wheel has no place
for a top-level data folder, and a top-level ``configs`` package in site-packages would collide with
any other distribution's, so setup.py installs the folder as ``kernels/_configs``. Code reaches the
files only through :data:`CONFIGS_DIR`, which is that copy when it exists (an installed package) and
the repository's ``configs/`` otherwise (a checkout, editable installs included).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
INSTALLED_CONFIGS_DIR = _PACKAGE_DIR / "_configs"
CHECKOUT_CONFIGS_DIR = _PACKAGE_DIR.parent / "configs"
CONFIGS_DIR = INSTALLED_CONFIGS_DIR if INSTALLED_CONFIGS_DIR.is_dir() else CHECKOUT_CONFIGS_DIR


def config_path(*parts: str) -> Path:
    """A file or folder under :data:`CONFIGS_DIR`, e.g. ``config_path("bench", "tiny.yaml")``."""
    return CONFIGS_DIR.joinpath(*parts)
