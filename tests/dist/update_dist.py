"""Run by tests/test_budget.py under a 2-process launch (gloo, CPU): the token-budgeted padding-free policy update
of :class:`~trl_nrollout.NRolloutGRPOTrainer` on ranks with unequal work, under plain torch FSDP2 (``fully_shard``:
accelerate cannot run FSDP on a CPU) and under the trainer's own DDP (``accelerator.prepare``).

argv: model folder, output folder. Each rank builds one trainer per case (its model sharded or wrapped), makes its
own rollout (:data:`COMPLETIONS`: 16 samples on rank 0, 8 on rank 1), splits it into TRL's four count-based micro
batches (two optimizer steps of two), attaches the mini batches' normalizers (all ranks), re-cuts each optimizer
step under a token budget of 40 (``budgeted_update.steps``: the busiest rank's count of micro batches on every rank;
rank 1 makes up the difference with a forward that weighs nothing) and runs the Trainer's ``compute_loss`` +
``accelerator.backward`` for each micro step, as ``training_step`` does (no optimizer step: the gradients of both
optimizer steps add up). The padding-free forwards run either masked rows (a block-diagonal mask) or varlen rows
(``attn_implementation="trl_nrollout_varlen"``: one SDPA per sequence on a CPU).

Each rank writes ``batch{rank}.pt`` (its samples, tagged ``sample_id``) and, per case, ``{case}_rank{rank}.json``
(its micro-batch counts, its loss, the per-token log-probs each real sample was trained with); rank 0 writes
``{case}_grads.pt``, the full gradients after the step (FSDP2: gathered from the shards). The test compares them
with one process training the union of both ranks' samples in the padded layout (count-based).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from trl.trainer.utils import split_tensor_dict

import trl_nrollout.trainer.grpo as trainer_module
import trl_nrollout.trainer.update as update_module
from trl_nrollout import NRolloutGRPOTrainer
from trl_nrollout.builtin import digits_dataset, digits_reward
from trl_nrollout.config import NRolloutConfig
from trl_nrollout.passes.varlen import VARLEN_NAME

PROMPT, COMPLETION, BUDGET = 9, 20, 40
CHUNKS = 4  # TRL's steps_per_generation: the rollout's count-based micro batches, 2 per optimizer step

#: case -> (how the model is wrapped, the trainer's options); each a loss aggregation of its own
CASES: dict[str, tuple[str, dict]] = {
    "fsdp2_masked": ("fsdp2", dict(loss_type="dapo", beta=0.05)),  # token-mean, with the KL loss
    "fsdp2_varlen": ("fsdp2", dict(loss_type="dr_grpo", model_init_kwargs={"attn_implementation": VARLEN_NAME})),
    # GSPO: the sequence ratio, each sequence's token mean
    "ddp_varlen": ("ddp", dict(loss_type="grpo", importance_sampling_level="sequence",
                               model_init_kwargs={"attn_implementation": VARLEN_NAME})),
}


def trainer_options() -> dict:
    """The options every case shares (the one-process reference takes them too)."""
    return dict(per_device_train_batch_size=6, num_generations=3, gradient_accumulation_steps=2,
                steps_per_generation=CHUNKS, max_completion_length=COMPLETION, use_cpu=True, report_to="none",
                save_strategy="no", seed=1, temperature=0.9, bf16=False, shared_prompt_forward=False)


#: each rank's completion lengths, by optimizer step (TRL's micro batches: 4 per rollout, 2 per optimizer step).
#: Step 1: rank 0's 8 samples need 5 micro batches of 40 tokens, rank 1's 4 long ones 4 (one each): rank 1 runs
#: its 4 and one that weighs nothing. Step 2: short samples, 2 micro batches each (padding-free rows on both ranks).
COMPLETIONS = {0: [[20, 3, 18, 19, 17, 4, 19, 1], [1, 0, 3, 2, 5, 1, 4, 2]],
               1: [[20, 17, 19, 20], [16, 1, 14, 2]]}


def rank_batch(rank: int, vocab: int) -> dict:
    """A rollout's samples on ``rank`` (:data:`COMPLETIONS`; rank 1's prompts are 9 tokens, rank 0's 2-9), in TRL's
    layout (left-padded prompts, right-padded completions), log-probs around the model's own so that ratios clip;
    ``sample_id`` ``[B]`` names each sample across ranks."""
    g = torch.Generator().manual_seed(300 + rank)
    completion_len = torch.tensor([n for step in COMPLETIONS[rank] for n in step])
    rows = len(completion_len)
    prompt_len = torch.randint(2, PROMPT + 1, (rows,), generator=g) if rank == 0 else torch.full((rows,), PROMPT)
    prompt_mask = (torch.arange(PROMPT)[None] >= PROMPT - prompt_len[:, None]).long()
    prompt_ids = torch.randint(3, vocab, (rows, PROMPT), generator=g).masked_fill(prompt_mask == 0, 0)
    completion_mask = (torch.arange(COMPLETION)[None] < completion_len[:, None]).long()
    completion_ids = torch.randint(3, vocab, (rows, COMPLETION), generator=g).masked_fill(completion_mask == 0, 0)
    base = -2.0 + 0.1 * torch.randn(rows, COMPLETION, generator=g)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.randn(rows, COMPLETION, generator=g),
        "old_per_token_logps": base + 0.3 * torch.randn(rows, COMPLETION, generator=g),
        "sampling_per_token_logps": base + 0.4 * torch.randn(rows, COMPLETION, generator=g),
        "ref_per_token_logps": base + 0.3 * torch.randn(rows, COMPLETION, generator=g),
        "sample_id": torch.arange(rows) + 100 * rank,
    }


def record_logps(trainer) -> tuple[dict[int, list[float]], list[float]]:
    """Spy on the trainer's update: the per-token log-probs ``[C_i]`` of every real sample its micro batches train
    (by ``sample_id``; the forwards that weigh nothing, ``loss_scale=0``, are counted, not recorded)."""
    logps: dict[int, list[float]] = {}
    scales: list[float] = []
    update = trainer.policy_update  # the part whose loss every micro batch runs
    inner_loss, inner_logps = update.loss, update.policy_logps
    current: dict = {}

    def compute_loss(model, inputs, step):
        current["inputs"] = inputs
        scales.append(float(inputs.get("loss_scale", 1.0)))
        return inner_loss(model, inputs, step)

    def policy_logps(model, input_ids, attention_mask, logits_to_keep, mm=None):
        out = inner_logps(model, input_ids, attention_mask, logits_to_keep, mm)
        inputs = current["inputs"]
        if inputs.get("loss_scale", 1.0) != 0.0:
            for row, sid in enumerate(inputs["sample_id"].tolist()):
                n = int(inputs["completion_mask"][row].sum())
                logps[sid] = out[0][row, :n].detach().float().tolist()
        return out

    update.loss, update.policy_logps = compute_loss, policy_logps
    return logps, scales


def main() -> None:
    model_dir, out_dir = sys.argv[1:3]
    trainer_module.vllm_available = lambda: False  # the HF engine: no rollout runs here anyway
    rows: list[str] = []  # each padding-free forward's attention: "mask" (block-diagonal) or "varlen"
    pack_rows = update_module.pack_rows
    update_module.pack_rows = lambda *a, **kw: rows.append("varlen" if kw["mask_dtype"] is None else "mask") or \
        pack_rows(*a, **kw)
    for case, (wrap, options) in CASES.items():
        args = NRolloutConfig(output_dir=os.path.join(out_dir, case), ppo_max_token_len_per_device=BUDGET,
                              **trainer_options(), **options)
        trainer = NRolloutGRPOTrainer(model=model_dir, reward_funcs=[digits_reward], args=args,
                                      train_dataset=digits_dataset(8))
        acc = trainer.accelerator
        rank, world = acc.process_index, acc.num_processes
        assert world == 2 and trainer.args.use_dynamic_bsz
        full = sum(p.numel() for p in trainer.model.parameters())
        if wrap == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in trainer.model.model.layers:
                fully_shard(layer)
            fully_shard(trainer.model)
            model = trainer.model
            local = sum(p.to_local().numel() for p in model.parameters())
        else:
            model = acc.prepare_model(trainer.model)
            assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
            local = sum(p.numel() for p in model.parameters())
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2
        batch = rank_batch(rank, trainer.model.config.vocab_size)
        if case == next(iter(CASES)):
            torch.save(batch, os.path.join(out_dir, f"batch{rank}.pt"))
        chunks = trainer.policy_update.add_normalizers(split_tensor_dict(batch, CHUNKS), 2)
        steps = trainer.budgeted_update.steps(trainer.model, chunks)
        logps, scales = record_logps(trainer)
        rows.clear()
        model.zero_grad()
        loss = 0.0
        for inputs in steps:  # as training_step: the Trainer's compute_loss, then backward
            step_loss = trainer.compute_loss(model, inputs)
            acc.backward(step_loss)
            loss += step_loss.item()
        grads = {}
        for name, p in model.named_parameters():  # every rank calls full_tensor (a collective), in the same order
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name.removeprefix("module.")] = g.detach().clone()
        metrics = trainer._metrics["train"]
        result = {
            "rank": rank, "world": world, "case": case, "full_numel": full, "local_numel": local,
            "rows_per_micro_step": [len(s) for s in steps], "parts_per_micro_step": [len(s.parts) for s in steps],
            "forwards": len(scales), "weightless_forwards": sum(s == 0.0 for s in scales),
            "micro_batches": metrics["update/micro_batches"][-1],
            "micro_batches_least_rank": metrics["update/micro_batches_least_rank"][-1],
            "rows": sorted(set(rows)), "padfree_forwards": len(rows), "loss": loss, "logps": {str(k): v for k, v in logps.items()},
            "sync_gradients_restored": bool(acc.sync_gradients),
        }
        with open(os.path.join(out_dir, f"{case}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
        if rank == 0:
            torch.save(grads, os.path.join(out_dir, f"{case}_grads.pt"))
        acc.wait_for_everyone()


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # a clean exit: no rank left with live gloo threads
        torch.distributed.destroy_process_group()
