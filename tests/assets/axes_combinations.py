"""Run by tests/test_combinations.py: one trainer per combination of the rollout's axes, built and trained (2 steps)
one after another in this process (the pytest process, colocated engines; main() also serves as a rollout rank's
script, building its worker per combination, but no test launches it so: rollout-rank combinations are covered by
the launches tests/test_combinations.py names).

argv: output folder, JSON list of combinations ``{"name", "episode", "options"[, "slow_rank"]}`` (``options``:
NRolloutConfig fields; ``episode``: one of :data:`EPISODES`; ``slow_rank``: that rank's engine steps slowed;
``resume``: a checkpoint to resume from). Writes ``<name>.json`` per combination (trainer rank 0): for each
training step, the Round ``_assign`` received (each sample's prompt and completion ids, tool mask, whether its
image tensors came along; for tool episodes the text of the masked and the trained tokens) and the log history.
"""

from __future__ import annotations

import json
import sys

from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
from trl_nrollout.builtin import (
    TOOL_CALL_TOKEN,
    colour_reward,
    digits_dataset,
    digits_reward,
    image_dataset,
    lucky_number,
    resolve_model,
    tool_dataset,
    tool_reward,
)
from trl_nrollout.rollout.types import SamplingOptions
from trl_nrollout.trainer.agents import agent_reward

#: the episode kinds (tests/test_combinations.py CHOICES) and the model each runs on
EPISODES = {"one completion": "builtin:tiny-qwen2", "tools": "builtin:tiny-qwen2-tools",
            "environment": "builtin:tiny-qwen2-tools", "custom": "builtin:tiny-qwen2", "images": "builtin:tiny-idefics3",
            "agent": "builtin:tiny-qwen2-tools", "tool images": "builtin:tiny-idefics3-tools"}
#: the built-in tool as the OpenAI API describes it (what an agent sends as ``tools``)
TOOL_SCHEMA = [{"type": "function", "function": {"name": "lucky_number", "description": "Returns today's lucky number.",
                                                 "parameters": {"type": "object", "properties": {}}}}]


async def tool_agent(client, row, tools=(), max_tokens: int | None = None) -> dict:
    """An agent through the endpoint (``agent=``): asks, runs the built-in tool when the model calls it (the trainer's
    ``tools=`` where it has them: ``tools``), asks again (at most 3 calls, each extending the last, each of at most
    ``max_tokens``); reward 1 when the tool ran, the question it was asked (``asked``: what :func:`agent_check`
    compares with the sample it scores) and how many tools the trainer gave it (``given``)."""
    by_name = {t.__name__: t for t in tools}
    messages, ran = list(row["prompt"]), 0
    limit = {"max_tokens": max_tokens} if max_tokens else {}
    for _ in range(3):
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOL_SCHEMA,
                                                      **limit)).choices[0].message
        if not reply.tool_calls:
            break
        messages = messages + [reply.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": c.id, "name": c.function.name,
             "content": by_name.get(c.function.name, lucky_number)()}
            for c in reply.tool_calls]
        ran += 1
    return {"reward": float(ran > 0), "asked": row["prompt"][-1]["content"], "given": len(tools)}


def tools_given(prompts: list, given: list, **kwargs) -> list[float]:
    """Raises unless every scored agent got the trainer's tools= (agent= with tools=); a reward function, it scores
    0."""
    if any(g is not None and g != 1 for g in given):
        raise ValueError(f"an agent did not get the trainer's tools: {given}")
    return [0.0] * len(prompts)


def agent_check(prompts: list, asked: list, **kwargs) -> list[float]:
    """Raises unless each sample's agent result is its own episode's (its agent was asked the sample's question:
    an episode run on another rank came home to its place; None: the agent raised, e.g. past the token budget, an
    unscored episode) and some are; a reward function, it scores 0."""
    if all(question is None for question in asked):
        raise ValueError("no agent returned a result")
    for prompt, question in zip(prompts, asked, strict=True):
        if question is not None and question != prompt[-1]["content"]:
            raise ValueError(f"a sample scored with another episode's result: asked {question!r}, the sample's "
                             f"prompt {prompt[-1]['content']!r}")
    return [0.0] * len(prompts)


class LuckyEnv:
    """A TRL environment: reset per episode, one tool (its public method), its own reward."""

    def reset(self, **row) -> None:
        self.calls = 0
        self.prompt = row["prompt"][-1]["content"]  # what env_check compares with the sample it scores

    def lucky_number(self) -> str:
        """Returns today's lucky number.

        Returns:
            The lucky number, as digits.
        """
        self.calls += 1
        return "7"

    def get_reward(self) -> float:
        return float(self.calls > 0)


