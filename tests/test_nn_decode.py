"""Decode loops: host-planned and fully jitted give the reference path's tokens, which equal
recomputing each whole sequence without a cache; no retrace within a bucket; lagged token reads;
slots reused after a request finishes."""

import numpy as np
import pytest

pytest.importorskip("flax", reason="jax_mla.nn needs flax (pip install .[nn])")

from flax import nnx  # noqa: E402

from nn_util import fresh_prefill_logits, record_transfer_guard_levels  # noqa: E402
from jax_mla.nn import (DeepseekConfig, DeepseekModel, Generator, PagedCacheManager,  # noqa: E402
                        RopeScaling)

PROMPTS = [[5, 17, 3, 90, 41], [7, 7, 8, 1, 2, 60, 33, 12, 9], [88, 4, 19]]
STEPS = 7


def tiny_model(seed=0):
    cfg = DeepseekConfig(hidden_size=64, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=12, vocab_size=97, intermediate_size=96,
                         num_hidden_layers=2, max_position_embeddings=256,
                         rope_scaling=RopeScaling(factor=4.0, mscale=0.8, mscale_all_dim=0.6,
                                                  original_max_position_embeddings=64))
    return DeepseekModel(cfg, rngs=nnx.Rngs(seed))


def manager(page_size=4, max_requests=4):
    return PagedCacheManager(num_pages=64, page_size=page_size, max_requests=max_requests, max_pages_per_request=16)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference_run(model):
    """Host-planned loop with the jnp reference attention: the tokens and per-step logits."""
    gen = Generator(model, manager(), backend="reference")
    slots, prefill_logits = gen.prefill(PROMPTS, with_logits=True)
    logits = gen.decode(STEPS, with_logits=True)
    return slots, gen.results(), [np.asarray(prefill_logits)] + [np.asarray(x) for x in logits]


def recompute_logits(model, seqs):
    """Logits at every position of each sequence, from one cache-free pass (expanded form)."""
    return fresh_prefill_logits(model, manager(), seqs, num_tokens=64, form="expanded")


def test_reference_path_equals_cache_free_recompute(model, reference_run):
    slots, out, _ = reference_run
    assert all(len(out[s]) == STEPS + 1 for s in slots)
    seqs = [p + out[s][:-1] for p, s in zip(PROMPTS, slots)]
    for p, s, logits in zip(PROMPTS, slots, recompute_logits(model, seqs)):
        assert logits[len(p) - 1:].argmax(-1).tolist() == out[s]


def test_host_planned_loop_equals_reference(model, reference_run):
    slots, want, want_logits = reference_run
    gen = Generator(model, manager(), backend="auto")
    _, prefill_logits = gen.prefill(PROMPTS, with_logits=True)
    logits = gen.decode(STEPS, with_logits=True)
    assert gen.results() == want
    got = [np.asarray(prefill_logits)] + [np.asarray(x) for x in logits]
    for a, b in zip(got, want_logits):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert gen.traces["decode"] == 1


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_multi_step_dispatch_equals_reference(model, reference_run, backend, monkeypatch):
    """steps_per_dispatch=3 over 7 steps: dispatches of 3, 3 and 1 steps (each a plan for its last
    step's lengths), the same tokens and per-step logits as one step per dispatch."""
    slots, want, want_logits = reference_run
    seen = record_transfer_guard_levels(monkeypatch)
    gen = Generator(model, manager(), backend=backend)
    gen.prefill(PROMPTS)
    ticks = []
    logits = gen.decode(STEPS, with_logits=True, steps_per_dispatch=3, on_step=ticks.append)
    assert gen.results() == want
    assert ticks == list(range(STEPS)) and len(logits) == STEPS
    for a, b in zip(logits, want_logits[1:]):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-4)
    assert seen == ["disallow"] * 3  # three dispatches for seven steps
    assert gen.traces["decode_scan"] == 1 and gen.traces["decode"] == 1  # the 3-step program and the 1-step one
    assert len(gen.timings["dispatch_s"]) == 3
    gen.decode(6, steps_per_dispatch=3)  # without logits: one more program, then windows reuse it
    gen.decode(6, steps_per_dispatch=3)
    assert gen.traces["decode_scan"] == 2 and gen.traces["decode"] == 1
    assert all(len(v) == 1 + STEPS + 12 for v in gen.results().values())


def test_jitted_loop_equals_reference(model, reference_run):
    slots, want, _ = reference_run
    gen = Generator(model, manager(), backend="auto")
    gen.prefill(PROMPTS)
    gen.decode_jitted(STEPS)
    assert gen.results() == want
    # Split in two scans: the second starts from lengths the first left on the host.
    gen2 = Generator(model, manager(), backend="reference")
    gen2.prefill(PROMPTS)
    gen2.decode_jitted(3)
    gen2.decode_jitted(STEPS - 3)
    assert gen2.results() == want


