"""Another installed distribution providing the import name ``kernels`` (Hugging Face's) is never silent."""

import os
import subprocess
import sys

import pytest

from kernels import name_clash
from kernels.testing import REPO_ROOT


def _fake_distribution(site: str, name: str = "kernels") -> str:
    """A dist-info in ``site`` whose RECORD lists ``site/kernels/__init__.py``; returns that package dir."""
    package = os.path.join(site, "kernels")
    os.makedirs(package)
    open(os.path.join(package, "__init__.py"), "w").close()
    info = os.path.join(site, f"{name}-0.9.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.9.0\n")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write(f"kernels/__init__.py,,\n{name}-0.9.0.dist-info/METADATA,,\n")
    with open(os.path.join(info, "top_level.txt"), "w") as f:
        f.write("kernels\n")
    return package


def test_files_of_another_distribution_inside_ours_raise(tmp_path, monkeypatch):
    package = _fake_distribution(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert name_clash.foreign_distributions() == ["kernels"]
    with pytest.raises(ImportError, match=r"provided by two installed distributions: coc-overlap .* and kernels"):
        name_clash.check(package)


def test_another_distribution_elsewhere_warns(tmp_path, monkeypatch):
    _fake_distribution(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"shadows the other one"):
        name_clash.check(os.path.join(REPO_ROOT, "kernels"))


def test_no_other_distribution_is_quiet(recwarn):
    assert name_clash.foreign_distributions() == []
    name_clash.check(os.path.join(REPO_ROOT, "kernels"))
    assert not [w for w in recwarn if "kernels" in str(w.message)]


def test_autopar_refuses_a_foreign_kernels_package(tmp_path):
    _fake_distribution(str(tmp_path / "site"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), REPO_ROOT]))
    proc = subprocess.run(
        [sys.executable, "-c", "import autopar"],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "autopar needs CoC's 'kernels' package" in proc.stderr, proc.stderr[-2000:]
