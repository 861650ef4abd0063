"""Each process reads its own HYBRIDSERVE_<SERVICE>_ variables and the shared ones; typos fail at start.

Most tests hand the settings an explicit environment (`from_environ`), so the shell's own
HYBRIDSERVE_ variables cannot change what they see.
"""
from __future__ import annotations

import logging

import pydantic
import pytest

import services.settings as settings_module
from services.decode_fpga.settings import DecodeSettings
from services.gateway.settings import GatewaySettings
from services.prefill_gpu.settings import PrefillSettings
from services.settings import CommonSettings, UnknownSettingError
from services.launcher.stack import UpSettings, _children_environment

SERVICES = (PrefillSettings, DecodeSettings, GatewaySettings, UpSettings)


@pytest.fixture
def deprecations(monkeypatch, caplog):
    """The deprecation warnings logged while the test runs, each process's 'once' starting afresh."""
    monkeypatch.setattr(settings_module, "_warned", set())
    caplog.set_level(logging.WARNING, logger="services.settings")
    return lambda: [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


# ---- new names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, env, field, value", [
    (PrefillSettings, "HYBRIDSERVE_PREFILL_PORT", "port", 1234),
    (PrefillSettings, "HYBRIDSERVE_PREFILL_WIRE_DTYPE", "wire_dtype", "fp16"),
    (PrefillSettings, "HYBRIDSERVE_PREFILL_GENERATE_MAX_CONCURRENCY", "max_concurrency", 5),
    (PrefillSettings, "HYBRIDSERVE_PREFILL_HANDOFF_QUEUE_DEPTH", "prefill_queue_depth", 7),
    (DecodeSettings, "HYBRIDSERVE_DECODE_KV_CHANNELS", "kv_channels", 32),
    (DecodeSettings, "HYBRIDSERVE_DECODE_PREFILL_ADDRESS", "prefill_address", "p:1"),
    (DecodeSettings, "HYBRIDSERVE_DECODE_OPENCL_LAYER_KERNELS", "opencl_layer_kernels", False),
    (GatewaySettings, "HYBRIDSERVE_GATEWAY_PORT", "port", 8123),
    (GatewaySettings, "HYBRIDSERVE_GATEWAY_DECODE_ADDRESS", "decode_address", "d:2"),
    (UpSettings, "HYBRIDSERVE_UP_STARTUP_TIMEOUT_S", "startup_timeout_s", 5.0),
])
def test_a_new_name_is_read(cls, env, field, value, deprecations):
    assert cls.env_name(field) == env
    assert getattr(cls.from_environ({env: str(value)}), field) == value
    assert deprecations() == []


def test_the_environment_itself_is_read(monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_DECODE_MAX_SEQUENCES", "3")
    assert DecodeSettings().max_sequences == 3
    assert DecodeSettings.from_environ({}).max_sequences == 4  # an explicit environment replaces it


def test_the_gateway_port_is_read_as_port():
    assert GatewaySettings.from_environ({"HYBRIDSERVE_GATEWAY_PORT": "8124"}).port == 8124


# ---- old names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, old, field, value, new", [
    (PrefillSettings, "HYBRIDSERVE_PORT", "port", 1234, "HYBRIDSERVE_PREFILL_PORT"),
    (PrefillSettings, "HYBRIDSERVE_MAX_CONCURRENCY", "max_concurrency", 1,
     "HYBRIDSERVE_PREFILL_GENERATE_MAX_CONCURRENCY"),
    (PrefillSettings, "HYBRIDSERVE_PREFILL_MAX_CONCURRENCY", "prefill_max_concurrency", 3,
     "HYBRIDSERVE_PREFILL_HANDOFF_MAX_CONCURRENCY"),
    (DecodeSettings, "HYBRIDSERVE_WEIGHTS_DTYPE", "weights_dtype", "fp16", "HYBRIDSERVE_DECODE_WEIGHTS_DTYPE"),
    (DecodeSettings, "HYBRIDSERVE_PREFILL_ADDRESS", "prefill_address", "p:1", "HYBRIDSERVE_DECODE_PREFILL_ADDRESS"),
    (GatewaySettings, "HYBRIDSERVE_PREFILL_ADDRESS", "prefill_address", "p:1", "HYBRIDSERVE_GATEWAY_PREFILL_ADDRESS"),
    (GatewaySettings, "HYBRIDSERVE_API_KEY", "api_key", "k", "HYBRIDSERVE_GATEWAY_API_KEY"),
    (UpSettings, "HYBRIDSERVE_STARTUP_TIMEOUT_S", "startup_timeout_s", 5.0, "HYBRIDSERVE_UP_STARTUP_TIMEOUT_S"),
])
def test_an_old_name_still_works_with_one_warning_naming_the_new(cls, old, field, value, new, deprecations):
    for _ in range(2):
        got = getattr(cls.from_environ({old: str(value)}), field)
        assert (got.get_secret_value() if isinstance(got, pydantic.SecretStr) else got) == value
    assert len(deprecations()) == 1
    assert old in deprecations()[0] and new in deprecations()[0]


def test_the_new_name_wins_over_the_old(deprecations):
    s = PrefillSettings.from_environ({"HYBRIDSERVE_PORT": "1", "HYBRIDSERVE_PREFILL_PORT": "2"})
    assert s.port == 2
    assert "ignored" in deprecations()[0]


