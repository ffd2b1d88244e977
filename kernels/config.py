"""The COC_* environment and ``coc_cfgs`` keys, loaded into one typed, validated config.

Every value is read at call time (a user or a test may change the environment between calls),
so :func:`get_config` is on the hot path of every op: it builds the config once per distinct
``(environment values, config-file mtime)`` and returns the cached object afterwards.

Validation lives here and nowhere else: a bad variable value, an unknown YAML key or a value of the
wrong type raises ``ValueError`` naming the variable or key, the value and what is accepted.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

PARALLEL_NUMS = (1, 2, 4, 8)
BACKENDS = ("sequential", "chunked", "fused")
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")

ENV_PARALLEL_NUM = "COC_PARALLEL_NUM"
ENV_FUSED = "USE_COC_FUSED_KERNEL"
ENV_CONFIG = "COC_CONFIG"
ENV_TIMEOUT = "COC_TIMEOUT"
ENV_TUNE_CACHE = "COC_TUNE_CACHE"
ENV_CHECK = "COC_CHECK"
ENV_INDUCTOR_PASS = "COC_INDUCTOR_PASS"
ENV_FP8 = "COC_FP8"
_ENV_VARS = (
    ENV_PARALLEL_NUM,
    ENV_FUSED,
    ENV_CONFIG,
    ENV_TIMEOUT,
    ENV_TUNE_CACHE,
    ENV_CHECK,
    ENV_INDUCTOR_PASS,
    ENV_FP8,
)

ShapeKey = tuple[int, int, int]


@dataclass(frozen=True)
class CocConfig:
    """Resolved settings: the defaults (the one place they are stated; docs/api.md section 3 lists them),
    overridden by the COC_* environment and the YAML file ``COC_CONFIG`` names."""

    parallel_num: int | str = 1
    use_fused: bool = False
    timeout: float = 60.0
    recompute_all_gather: bool = True
    matmul_soc_friendly: bool = True
    customized_coc: Mapping[ShapeKey, int] = field(default_factory=dict)
    enable_coc_in_column_backward: bool = False
    k_min: int = 1024
    k_max: int = 4096
    tune_cache: str | None = None  # JSON file of COC_PARALLEL_NUM=auto choices (kernels.tune)
    # COC_CHECK: None (unset) compares a call across ranks the first time its signature is seen, True (1)
    # at every call, False (0) never on sequential / chunked (kernels.callcheck).
    check: bool | None = None
    inductor_pass: bool = False  # COC_INDUCTOR_PASS=1: `import kernels` enables kernels.inductor
    fp8: bool = False  # COC_FP8=1: autopar linears built without fp8= use the default Fp8Recipe (docs/fp8.md)

    def parallel_num_for(self, m: int, k: int, n: int) -> int | str:
        """The split count for an op of shape ``[m, k, n]``: ``customized_coc`` wins over the env."""
        return self.customized_coc.get((m, k, n), self.parallel_num)


# Keys of the YAML file and their accepted types, in one table: validation and docs follow it.
_YAML_KEYS: dict[str, tuple[type, ...]] = {
    "recompute_all_gather": (bool,),
    "matmul_soc_friendly": (bool,),
    "customized_coc": (dict,),
    "enable_coc_in_column_backward": (bool,),
    "k_min": (int,),
    "k_max": (int,),
}


def _parse_parallel_num(raw: str, source: str) -> int | str:
    value = raw.strip().lower()
    if value == "auto":
        return "auto"
    try:
        num = int(value)
    except ValueError:
        num = None
    if num not in PARALLEL_NUMS:
        raise ValueError(f"{source}={raw!r} is not accepted; use one of {PARALLEL_NUMS} or 'auto'")
    return num


def _parse_switch(name: str, raw: str) -> bool:
    value = raw.strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name}={raw!r} is not accepted; use 0 or 1 (or leave it empty for the default)")
    return value == "1"


def _parse_timeout(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} is not accepted; use a finite number of seconds > 0")
    return value


def parse_shape_key(key: Any) -> ShapeKey:
    """``"[m, k, n]"`` in any spacing (or a 3-sequence of ints) -> ``(m, k, n)``."""
    parsed = key
    if isinstance(key, str):
        try:
            parsed = ast.literal_eval(key.strip())
        except (ValueError, SyntaxError):
            parsed = None
    if (
        not isinstance(parsed, (list, tuple))
        or len(parsed) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in parsed)
    ):
        raise ValueError(f"customized_coc key {key!r} is not accepted; use '[m, k, n]' with three positive integers")
    return (parsed[0], parsed[1], parsed[2])


def _check_yaml(data: Any, path: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"{ENV_CONFIG}={path!r}: the file must hold a mapping of coc_cfgs keys, got {type(data).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _YAML_KEYS:
            raise ValueError(f"{ENV_CONFIG}={path!r}: unknown key {key!r}; accepted keys are {sorted(_YAML_KEYS)}")
        types = _YAML_KEYS[key]
        # bool is an int subclass: an int key given True/False is a mistake, not a number.
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise ValueError(
                f"{ENV_CONFIG}={path!r}: key {key!r} has value {value!r}; accepted: "
                f"{' or '.join(t.__name__ for t in types)}"
            )
        if key == "customized_coc":
            value = _check_customized_coc(value, path)
        elif key in ("k_min", "k_max") and value < 1:
            raise ValueError(f"{ENV_CONFIG}={path!r}: key {key!r} has value {value!r}; accepted: an integer >= 1")
        out[key] = value
    return out


def _check_customized_coc(value: dict, path: str) -> dict[ShapeKey, int]:
    """The YAML's ``customized_coc`` mapping with its ``'[m, k, n]'`` string keys parsed to shapes."""
    table = {}
    for shape, num in value.items():
        if num not in PARALLEL_NUMS or isinstance(num, bool):
            raise ValueError(
                f"{ENV_CONFIG}={path!r}: customized_coc[{shape!r}] = {num!r}; "
                f"accepted parallel_num values are {PARALLEL_NUMS}"
            )
        try:
            table[parse_shape_key(shape)] = num
        except ValueError as e:
            raise ValueError(f"{ENV_CONFIG}={path!r}: {e}") from None
    return table


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return _check_yaml(yaml.safe_load(f), path)
    except OSError as e:
        raise ValueError(
            f"{ENV_CONFIG}={path!r} cannot be read ({e.strerror}); accepted: the path of a readable YAML file"
        ) from None
    except yaml.YAMLError as e:
        raise ValueError(f"{ENV_CONFIG}={path!r} is not valid YAML: {e}") from None


