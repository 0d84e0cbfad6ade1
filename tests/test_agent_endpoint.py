"""The agents' OpenAI-compatible endpoint on a real vLLM engine, driven by the real ``openai`` client: the schema, the
episodes' attribution, errors, limits and seeds (the trainer's side: tests/test_agents.py). Its own module: the
module-scoped engine must be gone before another module's tests build their engines in this process."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from trl_nrollout.rollout.episodes.agent_calls import chains


# ---------------------------------------------------------------------------------------------- the endpoint
@pytest.fixture(scope="module")
def served(tiny_model_path):
    """A real engine of the tiny model and an endpoint on it, served from a thread per test (see ``run``)."""
    from transformers import AutoTokenizer

    from tests.conftest import restored_distributed_env
    from trl_nrollout.plan.layout import RolloutLayout
    from trl_nrollout.rollout.engines.vllm_group import VLLMEngineGroup
    from trl_nrollout.rollout.episodes.endpoint import AgentEndpoint

    layout = RolloutLayout.build(num_processes=1, train_batch_size=4, rollout_n=2)
    with restored_distributed_env():  # the engine's RANK / MASTER_PORT ... must not outlive this module
        engine = VLLMEngineGroup(tiny_model_path, layout, rank=0, max_model_len=160, seed=0)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    endpoint = AgentEndpoint(tok, model_name="tiny", max_model_len=160, max_completion_length=64, max_calls=3,
                             policy={"temperature": 1.0})
    endpoint.start()
    yield engine, endpoint
    endpoint.close()
    engine.close()


def run(served, agents: dict, seed=None) -> dict:
    """Open one episode per agent (``key -> function(base_url) -> result``), run the agents in threads against the
    endpoint while this thread serves their requests on the engine; returns the records by key."""
    from trl_nrollout.rollout.episodes.agent_calls import EpisodeRecord
    from trl_nrollout.rollout.types import SamplingOptions

    engine, endpoint = served
    records = [EpisodeRecord(key=k, row={}) for k in agents]
    endpoint.open(records, seed)
    results, done = {}, threading.Event()

    def go():
        threads = []
        for key, fn in agents.items():
            def one(key=key, fn=fn):
                try:
                    results[key] = fn(endpoint.base_url(key))
                except Exception as err:  # noqa: BLE001 - the test reads it
                    results[key] = err
            threads.append(threading.Thread(target=one))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()

    threading.Thread(target=go, daemon=True).start()
    base = SamplingOptions(max_tokens=8, temperature=1.0)
    endpoint.serve(engine.request_loop(), lambda c: engine.sampling_params(
        1, replace(base, max_tokens=c.max_tokens, seed=c.seed, stop=tuple(c.stop))), done.is_set)
    return {r.key: (r, results.get(r.key)) for r in records}


def _client(base_url: str):
    import openai

    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)


@pytest.mark.vllm
def test_the_endpoint_answers_openais_schema_and_records_the_tokens(served):
    """A chat completion, a text completion and the model list, read by the openai client into its own response
    models (validated again strictly); each call is recorded with the engine's tokens, and the answer's text is
    those tokens decoded."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    def agent(base_url):
        client = _client(base_url)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Write a number:"}],
                                              max_tokens=6)
        text = client.completions.create(model="policy", prompt="Give me some digits:", max_tokens=5)
        models = client.models.list()
        return chat, text, models

    (record, (chat, text, models)), = run(served, {"a": agent}).values()
    ChatCompletion.model_validate(chat.model_dump(), strict=True)
    Completion.model_validate(text.model_dump(), strict=True)
    assert [m.id for m in models.data] == ["tiny"]
    assert len(record.calls) == 2 and 1 <= len(record.calls[0].completion_ids) <= 6
    tok = served[1].tokenizer
    assert chat.choices[0].message.content == tok.decode(record.calls[0].completion_ids, skip_special_tokens=True)
    assert chat.usage.completion_tokens == len(record.calls[0].completion_ids)
    assert record.calls[0].prompt_ids == tok.apply_chat_template([{"role": "user", "content": "Write a number:"}],
                                                                  add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False)
    assert all(lp <= 0 for lp in record.calls[0].logprobs) and len(record.calls[0].logprobs) == chat.usage.completion_tokens


