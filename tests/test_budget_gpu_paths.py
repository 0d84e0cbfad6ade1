"""The budgets' arithmetic on the paths that ran out of GPU memory (issue 62 items 3-5), checked on a CPU: the FSDP
log-prob pass's output head on the scored positions only, its own bytes per token in the budget, ZeRO-3's partitioned
parameters counted at their full size, FSDP's gradients reduce-scattered every micro batch."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ROOT, run_cmd, torchrun
from tests.dist.scored_head_dist import VocabWatch
from trl_nrollout.passes.budget import (
    frozen_weight_bytes,
    full_numel,
    logits_bytes_per_token,
    logprob_pass_tokens,
    sync_each_micro_batch,
    update_state_bytes,
)
from trl_nrollout.passes.logprobs import ScoredHead, compute_log_probs, plain_output_head
from trl_nrollout.plan.activations import (
    BUDGET_ROUNDING,
    DEFAULT_ACTIVATION_FRACTION,
    activation_bytes_per_token,
    default_update_token_budget,
)
from trl_nrollout.plan.cost import TRAIN_BYTES_PER_PARAM
from trl_nrollout.trainer.budgeted_update import (
    BudgetedMicroBatches,
    fsdp_gradients_each_micro_batch,
    resolve_update_budget,
)

GIB = 2**30
#: Qwen2.5-7B's config.json (the issue's model)
QWEN25_7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                 tie_word_embeddings=False)


def _tiny(**config):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, **config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().eval()


def _samples(n: int = 9, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (int(torch.randint(2, 16, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    prompts[4] = prompts[5] = prompts[3]
    completions = [torch.randint(3, 300, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n)]
    return prompts, completions


def _full_forward(model, prompts, completions):
    """One sample at a time, the whole logits, a float32 log-softmax: log-probs and entropies ``[B, C]``."""
    lp = torch.zeros(len(prompts), max(len(c) for c in completions))
    ent = torch.zeros_like(lp)
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(prompts, completions)):
            logp = torch.log_softmax(model(torch.tensor([p + c])).logits[0].float(), -1)
            for j, tok in enumerate(c):
                lp[i, j] = logp[len(p) + j - 1, tok]
                ent[i, j] = -(logp[len(p) + j - 1].exp() * logp[len(p) + j - 1]).sum()
    return lp, ent


# ---------------------------------------------------------------------------------------------- item 3: the head
@pytest.mark.parametrize("layout", [dict(micro_batch_size=4), dict(max_token_len=48, padding_free=True),
                                    dict(micro_batch_size=9, shared_prompts=True),
                                    dict(micro_batch_size=3, pad_side="left")],
                         ids=["plain", "padfree_budget", "shared_prompts", "left_padded"])
def test_the_models_own_forward_scores_through_the_head_on_scored_rows_only(layout):
    """The log-prob pass through the model's own forward (what FSDP runs; here ``lean_head=False`` on one process)
    never makes a tensor wider than one ``[chunk_rows, V]`` chunk of the vocabulary (the watch sees every
    operation's output), the head module itself runs on zero rows, and the log-probs, entropies and a sampler's
    support values equal a one-sample-at-a-time full forward's. Mutation: ``ScoredHead.of`` returning None (the
    whole logits, as before) -> the watch sees ``[rows, positions, V]`` logits and the bound fails."""
    model = _tiny()
    prompts, completions = _samples()
    ref_lp, ref_ent = _full_forward(model, prompts, completions)
    head_rows: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: head_rows.append(args[0][..., 0].numel()))
    top = lambda logits, targets: logits.max(-1).values  # noqa: E731 - a support function of the whole row
    try:
        with VocabWatch(320) as watch:
            got = compute_log_probs(model, prompts, completions, with_entropy=True, lean_head=False, chunk_rows=3,
                                    support=top, **layout)
    finally:
        hook.remove()
    assert 0 < watch.most <= 3 * 320, watch.most
    assert head_rows and set(head_rows) == {0}
    torch.testing.assert_close(got.logprobs, ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(got.entropy, ref_ent, atol=2e-5, rtol=0)
    with torch.no_grad():  # the support values: the largest logit at each predicting position
        for i, (p, c) in enumerate(zip(prompts, completions)):
            want = model(torch.tensor([p + c])).logits[0, len(p) - 1:len(p) + len(c) - 1].max(-1).values
            torch.testing.assert_close(got.support_log_mass[i, :len(c)], want, atol=2e-5, rtol=0)


def test_a_post_processed_head_keeps_the_whole_logits_and_says_so_in_the_budget():
    """Soft-capped or scaled logits are not a plain head's: the pass runs the model's whole forward (correct), and
    its logits count ``V (b + 4)`` bytes per token in its budget; a plain head counts none."""
    plain, capped = _tiny(), _tiny()
    capped.config.final_logit_softcapping = 30.0
    assert plain_output_head(plain) is plain.lm_head and plain_output_head(capped) is None
    assert ScoredHead.of(capped, None, torch.zeros(1, dtype=torch.long), temperature=1.0, chunk_rows=1,
                         with_entropy=False, support=None, fp32=False) is None
    assert logits_bytes_per_token(152064, 2, head_on_scored_rows=True) == 0
    assert logits_bytes_per_token(152064, 2, head_on_scored_rows=False) == 152064 * 6


def test_the_passes_budget_counts_their_own_bytes_per_token():
    """Qwen2.5-7B under FSDP on 8 x H100 (bf16, checkpointing, sleep mode): the update's default budget is tens of
    thousands of tokens, whose whole float32 + bf16 logits would take more than the device (the issue: ~71 GB in
    one micro batch). With the head on scored rows the passes keep the update's budget (their logits take a bounded
    chunk); with whole logits their own budget fits the logits too, and is below the update's. Mutation: the
    passes' budget ignoring ``logits_bytes`` (the update's) -> the whole-logits budget's bytes exceed the room."""
    memory, ranks = 80 * GIB, 8
    state = 7_615_616_512 * TRAIN_BYTES_PER_PARAM // ranks
    act = activation_bytes_per_token(QWEN25_7B, dtype_bytes=2, gradient_checkpointing=True)
    update = default_update_token_budget(QWEN25_7B, device_memory_bytes=memory, state_bytes_per_device=state,
                                         longest_sample=4096, gradient_checkpointing=True)
    assert 60_000 < update < 100_000
    assert update * logits_bytes_per_token(152064, 2, False) > 60 * GIB  # what the old pass held at that budget
    options = dict(room_bytes=memory - state, activation_bytes_per_token=act, longest_sample=4096,
                   fraction=DEFAULT_ACTIVATION_FRACTION, rounding=BUDGET_ROUNDING)
    assert logprob_pass_tokens(update, logits_bytes=0, **options) == update
    whole = logits_bytes_per_token(152064, 2, False)
    own = logprob_pass_tokens(update, logits_bytes=whole, **options)
    assert own < update and own % BUDGET_ROUNDING == 0
    assert own * (act + whole) <= DEFAULT_ACTIVATION_FRACTION * (memory - state)
    assert logprob_pass_tokens(update, logits_bytes=whole, **{**options, "room_bytes": GIB}) == 4096  # the floor
    assert logprob_pass_tokens(update, logits_bytes=whole, **{**options, "room_bytes": None}) == update  # a CPU


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp1_and_fsdp2_passes_never_build_whole_logits(tiny_model_path, tmp_path):
    """Two processes (torchrun, gloo, CPU) with the model sharded by plain torch FSDP1 and FSDP2 (the head's weight a
    shard outside the forward): in the plain, the token-budgeted padding-free and the shared-prompt layouts the
    largest vocabulary-wide tensor of the pass is one ``[chunk_rows, V]`` chunk, the head module runs on zero rows,
    and the log-probs equal the unsharded model's full forward; the control pass (the whole logits, as before the
    fix) makes ``[rows, positions, V]`` logits, so the watch would see them. Mutation: ``ScoredHead.of`` returning
    None -> every layout's largest tensor is the whole logits and the test fails."""
    run_cmd([*torchrun(2), str(ROOT / "tests/dist/scored_head_dist.py"), tiny_model_path, str(tmp_path)], timeout=300,
            env={"ACCELERATE_USE_CPU": None})
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        chunk_elements = res["chunk"] * res["vocab"]
        for mode in ("fsdp1", "fsdp2"):
            for layout in ("plain", "padfree_budget", "shared_prompts"):
                one = res["modes"][mode][layout]
                assert 0 < one["most_vocab_elements"] <= chunk_elements, (rank, mode, layout, one)
                assert one["head_calls"] >= 1 and one["head_module_rows"] == 0, (rank, mode, layout, one)
                assert one["max_abs_diff"] < 2e-5, (rank, mode, layout, one)
            control = res["modes"][mode]["control_whole_logits"]
            assert control["most_vocab_elements"] >= 5 * chunk_elements and control["max_abs_diff"] < 2e-5, control


