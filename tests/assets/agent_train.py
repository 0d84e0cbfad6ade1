"""Run by tests/test_agents.py: NRolloutGRPOTrainer(agent=...) with an async openai-client agent that calls the built-in
tool when the model asks (up to 3 calls per episode, each call extending the last). Writes agent_run.json from every
rank (its endpoint's port, its episodes' keys and outcomes) and the log history from rank 0.

    accelerate launch --multi_gpu --num_processes 2 [--config_file zero3_cpu.yaml] agent_train.py OUT [tp2]
"""

import json
import sys

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import lucky_number, tool_dataset

TOOLS = [{"type": "function", "function": {"name": "lucky_number", "description": "Returns today's lucky number.",
                                           "parameters": {"type": "object", "properties": {}}}}]
SEEN: list = []


async def agent(client, row):
    """Ask, run the tool calls the model makes, ask again (at most 3 calls); reward 1 when a tool ran."""
    messages, ran = list(row["prompt"]), 0
    for _ in range(3):
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                      max_tokens=12)).choices[0].message
        SEEN.append(str(client.base_url))
        if not reply.tool_calls:
            break
        messages = messages + [reply.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": c.id, "name": c.function.name, "content": lucky_number()}
            for c in reply.tool_calls]
        ran += 1
    return float(ran > 0)


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
        json.dump({"port": trainer._agent_endpoint.port, "urls": sorted(set(SEEN)), "calls": len(SEEN),
                   "history": trainer.state.log_history if rank == 0 else None}, f)
    trainer.close()
