"""``NRolloutDistillationTrainer`` / ``NRolloutDistillationConfig``: a drop-in for TRL's ``DistillationTrainer``.

No ``DistillationConfig`` option is silently ignored: this walks TRL's actual fields, so a TRL upgrade that adds one
fails here until it is classified in :data:`~trl_nrollout.config.distillation.DISTILL_OPTIONS`. The loss and its
gradients are TRL's on the same batch for every ``beta`` (ours is TRL's code, inherited: a change to it, or to how our
config hands ``beta`` / ``temperature`` to it, fails here). The student samples on our real vLLM-CPU engine, whose
weights follow the student after every optimizer step."""

from __future__ import annotations

import inspect
import json
import math
from collections import defaultdict
from dataclasses import fields

import pytest
import torch
from transformers import TrainingArguments
from trl import DistillationConfig, DistillationTrainer

from trl_nrollout.config.distillation import (
    DISTILL_OPTIONS,
    DISTILL_TRAINER_ARGS,
    ENGINE_OPTIONS,
    NRolloutDistillationConfig,
)
from trl_nrollout.config.options import NRolloutConfig
from trl_nrollout.config.trl_options import UnsupportedTRLOption
from trl_nrollout.errors import InputError

# the fields DistillationConfig adds to TrainingArguments, and those it declares again with its own default
TRL_FIELDS = [f for f in fields(DistillationConfig) if f.name not in {g.name for g in fields(TrainingArguments)}
              or f.name in DistillationConfig.__annotations__]
REFUSED = [name for name, (status, _, _) in DISTILL_OPTIONS.items() if status == "refused"]
BASE = dict(use_cpu=True, report_to="none", max_steps=1, bf16=False, gradient_checkpointing=False,
            save_strategy="no")


def cfg(tmp_path, **kw) -> NRolloutDistillationConfig:
    return NRolloutDistillationConfig(**{"output_dir": str(tmp_path), "rollout_backend": "hf", **BASE, **kw})


@pytest.mark.fast
def test_every_distillation_config_field_is_classified():
    """Mutation tried: ``beta`` removed from DISTILL_OPTIONS -> fails naming it."""
    names = {f.name for f in TRL_FIELDS}
    assert names - set(DISTILL_OPTIONS) == set(), "classify these in trl_nrollout/config/distillation.py"
    assert set(DISTILL_OPTIONS) - names == set(), "options that DistillationConfig no longer has"


@pytest.mark.fast
def test_every_distillation_trainer_argument_is_taken_and_classified():
    from trl_nrollout.trainer.distillation import NRolloutDistillationTrainer

    ours = set(inspect.signature(NRolloutDistillationTrainer.__init__).parameters) - {"self"}
    theirs = set(inspect.signature(DistillationTrainer.__init__).parameters) - {"self"}
    assert theirs == ours
    assert set(DISTILL_TRAINER_ARGS) == theirs - {"model", "args", "train_dataset", "eval_dataset",
                                                   "processing_class", "callbacks", "optimizers"}


@pytest.mark.fast
def test_the_engine_options_are_grpos_own_definitions(tmp_path):
    """The shared options have NRolloutConfig's defaults and help (one definition). Mutation tried: another default
    for rollout_tp_size in the distillation config -> fails."""
    grpo = {f.name: f for f in fields(NRolloutConfig)}
    ours = {f.name: f for f in fields(NRolloutDistillationConfig)}
    for name in ENGINE_OPTIONS:
        assert (ours[name].default, ours[name].metadata) == (grpo[name].default, grpo[name].metadata), name


def _non_neutral(neutral):
    if isinstance(neutral, bool):
        return not neutral
    if isinstance(neutral, int | float):
        return neutral + 1.5
    return "something_else" if isinstance(neutral, str) else "http://elsewhere:8000"


@pytest.mark.fast
@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_option_is_an_error_naming_it(name, tmp_path):
    _, neutral, why = DISTILL_OPTIONS[name]
    value = _non_neutral(neutral)
    with pytest.raises(UnsupportedTRLOption) as err:
        cfg(tmp_path, **{name: value})
    assert f"{name}={value!r} is not supported by NRolloutDistillationTrainer" in str(err.value)
    assert why in str(err.value)
    cfg(tmp_path, **{name: neutral})  # TRL's default is accepted


