"""Transitional: the program-order mode moved to :mod:`kernels.testing.program_order`."""

from kernels.testing.program_order import ENV, install, install_if_requested, parse, permutation

__all__ = ["ENV", "install", "install_if_requested", "parse", "permutation"]
