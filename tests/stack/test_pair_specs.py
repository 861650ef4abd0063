"""`up --pairs N`'s children, without starting them: names, ports a stride apart, who follows whom."""
from __future__ import annotations

from services.launcher.cli import main
from services.decode_fpga.settings import DecodeSettings
from services.prefill_gpu.settings import PrefillSettings
from services.launcher.stack import UpSettings, _pair_specs


def specs(i: int, pairs: int, **prefill):
    s = UpSettings(pairs=pairs, port_stride=10)
    return _pair_specs(i, s, PrefillSettings(**{"port": 50061, "metrics_port": 9101, **prefill}),
                       DecodeSettings(port=50062, metrics_port=9102), {"KEEP": "1"})


def test_pair_i_listens_a_stride_further_and_its_decode_follows_its_own_prefill():
    (prefill, decode), address = specs(1, 2)
    assert (prefill.name, decode.name, decode.follows) == ("prefill_gpu.1", "decode_fpga.1", "prefill_gpu.1")
    assert address == "127.0.0.1:50071,127.0.0.1:50072"
    assert prefill.env[PrefillSettings.env_name("port")] == "50071"
    assert prefill.env[PrefillSettings.env_name("metrics_port")] == "9111"
    assert decode.env[DecodeSettings.env_name("prefill_address")] == "127.0.0.1:50071"
    assert decode.env[DecodeSettings.env_name("metrics_port")] == "9112" and decode.env["KEEP"] == "1"


def test_one_pair_keeps_the_names_and_ports_of_a_plain_up():
    (prefill, decode), address = specs(0, 1)
    assert (prefill.name, decode.name) == ("prefill_gpu", "decode_fpga")
    assert address == "127.0.0.1:50061,127.0.0.1:50062"


def test_no_metrics_port_stays_none_for_every_pair():
    (prefill, _), _ = specs(2, 3, **{"metrics_port": 0})
    assert prefill.env[PrefillSettings.env_name("metrics_port")] == "0"


def test_up_refuses_zero_pairs(capsys):
    try:
        main(["up", "--pairs", "0"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("up --pairs 0 was accepted")
    assert "must be 1 or more" in capsys.readouterr().err


def test_pools_of_one_prefill_and_two_decodes_share_the_prefill_engine():
    from services.launcher.stack import _layout_specs

    s = UpSettings(prefill_engines=1, decode_engines=2, port_stride=10)
    specs, pairs, gateway = _layout_specs(s, PrefillSettings(port=50061, metrics_port=9101),
                                          DecodeSettings(port=50062, metrics_port=9102), {})
    assert [c.name for c in specs] == ["prefill_gpu.0", "decode_fpga.0", "decode_fpga.1"]
    assert [c.follows for c in specs] == [None, "prefill_gpu.0", "prefill_gpu.0"]
    assert pairs == ["127.0.0.1:50061,127.0.0.1:50062", "127.0.0.1:50061,127.0.0.1:50072"]
    assert {c.env[DecodeSettings.env_name("prefill_address")] for c in specs[1:]} == {"127.0.0.1:50061"}
    assert gateway == {"prefill_pool": "127.0.0.1:50061", "decode_pool": "127.0.0.1:50062,127.0.0.1:50072"}


def test_pools_of_two_and_four_pull_from_prefill_j_mod_n_and_may_pull_from_any():
    from services.launcher.stack import _layout_specs

    s = UpSettings(prefill_engines=2, decode_engines=4)
    specs, pairs, gateway = _layout_specs(s, PrefillSettings(port=50061), DecodeSettings(port=50062), {})
    decodes = [c for c in specs if c.name.startswith("decode")]
    assert [c.env[DecodeSettings.env_name("prefill_address")] for c in decodes] == [
        "127.0.0.1:50061", "127.0.0.1:50071"] * 2
    assert {c.env[DecodeSettings.env_name("prefill_addresses")] for c in decodes} == {"127.0.0.1:50061,127.0.0.1:50071"}
    assert len(pairs) == 8 and [p.split(",")[0] for p in pairs] == ["127.0.0.1:50061"] * 4 + ["127.0.0.1:50071"] * 4


def test_more_prefill_than_decode_engines_is_a_layout_and_pools_with_pairs_are_refused():
    import pytest
    from pydantic import ValidationError

    from services.launcher.stack import _layout_specs

    specs, pairs, gateway = _layout_specs(UpSettings(prefill_engines=2, decode_engines=1), PrefillSettings(port=50061),
                                          DecodeSettings(port=50062), {})
    assert [c.name for c in specs] == ["prefill_gpu.0", "prefill_gpu.1", "decode_fpga.0"]
    assert pairs == ["127.0.0.1:50061,127.0.0.1:50062", "127.0.0.1:50071,127.0.0.1:50062"]
    assert gateway["prefill_pool"] == "127.0.0.1:50061,127.0.0.1:50071"
    with pytest.raises(ValidationError, match="not both"):
        UpSettings(pairs=2, decode_engines=2)


def test_autoscaled_pools_start_at_their_minimum_and_every_decode_engine_may_pull_from_the_most():
    from services.launcher.stack import _layout_specs, _scaled_spec

    s = UpSettings(prefill_engines=1, decode_engines=1, autoscale=True, max_prefill_engines=2, max_decode_engines=3)
    prefill, decode = PrefillSettings(port=50061), DecodeSettings(port=50062)
    specs, pairs, gateway = _layout_specs(s, prefill, decode, {})
    assert [c.name for c in specs] == ["prefill_gpu.0", "decode_fpga.0"] and len(pairs) == 1
    assert gateway == {"prefill_pool": "127.0.0.1:50061", "decode_pool": "127.0.0.1:50062", "pool_admin": "true"}
    both = "127.0.0.1:50061,127.0.0.1:50071"
    assert specs[1].env[DecodeSettings.env_name("prefill_addresses")] == both
    spec_of = _scaled_spec(s, prefill, decode, {})
    extra, address, _ = spec_of("decode", 2)
    assert (extra.name, address, extra.follows) == ("decode_fpga.2", "127.0.0.1:50082", "prefill_gpu.0")
    assert extra.env[DecodeSettings.env_name("prefill_addresses")] == both
    extra, address, _ = spec_of("prefill", 1)
    assert (extra.name, address, extra.follows) == ("prefill_gpu.1", "127.0.0.1:50071", None)


def test_up_refuses_autoscale_bounds_without_autoscale(capsys):
    assert main(["up", "--decode", "1", "--max-decode", "2"]) == 2
    assert "bound autoscale, which is off" in capsys.readouterr().err