@pytest.mark.vllm
def test_concurrent_episodes_get_their_own_calls(served):
    """Eight episodes at once, each asking about its own number: every episode's recorded prompts hold its own
    number only, and its answers are its recorded tokens (attribution by the key in the base URL)."""
    def agent(k):
        def fn(base_url):
            client = _client(base_url)
            answers = []
            messages = [{"role": "user", "content": f"episode {k} number {k}"}]
            for _ in range(2):
                r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
                answers.append(r.choices[0].message.content)
                messages = messages + [{"role": "assistant", "content": answers[-1]},
                                       {"role": "user", "content": f"again {k}"}]
            return answers
        return fn

    out = run(served, {f"ep{k}": agent(k) for k in range(8)})
    tok = served[1].tokenizer
    for k in range(8):
        record, answers = out[f"ep{k}"]
        assert not isinstance(answers, Exception), answers
        assert len(record.calls) == 2
        prompts = [tok.decode(c.prompt_ids) for c in record.calls]
        assert all(f"number {k}" in p for p in prompts)
        assert all(f"number {j}" not in p for p in prompts for j in range(8) if j != k)
        assert [tok.decode(c.completion_ids, skip_special_tokens=True) for c in record.calls] == answers
        # the second call extends the first token for token: one sample
        assert record.calls[1].extends and chains(record.calls)


@pytest.mark.vllm
def test_bad_requests_get_openai_errors_and_the_run_goes_on(served):
    import openai

    def agent(base_url):
        client = _client(base_url)
        errors = []
        for kwargs in ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
                       {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]},
                       {"model": "tiny", "messages": [{"role": "user", "content": "seven " * 200}]},
                       {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}):
            try:
                client.chat.completions.create(**kwargs)
            except openai.APIStatusError as err:
                errors.append((err.status_code, err.body.get("code") if isinstance(err.body, dict) else None))
        ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        return errors, ok

    (record, (errors, ok)), = run(served, {"bad": agent}).values()
    assert errors == [(404, "model_not_found"), (400, None), (400, "context_length_exceeded"), (400, None)]
    assert ok.choices[0].message.content is not None and len(record.calls) == 1
    closed = _client(served[1].base_url("bad"))
    with pytest.raises(openai.NotFoundError, match="episode 'bad' is not open"):
        closed.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.vllm
def test_an_episodes_call_limit_is_an_error_answer(served):
    import openai

    def agent(base_url):
        client = _client(base_url)
        for _ in range(4):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)

    (record, err), = run(served, {"many": agent}).values()
    assert isinstance(err, openai.BadRequestError) and "agent_max_calls" in str(err)
    assert len(record.calls) == 3 and record.outcome == "calls"


@pytest.mark.vllm
def test_seeded_calls_sample_what_the_engine_samples_for_that_seed(served):
    """A call's sampling seed comes from the trainer (episode, call): the same seed gives the same tokens whichever
    other episodes run beside it, a different call index another draw. Every agent's two calls are answered (a run
    whose calls all fail would compare two empty lists). Mutations tried: every call refused (the model check
    inverted: 404s) -> the agents' errors are read; the endpoint's seed read for call 0 whatever the call -> the two
    calls draw alike; no seed given to the engine -> the crowd's draws differ from the lone episode's."""
    def agent(base_url):
        client = _client(base_url)
        return [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Write:"}],
                                               max_tokens=8).choices[0].message.content for _ in range(2)]

    seed = lambda i, c: 1000 + 17 * c  # noqa: E731 - every episode's call c draws from the same seed
    alone = run(served, {"x": agent}, seed=seed)
    crowd = run(served, {f"y{k}": agent for k in range(5)}, seed=seed)
    tok = served[1].tokenizer
    for record, answers in [*alone.values(), *crowd.values()]:
        assert not isinstance(answers, Exception), answers  # the agent's calls all came back
        assert len(record.calls) == 2 and all(c.completion_ids for c in record.calls)
        assert answers == [tok.decode(c.completion_ids, skip_special_tokens=True) for c in record.calls]
    tokens = [c.completion_ids for c in alone["x"][0].calls]
    assert tokens[0] != tokens[1]  # call 1's seed is another draw than call 0's
    assert all([c.completion_ids for c in r.calls] == tokens for r, _ in crowd.values())