@pytest.mark.fast
def test_the_server_refusal_says_the_option_the_value_the_rule_and_the_fix(tmp_path):
    with pytest.raises(UnsupportedTRLOption) as err:
        cfg(tmp_path, vllm_mode="server")
    assert str(err.value) == (
        "vllm_mode='server' is not supported by NRolloutDistillationTrainer: no server: our engine group lives in "
        "the trainer processes (vllm_mode='colocate'). Remove it (TRL's default 'colocate' is what our engines do), "
        "or use trl.DistillationTrainer for this option.")
    with pytest.raises(UnsupportedTRLOption, match="rollout_dispatch='balanced' is not built for "
                                                   "NRolloutDistillationTrainer.*Use rollout_dispatch='shares'"):
        cfg(tmp_path, rollout_backend="auto", rollout_dispatch="balanced")


@pytest.mark.fast
def test_trls_vllm_fields_map_onto_ours(tmp_path):
    c = cfg(tmp_path, rollout_backend="auto", use_vllm=True, vllm_tensor_parallel_size=2, vllm_max_model_length=900)
    assert (c.rollout_backend, c.use_vllm, c.rollout_tp_size, c.rollout_max_model_len) == ("vllm", False, 2, 900)
    assert cfg(tmp_path, rollout_backend="auto", rollout_tp_size=2).vllm_tensor_parallel_size == 2
    with pytest.raises(InputError, match="vllm_tensor_parallel_size=2 conflicts with rollout_tp_size=4"):
        cfg(tmp_path, rollout_backend="auto", vllm_tensor_parallel_size=2, rollout_tp_size=4)
    with pytest.raises(InputError, match="use_vllm=True asks for vLLM, but rollout_backend='hf'"):
        cfg(tmp_path, use_vllm=True)
    with pytest.raises(InputError, match=r"rollout_backend='hf' .* no use for rollout_tp_size=2"):
        cfg(tmp_path, rollout_tp_size=2)
    with pytest.raises(InputError, match=r"beta=1.5 must be in \[0, 1\] .* e.g. 0.5"):  # TRL's rule, our error
        cfg(tmp_path, beta=1.5)


@pytest.mark.fast
def test_a_plain_distillation_config_converts_with_its_settings(tmp_path):
    from trl_nrollout.trainer.distillation import to_distillation_config

    theirs = DistillationConfig(output_dir=str(tmp_path), beta=0.25, temperature=0.6, top_k=5,
                                max_completion_length=12, **BASE)
    ours = to_distillation_config(theirs)
    assert isinstance(ours, NRolloutDistillationConfig)
    for name in ("beta", "temperature", "top_k", "max_completion_length", "learning_rate", "seed"):
        assert getattr(ours, name) == getattr(theirs, name), name


@pytest.mark.fast
def test_docs_show_the_generated_table():
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts/gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.DISTILLATION.read_text() == gen.render_distillation(gen.DISTILLATION.read_text()), (
        "docs/distillation.md's options table is stale: run python scripts/gen_config_docs.py")


# ---------------------------------------------------------------------------------------------- the loss is TRL's
@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory) -> str:
    from tests.assets.distill_train import perturbed_teacher

    return perturbed_teacher(str(tmp_path_factory.mktemp("distill")))


def _batch(vocab: int, tools: bool) -> dict:
    """One batch in TRL's layout: prompts left-padded ``[3, 5]``, completions right-padded ``[3, 6]``, optionally a
    tool mask (tool-output tokens 0) ``[3, 6]``, and the count of loss tokens."""
    g = torch.Generator().manual_seed(5)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    batch = {"prompt_ids": torch.randint(vocab, (3, 5), generator=g) * prompt_mask, "prompt_mask": prompt_mask,
             "completion_ids": torch.randint(vocab, (3, 6), generator=g) * completion_mask,
             "completion_mask": completion_mask}
    loss_mask = completion_mask
    if tools:
        batch["tool_mask"] = torch.tensor([[1, 0, 0, 1, 1, 1], [1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]])
        loss_mask = completion_mask * batch["tool_mask"]
    batch["num_items_in_batch"] = loss_mask.sum()
    return batch


