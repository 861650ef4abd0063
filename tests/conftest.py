"""Shared fixtures: the real default model, loaded once per test session.

Loading the weights takes ~6 s and the transformers reference ~15 s on this
machine, so every test module shares these session-scoped objects.
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the stacks the tests start profile on a machine the suite keeps busy: a second sweep (the default
# retry, services/engine/profile_cache.py) is as busy as the first and cost ~12 s per engine start
os.environ.setdefault("HYBRIDSERVE_PROFILE_ATTEMPTS", "1")
# and that one busy sweep is kept for the later stacks (probed, never called quiet): each engine start
# then probes for ~1-2 s where it swept for 8-20 s, and an engine joining a pool, or draining out of
# one, no longer waits its turn behind the others' sweeps (a drain in test_up_pools took 38 s so)
os.environ.setdefault("HYBRIDSERVE_PROFILE_KEEP_BUSY", "1")

# as prefill_gpu's service does before its model loads: MKL's strict mode can be chosen only before
# any matmul of the process, and the torch engines tested here must run as the service runs them
from services.prefill_gpu.cpu_matmul import request_strict_mkl  # noqa: E402

request_strict_mkl()


# make test's lanes, by path (tests/lanes.py, which defines them): run directly, pytest runs all
from tests.lanes import lane_of  # noqa: E402


def pytest_collection_modifyitems(config, items):
    for item in items:
        if lane := lane_of(item.nodeid):
            item.add_marker(getattr(pytest.mark, lane))


# the lines of a failed live test's service logs that say what went wrong, in its report: a fresh
# clone's CI keeps only the report (pytest's temporary folders are gone by the time anyone looks)
LOG_TRACE = ("Traceback", "ERROR", "Exception", "failed", "exited")
LOG_TRACE_LINES = 200


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when != "call" or not report.failed or tmp is None:
        return
    for log in sorted(tmp.rglob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        picked, until = [], -1
        for i, line in enumerate(lines):
            if any(word in line for word in LOG_TRACE):
                until = i + 12  # a traceback's frames follow its first line
            if i <= until:
                picked.append(line)
        if picked:
            report.sections.append((f"{log.name}: what went wrong", "\n".join(picked[-LOG_TRACE_LINES:])))


@pytest.fixture(scope="session")
def profile_cache(pytestconfig, tmp_path_factory):
    """The engines' profile cache for the live stacks that do not test profiling itself: in pytest's
    cache directory (not the user's ~/.cache), so a sweep one stack's engines could cache (a quiet
    machine) spares the later stacks theirs: they run a quick probe of it instead. With pytest's
    cache turned off (-p no:cacheprovider), a folder of this session's."""
    cache = getattr(pytestconfig, "cache", None)
    return cache.mkdir("hybridserve-profile") if cache is not None else tmp_path_factory.mktemp("profile")


@pytest.fixture(scope="session")
def loaded_model():
    """The default model; TEST_CHECKPOINT names another (a lent GPU machine, which cannot
    receive the default GGUF, runs the `cuda` tests on a checkpoint of the same shape). Not a
    HYBRIDSERVE_ variable: the services refuse names they do not know."""
    from services.model.loading import load_model

    return load_model(os.environ.get("TEST_CHECKPOINT") or None)


@pytest.fixture(scope="session")
def model_config(loaded_model):
    return loaded_model.config


@pytest.fixture(scope="session")
def tokenizer(loaded_model):
    from services.model.tokenizer import load_tokenizer

    return load_tokenizer(loaded_model.checkpoint)


@pytest.fixture(scope="session")
def torch_engine(loaded_model):
    from services.prefill_gpu.engine import TorchEngine

    return TorchEngine(loaded_model.config, loaded_model.weights, device="cpu")


@pytest.fixture(scope="session")
def hf_model(loaded_model):
    """transformers' own Llama on the same GGUF: the numerical reference (services/model/reference.py)."""
    import torch
    import transformers

    from services.model.reference import load_reference

    model = load_reference(loaded_model.checkpoint)
    # what its greedy tokens depend on, for hf_greedy's store shared by make test's lanes (a GGUF file's
    # size and time name it; a checkpoint directory's would not, and it goes without the store)
    path = loaded_model.checkpoint.path
    if loaded_model.checkpoint.kind == "gguf":
        model.hybridserve_reference_key = [str(path), path.stat().st_size, path.stat().st_mtime_ns,
                                           torch.__version__, transformers.__version__, request_strict_mkl()]
    return model


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids drawn reproducibly from the vocabulary (specials included: the model must cope)."""
    return np.random.default_rng(seed + n).integers(3, vocab, n).tolist()


# per model, per prompt: the longest greedy continuation transformers has given (a shorter one is its
# prefix: a step does not depend on how many follow). The engine contract, the block-format and the
# paged-step tests ask for the same seeded prompts: computed once, ~8 s of the suite's reference runs.
_HF_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# and for the default model's reference (hf_model: its key names the file, torch's and transformers'
# versions and MKL's mode), in pytest's cache folder: make test's lanes are separate processes, and the
# engine lane's block-format tests and the other in-process lane's engine contract ask for the same
# 64-token continuations (~17 s of transformers' generate, once more in the second). Each entry is
# transformers' own output in this checkout, written by the first lane that ran it.
_HF_GREEDY_DIR = None


def pytest_configure(config):
    global _HF_GREEDY_DIR
    cache = getattr(config, "cache", None)
    _HF_GREEDY_DIR = cache.mkdir("hf-greedy") if cache is not None else None


def _stored_greedy(hf_model, prompt: list[int]):
    """hf_greedy's file for (model, prompt), or None where the model has no key or pytest no cache."""
    key = getattr(hf_model, "hybridserve_reference_key", None)
    if key is None or _HF_GREEDY_DIR is None:
        return None
    ids = [int(t) for t in prompt]
    return _HF_GREEDY_DIR / (hashlib.sha256(json.dumps([key, ids]).encode()).hexdigest()[:40] + ".json")


def hf_greedy(hf_model, prompt: list[int], n_new: int) -> list[int]:
    """transformers' generate, greedy, EOS ignored: the tokens every engine must reproduce.

    EOS is disabled with an id that never occurs rather than min_new_tokens, which
    would mask EOS's logit and so change which token wins.
    """
    import copy

    import torch

    known = _HF_GREEDY.setdefault(hf_model, {})
    done = known.get(tuple(prompt), [])
    stored = _stored_greedy(hf_model, prompt)
    if len(done) < n_new and stored is not None and stored.exists():
        done = known[tuple(prompt)] = max(done, json.loads(stored.read_text()), key=len)
    if len(done) >= n_new:
        return done[:n_new]
    gc = copy.deepcopy(hf_model.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.max_new_tokens, gc.do_sample = -1, 0, n_new, False
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), generation_config=gc)
    tokens = out[0, len(prompt):].tolist()
    known[tuple(prompt)] = tokens
    # whole or not at all (another lane may read it at any moment), and never shorter than another's
    if stored is not None and not (stored.exists() and len(json.loads(stored.read_text())) >= len(tokens)):
        partial = stored.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(tokens))
        os.replace(partial, stored)
    return list(tokens)