@pytest.mark.vllm
def test_a_request_carried_past_a_step_continues_with_its_tokens(served):
    """``serve(carry=True)`` (agents' and rollout functions' partial rollouts): a step that ends while a request
    runs aborts it with its tokens kept and queues it again, the episode stays open, and the next serve continues it
    from its prompt and kept tokens: no token is generated twice. Its agent gets one answer, which starts with the
    kept tokens (the tokens a seeded request never interrupted draws first) and their log-probs, within the call's
    ``max_tokens`` in all, recorded with the call's own prompt, each token tagged with the policy version of the
    serve that drew it (the kept ones the first step's, the rest the next's); a call with stop strings keeps its
    tokens too (none of its text can start a stop string), so nothing is drawn twice; a queued request of an episode
    closed meanwhile (started again) gets a 404 and never reaches the engine. Mutations tried: the kept tokens
    dropped (the call run from its start, as before issue 65 item 3) -> the answer no longer starts with them; the
    continuation given the whole ``max_tokens`` -> the answer runs past 24 tokens; closed episodes' calls not
    filtered -> the closed episode's request runs; the kept tokens' versions not recorded -> the versions assertion
    fails; stop-string calls keeping nothing (as before) -> the stopped call's kept tokens are empty."""
    from trl_nrollout.rollout.episodes.agent_calls import EpisodeRecord
    from trl_nrollout.rollout.types import SamplingOptions

    engine, endpoint = served
    base = SamplingOptions(max_tokens=24, temperature=1.0)

    def params(c):
        return engine.sampling_params(1, replace(base, max_tokens=c.max_tokens, seed=c.seed, stop=tuple(c.stop)))

    def ask(key: str, out: dict, stop=None) -> threading.Thread:
        def go():
            try:
                out[key] = _client(endpoint.base_url(key)).chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Write:"}], max_tokens=24, stop=stop)
            except Exception as err:  # noqa: BLE001 - the test reads it
                out[key] = err
        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        return thread

    records = {k: EpisodeRecord(key=k, row={}) for k in ("whole", "carried", "stopped", "closed")}
    endpoint.open(list(records.values()), lambda i, c: 4321)  # every call the same seed
    out: dict = {}
    whole = ask("whole", out)
    endpoint.serve(engine.request_loop(stream=True), params, lambda: not whole.is_alive(), carry=True)
    loop = engine.request_loop(stream=True)
    carried, stopped = ask("carried", out), ask("stopped", out, stop=["\x00never"])
    deadline = time.monotonic() + 60
    while endpoint.requests.qsize() < 2:  # both reach the engine in its first step
        assert time.monotonic() < deadline, "the two requests never reached the queue"
        time.sleep(0.01)
    steps = []  # the step ends after a few engine steps of the request

    def ended() -> bool:
        steps.append(loop.has_unfinished)
        return sum(steps) >= 5

    first = endpoint.serve(loop, params, ended, carry=True, version=3)
    assert first["carried"] == 2 and carried.is_alive() and not records["carried"].calls
    queued = next(c for c in list(endpoint.requests.queue) if c.key == "carried")
    kept, kept_logprobs = list(queued.kept_ids), list(queued.kept_logprobs)
    assert 0 < len(kept) < 24 and queued.kept_versions == [3] * len(kept)
    with_stop = next(c for c in list(endpoint.requests.queue) if c.key == "stopped")
    assert with_stop.kept_ids == kept and first["redrawn_tokens"] == 0  # (same seed, same steps: same tokens)
    assert first["kept_tokens"] == 2 * len(kept)
    closed = ask("closed", out)
    deadline = time.monotonic() + 60
    while not any(c.key == "closed" for c in list(endpoint.requests.queue)):  # its request waits in the queue
        assert time.monotonic() < deadline, "the closed episode's request never reached the queue"
        time.sleep(0.01)
    endpoint.forget(["closed"])
    second = endpoint.serve(engine.request_loop(stream=True), params,
                            lambda: not carried.is_alive() and not closed.is_alive() and not stopped.is_alive(),
                            carry=True, version=4)
    assert second["requests"] == 2  # the carried ones; the closed episode's never ran
    assert not isinstance(out["carried"], Exception), out["carried"]
    (call,), (uninterrupted,) = records["carried"].calls, records["whole"].calls
    assert call.completion_ids[:len(kept)] == kept == uninterrupted.completion_ids[:len(kept)]
    assert call.logprobs[:len(kept)] == pytest.approx(kept_logprobs)
    assert len(kept) < len(call.completion_ids) <= 24 and call.prompt_ids == uninterrupted.prompt_ids
    assert call.versions == [3] * len(kept) + [4] * (len(call.completion_ids) - len(kept))
    assert records["carried"].oldest_version == 3 and uninterrupted.versions == [] and records["whole"].oldest_version is None
    assert records["stopped"].calls[0].completion_ids[:len(kept)] == kept
    assert "404" in str(out["closed"]) or "episode_closed" in str(out["closed"])
    endpoint.open([], None)


