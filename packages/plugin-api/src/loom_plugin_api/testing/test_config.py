"""Config tier: the platform's configuration hooks on a ``LoomConfigView``."""

from __future__ import annotations

import copy

import pytest

from ..attention import AttentionBackend, AttentionSelectorConfig
from ..platform import Platform
from ..worker import WorkerBase
from ._config_view import snapshot, tiny_config_view
from ._names import resolve_subclass

pytestmark = pytest.mark.config

KNOWN_DTYPES = ("float32", "bfloat16", "float16")


def _configured(platform_cls: type[Platform], dtype: str = "float32", **cache: object):
    config = tiny_config_view(platform_cls.device_type, dtype, **cache)
    platform_cls.apply_config_platform_defaults(config)
    platform_cls.check_and_update_config(config)
    return config


def test_sets_worker_cls(platform_cls: type[Platform]) -> None:
    config = _configured(platform_cls, platform_cls.supported_dtypes[0])
    worker_cls = config.parallel_config.worker_cls
    if worker_cls == "auto":
        pytest.fail(
            f"{platform_cls.__qualname__}.check_and_update_config left parallel_config.worker_cls 'auto': "
            "set it to the qualified name of your WorkerBase subclass when it is 'auto'"
        )
    resolve_subclass(
        worker_cls, WorkerBase, f"{platform_cls.__qualname__}.check_and_update_config (worker_cls)"
    )


def test_keeps_a_worker_cls_the_user_chose(platform_cls: type[Platform]) -> None:
    config = tiny_config_view(platform_cls.device_type, platform_cls.supported_dtypes[0])
    config.parallel_config.worker_cls = "user.module.UserWorker"
    platform_cls.check_and_update_config(config)
    if config.parallel_config.worker_cls != "user.module.UserWorker":
        pytest.fail(
            f"{platform_cls.__qualname__}.check_and_update_config replaced the user's worker_cls with "
            f"{config.parallel_config.worker_cls!r}: set it only when it is 'auto'"
        )


def test_is_idempotent(platform_cls: type[Platform]) -> None:
    config = _configured(platform_cls, platform_cls.supported_dtypes[0])
    once = snapshot(config)
    platform_cls.check_and_update_config(config)
    twice = snapshot(config)
    if once != twice:
        changed = sorted(
            f"{section}.{k}"
            for section in once
            for k in once[section]
            if once[section][k] != twice[section][k]
        )
        pytest.fail(
            f"{platform_cls.__qualname__}.check_and_update_config is not idempotent: a second call changed "
            f"{', '.join(changed)}"
        )


@pytest.mark.parametrize("dtype", KNOWN_DTYPES)
def test_accepts_a_declared_dtype(platform_cls: type[Platform], dtype: str) -> None:
    if dtype not in platform_cls.supported_dtypes:
        pytest.skip(f"{platform_cls.__qualname__}.supported_dtypes does not declare {dtype}")
    try:
        _configured(platform_cls, dtype)
    except ValueError as e:
        pytest.fail(
            f"{platform_cls.__qualname__} declares {dtype} in supported_dtypes but check_and_update_config "
            f"rejects it: {e}. Remove it from supported_dtypes or accept it"
        )


@pytest.mark.parametrize("dtype", KNOWN_DTYPES)
def test_rejects_an_undeclared_dtype(platform_cls: type[Platform], dtype: str) -> None:
    if dtype in platform_cls.supported_dtypes:
        pytest.skip(f"{platform_cls.__qualname__}.supported_dtypes declares {dtype}")
    config = tiny_config_view(platform_cls.device_type, dtype)
    try:
        platform_cls.check_and_update_config(config)
    except ValueError as e:
        if dtype not in str(e):
            pytest.fail(
                f"{platform_cls.__qualname__}.check_and_update_config rejects dtype {dtype} with {e!r}, "
                "which does not name the dtype: say which dtype and what to use instead"
            )
        return
    pytest.fail(
        f"{platform_cls.__qualname__}.check_and_update_config accepts dtype {dtype}, which is not in its "
        f"supported_dtypes {platform_cls.supported_dtypes}: raise ValueError naming the dtype and the ones "
        "to use, or declare it"
    )


def _backend(platform_cls: type[Platform], config) -> type[AttentionBackend]:
    model = config.model_config
    selector = AttentionSelectorConfig(
        head_size=model.get_head_size(), dtype=model.torch_dtype, block_size=config.cache_config.block_size
    )
    qualname = platform_cls.get_attn_backend_cls(None, selector, model.get_num_attention_heads())
    return resolve_subclass(qualname, AttentionBackend, f"{platform_cls.__qualname__}.get_attn_backend_cls()")


def test_block_size_fits_the_backend(platform_cls: type[Platform]) -> None:
    # The engine's default block size (16) when the user sets none.
    config = _configured(platform_cls, platform_cls.supported_dtypes[0])
    platform_cls.update_block_size_for_backend(config)
    supported = _backend(platform_cls, config).get_supported_block_sizes()
    if config.cache_config.block_size not in supported:
        pytest.fail(
            f"after {platform_cls.__qualname__}.update_block_size_for_backend the block size is "
            f"{config.cache_config.block_size}, which the attention backend does not support "
            f"({supported}): pick one of them when the user did not set --block-size"
        )


def test_block_size_update_is_idempotent(platform_cls: type[Platform]) -> None:
    config = _configured(platform_cls, platform_cls.supported_dtypes[0])
    platform_cls.update_block_size_for_backend(config)
    before = copy.deepcopy(snapshot(config))
    platform_cls.update_block_size_for_backend(config)
    if snapshot(config) != before:
        pytest.fail(
            f"{platform_cls.__qualname__}.update_block_size_for_backend changed the config again on a "
            "second call: it runs in every worker and must be idempotent"
        )
