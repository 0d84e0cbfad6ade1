"""The OpenAI Agents SDK through the endpoint (issue 63): the SDK calls OpenAI's Responses API by default, which the
endpoint does not serve; its answer there names the switch, and an Agents SDK agent switched to Chat Completions
(``OpenAIChatCompletionsModel``, as docs/agents.md shows) trains through the endpoint on the vLLM engine."""

from __future__ import annotations

import pytest

from tests.test_agents import _trainer


async def sdk_agent(client, row):
    """An Agents SDK agent as docs/agents.md writes it: the episode's async client, Chat Completions."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no traces sent anywhere (the SDK would post them to OpenAI)
    agent = Agent(name="digits", instructions="Answer with a number.",
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                  model_settings=ModelSettings(max_tokens=8))
    result = await Runner.run(agent, row["prompt"][-1]["content"])
    text = str(result.final_output)
    return sum(ch.isdigit() for ch in text) / max(1, len(text))


@pytest.mark.vllm
def test_an_agents_sdk_agent_trains_and_the_responses_api_names_the_switch(tmp_path):
    """Every episode of the Agents SDK agent makes its call and is scored (no error episode), what trained is what
    the engine generated (log-probs equal), and a call to /v1/responses from the same SDK with its default model
    gets the endpoint's 404 naming OpenAIChatCompletionsModel. Fails when the Responses route answers the generic
    'no route' (it did), or when the SDK's chat calls are not served as the openai client's are."""
    from trl_nrollout.rollout.episodes.endpoint import RESPONSES_API

    seen_errors: list[str] = []
    tried: list[bool] = []

    async def agent(client, row):
        from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled

        set_tracing_disabled(True)
        if not tried:  # once per run: the SDK's default API (Responses)
            tried.append(True)
            try:
                await Runner.run(Agent(name="r", model=OpenAIResponsesModel(model="policy", openai_client=client)),
                                 "hi")
            except Exception as err:  # noqa: BLE001 - the endpoint's 404 comes back as the SDK's error
                seen_errors.append(str(err))
        return await sdk_agent(client, row)

    from trl_nrollout.builtin import tool_dataset

    dataset = tool_dataset(8)
    trainer = _trainer(tmp_path, agent=agent, dataset=dataset, max_steps=1, train_batch_size=2, rollout_n=2)
    trainer.train()
    trainer.close()
    log = next(h for h in trainer.state.log_history if "agent/calls_per_episode" in h)
    assert log["agent/calls_per_episode"] >= 1 and log["agent/error_episodes"] == 0
    assert log["rollout_corr/logprob_abs_diff_max"] < 1e-4
    assert seen_errors and "OpenAIChatCompletionsModel" in seen_errors[0] and RESPONSES_API[:40] in seen_errors[0]