def test_no_retrace_within_a_bucket(model):
    gen = Generator(model, manager(page_size=4), backend="auto")
    gen.prefill(PROMPTS[:2])  # 14 tokens: bucket 16
    gen.decode(6)  # lengths 5..15: crosses page boundaries, changes the plan's values
    gen.prefill(PROMPTS[1:2])  # 9 tokens: bucket 16
    gen.decode(5)  # 3 requests instead of 2: same token bucket
    assert gen.traces["prefill"] == 1 and gen.traces["decode"] == 1
    gen.decode_jitted(4)
    gen.decode_jitted(4)
    assert gen.traces["decode_scan"] == 1
    assert all(len(v) == 1 + 6 + 5 + 8 or len(v) == 1 + 5 + 8 for v in gen.results().values())


def test_tokens_come_back_late(model, reference_run):
    slots, want, _ = reference_run
    gen = Generator(model, manager(), backend="auto")
    gen.prefill(PROMPTS)
    gen.decode(STEPS, fetch_lag=3)
    # The prefill token and the first STEPS - 3 decode tokens have been read; 3 are still in flight.
    assert {s: len(v) for s, v in gen.outputs.items()} == {s: 1 + STEPS - 3 for s in slots}
    assert gen.results() == want


def test_finished_slot_is_reused(model):
    gen = Generator(model, manager(max_requests=2), backend="auto")
    a, b = gen.prefill(PROMPTS[:2])
    gen.decode(3)
    first = gen.finish(a)
    assert len(first) == 4
    (c,) = gen.prefill(PROMPTS[2:])
    assert c == a  # the freed slot, with its freed pages
    gen.decode(4)
    out = gen.results()
    solo = Generator(model, manager(max_requests=2), backend="reference")
    (s,) = solo.prefill(PROMPTS[2:])
    solo.decode(4)
    assert out[c] == solo.results()[s]
    alone_b = Generator(model, manager(max_requests=2), backend="reference")
    (s,) = alone_b.prefill(PROMPTS[1:2])
    alone_b.decode(7)
    assert out[b] == alone_b.results()[s]


def test_decode_step_runs_under_the_device_to_host_guard(model, monkeypatch):
    """The step is dispatched inside transfer_guard_device_to_host('disallow'). (On a GPU that
    guard rejects any device->host copy in the step; the CPU backend does not count any.)"""
    seen = record_transfer_guard_levels(monkeypatch)
    gen = Generator(model, manager(), backend="auto")
    gen.prefill(PROMPTS)
    gen.decode(2)
    gen.decode_jitted(2)
    assert seen == ["disallow"] * 3


def test_bad_prompts_leave_the_manager_unchanged(model):
    mgr = manager(max_requests=2)
    gen = Generator(model, mgr, backend="reference")
    with pytest.raises(ValueError, match=r"prompt 1 has token ids outside \[0, 97\)"):
        gen.prefill([[1, 2], [3, 97]])
    with pytest.raises(ValueError, match="form="):
        gen.prefill([[1, 2]], form="dense")
    assert mgr.num_free_pages == mgr.num_pages and not mgr.active.any() and mgr.pending_entries == 0


def test_temperature_sampling_same_in_both_loops(model, reference_run):
    _, greedy, _ = reference_run
    outs = []
    for jitted in (False, True):
        gen = Generator(model, manager(), backend="auto", temperature=1.5, seed=7)
        gen.prefill(PROMPTS)
        gen.decode_jitted(STEPS) if jitted else gen.decode(STEPS)
        outs.append(gen.results())
    assert outs[0] == outs[1]  # one key per step, split the same way on both paths
    assert outs[0] != greedy


def test_bad_arguments_raise_before_anything_changes(model):
    with pytest.raises(ValueError, match="backend='fast'"):
        Generator(model, manager(), backend="fast")
    with pytest.raises(ValueError, match="temperature"):
        Generator(model, manager(), temperature=-1.0)
    mgr = manager(max_requests=2)
    gen = Generator(model, mgr, backend="reference")
    (a,) = gen.prefill(PROMPTS[:1])
    lengths = mgr.lengths.copy()
    for call, match in ((lambda: gen.decode_jitted(-2), "num_steps must be an int >= 0, got -2"),
                        (lambda: gen.decode(-1), "num_steps must be an int >= 0, got -1"),
                        (lambda: gen.decode(2, fetch_lag=-1), "fetch_lag"),
                        (lambda: gen.decode(1.5), "num_steps"),
                        (lambda: gen.finish(-1), r"slot -1 is not in \[0, 2\)"),
                        (lambda: gen.finish(1), "slot 1 holds no request")):
        with pytest.raises(ValueError, match=match):
            call()
    np.testing.assert_array_equal(mgr.lengths, lengths)
    assert mgr.active.tolist() == [True, False] and len(mgr._free_slots) == 1
    gen.decode_jitted(0)  # zero steps: nothing happens
    np.testing.assert_array_equal(mgr.lengths, lengths)
    assert len(gen.finish(a)) == 1