# ---------------------------------------------------------------------------------------------- item 4: ZeRO-3
@pytest.fixture
def world_of_one():
    """A one-process gloo group (DeepSpeed's zero.Init and FSDP2 need one), destroyed after; DeepSpeed's own handle on
    it and accelerate's process state are put back as they were."""
    import deepspeed.comm.comm as ds_comm
    from accelerate.state import AcceleratorState, GradientState

    cdb = ds_comm.cdb
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
        ds_comm.cdb = cdb
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_a_zero3_partitioned_model_counts_its_full_size(world_of_one, monkeypatch):
    """A model built under DeepSpeed's ``zero.Init`` (what ``zero3_init_flag`` does before ``prepare``) has no local
    elements; the update's state counts its full size, the same as the unpartitioned model's. Mutation:
    ``full_numel`` returning ``p.numel()`` -> 0 parameters."""
    import deepspeed

    for key, value in dict(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", DS_ACCELERATOR="cpu").items():
        monkeypatch.setenv(key, value)
    # DeepSpeed's shared-memory all-reduce (a speed path of its CPU comm) loads through a ninja subprocess, which the
    # fast tier forbids: left out; the partitioning is DeepSpeed's own
    monkeypatch.setattr(sys.modules["deepspeed.comm.torch"], "build_shm_op", lambda: None)
    with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                  "zero_optimization": {"stage": 3}}):
        partitioned = _tiny()
    full = _tiny()
    assert sum(p.numel() for p in partitioned.parameters()) == 0  # really partitioned
    counted = update_state_bytes(partitioned.parameters(), processes=4, sharded=True)
    assert counted == update_state_bytes(full.parameters(), processes=4, sharded=True)
    assert counted[0] == sum(p.numel() for p in full.parameters()) > 0


