"""The whole stack started with a wrong cached profile (OpenCL decode 50x too slow, as a busy
machine once recorded it, or slower where that would not put it far behind gpu mode): within ten
auto requests the router no longer picks gpu mode, the wrong profile's choice, where forced runs show
it far slower, and picks a mode within 2x of the fastest forced one. Real engines and gateway on
loopback; runs alone in make test's quiet lane (slow)."""
from __future__ import annotations

import itertools
import json
import re
import statistics

import grpc
import httpx
import pytest

from services.engine.profile_cache import cache_path
from services.gateway.routing.router import Router
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
from tests.gateway.conftest import API_KEY, DECODE_ENV, MODEL, wait_calibrated
from tests.services_harness import Service, engine_pair, start_gateway, wait_http_ok

N_IN, N_OUT = 256, 48  # a cell where the decode engine matters: fpga decode is ~7x faster per token


def profile_of(service: Service) -> list[dict]:
    with grpc.insecure_channel(service.address) as ch:
        reply = pb_grpc.EngineStub(ch).Profile(pb.ProfileRequest(), timeout=300)
    return [{"stage": s.stage, "device": s.device, "n_in": s.n_in, "n_out": s.n_out, "seconds": s.seconds}
            for s in reply.samples]


def decode_s_per_token(samples: list[dict]) -> float:
    return statistics.median(s["seconds"] / s["n_out"] for s in samples if s["stage"] == "decode")


def plant_wrong_profile(tmp_path, decode: Service, gpu_samples: list[dict]) -> list[dict]:
    """decode_fpga's own profile, with every decode time at least 50x, where its next start will read it.

    At least 10x slower per token than gpu mode's decode measured here too, so that, on any machine,
    the wrong profile ranks gpu first by far at this cell (50x alone did not where gpu mode's decode
    was slow for the machine)."""
    samples = profile_of(decode)  # measures (and caches, on a quiet machine) under its real key
    key = re.search(r"running the start-up sweep \((.+)\)$", decode.log_path.read_text(), re.M).group(1)
    factor = max(50.0, 10 * decode_s_per_token(gpu_samples) / decode_s_per_token(samples))
    wrong = [dict(s, seconds=factor * s["seconds"]) if s["stage"] == "decode" else s
             for s in samples if s["stage"] != "handoff"]
    cache_path(str(tmp_path / "profile"), key).write_text(json.dumps(wrong))
    return wrong


def same_samples(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x["stage"] == y["stage"] and abs(x["seconds"] / y["seconds"] - 1) < 1e-5
                                    for x, y in zip(a, b))


PROMPTS = itertools.count()


def complete(url: str, mode: str) -> dict:
    """One request of N_IN tokens no earlier one shared a block with: a repeated prompt would be a
    prefix-cache hit, and a mode measured after another on it would look faster than it is."""
    k = next(PROMPTS)
    body = {"model": MODEL, "prompt": [300 + (k * N_IN + i) % 40000 for i in range(N_IN)], "max_tokens": N_OUT,
            "temperature": 0, "ignore_eos": True, "mode": mode}
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300)
    r.raise_for_status()
    return r.json()["hybridserve"]


@pytest.mark.slow
def test_a_50x_wrong_cached_profile_is_corrected_within_ten_requests(tmp_path):
    prefill, decode = engine_pair(tmp_path, decode_env=DECODE_ENV)
    gateway = None
    try:
        prefill.wait_healthy(timeout=420)
        decode.wait_healthy(timeout=420)
        gpu_profile = profile_of(prefill)
        wrong = plant_wrong_profile(tmp_path, decode, gpu_profile)
        decode.stop()
        decode = Service("services.decode_fpga", {**decode.env}, tmp_path / "decode_again.log").start()
        decode.wait_healthy(timeout=420)
        # served as planted, unless a start-up probe caught it (then the router starts right)
        served = profile_of(decode)
        planted = same_samples([s for s in served if s["stage"] != "handoff"], wrong)
        if planted:
            # the router the gateway builds from these profiles believes hybrid and fpga far slower than
            # gpu here: asked of the router itself, before the gateway's calibration check (which may
            # correct it before the first request, on a busy machine) and whatever the machine's speed
            believed = Router(gpu_profile + served, explore_share=0.0).estimates(N_IN, N_OUT)
            assert min(believed["hybrid"], believed["fpga"]) > 2 * believed["gpu"], believed
        gateway = start_gateway(tmp_path, prefill, decode, {"HYBRIDSERVE_API_KEY": API_KEY})
        wait_http_ok(gateway)
        url = f"http://127.0.0.1:{gateway.port}"
        wait_calibrated(url)
        auto = [complete(url, "auto") for _ in range(10)]
        # gpu mode once (~6x the others here, ~3.5 s a request; the quiet lane runs alone), the two
        # close ones three times each
        forced = {m: statistics.median(complete(url, m)["timings"]["e2e_s"] for _ in range(1 if m == "gpu" else 3))
                  for m in ("gpu", "fpga", "hybrid")}
        fastest = min(forced, key=forced.get)
        if forced["gpu"] <= 1.1 * forced[fastest]:
            pytest.skip(f"gpu mode, the wrong profile's choice, is (near) the fastest here: nothing to correct "
                        f"({forced})")
        ran = [a["mode"] for a in auto]
        why = (ran, [a["reason"] for a in auto], forced, auto[-1].get("estimates"))
        # what is tested is that the 50x error is corrected: the wrong profile's choice, gpu mode (2-6x
        # slower here), is not among the last three choices. Between fpga and hybrid the forced runs
        # themselves swing from run to run with what else the machine does (their one-launch steps give
        # up beside other work): fpga 0.73-2.19 s and hybrid 1.13-1.52 s in four runs on 2026-11-28, so
        # either may be ahead by half. The choice between them is held to 2x of the fastest here; whether
        # auto picks the better of two close modes is the serving benchmark's measure (bench/serve.py)
        if forced["gpu"] > 1.5 * forced[fastest]:
            assert "gpu" not in ran[-3:], why
        assert all(forced[m] <= 2 * forced[fastest] for m in ran[-3:]), why
    finally:
        for svc in (gateway, decode, prefill):
            if svc is not None:
                svc.stop()
