"""Token-budgeted micro batches for the update (``use_dynamic_bsz`` / ``ppo_max_token_len_per_device``).

The property: re-cutting an optimizer step's samples under a token budget changes how many forwards run and how
wide they are, never the gradient. Each case builds our trainer from a plain config on a tiny model, makes one
rollout's batch of 12 samples of long-tailed lengths (left-padded prompts of 2-9 tokens, completions of 0-20),
cuts it as TRL's loop does (two micro batches of 6, one optimizer step), and compares the summed gradients of the
count-based update with the budgeted one (several micro batches per micro step), for every TRL loss type, GSPO's
sequence ratio, the entropy bonus, and both forward layouts (padding-free rows and padded micro batches).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.trainer.utils import split_tensor_dict

import trl_nrollout.trainer.grpo as trainer_module
import trl_nrollout.trainer.update as update_module
from tests.conftest import save_tiny_model
from trl_nrollout import NRolloutGRPOTrainer
from trl_nrollout.builtin import digits_dataset, digits_reward
from trl_nrollout.config import NRolloutConfig
from trl_nrollout.config.trl_options import TRL_LOSS_TYPES
from trl_nrollout.errors import InputError
from trl_nrollout.passes.budget import BudgetedStep, concat_batches, sample_lengths, select_rows, slot_sizes
from trl_nrollout.passes.varlen import VARLEN_NAME

ROWS, PROMPT, COMPLETION = 12, 9, 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    return save_tiny_model(tmp_path_factory.mktemp("budget") / "model")


def _trainer(model_dir: str, tmp_path, monkeypatch, **options) -> NRolloutGRPOTrainer:
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    peft_config = options.pop("peft_config", None)
    args = NRolloutConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, num_generations=3,
                          gradient_accumulation_steps=2, steps_per_generation=2, max_completion_length=COMPLETION,
                          use_cpu=True, report_to="none", save_strategy="no", seed=1, temperature=0.9,
                          **{"bf16": False, **options})
    trainer = NRolloutGRPOTrainer(model=model_dir, reward_funcs=[digits_reward], args=args,
                                  train_dataset=digits_dataset(12), peft_config=peft_config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def _batch(trainer: NRolloutGRPOTrainer, seed: int) -> dict:
    """12 samples in TRL's layout: left-padded prompts, right-padded completions of long-tailed lengths, log-probs
    around the model's own so that ratios clip."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_len = torch.randint(2, PROMPT + 1, (ROWS,), generator=g)
    completion_len = torch.tensor([1, 20, 2, 0, 3, 17, 1, 5, 2, 20, 1, 4])
    prompt_mask = (torch.arange(PROMPT)[None] >= PROMPT - prompt_len[:, None]).long()
    prompt_ids = torch.randint(3, vocab, (ROWS, PROMPT), generator=g).masked_fill(prompt_mask == 0, 0)
    completion_mask = (torch.arange(COMPLETION)[None] < completion_len[:, None]).long()
    completion_ids = torch.randint(3, vocab, (ROWS, COMPLETION), generator=g).masked_fill(completion_mask == 0, 0)
    base = -2.0 + 0.1 * torch.randn(ROWS, COMPLETION, generator=g)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.randn(ROWS, COMPLETION, generator=g),
        "old_per_token_logps": base + 0.3 * torch.randn(ROWS, COMPLETION, generator=g),
        "sampling_per_token_logps": base + 0.4 * torch.randn(ROWS, COMPLETION, generator=g),
        "ref_per_token_logps": base + 0.3 * torch.randn(ROWS, COMPLETION, generator=g),
    }


def _grads(trainer, steps: list) -> tuple[float, list[torch.Tensor]]:
    """The optimizer step's loss and summed gradients over TRL's micro steps, each through the Trainer's own
    ``compute_loss`` then ``accelerator.backward`` (as ``training_step`` does)."""
    trainer.model.zero_grad()
    total = 0.0
    for inputs in steps:
        loss = trainer.compute_loss(trainer.model, inputs)
        trainer.accelerator.backward(loss)
        total += loss.item()
    return total, [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


CASES = [dict(loss_type=t) for t in sorted(TRL_LOSS_TYPES) if t != "vespo"] + [
    dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_neg=1.0),
    dict(loss_type="dapo", importance_sampling_level="sequence"),  # GSPO's sequence ratio
    dict(loss_type="bnpo", entropy_coef=0.1),  # the entropy bonus: a per-micro-batch mean, like bnpo
    dict(loss_type="dapo", beta=0.05),
]


