"""Generator.serve: a stream of requests through fewer slots. Requests are admitted and finished
between steps (slots and pages reused), each gets exactly the tokens it gets alone on the reference
path, eos stops a request, compilations stay within the buckets touched, steps run under the
device-to-host transfer guard."""

import numpy as np
import pytest

pytest.importorskip("flax", reason="jax_mla.nn needs flax (pip install .[nn])")

from nn_util import record_transfer_guard_levels  # noqa: E402

from test_nn_decode import tiny_model  # noqa: E402
from jax_mla.nn import Generator, OutOfPagesError, PagedCacheManager  # noqa: E402

N = 12


def manager(max_requests=3, num_pages=24):
    return PagedCacheManager(num_pages=num_pages, page_size=4, max_requests=max_requests, max_pages_per_request=8)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def stream():
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 97, rng.integers(2, 13)).tolist() for _ in range(N)]
    budget = rng.integers(1, 9, N)
    return prompts, budget


def alone(model, prompt, new_tokens):
    """The request by itself: prefill + decode on the reference path (greedy, fp32)."""
    gen = Generator(model, manager(max_requests=1), backend="reference")
    (s,) = gen.prefill([prompt])
    gen.decode(int(new_tokens) - 1)
    return gen.results()[s]


@pytest.fixture(scope="module")
def alone_results(model, stream):
    prompts, budget = stream
    return [alone(model, p, b) for p, b in zip(prompts, budget)]


@pytest.fixture(scope="module")
def served(model, stream):
    prompts, budget = stream
    gen = Generator(model, manager(), backend="auto")
    return gen, gen.serve(prompts, budget, fetch_lag=3)


def test_stream_equals_each_request_alone(stream, served, alone_results):
    gen, out = served
    prompts, budget = stream
    assert out == alone_results
    assert [len(o) for o in out] == budget.tolist()
    st = gen.stream_stats
    # 12 requests through 3 slots: admitted in several prefill steps between decode steps.
    assert st["requests"] == N and st["prefill_steps"] >= N // 3 and st["decode_steps"] >= max(budget) - 1
    assert st["tokens"] == budget.sum() and len(st["ttft_s"]) == N and all(t > 0 for t in st["ttft_s"])
    assert gen.manager.active_slots.size == 0 and gen.manager.num_free_pages == gen.manager.num_pages


def test_stream_with_multi_step_dispatch_equals_each_request_alone(model, stream, alone_results):
    """Four steps per dispatch: requests join and leave only between dispatches; one that is done
    inside a dispatch keeps decoding until it ends, and those extra tokens are dropped."""
    prompts, budget = stream
    gen = Generator(model, manager(num_pages=36), backend="auto")
    out = gen.serve(prompts, budget, fetch_lag=2, steps_per_dispatch=4)
    assert out == alone_results
    assert gen.stream_stats["decode_steps"] % 4 == 0
    assert gen.traces["decode_scan"] == 1 and gen.traces["decode"] == 0
    assert gen.manager.active_slots.size == 0 and gen.manager.num_free_pages == gen.manager.num_pages
    eos = alone_results[0][-1]
    gen = Generator(model, manager(num_pages=36), backend="auto")
    want = [a[: a.index(eos) + 1] if eos in a else a for a in alone_results]
    assert gen.serve(prompts, budget, eos_token_id=eos, steps_per_dispatch=4) == want


def test_stream_longest_first_admission(model, stream, alone_results):
    """admit='longest_first': the largest max_new_tokens are admitted first; results still come back
    in arrival order, each equal to the request alone."""
    prompts, budget = stream
    gen = Generator(model, manager(), backend="auto")
    admitted = []
    real = gen.prefill

    def spy(batch, **kw):
        admitted.append([prompts.index(list(p)) for p in batch])
        return real(batch, **kw)

    gen.prefill = spy
    assert gen.serve(prompts, budget, admit="longest_first", steps_per_dispatch=2) == alone_results
    order = [i for batch in admitted for i in batch]
    assert sorted(order) == list(range(N))
    assert [budget[i] for i in order] == sorted(budget, reverse=True)
    with pytest.raises(ValueError, match="admit='soonest'"):
        gen.serve(prompts, budget, admit="soonest")


def test_stream_compiles_once_per_bucket(served):
    gen, _ = served
    assert gen.traces["decode"] == 1  # 1-3 active requests: one decode bucket (min_token_bucket 8)
    # One compilation per prefill bucket touched: token rows (8, 16 or 32 for 2..36 new tokens) and
    # the plan's partial-row workspace (by the longest prompt tile).
    assert gen.traces["prefill"] == gen.stream_stats["prefill_buckets"] <= 3 * 3


def test_stream_stops_at_eos(model, stream, alone_results):
    prompts, budget = stream
    eos = alone_results[0][-1]  # a token some requests emit
    gen = Generator(model, manager(), backend="auto")
    out = gen.serve(prompts, budget, eos_token_id=eos)
    want = [a[: a.index(eos) + 1] if eos in a else a for a in alone_results]
    assert out == want
    assert any(len(w) < b for w, b in zip(want, budget))


def test_stream_runs_steps_under_the_transfer_guard(model, stream, monkeypatch):
    seen = record_transfer_guard_levels(monkeypatch)
    prompts, budget = stream
    gen = Generator(model, manager(), backend="auto")
    gen.serve(prompts[:5], budget[:5])
    assert seen == ["disallow"] * gen.stream_stats["decode_steps"] and seen


def test_stream_bad_arguments(model):
    gen = Generator(model, manager(num_pages=4), backend="auto")
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.serve([[1, 2]], 0)
    with pytest.raises(OutOfPagesError, match="request 1"):
        gen.serve([[1, 2], [3] * 10], [2, 20])  # 30 tokens: 8 pages of 4, the cache has 4
    assert gen.manager.active_slots.size == 0