def _loss_and_grads(trainer, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = trainer.model
    model.train()
    model.zero_grad()
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.fast
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_loss_and_gradients_are_trls_on_the_same_batch(beta, teacher_path, tmp_path):
    """TRL's DistillationTrainer and ours, built from the same settings (temperature 0.7, fp32), on the same batch,
    without and with a tool mask: the same loss and the same gradient of every student parameter (1e-5).
    Mutations tried: ``self.temperature = 1.0`` after TRL's __init__ in ours; ``self.beta = 1 - self.beta`` in
    ours (beta 0 and 1 fail; 0.5 is symmetric in the JSD, so it passes as it must) -> fails."""
    from trl_nrollout.builtin import digits_dataset, resolve_model
    from trl_nrollout.trainer.distillation import NRolloutDistillationTrainer

    settings = dict(beta=beta, temperature=0.7, max_completion_length=6, per_device_train_batch_size=3, seed=1,
                    **BASE)
    student = resolve_model("builtin:tiny-qwen2")
    theirs = DistillationTrainer(student, teacher_model=teacher_path, train_dataset=digits_dataset(6),
                                 args=DistillationConfig(output_dir=str(tmp_path / "trl"), **settings))
    ours = NRolloutDistillationTrainer(student, teacher_model=teacher_path, train_dataset=digits_dataset(6),
                                       args=NRolloutDistillationConfig(output_dir=str(tmp_path / "ours"),
                                                                       rollout_backend="hf", **settings))
    assert ours.student_sampler is None  # rollout_backend='hf': nothing started
    vocab = ours.model.config.vocab_size
    for tools in (False, True):
        batch = _batch(vocab, tools)
        loss_t, grads_t = _loss_and_grads(theirs, batch)
        ours.teacher_pass.last = None
        loss_o, grads_o = _loss_and_grads(ours, batch)
        assert ours.teacher_pass.last is not None  # the teacher ran through our pass, not TRL's padded call
        assert math.isfinite(float(loss_t)) and float(loss_t) > 0
        torch.testing.assert_close(loss_o, loss_t, atol=1e-5, rtol=1e-5)
        assert grads_o.keys() == grads_t.keys() and len(grads_t) > 0
        for name, grad in grads_t.items():
            torch.testing.assert_close(grads_o[name], grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.fast
def test_the_teacher_pass_equals_a_plain_forward_under_a_small_budget(teacher_path, monkeypatch):
    """The drop-in's teacher pass (:class:`TeacherPass`) on TRL's layout (9 samples, prompts left-padded, completions
    right-padded) under a 30-token budget: three forwards, one of padding-free rows (short samples end to end); the
    teacher's log-softmax (temperature 0.7, over the vocabulary) from its hidden states equals TRL's plain padded
    forward of the teacher on the same tokens at every completion token (1e-5), the hidden states are 0 past each
    completion's end, and a sample longer than the budget is refused naming the option. Mutations tried: the
    predicting positions offset by one (``completion_positions``: ``first`` instead of ``first - 1``) -> fails; the
    budget's split dropping its last micro batch (``for idx in batches[:-1]``) -> fails."""
    from transformers import AutoModelForCausalLM

    from trl_nrollout.passes import logprobs as logprobs_module
    from trl_nrollout.trainer.distillation import TeacherPass
    from trl_nrollout.trainer.metrics import Metrics

    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    p_lens, c_lens = [8, 2, 3, 2, 9, 3, 2, 4, 10], [8, 2, 1, 3, 5, 2, 2, 4, 8]
    width_p, keep = max(p_lens), max(c_lens)
    vocab = teacher.config.vocab_size
    ids = torch.zeros(len(p_lens), width_p + keep, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (p, c) in enumerate(zip(p_lens, c_lens)):
        ids[r, width_p - p:width_p + c] = torch.randint(1, vocab, (p + c,), generator=g)
        mask[r, width_p - p:width_p + c] = 1
    padfree = []
    real = logprobs_module._padfree_selected
    monkeypatch.setattr(logprobs_module, "_padfree_selected",
                        lambda *a, **kw: (out := real(*a, **kw)) is not None and padfree.append(1) or out)
    part = TeacherPass(max_token_len=30, padding_free=True, pad_token_id=0, pad_to_multiple_of=None,
                       metrics=Metrics({"train": defaultdict(list)}))
    assert part.takes(teacher, ids, mask, keep, {})
    ours = part.hidden_states(teacher, ids, mask, keep, "train")
    assert part.last.num_forwards >= 3 and any(len(mb) > 1 for mb in part.last.micro_batches) and padfree
    with torch.no_grad():
        plain = teacher.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1][:, -keep:]
        valid = mask[:, -keep:].bool()
        got, want = (torch.log_softmax(teacher.lm_head(h[valid]) / 0.7, -1) for h in (ours, plain))
    assert got.shape == (sum(c_lens), vocab)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float(ours[~valid].abs().max()) == 0.0
    with pytest.raises(InputError, match="ref_log_prob_max_token_len_per_device=17 .* longest sample"):
        TeacherPass(max_token_len=17, padding_free=True, pad_token_id=0, pad_to_multiple_of=None,
                    metrics=part.metrics).hidden_states(teacher, ids, mask, keep, "train")


@pytest.fixture
def gloo_world_of_one():
    """A one-process gloo group (FSDP2's ``fully_shard`` needs one), destroyed after."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.fast
def test_an_fsdp2_teacher_runs_our_pass_and_gives_the_plain_teachers_loss(teacher_path, gloo_world_of_one,
                                                                         tmp_path):
    """The teacher sharded by FSDP2 (``fully_shard`` per decoder layer and at the root, as accelerate's FSDP2 prepares
    it; a one-process gloo group: accelerate cannot run FSDP on a CPU): TRL's loss calls the teacher's backbone
    inside the teacher's own forward, and there our pass runs (padding-free rows, a 12-token budget: several
    forwards), not TRL's padded fallback; the loss and every student gradient equal those with the plain teacher
    (1e-5), without and with a tool mask. Mutation tried: ``lean_parts`` refusing FSDP whatever ``in_forward`` (the
    fallback of before) -> our pass does not run -> fails."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from trl_nrollout.builtin import digits_dataset, resolve_model
    from trl_nrollout.passes.distributed import is_fsdp
    from trl_nrollout.trainer.distillation import NRolloutDistillationTrainer

    settings = dict(beta=0.5, temperature=0.7, max_completion_length=6, per_device_train_batch_size=3, seed=1,
                    ref_log_prob_max_token_len_per_device=12, **BASE)
    ours = NRolloutDistillationTrainer(resolve_model("builtin:tiny-qwen2"), teacher_model=teacher_path,
                                       train_dataset=digits_dataset(6),
                                       args=NRolloutDistillationConfig(output_dir=str(tmp_path), rollout_backend="hf",
                                                                       **settings))
    sharded = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    assert is_fsdp(sharded)
    plain_teacher = ours.teacher_model
    vocab = ours.model.config.vocab_size
    for tools in (False, True):
        batch = _batch(vocab, tools)
        ours.teacher_model = plain_teacher
        loss_p, grads_p = _loss_and_grads(ours, batch)
        ours.teacher_model, ours.teacher_pass.last = sharded, None
        loss_s, grads_s = _loss_and_grads(ours, batch)
        assert ours.teacher_pass.last is not None and ours.teacher_pass.last.num_forwards > 1  # our pass ran
        torch.testing.assert_close(loss_s, loss_p, atol=1e-5, rtol=1e-5)
        assert grads_s.keys() == grads_p.keys() and len(grads_p) > 0
        for name, grad in grads_p.items():
            torch.testing.assert_close(grads_s[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def _bf16_checkpoint(source: str, out) -> str:
    """``source`` (a model folder) saved in bfloat16 in ``out``, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return str(out)


@pytest.mark.fast
def test_bf16_the_loss_and_gradients_are_trls(teacher_path, tmp_path):
    """A bf16 checkpoint (student and teacher, loaded in bfloat16) with ``bf16=True`` on CPU: the loss and every
    student gradient equal TRL's DistillationTrainer's under the same settings (bf16 tolerance: 1e-2), without and
    with a tool mask. Measured: in this direct ``compute_loss`` call (before ``train()`` prepares the student) neither
    the student's nor the teacher's forward runs under CPU autocast, in TRL's class as in ours; whether TRL's
    training step autocasts the teacher's forward is not checked here. Mutation: not tried (session time)."""
    from trl_nrollout.builtin import digits_dataset, resolve_model
    from trl_nrollout.trainer.distillation import NRolloutDistillationTrainer

    student = _bf16_checkpoint(resolve_model("builtin:tiny-qwen2"), tmp_path / "student")
    teacher = _bf16_checkpoint(teacher_path, tmp_path / "teacher")
    settings = dict(beta=0.5, temperature=0.7, max_completion_length=6, per_device_train_batch_size=3, seed=1,
                    model_init_kwargs={"dtype": "bfloat16"}, teacher_model_init_kwargs={"dtype": "bfloat16"},
                    **{**BASE, "bf16": True})  # (TRL loads a checkpoint in float32 unless told its dtype)
    theirs = DistillationTrainer(student, teacher_model=teacher, train_dataset=digits_dataset(6),
                                 args=DistillationConfig(output_dir=str(tmp_path / "trl"), **settings))
    ours = NRolloutDistillationTrainer(student, teacher_model=teacher, train_dataset=digits_dataset(6),
                                       args=NRolloutDistillationConfig(output_dir=str(tmp_path / "ours"),
                                                                       rollout_backend="hf", **settings))
    assert next(ours.model.parameters()).dtype == torch.bfloat16
    vocab = ours.model.config.vocab_size
    for tools in (False, True):
        batch = _batch(vocab, tools)
        results = []
        for trainer in (theirs, ours):
            with trainer.compute_loss_context_manager():
                results.append(_loss_and_grads(trainer, batch))
        (loss_t, grads_t), (loss_o, grads_o) = results
        assert math.isfinite(float(loss_t)) and float(loss_t) > 0
        torch.testing.assert_close(loss_o.float(), loss_t.float(), atol=1e-2, rtol=1e-2)
        assert grads_o.keys() == grads_t.keys() and len(grads_t) > 0
        for name, grad in grads_t.items():
            torch.testing.assert_close(grads_o[name].float(), grad.float(), atol=1e-2, rtol=1e-2, msg=name)


# ---------------------------------------------------------------------------------------------- our engine samples
@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """tests/assets/distill_train.py in one process (3 steps on our vLLM-CPU engine, 4 prompts a step, then LoRA)."""
    from tests.conftest import ROOT, run_cmd, torchrun

    out = tmp_path_factory.mktemp("distill_one")
    run_cmd([*torchrun(1), str(ROOT / "tests/assets/distill_train.py"), str(out)], timeout=600,
            env={"ACCELERATE_USE_CPU": None})
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.vllm
def test_the_student_samples_on_our_engine_which_follows_every_step(one_process):
    """tests/assets/distill_train.py: three optimizer steps (lr 5e-2, the student's weights move), the student
    sampled on our vLLM-CPU engine. At every engine call, the engine's log-prob of each sampled token equals the
    student's own (plain forward, temperature 0.8) within 1e-4: the completions come from the engine and its weights
    are the student's of that step; one call per step; the loss is finite; each step after the first logs the sync.
    Then a LoRA student with rollout_lora_sync='adapter' (same process): the engine serves the adapter and gets
    only the adapter's bytes after a step, and its log-probs still equal the PEFT student's.
    Mutation tried: the sampler's weight sync skipped -> the gap is 2.8 at step 1, 10 at step 2 -> fails."""
    result = one_process
    assert [c["step"] for c in result["calls"]] == [0, 1, 2] and result["engine_calls"] == {"train": 3}
    assert all(c["samples"] == 4 and c["same_tokens"] for c in result["calls"])
    # the teacher's pass in the loss (a 32-token budget: several forwards) equals a plain forward of the teacher
    assert len(result["teacher_forwards"]) == 3 and max(result["teacher_forwards"]) > 1
    assert result["teacher_gap"] < 1e-5
    assert max(c["gap"] for c in result["calls"]) < 1e-4
    assert result["moved"] > 1e-2 and result["synced_step"] == 2
    steps = [h for h in result["history"] if "loss" in h]
    assert len(steps) == 3 and all(math.isfinite(h["loss"]) for h in steps)
    assert [h["weight_sync/mb"] > 0 for h in steps[1:]] == [True, True] and "weight_sync/mb" not in steps[0]
    # a LoRA student (rollout_lora_sync='adapter'): the engine serves the adapter, which follows the student
    lora = result["lora"]
    assert lora["lora_sync"] == "adapter" and [c["step"] for c in lora["calls"]] == [0, 1]
    assert max(c["gap"] for c in lora["calls"]) < 1e-4 and lora["moved"] > 1e-3
    steps = [h for h in lora["history"] if "loss" in h]
    assert steps[1]["weight_sync/mb"] == pytest.approx(lora["adapter_bytes"] / 2**20)
    assert lora["adapter_bytes"] < lora["model_bytes"] / 10


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_two_processes_reproduce_one(mode, one_process, tmp_path):
    """The same 3 steps on 2 processes, 2 prompts each (DDP, or DeepSpeed ZeRO-3 on CPU over gloo: the student and
    TRL's teacher sharded, our engine's weights gathered in buckets), reproduce one process with 4: each sample's
    completion (the same seed per sample wherever it runs) and the engine's log-prob of every sampled token (the
    weights after each step: 1e-4), every step's loss (1e-5) and gradient norm (1e-4 relative). Mutation tried: the
    sampler's seeds from the rank's own index (``sample_offset=0``) -> rank 1 samples other completions -> fails.
    Measured (2 cores): DDP 13 s, ZeRO-3 72 s, the one-process run 32 s (shared with the test above)."""
    from tests.conftest import ACCELERATE_LAUNCH, ROOT, run_cmd

    head = ([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2"] if mode == "ddp" else
            [*ACCELERATE_LAUNCH, "--config_file", str(ROOT / "recipes/accelerate/zero3_cpu.yaml")])
    run_cmd([*head, str(ROOT / "tests/assets/distill_train.py"), str(tmp_path), "two", *(["zero3"] if mode == "zero3"
                                                                                          else [])], timeout=600)
    ranks = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    for got, one in zip(zip(*(r["calls"] for r in ranks), strict=True), one_process["calls"], strict=True):
        assert [c["step"] for c in got] == [one["step"]] * 2 and [c["samples"] for c in got] == [2, 2]
        assert got[0]["completions"] + got[1]["completions"] == one["completions"]
        for mine, want in zip(got[0]["logprobs"] + got[1]["logprobs"], one["logprobs"], strict=True):
            assert mine == pytest.approx(want, abs=1e-4)
    for rank in ranks:  # the teacher's pass (padding-free, budgeted, ZeRO-3: sharded) equals a plain forward
        assert len(rank["teacher_forwards"]) == 3 and rank["teacher_gap"] < 1e-5
    assert max(f for rank in ranks for f in rank["teacher_forwards"]) > 1
    if mode == "zero3":  # every rank as many forwards as the busiest (the parameters are gathered in each)
        assert ranks[0]["teacher_forwards"] == ranks[1]["teacher_forwards"]
    want = [h for h in one_process["history"] if "loss" in h]
    for rank in ranks:
        steps = [h for h in rank["history"] if "loss" in h]
        assert len(steps) == len(want) == 3
        for got, one in zip(steps, want, strict=True):
            assert got["loss"] == pytest.approx(one["loss"], abs=1e-5), (mode, got["step"])
            assert got["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4), (mode, got["step"])


@pytest.mark.fast
def test_tools_with_an_engine_context_below_the_models_are_refused(tmp_path):
    """TRL's tool loop keeps a tool result that fits the model's context, not the engine's: with tools and a smaller
    ``rollout_max_model_len`` a conversation could outgrow the engine mid-training, so the drop-in refuses it with
    the fix; without tools, or at the model's context, it runs. Mutation tried: the rule removed -> no refusal."""
    from trl_nrollout.trainer.distillation import engine_refusal

    args = cfg(tmp_path, rollout_backend="vllm", rollout_max_model_len=256)
    why = engine_refusal(args, is_vlm=False, tools=True, context=1024)
    assert why is not None and "rollout_max_model_len=256" in why and "(1024 tokens)" in why and "set it to 1024" in why
    assert engine_refusal(args, is_vlm=False, tools=False, context=1024) is None
    assert engine_refusal(cfg(tmp_path, rollout_backend="vllm", rollout_max_model_len=1024), is_vlm=False, tools=True,
                          context=1024) is None


@pytest.mark.fast
def test_the_engine_options_follow_grpos_rules(tmp_path):
    """The engine options the two configs share are checked by one function (config/checks.py
    ``check_engine_options``): a LoRA sync device with a fixed sync mode, a bad bucket size, a zero sequence cap are
    refused here as NRolloutConfig refuses them. Mutation tried: the call removed from the distillation config -> the
    device is accepted silently."""
    with pytest.raises(InputError, match=r"rollout_lora_sync_device='h100' prices rollout_lora_sync='auto'"):
        cfg(tmp_path, rollout_backend="vllm", rollout_lora_sync="merged", rollout_lora_sync_device="h100")
    with pytest.raises(InputError, match=r"weight_sync_bucket_mb=0 must be a whole number of MiB >= 1"):
        cfg(tmp_path, rollout_backend="vllm", weight_sync_bucket_mb=0)
    with pytest.raises(InputError, match=r"rollout_max_num_seqs=0 must be >= 1"):
        cfg(tmp_path, rollout_backend="vllm", rollout_max_num_seqs=0)