def test_an_ambiguous_old_name_keeps_meaning_the_reading_process_own():
    env = {"HYBRIDSERVE_PORT": "1111", "HYBRIDSERVE_MAX_CONCURRENCY": "3"}
    assert PrefillSettings.from_environ(env).port == 1111
    assert DecodeSettings.from_environ(env).port == 1111
    assert DecodeSettings.from_environ(env).max_concurrency == 3
    assert GatewaySettings.from_environ(env).port == 8000  # the gateway never read HYBRIDSERVE_PORT


def test_up_chooses_the_children_ports_whatever_the_old_shared_names_say(monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_PORT", "1111")
    monkeypatch.setenv("HYBRIDSERVE_DECODE_ADDRESS", "elsewhere:1")
    monkeypatch.setenv("HYBRIDSERVE_MAX_CONCURRENCY", "3")
    env = _children_environment()
    assert "HYBRIDSERVE_PORT" not in env and "HYBRIDSERVE_DECODE_ADDRESS" not in env
    assert env["HYBRIDSERVE_MAX_CONCURRENCY"] == "3"  # still each child's own, as before


def test_no_old_name_means_another_field_under_its_new_name():
    new = {cls.env_name(f): (cls, f) for cls in SERVICES for f in cls.model_fields}
    for cls in SERVICES:
        for old, field in cls.old_env_names().items():
            assert new.get(old, (cls, field)) == (cls, field), (old, cls.service, field)


# ---- unknown names ------------------------------------------------------------------------------------
def test_a_typo_under_the_own_prefix_fails_naming_the_nearest():
    with pytest.raises(UnknownSettingError, match="HYBRIDSERVE_DECODE_KV_CHANEL is not a setting of decode_fpga; "
                                                  "did you mean HYBRIDSERVE_DECODE_KV_CHANNELS\\?"):
        DecodeSettings.from_environ({"HYBRIDSERVE_DECODE_KV_CHANEL": "4"})
    with pytest.raises(UnknownSettingError, match="did you mean HYBRIDSERVE_GATEWAY_API_KEY"):
        GatewaySettings.from_environ({"HYBRIDSERVE_GATEWAY_APIKEY": "k"})


def test_a_typo_under_the_shared_prefix_fails_in_every_process():
    for cls in (*SERVICES, CommonSettings):
        with pytest.raises(UnknownSettingError, match="HYBRIDSERVE_MODLE is not a hybridserve setting; "
                                                      "did you mean HYBRIDSERVE_MODEL\\?"):
            cls.from_environ({"HYBRIDSERVE_MODLE": "x"})


def test_variables_read_outside_the_services_are_left_alone_by_every_process():
    # `HYBRIDSERVE_INSTALL_WITH=pip make run` refused to start (the variable is the install tool's)
    for name in settings_module.OUTSIDE_VARIABLES:
        for cls in SERVICES:
            cls.from_environ({name: "1"})
    with pytest.raises(UnknownSettingError, match="HYBRIDSERVE_INSTALL_WIHT is not a hybridserve setting"):
        GatewaySettings.from_environ({"HYBRIDSERVE_INSTALL_WIHT": "pip"})  # a typo of one is still a typo


def test_other_services_prefixes_are_ignored():
    env = {"HYBRIDSERVE_PREFILL_NOT_A_SETTING": "1", "HYBRIDSERVE_DECODE_KV_CHANNELS": "8"}
    assert DecodeSettings.from_environ({"HYBRIDSERVE_PREFILL_NOT_A_SETTING": "1"}).kv_channels == 1
    assert PrefillSettings.from_environ({"HYBRIDSERVE_DECODE_KV_CHANNELS": "8"}).port == 50061
    assert GatewaySettings.from_environ(env).port == 8000
    with pytest.raises(UnknownSettingError, match="not a setting of prefill_gpu"):
        PrefillSettings.from_environ(env)


def test_old_names_of_other_services_under_the_own_prefix_are_not_typos():
    # HYBRIDSERVE_PREFILL_ADDRESS was decode_fpga's and the gateway's, not prefill_gpu's
    s = PrefillSettings.from_environ({"HYBRIDSERVE_PREFILL_ADDRESS": "p:1", "HYBRIDSERVE_DECODE_ADDRESS": "d:2"})
    assert s.port == 50061


def test_bad_values_are_still_validation_errors():
    with pytest.raises(pydantic.ValidationError):
        DecodeSettings.from_environ({"HYBRIDSERVE_DECODE_WEIGHTS_DTYPE": "int3"})
    with pytest.raises(pydantic.ValidationError):
        DecodeSettings(not_a_field=1)


# ---- shared names -------------------------------------------------------------------------------------
def test_shared_names_are_read_by_every_process_that_has_them():
    env = {"HYBRIDSERVE_MODEL": "/m.gguf", "HYBRIDSERVE_LOG_LEVEL": "DEBUG", "HYBRIDSERVE_HOST": "0.0.0.0",
           "HYBRIDSERVE_PROFILE_AT_START": "false", "HYBRIDSERVE_PROFILE_ATTEMPTS": "1"}
    for cls in SERVICES:
        s = cls.from_environ(env)
        assert (s.model, s.log_level, s.host) == ("/m.gguf", "DEBUG", "0.0.0.0")
    for cls in (PrefillSettings, DecodeSettings):
        assert cls.from_environ(env).profile_at_start is False
        assert cls.from_environ(env).profile_attempts == 1 and cls.from_environ({}).profile_attempts == 2
    assert CommonSettings.from_environ(env).model == "/m.gguf"


def test_a_shared_field_has_one_default_everywhere():
    for field in settings_module.SHARED_FIELDS:
        defaults = {cls.model_fields[field].default for cls in SERVICES if field in cls.model_fields}
        assert len(defaults) == 1, (field, defaults)
