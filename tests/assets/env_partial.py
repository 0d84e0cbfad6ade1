"""Run by tests/test_tools.py (in its process): ``environment_factory`` with ``rollout_partial=True``, tool episodes
request by request, one engine. A run of 3 steps saving at step 2, then a run resumed from that checkpoint.

argv: output folder. Writes ``result.json``: for each reward call (one per training step) and each sample trained,
the tool results in its messages, what its environment returned, the environment's identity and reset serial; the
reset serial reached at each reward call; both runs' log histories; the log lines of ``trl_nrollout``'s
partial-environment logger; the reset serial when the resumed run started.
"""

from __future__ import annotations

import json
import logging
import sys

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import TOOL_CALL_TOKEN, resolve_model, tool_dataset, tool_reward

RESETS = [0]  # resets so far, all environments together
CALLS: list[dict] = []  # per reward call: its step and samples


class IdEnv:
    """An environment whose tool returns the environment's own number, so a sample's messages tell which
    environment served its tool calls."""

    made = 0

    def __init__(self) -> None:
        IdEnv.made += 1
        self.ident = IdEnv.made
        self.returned: list[str] = []
        self.serial = 0

    def reset(self, **row) -> None:
        RESETS[0] += 1
        self.serial = RESETS[0]
        self.returned = []

    def lucky_number(self) -> str:
        """Returns today's lucky number.

        Returns:
            The lucky number, as digits.
        """
        self.returned.append(str(self.ident))
        return str(self.ident)


def pairing(completions, environments, trainer_state, **kwargs) -> list[float]:
    """Records, per sample, its tool results and its environment (what the test checks); rewards nothing."""
    CALLS.append({"step": trainer_state.global_step, "resets": RESETS[0], "samples": [
        {"results": [m["content"] for m in messages if m.get("role") == "tool"], "returned": list(env.returned),
         "ident": env.ident, "serial": env.serial} for messages, env in zip(completions, environments, strict=True)]})
    return [0.0] * len(completions)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def trainer(out: str, steps: int):
    from transformers import AutoTokenizer

    model = resolve_model("builtin:tiny-qwen2-tools")
    call = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(TOOL_CALL_TOKEN)
    args = NRolloutConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4, max_completion_length=40,
                          max_steps=steps, learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True,
                          bf16=False, save_strategy="steps", save_steps=2, seed=0, rollout_backend="vllm",
                          rollout_partial=True, rollout_multi_turn="requests", max_staleness=1,
                          generation_kwargs={"logit_bias": {call: 4.0}})
    return NRolloutGRPOTrainer(model=model, args=args, reward_funcs=[tool_reward, pairing],
                               train_dataset=tool_dataset(64), environment_factory=IdEnv)


def main(out: str) -> None:
    handler = Lines()
    logger = logging.getLogger("trl_nrollout.trainer.partial_envs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    full = trainer(f"{out}/full", 3)
    full.train()
    history = full.state.log_history
    calls = len(CALLS)
    resumed = trainer(f"{out}/resumed", 3)
    resets_at_resume = RESETS[0]
    resumed.train(resume_from_checkpoint=f"{out}/full/checkpoint-2")
    resumed.close()
    logger.removeHandler(handler)
    with open(f"{out}/result.json", "w") as fh:
        json.dump({"full": CALLS[:calls], "resumed": CALLS[calls:], "history": history,
                   "resumed_history": resumed.state.log_history, "lines": handler.lines,
                   "resets_at_resume": resets_at_resume}, fh)


if __name__ == "__main__":
    main(sys.argv[1])
