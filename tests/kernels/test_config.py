"""COC_* environment and coc_cfgs YAML: defaults, overrides, call-time reads, every bad value."""

import dataclasses
import os

import pytest
import torch
import yaml

import kernels
from kernels import config as cfg
from kernels.ops.all_reduce import SPEC as ALL_REDUCE
from kernels.ops.gemm import GemmCall
from kernels.protocol import backend as backend_choice
from kernels.protocol import decide, requested


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (
        "COC_PARALLEL_NUM",
        "USE_COC_FUSED_KERNEL",
        "COC_CONFIG",
        "COC_TIMEOUT",
        "COC_TUNE_CACHE",
        "COC_CHECK",
    ):
        monkeypatch.delenv(name, raising=False)


def test_shipped_yaml_overrides_nothing(monkeypatch):
    """The defaults live in CocConfig only: configs/coc.yaml is a valid overrides file that sets no key."""
    from kernels.paths import config_path

    with open(config_path("coc.yaml")) as f:
        assert yaml.safe_load(f) == {}
    monkeypatch.setenv("COC_CONFIG", str(config_path("coc.yaml")))
    assert dataclasses.asdict(kernels.get_config()) == dataclasses.asdict(cfg.CocConfig())
    defaults = cfg.CocConfig()
    assert (defaults.parallel_num, defaults.use_fused, defaults.timeout) == (1, False, 60.0)


def test_env_values(monkeypatch):
    monkeypatch.setenv("COC_PARALLEL_NUM", "4")
    monkeypatch.setenv("USE_COC_FUSED_KERNEL", "1")
    monkeypatch.setenv("COC_TIMEOUT", "2.5")
    c = kernels.get_config()
    assert (c.parallel_num, c.use_fused, c.timeout) == (4, True, 2.5)
    monkeypatch.setenv("COC_PARALLEL_NUM", " auto ")
    assert kernels.get_config().parallel_num == "auto"


def test_read_at_call_time_and_cached(monkeypatch):
    monkeypatch.setenv("COC_PARALLEL_NUM", "2")
    first = kernels.get_config()
    assert first is kernels.get_config()  # cached while nothing changes
    monkeypatch.setenv("COC_PARALLEL_NUM", "8")
    assert kernels.get_config().parallel_num == 8


def test_yaml_overrides_and_reload(tmp_path, monkeypatch):
    path = tmp_path / "coc.yaml"
    path.write_text("recompute_all_gather: false\ncustomized_coc:\n  '[ 8,16 , 32]': 4\n  '[1, 2, 3]': 1\n")
    monkeypatch.setenv("COC_CONFIG", str(path))
    c = kernels.get_config()
    assert c.recompute_all_gather is False and c.matmul_soc_friendly is True
    assert c.customized_coc == {(8, 16, 32): 4, (1, 2, 3): 1}
    assert c.parallel_num_for(8, 16, 32) == 4 and c.parallel_num_for(8, 16, 33) == 1
    path.write_text("k_min: 16\nk_max: 32\n")
    os.utime(path, ns=(1, 10**18))  # a new mtime even on coarse-timestamp filesystems
    c = kernels.get_config()
    assert (c.k_min, c.k_max, c.recompute_all_gather) == (16, 32, True)


@pytest.mark.parametrize(
    "name,value,needle",
    [
        ("COC_PARALLEL_NUM", "3", "use one of (1, 2, 4, 8)"),
        ("COC_PARALLEL_NUM", "two", "'two'"),
        ("USE_COC_FUSED_KERNEL", "true", "use 0 or 1"),
        ("USE_COC_FUSED_KERNEL", "2", "'2'"),
        ("COC_CHECK", "yes", "use 0 or 1"),
        ("COC_CHECK", "2", "'2'"),
        ("COC_TIMEOUT", "0", "> 0"),
        ("COC_TIMEOUT", "-1", "'-1'"),
        ("COC_TIMEOUT", "nan", "'nan'"),
        ("COC_TIMEOUT", "inf", "'inf'"),
        ("COC_TIMEOUT", "soon", "'soon'"),
        ("COC_CONFIG", "/nonexistent/coc.yaml", "cannot be read"),
    ],
)
def test_bad_env_value(monkeypatch, name, value, needle):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        kernels.get_config()
    assert name in str(e.value) and needle in str(e.value)