@pytest.mark.parametrize("layout", ["padding_free", "varlen", "padded"])
@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_budgeted_micro_batches_give_the_count_based_gradient(options, layout, model_dir, tmp_path, monkeypatch):
    """``varlen``: the model loaded with ``attn_implementation="trl_nrollout_varlen"`` (padding-free rows without a
    mask, each sequence attending to itself by its boundaries; what CUDA runs through PyTorch's flash kernel).
    Mutations tried: each micro batch normalized by its own tokens (``agg_loss`` without ``row_tokens``) ->
    bnpo fails; the parts' losses summed without their backward (only the last part trained) -> every case fails;
    ``_gradients_held`` not restoring ``sync_gradients`` -> the next micro step's count differs; varlen attention
    over the whole row (one causal SDPA, the boundaries ignored) -> every varlen case fails."""
    extra = {"model_init_kwargs": {"attn_implementation": VARLEN_NAME}} if layout == "varlen" else {}
    trainer = _trainer(model_dir, tmp_path, monkeypatch, padding_free=layout != "padded",
                       shared_prompt_forward=False, ppo_max_token_len_per_device=40, **extra, **options)
    assert trainer.args.use_dynamic_bsz
    batch = _batch(trainer, seed=len(str(options)))
    chunks = trainer.policy_update.add_normalizers(split_tensor_dict(batch, 2), 2)
    plain_loss, plain = _grads(trainer, chunks)
    steps = trainer.budgeted_update.steps(trainer.model, chunks)
    assert len(steps) == 2 and all(isinstance(s, BudgetedStep) for s in steps)
    parts = [p for s in steps for p in s.parts]
    assert len(parts) > 2, "the budget must cut the step finer than TRL's two micro batches"
    assert all(sum(sample_lengths(p)) <= 40 if layout != "padded" else
               p["completion_ids"].shape[0] * max(sample_lengths(p)) <= 40 for p in parts)
    assert sorted(len(s) for s in steps) and sum(len(s) for s in steps) == ROWS
    rows = []
    real = update_module.pack_rows
    monkeypatch.setattr(update_module, "pack_rows", lambda *a, **kw: rows.append(kw["mask_dtype"]) or real(*a, **kw))
    budget_loss, budgeted = _grads(trainer, steps)
    assert bool(rows) == (layout != "padded")
    assert all((dtype is None) == (layout == "varlen") for dtype in rows), rows  # varlen rows carry no mask
    assert sum(g.abs().sum().item() for g in plain) > 1e-3, "a degenerate case tests nothing"
    assert trainer.accelerator.sync_gradients, "the micro step's boundary state is restored"
    assert abs(budget_loss - plain_loss) < 1e-5 * max(1.0, abs(plain_loss))
    for a, b in zip(budgeted, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_micro_batch_holds_its_own_width(model_dir, tmp_path, monkeypatch):
    """A selection is cut to its own longest prompt (left) and completion (right): a micro batch of short samples
    is not as wide as the step's longest. Mutation: keep the full width -> fails."""
    trainer = _trainer(model_dir, tmp_path, monkeypatch, ppo_max_token_len_per_device=40)
    batch = _batch(trainer, seed=3)
    short = [i for i, n in enumerate(batch["completion_mask"].sum(-1).tolist()) if 0 < n <= 3]
    part = select_rows(batch, short)
    assert part["completion_ids"].shape[1] == 3
    assert part["prompt_ids"].shape[1] == int(batch["prompt_mask"][short].sum(-1).max())
    assert torch.equal(part["completion_ids"], batch["completion_ids"][short][:, :3])
    assert torch.equal(part["prompt_mask"].sum(-1), batch["prompt_mask"][short].sum(-1))
    assert select_rows(batch, short, multiple_of=8)["completion_ids"].shape[1] == 8
    both = concat_batches([select_rows(batch, [0, 1]), select_rows(batch, [0, 1])])
    assert both["completion_ids"].shape[0] == 4


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16))
def test_slot_sizes_spread_the_micro_batches_over_the_micro_steps(count, slots):
    if count < slots:
        with pytest.raises(ValueError, match="cannot fill"):
            slot_sizes(count, slots)
        return
    sizes = slot_sizes(count, slots)
    assert sum(sizes) == count and len(sizes) == slots and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_dynamic_bsz_options_resolve_and_refuse(tmp_path):
    def cfg(**kw):
        return NRolloutConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)

    assert cfg().use_dynamic_bsz is False  # TRL's fields: per_device_train_batch_size counts, as in TRL
    assert cfg(train_batch_size=4, rollout_n=2).use_dynamic_bsz  # verl's, no micro batch: budgeted by default
    assert not cfg(train_batch_size=4, rollout_n=2, ppo_micro_batch_size_per_device=2).use_dynamic_bsz
    on = cfg(ppo_max_token_len_per_device=4096)
    assert on.use_dynamic_bsz and on.log_prob_max_token_len_per_device == 4096
    assert cfg(ppo_max_token_len_per_device=4096, log_prob_micro_batch_size_per_device=4) \
        .log_prob_max_token_len_per_device is None
    with pytest.raises(InputError, match=r"use_dynamic_bsz=False with ppo_max_token_len_per_device=4096"):
        cfg(use_dynamic_bsz=False, ppo_max_token_len_per_device=4096)
    with pytest.raises(InputError, match=r"ppo_max_token_len_per_device=0 must be >= 1"):
        cfg(ppo_max_token_len_per_device=0)