def _parse_tune_cache(raw: str) -> str:
    path = os.path.abspath(os.path.expanduser(raw))
    if os.path.isdir(path) or not os.path.isdir(os.path.dirname(path)):
        raise ValueError(
            f"{ENV_TUNE_CACHE}={raw!r} is not accepted; use the path of a JSON file "
            "(it may not exist yet) in an existing directory"
        )
    return path


def build_config(env: Mapping[str, str]) -> CocConfig:
    """Build and validate a config from environment-like values (the one place of validation)."""
    # An empty (or blank) value means unset: shells and launchers often export VAR= to clear one.
    env = {name: value for name, value in env.items() if value is not None and value.strip()}
    values: dict[str, Any] = {}
    path = env.get(ENV_CONFIG)
    if path:
        values.update(_load_yaml(path))
    k_min = values.get("k_min", CocConfig.k_min)
    k_max = values.get("k_max", CocConfig.k_max)
    if k_min > k_max:
        raise ValueError(
            f"{ENV_CONFIG}={path!r}: k_min={k_min} is greater than k_max={k_max}; accepted: k_min <= k_max"
        )
    if env.get(ENV_PARALLEL_NUM) is not None:
        values["parallel_num"] = _parse_parallel_num(env[ENV_PARALLEL_NUM], ENV_PARALLEL_NUM)
    if env.get(ENV_FUSED) is not None:
        values["use_fused"] = _parse_switch(ENV_FUSED, env[ENV_FUSED])
    if env.get(ENV_TIMEOUT) is not None:
        values["timeout"] = _parse_timeout(env[ENV_TIMEOUT])
    if env.get(ENV_TUNE_CACHE) is not None:
        values["tune_cache"] = _parse_tune_cache(env[ENV_TUNE_CACHE])
    if env.get(ENV_CHECK) is not None:
        values["check"] = _parse_switch(ENV_CHECK, env[ENV_CHECK])
    if env.get(ENV_INDUCTOR_PASS) is not None:
        values["inductor_pass"] = _parse_switch(ENV_INDUCTOR_PASS, env[ENV_INDUCTOR_PASS])
    if env.get(ENV_FP8) is not None:
        values["fp8"] = _parse_switch(ENV_FP8, env[ENV_FP8])
    return CocConfig(**values)