class _Rules:
    """The forward rules the budget reads, without a trainer (a trainer would build a model and an engine):
    padding-free rows with varlen attention."""

    def padfree_allowed(self, model) -> bool:
        return True

    def rows_varlen(self, model) -> bool:
        return True


def _budget(model, accelerator, args):
    """The trainer's default budget for ``model`` on ``accelerator``, prompts of 1,024 tokens."""
    return resolve_update_budget(args, accelerator, model, _Rules(), fsdp=False, prompt_length=lambda: 1024)


def _budgeted(accelerator, args, fsdp: bool = False) -> BudgetedMicroBatches:
    """The budgeted update on what it reads of the trainer (no loss runs here)."""
    return BudgetedMicroBatches(args, accelerator, _Rules(), None, None, None, sp=None, pad_to_multiple_of=None,
                                fsdp=fsdp)


def _args(**kw):
    return SimpleNamespace(use_dynamic_bsz=True, ppo_max_token_len_per_device=None, rollout_ranks=0,
                           vllm_enable_sleep_mode=True, rollout_backend="vllm", vllm_gpu_memory_utilization=0.5,
                           max_completion_length=3072, gradient_checkpointing=True, bf16=True, fp16=False, **kw)


def _h100(monkeypatch):
    """An 80 GiB CUDA device as the trainer reads it (this machine has no GPU: its properties are the one stand-in)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    return torch.device("cuda", 0)


def _partitioned_7b(**extra):
    """Qwen2.5-7B on the meta device, each parameter left as ``zero.Init`` leaves it (no local elements, its size in
    ``ds_numel``)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**{**QWEN25_7B, **extra}), dtype=torch.bfloat16)
    sizes = {}
    for p in model.parameters():
        sizes[p] = p.numel()
        p.data = torch.empty(0, dtype=p.dtype, device="meta")
        p.ds_numel, p.ds_id = sizes[p], len(sizes)
    return model, sum(sizes.values())


def test_the_default_budget_under_zero3_is_the_full_models(monkeypatch):
    """Qwen2.5-7B partitioned at load under ZeRO-3 on 4 x H100 (bf16, checkpointing, sleep mode): the trainer's
    default budget is the one for the full model's states (about 60k tokens), not for none (about 94k); the passes
    keep it (a plain head), or less where the logits are soft-capped (whole logits). Mutation: the state counting
    ``p.numel()`` -> the budget for 0 parameters."""
    model, total = _partitioned_7b()
    assert total > 7e9 and sum(p.numel() for p in model.parameters()) == 0
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, num_processes=4, device=_h100(monkeypatch),
                                  is_main_process=True, state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
                                      zero_stage=3)), gradient_state=SimpleNamespace(plugin_kwargs={}))
    budget = _budget(model, accelerator, _args())
    state = total * TRAIN_BYTES_PER_PARAM // 4  # bf16 weights and gradients, fp32 master and Adam moments
    want = default_update_token_budget(QWEN25_7B, device_memory_bytes=80 * GIB, state_bytes_per_device=state,
                                       longest_sample=4096, gradient_checkpointing=True)
    none = default_update_token_budget(QWEN25_7B, device_memory_bytes=80 * GIB, state_bytes_per_device=0,
                                       longest_sample=4096, gradient_checkpointing=True)
    assert budget.tokens == want and not budget.explicit and 50_000 < want < 70_000 and none > 1.5 * want
    assert budget.passes == budget.tokens
    capped, _ = _partitioned_7b(final_logit_softcapping=30.0)
    lower = _budget(capped, accelerator, _args())
    assert lower.tokens == want and 4096 <= lower.passes < want