def test_the_default_budget_follows_the_model_and_never_refuses_a_sample(model_dir, tmp_path, monkeypatch):
    """``use_dynamic_bsz=True`` without a budget: the default of ``default_update_token_budget`` for this model on
    a CPU (16,384 tokens), the old-policy and reference passes take it, and a step with a longer sample raises it
    to that sample; a budget the user set refuses such a sample, naming the option. Mutation: the default not
    raised to the longest sample -> the 20,000-token step is refused."""
    from trl_nrollout.plan.activations import CPU_DEFAULT_TOKEN_BUDGET

    trainer = _trainer(model_dir, tmp_path, monkeypatch, use_dynamic_bsz=True)
    assert trainer.update_budget.tokens == CPU_DEFAULT_TOKEN_BUDGET and not trainer.update_budget.explicit
    assert trainer.layout.old_log_prob.max_token_len == trainer.layout.ref_log_prob.max_token_len == 16384
    assert trainer.budgeted_update.budget_for([30, 20_000]) == 20_000
    explicit = _trainer(model_dir, tmp_path / "explicit", monkeypatch, ppo_max_token_len_per_device=12)
    chunks = explicit.policy_update.add_normalizers(split_tensor_dict(_batch(explicit, seed=5), 2), 2)
    with pytest.raises(ValueError, match=r"ppo_max_token_len_per_device=12 is below the longest sample"):
        explicit.budgeted_update.steps(explicit.model, chunks)