def env_check(prompts: list, completions: list, environments: list, **kwargs) -> list[float]:
    """Raises unless each sample's environment is its own episode's: reset with the sample's prompt, and called at
    least once per tool result the sample holds (a reward function; it scores 0)."""
    for prompt, messages, env in zip(prompts, completions, environments, strict=True):
        results = sum(isinstance(m, dict) and m.get("role") == "tool" for m in messages)
        if env.prompt != prompt[-1]["content"] or env.calls < results:
            raise ValueError(f"a sample scored with another episode's environment: reset with {env.prompt!r}, "
                             f"{env.calls} calls; the sample's prompt {prompt[-1]['content']!r}, {results} results")
    return [0.0] * len(prompts)


CALLS: list[int] = []  # how many prompts each rollout_func call got
HELD = {"released": None}  # a partial run's first group on rank 0: whether the step's end released it


def custom_rollout(prompts: list, trainer) -> dict:
    """A user's rollout on the trainer's engine (one sample per entry: each prompt comes n times), the last token of
    each sample masked (``env_mask``). With rollout_partial the first group rank 0 runs waits until step 1 has ended
    (at most 30 s) before it generates, its first token masked too: a partial step must not wait for it."""
    import time

    CALLS.append(len(prompts))
    held = (trainer.args.rollout_partial and trainer.accelerator.process_index == 0 and HELD["released"] is None
            and trainer.state.global_step == 0 and not getattr(trainer, "is_rollout_rank", False))
    if held:
        HELD["released"] = False
        deadline = time.monotonic() + 30
        while trainer.state.global_step < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        HELD["released"] = trainer.state.global_step >= 1
    ids = [trainer.processing_class(text=p)["input_ids"] for p in prompts]
    batch = trainer.rollout_engine.generate_expanded(ids, 1, SamplingOptions(max_tokens=8, temperature=1.0))
    return {"prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids, "logprobs": batch.logprobs,
            "env_mask": [[0 if held and i == 0 else 1 for i in range(len(c) - 1)] + [0] for c in batch.completion_ids]}


def show_picture() -> list:
    """Shows the picture to describe.

    Returns:
        The picture and a caption.
    """
    from trl_nrollout.builtin import colour_image

    # the same picture at every call: a sample's images do not depend on which process ran its tool, or when
    return [{"type": "image", "image": colour_image("red", seed=7)}, {"type": "text", "text": "here"}]


def bias_toward_the_picture_call(model, tokenizer, scale: float = 3.0) -> None:
    """Make ``model`` (the built-in tool-calling VLM) call ``show_picture`` often: the call token's tied embedding
    along the mean final hidden state (a logit bias would move vLLM's log-probs), ``scale`` times its inverse norm
    (the call token's logit there). In place, no grad."""
    import torch

    from trl_nrollout.builtin import PICTURE_CALL_TOKEN

    call = tokenizer.convert_tokens_to_ids(PICTURE_CALL_TOKEN)
    with torch.no_grad():
        ids = torch.tensor([tokenizer("user: write a number").input_ids])
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        direction = model.model.text_model.norm(hidden).mean(0)
        model.get_input_embeddings().weight[call] = scale * direction / direction.norm() ** 2


def bias_the_picture_call(trainer, model: str) -> None:
    """:func:`bias_toward_the_picture_call` on the trainer's model (``model``: its path), synced to the engine."""
    from transformers import AutoProcessor

    bias_toward_the_picture_call(trainer.model, AutoProcessor.from_pretrained(model).tokenizer)
    trainer.rollout_engine.load_weights(trainer.model)