@pytest.mark.parametrize("value", ["", "  "])
def test_empty_env_values_mean_unset(monkeypatch, tmp_path, value):
    """``VAR=`` (how shells and launchers clear a variable) gives the default, never an error."""
    names = ("COC_PARALLEL_NUM", "USE_COC_FUSED_KERNEL", "COC_CONFIG", "COC_TIMEOUT", "COC_TUNE_CACHE", "COC_CHECK")
    for name in names:
        monkeypatch.setenv(name, value)
    assert dataclasses.asdict(kernels.get_config()) == dataclasses.asdict(cfg.CocConfig())
    # An empty value also overrides nothing that another source set: the YAML file still applies
    # when only the others are empty.
    path = tmp_path / "coc.yaml"
    path.write_text("k_min: 8\n")
    monkeypatch.setenv("COC_CONFIG", str(path))
    assert kernels.get_config().k_min == 8 and kernels.get_config().parallel_num == 1


def test_coc_check_switch(monkeypatch):
    """Unset (or empty): None, the first call of each signature is checked; 1: every call; 0: never."""
    monkeypatch.delenv("COC_CHECK", raising=False)
    assert kernels.get_config().check is None
    monkeypatch.setenv("COC_CHECK", "")
    assert kernels.get_config().check is None
    monkeypatch.setenv("COC_CHECK", "1")
    assert kernels.get_config().check is True
    monkeypatch.setenv("COC_CHECK", " 0 ")
    assert kernels.get_config().check is False


@pytest.mark.parametrize(
    "text,needle",
    [
        ("recompute_all_gather: true\nbogus_key: 1\n", "unknown key 'bogus_key'"),
        ("recompute_all_gather: 1\n", "'recompute_all_gather' has value 1"),
        ("k_min: true\n", "'k_min' has value True"),
        ("k_min: 0\n", "'k_min' has value 0"),
        ("k_min: 4096\nk_max: 1024\n", "k_min=4096 is greater than k_max=1024"),
        ("customized_coc: [1, 2]\n", "'customized_coc' has value [1, 2]"),
        ("customized_coc:\n  '[1, 2]': 2\n", "customized_coc key '[1, 2]'"),
        ("customized_coc:\n  'abc': 2\n", "customized_coc key 'abc'"),
        ("customized_coc:\n  '[1, 2, 3]': 3\n", "customized_coc['[1, 2, 3]'] = 3"),
        ("- a list\n", "must hold a mapping"),
        ("key: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_yaml(tmp_path, monkeypatch, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    monkeypatch.setenv("COC_CONFIG", str(path))
    with pytest.raises(ValueError) as e:
        kernels.get_config()
    assert "COC_CONFIG" in str(e.value) and needle in str(e.value)


def test_empty_yaml_is_defaults(tmp_path, monkeypatch):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    monkeypatch.setenv("COC_CONFIG", str(path))
    assert dataclasses.asdict(kernels.get_config()) == dataclasses.asdict(cfg.CocConfig())


def _resolve(backend=None, parallel_num=None, m=8, k=16, n=32):
    call = GemmCall(op="matmul_all_reduce", pattern="all_reduce", backend=backend, parallel_num=parallel_num)
    resolved = decide(ALL_REDUCE, requested(call, (m, k, n)), torch.device("cpu"))
    return resolved.backend, resolved.parallel_num


def test_backend_choice_order(tmp_path, monkeypatch):
    assert _resolve() == ("sequential", 1)
    monkeypatch.setenv("COC_PARALLEL_NUM", "4")
    assert _resolve() == ("chunked", 4)
    assert _resolve(parallel_num=1) == ("sequential", 1)  # an explicit argument wins
    assert _resolve(backend="sequential") == ("sequential", 1)
    path = tmp_path / "c.yaml"
    path.write_text("customized_coc:\n  '[8, 16, 32]': 2\n  '[9, 16, 32]': 1\n")
    monkeypatch.setenv("COC_CONFIG", str(path))
    assert _resolve() == ("chunked", 2)  # customized_coc wins over COC_PARALLEL_NUM
    assert _resolve(m=9) == ("sequential", 1)  # and 1 means no chunking for that shape
    assert _resolve(m=10) == ("chunked", 4)


def test_fused_env_wins_and_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv("COC_PARALLEL_NUM", "2")
    monkeypatch.setenv("USE_COC_FUSED_KERNEL", "1")
    monkeypatch.setattr(backend_choice, "fused_unavailable", lambda call, device: "test reason")
    monkeypatch.setattr(backend_choice, "_warned", set())
    with pytest.warns(RuntimeWarning, match="test reason"):
        assert _resolve() == ("chunked", 2)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _resolve() == ("chunked", 2)  # warned once only
    monkeypatch.setattr(backend_choice, "fused_unavailable", lambda call, device: None)
    assert _resolve() == ("fused", 1)