@pytest.mark.parametrize("layout", ["padding_free", "varlen"])
@pytest.mark.parametrize("variant", ["lora", "bf16"])
def test_budgeted_gradients_with_lora_and_a_bf16_checkpoint(variant, layout, model_dir, tmp_path, monkeypatch):
    """The same equality through PEFT's LoRA forward (the adapters' gradients, fp32: 1e-4) and from a bf16 checkpoint
    trained with ``bf16=True`` (CPU autocast, as on a GPU; padding-free rows and budgeted micro batches round
    differently from the padded batch, so within bf16's tolerance: 2% of the gradient's norm), with masked rows and
    with varlen rows (``attn_implementation="trl_nrollout_varlen"``; the count-based side runs the padded batch
    through the same attention function, SDPA with the padding mask). Mutations: only the last micro batch of each
    micro step trained -> all fail; varlen attention over the whole row (the boundaries ignored) -> both varlen
    cases fail."""
    options: dict = {}
    if layout == "varlen":
        options["model_init_kwargs"] = {"attn_implementation": VARLEN_NAME}
    if variant == "lora":
        from peft import LoraConfig

        trainer = _trainer(model_dir, tmp_path, monkeypatch, ppo_max_token_len_per_device=40,
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  lora_dropout=0.0, init_lora_weights=False), **options)
    else:
        torch.manual_seed(0)
        bf16_dir = save_tiny_model(tmp_path / "bf16_model", dtype=torch.bfloat16)
        # the checkpoint's bf16 weights, not TRL's fp32 load
        options["model_init_kwargs"] = {**options.get("model_init_kwargs", {}), "dtype": "auto"}
        trainer = _trainer(bf16_dir, tmp_path, monkeypatch, ppo_max_token_len_per_device=40, bf16=True, **options)
        assert next(trainer.model.parameters()).dtype == torch.bfloat16
    assert trainer.forward_rules.rows_varlen(trainer.model) == (layout == "varlen")
    chunks = trainer.policy_update.add_normalizers(split_tensor_dict(_batch(trainer, seed=11), 2), 2)
    _, plain = _grads(trainer, chunks)
    steps = trainer.budgeted_update.steps(trainer.model, chunks)
    assert sum(len(s.parts) for s in steps) > 2
    rows = []
    real = update_module.pack_rows
    monkeypatch.setattr(update_module, "pack_rows", lambda *a, **kw: rows.append(kw["mask_dtype"]) or real(*a, **kw))
    _, budgeted = _grads(trainer, steps)
    assert rows and all((dtype is None) == (layout == "varlen") for dtype in rows), rows  # padding-free rows ran
    if variant == "lora":
        assert 0 < len(plain) < sum(1 for _ in trainer.model.parameters())  # the adapters only
        for a, b in zip(budgeted, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    else:
        flat_a = torch.cat([g.float().flatten() for g in budgeted])
        flat_b = torch.cat([g.float().flatten() for g in plain])
        assert flat_b.norm() > 0 and (flat_a - flat_b).norm() <= 0.02 * flat_b.norm()


def test_a_groups_samples_train_together_with_their_prompt_once(model_dir, tmp_path, monkeypatch):
    """Samples of one prompt (TRL's groups of ``num_generations``, shuffled across the rollout) land in one budgeted
    micro batch, whose rows then hold each prompt once (padding-free units), with the count-based gradient.
    Mutation: cut samples instead of groups (``_budget_items`` returning single samples) -> groups are split."""
    trainer = _trainer(model_dir, tmp_path, monkeypatch, ppo_max_token_len_per_device=120)
    batch = _batch(trainer, seed=21)
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(2))  # TRL shuffles before splitting
    for key in ("prompt_ids", "prompt_mask"):  # groups of 3 samples share a prompt (a long one: units pay)
        batch[key] = batch[key][torch.arange(ROWS) // 3 * 3][order]
    chunks = trainer.policy_update.add_normalizers(split_tensor_dict(batch, 2), 2)
    _, plain = _grads(trainer, chunks)
    steps = trainer.budgeted_update.steps(trainer.model, chunks)
    prompt_of = {tuple(r.tolist()) for r in batch["prompt_ids"]}
    for part in (p for s in steps for p in s.parts):
        keys = [tuple(r.tolist()) for r in torch.nn.functional.pad(part["prompt_ids"], (PROMPT - part[
            "prompt_ids"].shape[1], 0))]
        for key in set(keys):  # a group whose tokens fit the budget is whole in its micro batch
            assert keys.count(key) == 3 or key not in prompt_of, keys
    units = []
    real = update_module.pack_rows
    monkeypatch.setattr(update_module, "pack_rows", lambda *a, **kw: units.append(kw.get("units")) or real(*a, **kw))
    _, budgeted = _grads(trainer, steps)
    assert any(u for u in units), "a micro batch ran with each prompt once"
    for a, b in zip(budgeted, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_with_unequal_work_reproduce_one_padded_process(model_dir, tmp_path, monkeypatch):
    """The token-budgeted padding-free update in 2 processes (one launch: tests/dist/update_dist.py) under plain
    torch FSDP2 (``fully_shard`` on gloo, as test_logprobs.py runs it: accelerate cannot run FSDP on a CPU) with
    masked rows and with varlen rows, and under the trainer's DDP (``accelerator.prepare``) with varlen rows, each
    case a loss aggregation of its own (token-mean with the KL loss, Dr. GRPO's, GSPO's sequence ratio). The ranks'
    work differs (a rollout of 16 samples on rank 0, 8 on rank 1, two optimizer steps: in the first rank 0 needs 5
    micro batches under the budget, rank 1's 4 long samples 4): both run the busiest rank's count in each step
    (rank 1 one forward that weighs nothing), nothing hangs (FSDP2 gathers in every forward; the launch's timeout
    turns a hang into a failure), and the per-token log-probs, the loss and the gradients (summed over the two
    optimizer steps) equal one process training both ranks' samples count-based in the padded layout (fp32).
    Mutations tried: each rank its own count (``counts = torch.tensor(needs)`` for the busiest rank's in
    ``budgeted_update.steps``) -> the ranks' FSDP2 collectives no longer pair up (gloo: "collective mismatch") and the
    launch fails; the weightless forward weighing 1 (``loss_scale`` ignored in ``_part_loss``) -> the loss and the
    gradients differ; varlen attention over the whole row (the boundaries ignored) -> the varlen cases' log-probs
    differ; only the last micro batch of each micro step trained -> fails."""
    import json

    from tests.conftest import ACCELERATE_LAUNCH, ENV, ROOT, run_cmd
    from tests.dist.update_dist import CASES, CHUNKS, record_logps, trainer_options

    run_cmd([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2", str(ROOT / "tests/dist/update_dist.py"),
             model_dir, str(tmp_path)], timeout=300, env=ENV)
    # one process trains both ranks' samples: its count-based micro batch i holds both ranks' micro batch i (the
    # same optimizer steps, so the same normalizers)
    per_rank = [split_tensor_dict(torch.load(tmp_path / f"batch{r}.pt"), CHUNKS) for r in range(2)]
    union = [concat_batches([a, b]) for a, b in zip(*per_rank)]
    monkeypatch.setattr(trainer_module, "vllm_available", lambda: False)
    for case, (wrap, options) in CASES.items():
        ranks = [json.loads((tmp_path / f"{case}_rank{r}.json").read_text()) for r in range(2)]
        # as many forwards on both ranks, the busiest rank's count, though their own needs differed
        assert ranks[0]["parts_per_micro_step"] == ranks[1]["parts_per_micro_step"], (case, ranks)
        assert ranks[0]["forwards"] == ranks[1]["forwards"] == ranks[0]["micro_batches"] == 7, case
        assert all(r["micro_batches_least_rank"] == 6 for r in ranks), case  # rank 1 alone: 4 + 2
        assert [r["weightless_forwards"] for r in ranks] == [0, 1], case
        assert all(r["sync_gradients_restored"] for r in ranks)
        # padding-free rows ran, of the case's attention (masked rows pay on rank 0's mixed lengths only)
        layout = "varlen" if "varlen" in case else "mask"
        assert all(set(r["rows"]) <= {layout} for r in ranks) and ranks[0]["padfree_forwards"] >= 3, (case, ranks)
        assert layout == "mask" or ranks[1]["padfree_forwards"] >= 2, (case, ranks)
        if wrap == "fsdp2":
            assert all(r["local_numel"] < r["full_numel"] for r in ranks), case  # really sharded
        # one process, both ranks' samples, count-based micro batches, the padded layout
        ref_options = {k: v for k, v in options.items() if k != "model_init_kwargs"}
        args = NRolloutConfig(output_dir=str(tmp_path / f"{case}_ref"), padding_free=False,
                              **trainer_options(), **ref_options)
        ref = NRolloutGRPOTrainer(model=model_dir, reward_funcs=[digits_reward], args=args,
                                  train_dataset=digits_dataset(8))
        ref.model.train()
        ref.current_gradient_accumulation_steps = 2
        assert not ref.args.use_dynamic_bsz
        logps, _ = record_logps(ref)
        ref_loss, _ = _grads(ref, ref.policy_update.add_normalizers([dict(c) for c in union], 2))
        ref_grads = {n: p.grad for n, p in ref.model.named_parameters() if p.grad is not None}
        got = {**ranks[0]["logps"], **ranks[1]["logps"]}
        assert sorted(got, key=int) == [str(k) for k in sorted(logps)] and len(got) == 24, case
        worst = max((torch.tensor(got[str(k)]) - torch.tensor(v)).abs().max().item() for k, v in logps.items() if v)
        assert worst < 1e-5, (case, worst)
        # each rank's loss is over its own tokens, normalized by the totals over the ranks: their mean is one's
        loss = sum(r["loss"] for r in ranks) / 2
        assert abs(loss - ref_loss) < 1e-5 * max(1.0, abs(ref_loss)), (case, loss, ref_loss)
        grads = torch.load(tmp_path / f"{case}_grads.pt")
        assert grads.keys() == ref_grads.keys() and sum(g.abs().sum() for g in ref_grads.values()) > 1e-3
        for name, g in grads.items():  # within 1e-5 of each tensor's largest entry
            want = ref_grads[name]
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                       msg=lambda m, case=case, name=name: f"{case} {name}: {m}")
