"""Run by tests/test_agents.py: NRolloutGRPOTrainer(agent=...) with an async openai-client agent that calls the built-in
tool when the model asks (up to 3 calls per episode, each call extending the last), rank 1's episodes ending with a
call in a new conversation (split). Writes agent_run.json from every rank (its endpoint's port, the base URLs and
number of its episodes) and the log history from rank 0.

    accelerate launch --multi_gpu --num_processes 2 [--config_file zero3_cpu.yaml] agent_train.py OUT [tp2]
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from axes_combinations import tool_agent  # noqa: E402 - the tool loop the combinations run

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer  # noqa: E402
from trl_nrollout.builtin import tool_dataset  # noqa: E402

SEEN: list = []


async def agent(client, row):
    """The tool loop (calls of at most 12 tokens); on rank 1 one more call, in a new conversation (an edited
    history): rank 1's episodes split, so it trains more rows than rank 0."""
    SEEN.append(str(client.base_url))
    reward = await tool_agent(client, row, max_tokens=12)
    if os.environ.get("RANK") == "1":
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Summarize."}],
                                             max_tokens=12)
    return reward


if __name__ == "__main__":
    out = sys.argv[1]
    tp = 2 if "tp2" in sys.argv[2:] else 1  # one engine over both ranks
    args = NRolloutConfig(output_dir=out, train_batch_size=4, rollout_n=4, max_completion_length=64, max_steps=2,
                          learning_rate=1e-3, logging_steps=1, report_to="none", bf16=False, save_strategy="no",
                          seed=0, use_cpu=True, rollout_tp_size=tp)
    trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2-tools", args=args, train_dataset=tool_dataset(32), agent=agent)
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(f"{out}/agent_run_{rank}.json", "w") as f:
        json.dump({"port": trainer.collector.kind.endpoint.port, "urls": sorted(set(SEEN)), "episodes": len(SEEN),
                   "history": trainer.state.log_history if rank == 0 else None}, f)
    trainer.close()
