"""Run by tests/test_distill_dropin.py: NRolloutDistillationTrainer whose student samples on our vLLM engine, a few
optimizer steps. Every engine call is checked against the student as it is at that call: the engine's log-prob of
each sampled token (after temperature, as sampled) against a plain forward of the student on the same tokens. Every
call of the teacher's pass in the loss (padding-free, ``TEACHER_BUDGET`` tokens per forward) is checked against a
plain forward of the teacher on the same tokens (``teacher_gap``). Writes result.json.

    python distill_train.py OUT            # one process (the tests run it through the warm launcher)
    accelerate launch --multi_gpu --num_processes 2 distill_train.py OUT two
    accelerate launch --config_file recipes/accelerate/zero3_cpu.yaml distill_train.py OUT two zero3

Then, in the same process (the first trainer's engine closed), a LoRA student with rollout_lora_sync='adapter': the
engine serves the adapter, each step after the first sends the adapter alone (result.json's "lora").

``two``: the first run alone, on the same global batch split over the launch's processes (DDP or ZeRO-3: each rank
``4 / processes`` prompts per step); each rank writes ``result_rank<r>.json`` (its calls: sampled tokens and the
engine's log-probs of them, its log history), to compare with one process's.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_nrollout import NRolloutDistillationConfig, NRolloutDistillationTrainer
from trl_nrollout.builtin import digits_dataset, resolve_model

TEMPERATURE = 0.8
TEACHER_BUDGET = 32  # tokens per forward of the teacher's pass: two of these samples (<= 24 tokens) rarely share one


def perturbed_teacher(out: str) -> str:
    """The built-in tiny model with every weight moved by seeded noise (the student's tokenizer), saved in ``out``."""
    path = resolve_model("builtin:tiny-qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(f"{out}/teacher")
    AutoTokenizer.from_pretrained(path).save_pretrained(f"{out}/teacher")
    return f"{out}/teacher"


def sampled_gap(model, batch) -> float:
    """The largest |engine log-prob - the model's log-prob| over the sampled tokens of ``batch`` (a RolloutBatch)."""
    was = model.training
    model.eval()
    gap = 0.0
    with torch.no_grad():
        for prompt, completion, logps in zip(batch.prompt_ids, batch.completion_ids, batch.logprobs, strict=True):
            ids = torch.tensor([list(prompt) + list(completion)])
            logits = model(ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
            mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)
            gap = max(gap, float((mine - torch.tensor(logps)).abs().max()))
    model.train(was)
    return gap


def teacher_gap(plain, calls: list) -> float:
    """The largest |log-softmax difference| (over the vocabulary, at ``TEMPERATURE``) between the teacher's logits
    from our pass's hidden states and from a plain forward of the teacher (``plain``, a whole unprepared copy: TRL's
    padded call on the same tokens), over the valid completion positions of every recorded call."""
    gap = 0.0
    with torch.no_grad():
        for ids, mask, keep, hidden in calls:
            ref = plain.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1][:, -keep:]
            valid = mask[:, -keep:].bool()
            ours, theirs = (torch.log_softmax(plain.lm_head(h[valid]) / TEMPERATURE, -1) for h in (hidden, ref))
            gap = max(gap, float((ours - theirs).abs().max()))
    return gap


class Probe(NRolloutDistillationTrainer):
    """Records each engine call (the optimizer step, the gap to the student, the samples) and each call of the
    teacher's pass (TRL's tokens, our hidden states, the forwards it ran)."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.teacher_calls, self.teacher_forwards = [], [], []

    def _get_last_hidden_state(self, unwrapped_model, input_ids, attention_mask, logits_to_keep, **multimodal):
        out = super()._get_last_hidden_state(unwrapped_model, input_ids, attention_mask, logits_to_keep, **multimodal)
        if unwrapped_model is self.accelerator.unwrap_model(self.teacher_model):
            self.teacher_calls.append((input_ids.cpu(), attention_mask.cpu(), logits_to_keep, out.float().cpu()))
            self.teacher_forwards.append(self.teacher_pass.last.num_forwards)
        return out

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)
        batch = self.student_sampler.last
        student = self.accelerator.unwrap_model(self.model)
        self.calls.append({"step": self.state.global_step, "samples": len(out),
                           "same_tokens": [list(c) for c in batch.completion_ids] == out,
                           "gap": sampled_gap(student, batch), "completions": out,
                           "logprobs": [list(map(float, lp)) for lp in batch.logprobs]})
        return out


def run(out: str, teacher: str, **extra) -> dict:
    """Three steps (two with LoRA) of distillation, the engine's calls probed."""
    lora = extra.pop("peft_config", None)
    # before the config: under the launch's ZeRO-3 config a model loaded afterwards would be partitioned
    plain_teacher = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    settings = dict(output_dir=out, rollout_backend="vllm", per_device_train_batch_size=4, max_completion_length=8,
                    max_steps=2 if lora else 3, learning_rate=5e-2, temperature=TEMPERATURE, beta=0.5,
                    logging_steps=1, report_to="none", bf16=False, gradient_checkpointing=False, save_strategy="no",
                    seed=0, use_cpu=True, ref_log_prob_max_token_len_per_device=TEACHER_BUDGET)
    args = NRolloutDistillationConfig(**{**settings, **extra})
    trainer = Probe("builtin:tiny-qwen2", teacher_model=teacher, args=args, train_dataset=digits_dataset(32),
                    peft_config=lora)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = max((float((p.detach() - before[n]).abs().max()) for n, p in trainer.model.named_parameters()
                 if p.numel() and p.shape == before[n].shape), default=0.0)  # (ZeRO-3: this rank's shards are empty)
    result = {"calls": trainer.calls, "engine_calls": dict(trainer.student_sampler.calls),
              "history": trainer.state.log_history, "moved": moved, "synced_step": trainer.engine_setup.synced_step,
              "lora_sync": trainer.engine_setup.lora_sync(), "teacher_forwards": trainer.teacher_forwards,
              "teacher_gap": teacher_gap(plain_teacher, trainer.teacher_calls)}
    if lora is not None:
        from trl_nrollout.rollout.engines.weight_sync import adapter_bytes

        result["adapter_bytes"], result["model_bytes"] = adapter_bytes(trainer.accelerator.unwrap_model(trainer.model))
    trainer.close()
    return result


def two_processes(out: str, zero3: bool) -> None:
    """The first run on the launch's processes, the global batch (4 prompts a step) split over them (``zero3``:
    under the launch's DeepSpeed config, on CPU over gloo)."""
    import os

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # (the trainer sets up the process group)
    teacher = perturbed_teacher(f"{out}/rank{rank}")  # seeded: the same teacher on every rank
    result = run(out, teacher, per_device_train_batch_size=4 // world,
                 **(dict(use_cpu=False, ddp_backend="gloo") if zero3 else {}))
    with open(f"{out}/result_rank{rank}.json", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    from peft import LoraConfig

    out = sys.argv[1]
    if sys.argv[2:3] == ["two"]:
        two_processes(out, zero3=sys.argv[3:] == ["zero3"])
        sys.exit(0)
    teacher = perturbed_teacher(out)
    result = run(out, teacher)
    result["lora"] = run(f"{out}/lora", teacher, rollout_lora_sync="adapter", peft_config=LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    with open(f"{out}/result.json", "w") as f:
        json.dump(result, f)