def test_the_default_budget_counts_the_reference_and_the_teacher(monkeypatch):
    """The same 7B policy under ZeRO-3 on 4 x H100 holding a frozen reference (a 7B copy) and a teacher (7B, its
    parameters left trainable as TRL leaves a teacher's): their bf16 weights, split over the 4 ranks, count in the
    states (weights only, however ``requires_grad`` is set), so the default budget is lower than the policy's alone.
    Mutation: ``frozen`` ignored by ``resolve_update_budget`` (the old behaviour) -> the budget is the policy's alone."""
    model, total = _partitioned_7b()
    reference, _ = _partitioned_7b()
    for p in reference.parameters():
        p.requires_grad_(False)
    teacher, _ = _partitioned_7b()
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, num_processes=4, device=_h100(monkeypatch),
                                  is_main_process=True, state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
                                      zero_stage=3)), gradient_state=SimpleNamespace(plugin_kwargs={}))
    alone = _budget(model, accelerator, _args())
    held = resolve_update_budget(_args(), accelerator, model, _Rules(), fsdp=False, prompt_length=lambda: 1024,
                                 frozen=[reference, teacher])
    state = total * TRAIN_BYTES_PER_PARAM // 4 + 2 * (total * 2 // 4)  # + two bf16 frozen copies, sharded
    want = default_update_token_budget(QWEN25_7B, device_memory_bytes=80 * GIB, state_bytes_per_device=state,
                                       longest_sample=4096, gradient_checkpointing=True)
    assert held.tokens == want < alone.tokens
    assert frozen_weight_bytes(teacher.parameters(), 4, sharded=True) == total * 2 // 4
    assert frozen_weight_bytes(teacher.parameters(), 4, sharded=False) == total * 2


# ---------------------------------------------------------------------------------------------- item 5: FSDP grads
def test_fsdp2_micro_batches_reduce_scatter_their_gradients_each(world_of_one, monkeypatch):
    """A budgeted micro batch that is not its micro step's last, on an FSDP2 model (plain ``fully_shard`` over a
    one-process gloo group; accelerate's FSDP2 mode cannot start on a CPU, so a CPU accelerator reports
    ``is_fsdp2`` and its own ``no_sync`` then calls ``set_requires_gradient_sync(False)`` as it does on GPUs): its
    backward reduce-scatters (a sharded gradient on every parameter, no unsharded gradient kept), and the Trainer's
    micro steps are told to do the same (accelerate's ``sync_each_batch``). Mutation: ``sync_each_micro_batch``
    returning False -> every parameter keeps its unsharded gradient and no sharded one."""
    from accelerate import Accelerator
    from torch.distributed.fsdp import fully_shard

    assert sync_each_micro_batch(True) and not sync_each_micro_batch(False)
    model = _tiny()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.train()
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(type(accelerator), "is_fsdp2", property(lambda self: True))
    monkeypatch.setitem(accelerator.gradient_state.plugin_kwargs, "sync_each_batch", False)
    budgeted = _budgeted(accelerator, _args(), fsdp=False)  # plain fully_shard: found from the parameters
    with budgeted.gradients_held(model):
        assert not accelerator.sync_gradients
        model(torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss.backward()
    assert accelerator.sync_gradients
    states = [m._get_fsdp_state() for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    params = [fp for s in states for g in s._fsdp_param_groups for fp in g.fsdp_params]
    assert params and all(fp.unsharded_accumulated_grad is None for fp in params)
    assert all(p.grad is not None for p in model.parameters())
    fsdp_gradients_each_micro_batch(accelerator, True)
    assert accelerator.gradient_state.plugin_kwargs["sync_each_batch"] is True


def test_full_numel_reads_ds_numel():
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_numel = 12
    assert full_numel(p) == 12 and full_numel(torch.nn.Parameter(torch.empty(3, 4))) == 12