def build(out: str, combo: dict):
    """The combination's trainer: 2 prompts x n=4 per step, 2 steps."""
    episode, model = combo["episode"], resolve_model(EPISODES[combo["episode"]])
    options = dict(output_dir=f"{out}/{combo['name']}", per_device_train_batch_size=8, num_generations=4,
                   max_completion_length=16, max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none",
                   use_cpu=True, bf16=False, save_strategy="no", seed=0, rollout_backend="vllm")
    kwargs: dict = {}
    if episode in ("tools", "environment", "agent"):
        from transformers import AutoTokenizer

        # the call token made likely, so that 2 steps of a random model hold tool calls and results to mask
        call = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(TOOL_CALL_TOKEN)
        options.update(max_completion_length=40, generation_kwargs={"logit_bias": {call: 6.0}})
        kwargs = dict(reward_funcs=[tool_reward], train_dataset=tool_dataset(32))
        if episode == "agent":
            kwargs = dict(agent=tool_agent, reward_funcs=[agent_reward, agent_check], train_dataset=tool_dataset(32))
            if combo.get("agent_tools"):  # agent= with tools=: the agent gets them
                kwargs.update(tools=[lucky_number], reward_funcs=[agent_reward, agent_check, tools_given])
        else:
            if episode == "tools":
                kwargs.update(tools=[lucky_number])
            else:
                kwargs.update(environment_factory=LuckyEnv, reward_funcs=[tool_reward, env_check])
    elif episode == "images":
        kwargs = dict(reward_funcs=[colour_reward], train_dataset=image_dataset(16))
    elif episode == "tool images":  # image prompts and a tool that returns an image (issue 66)
        options.update(max_completion_length=64, max_tool_calling_iterations=2)
        kwargs = dict(reward_funcs=[colour_reward], train_dataset=image_dataset(16), tools=[show_picture])
    else:
        kwargs = dict(reward_funcs=[digits_reward], train_dataset=digits_dataset(32))
        if episode == "custom":
            kwargs.update(rollout_func=custom_rollout)
    args = NRolloutConfig(**{**options, **combo["options"]})
    trainer = NRolloutGRPOTrainer(model=model, args=args, **kwargs)
    if episode == "tool images" and not getattr(trainer, "is_rollout_rank", False):
        bias_the_picture_call(trainer, model)
    return trainer


def _spans(mask: list[int], value: int) -> list[tuple[int, int]]:
    """The maximal runs ``[start, end)`` of ``value`` in ``mask``."""
    runs, start = [], None
    for i, v in enumerate([*mask, None]):
        if v == value and start is None:
            start = i
        elif v != value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _pixels(collected, rank: int, world: int) -> list:
    """Per sample of this rank, its forward's images: ``[number of images, sum of pixel values]`` (None: none)."""
    mine = collected.mm_local
    if mine is None:  # the image tensors travelled with the job's samples: this rank's slice
        per_rank = len(collected.samples) // world
        mine = [s.mm for s in collected.samples[rank * per_rank:(rank + 1) * per_rank]]
    return [None if m is None else [int(m["pixel_values"].shape[1]), float(m["pixel_values"].double().sum())]
            for m in mine]


def record(trainer, rounds: list) -> None:
    """Wrap ``trainer._assign``: each training step's Round, summarized into ``rounds``."""
    assign = trainer._assign
    decode = trainer.processing_class.decode

    def spy(collected, ctx):
        if ctx.mode == "train":
            samples = []
            for s in collected.samples:
                row = {"prompt_ids": list(s.prompt_ids), "completion_ids": list(s.completion_ids),
                       "tool_mask": None if s.tool_mask is None else list(s.tool_mask), "mm": s.mm is not None}
                if s.tool_mask is not None:  # the text of each masked run and of each trained run
                    ids = s.completion_ids
                    row["masked"] = [decode(ids[a:b]) for a, b in _spans(s.tool_mask, 0)]
                    row["trained"] = [decode(ids[a:b]) for a, b in _spans(s.tool_mask, 1)]
                samples.append(row)
            mm_local = None if collected.mm_local is None else [m is not None for m in collected.mm_local]
            rounds.append({"n": ctx.n, "samples": samples, "mm_local": mm_local, "step": trainer.state.global_step,
                           "pixels": _pixels(collected, trainer.accelerator.process_index,
                                             trainer.accelerator.num_processes)})
        return assign(collected, ctx)

    trainer._assign = spy


def slow_engine(trainer, seconds: float) -> None:
    """Every engine step of this rank's engine waits ``seconds`` more (a slower device): an entry's ``slow_rank``
    option, so that a balanced queue moves that engine's groups to the others."""
    import time

    engine = trainer.rollout_engine.llm.llm_engine
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step


def main(out: str, combos: list[dict]) -> None:
    trainer = None
    for combo in combos:
        CALLS.clear()
        HELD["released"] = None
        slow = combo.get("slow_rank")
        trainer = build(out, combo)
        if getattr(trainer, "is_rollout_rank", False):  # serves this combination's trainer until its train() returns
            trainer.train()
            continue
        if slow is not None and trainer.accelerator.process_index == slow:
            slow_engine(trainer, combo.get("slow_s", 0.05))
        rounds: list = []
        record(trainer, rounds)
        trainer.train(resume_from_checkpoint=combo.get("resume"))
        if trainer.accelerator.is_main_process:
            with open(f"{out}/{combo['name']}.json", "w") as fh:
                json.dump({"rounds": rounds, "history": trainer.state.log_history, "calls": list(CALLS),
                           "held": HELD["released"], "engine": type(trainer.rollout_engine).__name__}, fh)
    if trainer is not None:  # rollout ranks: the trainer's stop, the rollout rank's last serve (the trainers before
        trainer.close()      # it ended theirs with train(); a new trainer's engine releases the last one's)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