_cache: dict[tuple, CocConfig] = {}


# CPython keeps os.environ's contents in a dict of encoded keys and values; reading it directly
# costs about 0.1 us where six os.environ.get calls cost about 2.5 us, on every op call.
_ENV_DATA = getattr(os.environ, "_data", None)
# The config's key reads the launcher's WORLD_SIZE too (it configures nothing): a config object then also stands for
# the WORLD_SIZE an op checked (kernels.checks.check_launched_alone) when it resolved a call's signature.
_KEY_VARS = (*_ENV_VARS, "WORLD_SIZE")
_ENV_KEYS = tuple(os.environ.encodekey(name) for name in _KEY_VARS) if _ENV_DATA is not None else ()


_ENV_GET = _ENV_DATA.get if _ENV_DATA is not None else None


def _raw_env_values() -> tuple:
    if _ENV_GET is None:
        return tuple(os.environ.get(name) for name in _KEY_VARS)
    # map: one C loop, no generator frames (this runs on every op call).
    return tuple(map(_ENV_GET, _ENV_KEYS))


def env_value(name: str) -> str | None:
    """``os.environ.get(name)`` at a fraction of its cost: for a name that is not set, ``Mapping.get`` raises and
    catches a ``KeyError`` (microseconds, on every op call that reads ``WORLD_SIZE``). No cache of encoded names:
    a dict written while ``torch.compile`` traces an op makes Dynamo refuse the class attribute reads after it."""
    if _ENV_DATA is None:
        return os.environ.get(name)
    return _decode(_ENV_DATA.get(os.environ.encodekey(name)))


def _decode(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else os.environ.decodevalue(value)


# The last environment seen without a config file, and its config: the common case of every op call is one tuple
# comparison (os.environ keeps the same value objects while nothing sets them, so it compares identities).
_last: tuple[tuple | None, CocConfig | None] = (None, None)


def get_config() -> CocConfig:
    """The config for the current environment; cheap enough to call on every op."""
    global _last
    # _raw_env_values inline: this runs on every op call.
    raw = tuple(map(_ENV_GET, _ENV_KEYS)) if _ENV_GET is not None else _raw_env_values()
    last_raw, last_config = _last
    if raw == last_raw:
        return last_config  # type: ignore[return-value]
    mtime = None
    if raw[2]:
        try:
            mtime = os.stat(_decode(raw[2])).st_mtime_ns
        except OSError:
            pass
    key = (raw, mtime)
    config = _cache.get(key)
    if config is None:
        env_values = tuple(_decode(v) for v in raw[: len(_ENV_VARS)])
        config = build_config({n: v for n, v in zip(_ENV_VARS, env_values, strict=True) if v is not None})
        if len(_cache) > 64:
            _cache.clear()
        _cache[key] = config
    if not raw[2]:
        _last = (raw, config)
    return config


def config_keys() -> list[str]:
    """Names of the ``coc_cfgs`` keys a YAML file may set."""
    return [f.name for f in fields(CocConfig) if f.name in _YAML_KEYS]