@pytest.mark.fast
def test_a_continued_calls_seed_moves_and_a_fresh_call_runs_whole():
    """A carried call continues from its prompt and kept tokens with the tokens left and its seed moved by the kept
    count (the continuation does not replay the first draws' random stream); a call that kept nothing runs whole.
    Mutation tried: the seed left as it was -> the first assertion fails."""
    from trl_nrollout.rollout.episodes.endpoint import PendingCall

    call = PendingCall("k", [1, 2, 3], 10, [], 7, kept_ids=[4, 5], kept_logprobs=[-0.1, -0.2])
    assert call.continuation() == ([1, 2, 3, 4, 5], 8, [], 9)
    fresh = PendingCall("k", [1, 2, 3], 10, ["\n"], 7)
    assert fresh.continuation() == ([1, 2, 3], 10, ["\n"], 7)
    assert PendingCall("k", [1], 4, [], None, kept_ids=[2]).continuation() == ([1, 2], 3, [], None)


@pytest.mark.fast
def test_a_cut_kept_for_a_call_with_stop_strings_lets_the_continuation_see_every_stop():
    """:func:`safe_cut`'s law (a property over random texts, one character a token): whatever the continuation
    draws, every stop string in the kept text + the continuation lies wholly in the continuation (the continuation's
    own stop check, all vLLM runs, sees it), the kept tokens never shrink below ``floor``, and a text without a stop
    string's characters is kept whole. Mutation tried: the cut keeping every token (stop strings ignored) -> a stop
    string straddling the cut is found."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from trl_nrollout.rollout.episodes.agent_calls import safe_cut

    chars = st.text(alphabet="ab\n", max_size=8)

    @settings(max_examples=300, deadline=None)
    @given(kept=chars, continuation=chars, stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3),
                                                          min_size=1, max_size=3), floor=st.integers(0, 8))
    def law(kept, continuation, stops, floor):
        ids = [ord(c) for c in kept]
        floor = min(floor, len(ids))
        keep = safe_cut(ids, stops, lambda t: "".join(map(chr, t)), floor)
        assert floor <= keep <= len(ids)
        if keep > floor:  # (below floor: the tokens the caller already knew safe)
            text = kept[:keep] + continuation
            for s in stops:
                start = text.find(s)
                while start != -1:
                    assert start >= keep, (kept, keep, continuation, s)
                    start = text.find(s, start + 1)
        if not set("".join(stops)) & set(kept):
            assert keep == len(ids)

    law()
