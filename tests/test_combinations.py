"""Every combination of the rollout's axes that the refusal table allows runs (issue 46): colocated engines, each
dispatch x end x episode, one trainer after another in this process (tests/assets/axes_combinations.py), 2 steps of 2
prompts x n=4 each, checking what each step trained on: groups (n contiguous samples of one prompt), masks (tool
results masked, the rest trained; a rollout_func's env_mask), images carried, partial rollouts' staleness within
max_staleness and the balanced queue's metrics.

The combinations are derived from :data:`~trl_nrollout.rollout.axes.REFUSALS` at test time: a row lifted from the
table joins the run; a refused combination is left out (tests/test_axes.py checks that each row is refused).
Rollout-rank combinations need launches of their own and are covered by the launches named in
:data:`RANKS_COVERED`, not here.
"""

from __future__ import annotations

import itertools
import json

import pytest

from tests.conftest import ACCELERATE_LAUNCH, ROOT, run_cmd, run_script_in_process
from trl_nrollout.rollout.axes import AXES, REFUSALS

#: each choice: the options it sets and the words of the refusal table it stands for
DISPATCH = {"shares": ({}, set()), "balanced": ({"rollout_dispatch": "balanced"}, {"rollout_dispatch='balanced'"})}
END = {"whole": ({}, set()), "partial": ({"rollout_partial": True}, {"rollout_partial=True"})}
#: episode choice -> (the script's episode kind, options, words); an environment's methods become the trainer's tools
EPISODE = {
    "one completion": ("one completion", {}, set()),
    "tools, turn by turn": ("tools", {}, {"tools", "rollout_multi_turn='turns'"}),
    "tools, request by request": ("tools", {"rollout_multi_turn": "requests"},
                                  {"tools", "rollout_multi_turn='requests'"}),
    "environment, turn by turn": ("environment", {}, {"environment_factory", "tools", "rollout_multi_turn='turns'"}),
    "environment, request by request": ("environment", {"rollout_multi_turn": "requests"},
                                        {"environment_factory", "tools", "rollout_multi_turn='requests'"}),
    "custom": ("custom", {}, {"rollout_func"}),
    "custom, request by request": ("custom", {"rollout_multi_turn": "requests"},
                                   {"rollout_func", "rollout_multi_turn='requests'"}),
    "images": ("images", {}, {"image prompts"}),
    "agent": ("agent", {}, {"agent"}),
}
#: the rollout-rank combinations and the launches that run them (the rest are refused by the table)
RANKS_COVERED = {
    "one completion, shares / balanced, whole / partial":
        "test_rollout_ranks.py::test_one_step_off_policy_under_zero3_samples_one_step_stale",
    "one completion, partial, checkpoint and resume": "test_a_rollout_rank_keeps_each_steps_episodes_and_groups_"
                                                      "in_flight (here)",
    "tools turn by turn / request by request": "test_tools.py::test_tool_episodes_on_a_rollout_rank_one_step_off",
    "environment turn by turn / request by request": "test_a_rollout_rank_keeps_each_steps_episodes_and_groups_in_flight (here)",
    "agent": "test_a_rollout_rank_keeps_each_steps_episodes_and_groups_in_flight (here)",
    "custom": "tests/assets/rollout_func_ranks.py (test_tools.py)",
    "images": "test_vlm.py::test_a_vlm_trains_on_a_rollout_rank_one_step_off",
    "images, tools request by request": "test_vlm.py::test_a_vlm_trains_on_a_rollout_rank_one_step_off",
    "images, tools / environments request by request, agent: partial": "test_a_rollout_rank_keeps_each_steps_"
                                                                        "episodes_and_groups_in_flight (here)",
}


def _side_holds(side: str, words: set[str]) -> bool:
    return all(part in words for part in side.split(" and "))


def refused(words: set[str]) -> bool:
    """Whether a refusal row of the table refuses a combination standing for ``words`` (colocated, vLLM)."""
    return any(_side_holds(r.first, words) and _side_holds(r.second, words) for r in REFUSALS)


#: (end, episode) choices that run the same machine as another: a partial rollout has no turn barrier (its tool
#: episodes run request by request) and runs a rollout_func group by group already; run once, as the other
SAME = {("partial", "tools, turn by turn"): "tools, request by request",
        ("partial", "environment, turn by turn"): "environment, request by request",
        ("partial", "custom, request by request"): "custom"}


#: combinations a launch of this file (or tests/test_dispatch.py, two engines) runs with these checks or stronger: the
#: one-process run leaves them out (kept cheap); each launch's own test below names them
COVERED = {
    "balanced-partial-tools_request_by_request": "test_partial_tool_episodes_on_a_balanced_queue_over_two_engines",
    "shares-partial-environment_request_by_request": "test_partial_environment_episodes_train_on_their_own_ranks_at_tp2",
    **dict.fromkeys(("balanced-whole-environment_request_by_request", "balanced-partial-environment_request_by_request",
                     "balanced-whole-agent", "balanced-partial-agent", "balanced-whole-custom", "balanced-partial-custom",
                     "balanced-whole-custom_request_by_request"),
                    "test_environment_and_agent_episodes_on_a_balanced_queue_come_home"),
    "shares-partial-agent": "test_partial_agent_episodes_run_on_across_steps",
    "shares-partial-custom": "test_partial_agent_episodes_run_on_across_steps (func_fresh)",
    **dict.fromkeys(("balanced-whole-one_completion", "balanced-partial-one_completion",
                     "balanced-whole-tools_request_by_request"), "test_dispatch.py (two engines, equal to shares)"),
}


def combinations() -> tuple[list[dict], list[dict]]:
    """The colocated combinations: (allowed ones as the script's entries, refused ones); an entry that runs the
    same machine as another (:data:`SAME`) says which, as ``same_as``."""
    allowed, refused_ = [], []
    for (d, (d_opts, d_words)), (e, (e_opts, e_words)), (k, (kind, k_opts, k_words)) in itertools.product(
            DISPATCH.items(), END.items(), EPISODE.items()):
        words = d_words | e_words | k_words
        entry = {"name": f"{d}-{e}-{k}".replace(", ", "_").replace(" ", "_"), "episode": kind,
                 "options": {**d_opts, **e_opts, **k_opts}, "words": sorted(words)}
        if (e, k) in SAME:
            entry["same_as"] = f"{d}-{e}-{SAME[e, k]}".replace(", ", "_").replace(" ", "_")
        (refused_ if refused(words) else allowed).append(entry)
    return allowed, refused_


def test_the_combinations_follow_the_refusal_table():
    """The run covers every colocated combination the table allows, and only those. Mutation tried: a row added to
    REFUSALS -> its combinations leave the run (the count check fails); every choice of AXES is mapped."""
    assert set(DISPATCH) == set(AXES["dispatch"]) and set(END) == set(AXES["end"])
    assert {k.split(",")[0] for k in EPISODE} == {k.split(",")[0] for k in AXES["episode"]}
    words = set().union(*(w for _, w in DISPATCH.values()), *(w for _, w in END.values()),
                        *(w for *_, w in EPISODE.values()),
                        {"rollout_ranks", "rollout_backend='hf'", "rollout_tp_size>1",  # (TP: not in this run)
                         "environment_factory or rollout_func"})  # (agent= with TRL's loops: one axis, two choices)
    for r in REFUSALS:  # every word of the table is one a combination can stand for
        assert all(p in words for side in (r.first, r.second) for p in side.split(" and ")), r
    allowed, refused_ = combinations()
    assert len(allowed) + len(refused_) == 2 * 2 * len(EPISODE)
    # every colocated combination on vLLM runs (issue 46): what the table refuses is the HF engine's
    assert not refused_, [c["name"] for c in refused_]
    assert {c["same_as"] for c in allowed if "same_as" in c} <= {c["name"] for c in allowed}
    assert set(COVERED) <= {c["name"] for c in allowed if "same_as" not in c}  # (a launch runs each)


ALLOWED, _ = combinations()


def launch_two(tmp_path, entries: list[dict], processes: int = 2) -> None:
    """tests/assets/axes_combinations.py over two processes (accelerate, CPU; or ``processes``), its entries one
    after another."""
    run_cmd([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", str(processes),
             str(ROOT / "tests/assets/axes_combinations.py"), str(tmp_path), json.dumps(entries)],
            timeout=600, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1",
                              "PYTHONPATH": str(ROOT)})
RENDERED = "<tool_response>\n7\n</tool_response>"  # the tool's result as the chat template renders it


@pytest.mark.slow
@pytest.mark.vllm
def test_every_allowed_combination_trains_on_whole_groups_with_their_masks(tmp_path):
    """One process, one trainer per allowed combination, 2 steps each (see the module docstring), but those a
    launch below runs (:data:`COVERED`) and those that run the same machine as another (:data:`SAME`). Mutations tried:
    tool masks dropped from the samples -> the mask checks fail."""
    run = [c for c in ALLOWED if "same_as" not in c and c["name"] not in COVERED]
    entries = [{k: v for k, v in c.items() if k != "words"} for c in run]
    run_script_in_process(ROOT / "tests/assets/axes_combinations.py", str(tmp_path), json.dumps(entries),
                          env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1"})
    for combo in run:
        check_combination(combo, json.loads((tmp_path / f"{combo['name']}.json").read_text()))


def check_combination(combo: dict, result: dict, engine: str = "VLLMEngineGroup") -> None:
    """What each step of a combination trained on (see the module docstring)."""
    name, kind, words = combo["name"], combo["episode"], set(combo["words"])
    assert result["engine"] == engine, name
    rounds = result["rounds"]
    assert len(rounds) == 2, name
    called = 0
    for rnd in rounds:
        n, samples = rnd["n"], rnd["samples"]
        assert n == 4 and samples and len(samples) % n == 0, name
        for g in range(0, len(samples), n):  # groups: n contiguous samples of one prompt
            assert len({tuple(s["prompt_ids"]) for s in samples[g:g + n]}) == 1, name
        for s in samples:
            assert s["completion_ids"], name
            if kind in ("tools", "environment", "agent"):  # an agent's tool results lie between its chained calls
                assert s["tool_mask"] is not None and len(s["tool_mask"]) == len(s["completion_ids"]), name
                for text in s["masked"]:  # masked: the rendered tool results (a random model may sample the
                    assert RENDERED in text, (name, text)  # <tool_response> token itself: not a result)
                assert all(RENDERED not in t for t in s["trained"]), name
                called += bool(s["masked"])
            elif kind == "custom":  # the rollout_func's env_mask: its last token (a held group's first too)
                body, held = s["tool_mask"][:-1], len(s["tool_mask"]) > 1 and s["tool_mask"][0] == 0
                assert s["tool_mask"][-1] == 0 and all(body[1:]) and (held or all(body)), name
                assert not (held and rnd is rounds[0]), name  # the held group did not train in the step it held
            else:
                assert s["tool_mask"] is None, name
        if kind == "images":
            carried = rnd["mm_local"] or [s["mm"] for s in samples]
            assert carried and all(carried), name
    if kind in ("tools", "environment", "agent"):
        assert called, f"{name}: no sample called the tool"
    if kind == "custom":  # partial or request by request: the function runs group by group (n prompts a call)
        grouped = "rollout_partial=True" in words or "rollout_multi_turn='requests'" in words
        calls = result["calls"]
        if grouped and engine == "RemoteEngines":  # it ran on the rollout rank (its own trainer), never here
            assert calls == [], (name, calls)
        else:
            assert calls and (all(c == 4 for c in calls) if grouped else all(c > 4 for c in calls)), (name, calls)
        if "rollout_partial=True" in words and engine != "RemoteEngines":  # step 1 ended while rank 0's first
            # group waited for it
            assert result["held"] is True, name
    logged = {k for h in result["history"] for k in h}
    if "rollout_partial=True" in words:  # max_staleness=1; on rollout ranks a job's weights are up to 1 step behind
        # (rollout_lookahead=1): 1 + 1
        stale = [h["partial/staleness_max"] for h in result["history"] if "partial/staleness_max" in h]
        assert stale and max(stale) <= (2 if engine == "RemoteEngines" else 1), name
    if "rollout_dispatch='balanced'" in words and "rollout_partial=True" not in words:
        assert "rollout/moved_groups" in logged, name  # (partial on one engine: the pool is the job's already;
        # the job-wide queue over two engines: test_dispatch.py::test_partial_rollouts_pull_the_jobs_pool..., and
        # test_partial_tool_episodes_on_a_balanced_queue_over_two_engines below)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_partial_tool_episodes_on_a_balanced_queue_over_two_engines(tmp_path):
    """balanced x partial x tools request by request over two processes, one engine each (the combination above
    runs it on one engine, where the pool is the job's anyway): the job's pool of episodes is one queue, every
    engine's episodes are gathered to every rank after each step, and each rank trains its share of the first groups
    to finish. The same checks as above on each step's job samples (groups whole, tool results masked and only
    they, staleness within the bound), from rank 0's Round (the job's samples). That the engines' episodes keep
    their masks and versions across steps and engines: tests/test_dispatch.py. Mutations tried: the branch of
    ``_partial_round`` that runs the balanced queue for tool episodes raising -> the launch fails (it is the path
    taken); the engines' leaders sending their tickets but not their groups -> the launch fails (the groups that
    train have no episodes on the ranks that did not run them).

    In the same launch, tool images from the balanced queue (issue 66): image prompts on the built-in VLM whose
    ``show_picture`` returns an image, request by request from fixed shares (the reference), from the balanced queue
    and in partial rollouts on it, engine 0 slowed so that engine 1 pulls rank 0's groups. The job's samples equal
    the shares' sample for sample (prompt and completion tokens, tool masks; rank 0's forward images: their count
    and pixels; a group's seed follows it to whichever engine runs it, and the tool shows the same picture
    at every call), and every sample's forward holds its prompt's image and one per tool result in its completion.
    Mutation tried: the balanced driver's later turns without their view (``continue_request`` given the context
    only: the tool images never reach the engine that pulled the group) -> the job's samples differ from the shares'
    (first at sample 6): fails."""
    combo = next(c for c in ALLOWED if c["name"] == "balanced-partial-tools_request_by_request")
    entry = {"name": combo["name"], "episode": combo["episode"],
             "options": {**combo["options"], "rollout_max_num_seqs": 4}}
    images = {"tool_images_shares": {}, "tool_images_balanced": {"rollout_dispatch": "balanced"},
              "tool_images_partial": {"rollout_dispatch": "balanced", "rollout_partial": True}}
    launch_two(tmp_path, [entry, *({"name": name, "episode": "tool images", "slow_rank": 0, "slow_s": 0.2,
                                    "options": {"rollout_multi_turn": "requests", "rollout_max_num_seqs": 4,
                                                "per_device_train_batch_size": 16, "max_steps": 1, **options}}
                                   for name, options in images.items())])
    result = json.loads((tmp_path / f"{combo['name']}.json").read_text())
    check_combination(combo, result)
    assert all(len(rnd["samples"]) == 2 * 8 for rnd in result["rounds"])  # the job's samples: 2 ranks x 8
    shares, balanced, partial = (json.loads((tmp_path / f"{name}.json").read_text())["rounds"][0] for name in images)
    for run in (shares, balanced, partial):  # rank 0's samples: the prompt's image, then one per tool result
        mine = run["samples"][:len(run["pixels"])]
        assert all(p is not None and p[0] == 1 + len(s["masked"]) for p, s in zip(run["pixels"], mine, strict=True))
        assert any(p[0] > 1 for p in run["pixels"]), "no tool image: the test tests nothing"
    keys = ("prompt_ids", "completion_ids", "tool_mask")
    assert [[s[k] for k in keys] for s in balanced["samples"]] == [[s[k] for k in keys] for s in shares["samples"]]
    assert balanced["pixels"] == shares["pixels"]
    history = json.loads((tmp_path / "tool_images_balanced.json").read_text())["history"]
    moved = [h["rollout/moved_groups"] for h in history if "rollout/moved_groups" in h]
    assert moved and max(moved) > 0, moved  # engine 1 ran rank 0's groups, their images with them


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_partial_environment_episodes_train_on_their_own_ranks_at_tp2(tmp_path):
    """partial x environments at rollout_tp_size=2: two processes, one engine of both, one pool of both ranks'
    groups. A group's tools run on the rank that drew it (its environments live there) and each rank trains its own
    groups: the engine runs until each rank has its share finished. The checks above, and the combination's
    ``env_check`` reward raises unless every sample is scored with its own episode's environment (reset with its
    prompt, called for each of its tool results). Mutations tried: the ranks' shares cut from the finish order as
    without environments (positional) -> a rank scores groups whose environments are on the other one: the launch
    fails; the stop at ``target`` groups in place of each rank's share -> a rank trains fewer than its share:
    the launch fails."""
    combo = next(c for c in ALLOWED if c["name"] == "shares-partial-environment_request_by_request")
    entry = {"name": combo["name"], "episode": combo["episode"],
             "options": {**combo["options"], "rollout_tp_size": 2, "max_steps": 3}}
    launch_two(tmp_path, [entry])
    result = json.loads((tmp_path / f"{combo['name']}.json").read_text())
    result["rounds"] = result["rounds"][:2]  # (check_combination counts 2 steps)
    check_combination(combo, result)
    assert all(len(rnd["samples"]) == 2 * 8 for rnd in result["rounds"])  # the job's samples: 2 ranks x 8
    pools = [h["partial/pool_groups"] for h in result["history"] if "partial/pool_groups" in h]
    assert pools and max(pools) > 0  # groups stayed in flight: the rollouts were partial


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_a_rollout_rank_keeps_each_steps_episodes_and_groups_in_flight(tmp_path):
    """Two trainers and rollout_ranks=1, one step ahead (rollout_lookahead=1): a step's job (both trainers' samples) is
    written while the step before it trains.
    Environments turn by turn: the step's environments are reset then, on instances of their own, and the step's
    tool turns and rewards use those (the environments' methods run on the trainer, each turn a job of the rollout
    rank); ``env_check`` raises unless every sample is scored with its own episode's environment. Environments
    request by request: the episodes run whole on the rollout rank, parsed with the environments' tool schemas, and
    each tool call comes home to the trainer's tool server (rollout/episodes/home_tools.py), which runs it on the sample's
    own environment (those of the step the job was written for); env_check as above. Agents
    (``agent=``): the job carries the step's rows, the rollout rank runs their episodes on its own endpoint and
    engine (the same script built it with the agent) and answers their records; ``agent_check`` raises unless every
    sample is scored with its own episode's result. The combinations' checks on each. Mutations tried: the step
    written ahead resets the pool's first environments (the live step's, as ``_start_episodes`` alone draws them)
    -> env_check fails the launch; the jobs written ahead without their rows -> every step's episodes run on demand
    (staleness 0, the assertion fails); the rollout rank's rows reversed -> agent_check fails the launch; the calls
    of a job written ahead run on the live step's environments (registered under its step with the live step's
    tools) -> env_check fails the launch.

    Partial rollouts (the rollout rank keeps the groups in flight from job to job): image prompts, their images
    sent with every request of a group and its prompt encoded again where it trains; tool episodes request by
    request, their tool masks and messages answered with them; environments' episodes, their environments waiting
    on the trainer across jobs, their calls sent home, each group trained by the trainer that holds them (env_check,
    and the trainer raises on a group drawn elsewhere); agents, a pool of live agents on the rollout rank's own
    endpoint, their records answered with their groups' rows (agent_check) (the combinations' checks); DAPO's extra
    rounds over the pool (every group filtered: the tool reward is 1 for all), each a job written when it runs;
    a checkpoint at step 2 keeps the pool the rollout rank held after step 2's own job, and the resumed run's first
    job carries it back, so its pool holds those groups after step 3 (without them it would be empty: no top-ups,
    rollout_partial_oversample=0). Mutations tried: the restore entry left out of the resumed run's first job ->
    pool_groups 0 at step 3, the assertion fails; the rollout rank's finished environment groups cut by position,
    not by the trainer that drew them -> a trainer receives another's group and raises."""
    entries = []
    ranks = {"rollout_ranks": 1, "rollout_lookahead": 1, "max_staleness": 1, "max_steps": 3}
    for name in ("shares-whole-environment_turn_by_turn", "shares-whole-environment_request_by_request",
                 "shares-whole-agent", "shares-partial-images", "shares-partial-tools_turn_by_turn",
                 "shares-partial-environment_request_by_request", "shares-partial-agent", "shares-partial-custom",
                 "shares-whole-custom_request_by_request"):
        combo = next(c for c in ALLOWED if c["name"] == name)
        entries.append({"name": combo["name"], "episode": combo["episode"], "options": {**combo["options"], **ranks}})
    saving = {**ranks, "rollout_partial": True, "save_strategy": "steps", "save_steps": 2}
    tools = next(c for c in ALLOWED if c["name"] == "shares-partial-tools_request_by_request")  # every reward 1:
    entries += [{"name": "dapo", "episode": "tools", "options": {**tools["options"], **ranks, "filter_groups": True,
                                                                "filter_groups_max_rounds": 2}},  # all filtered
                {"name": "first", "episode": "one completion", "options": {**saving, "max_steps": 2}},
                {"name": "resumed", "episode": "one completion", "resume": str(tmp_path / "first" / "checkpoint-2"),
                 "options": {**saving, "output_dir": str(tmp_path / "first"), "rollout_partial_oversample": 0.0}}]
    launch_two(tmp_path, entries, processes=3)  # 2 trainers + the rollout rank
    for entry in entries[:9]:
        combo = next(c for c in ALLOWED if c["name"] == entry["name"])
        result = json.loads((tmp_path / f"{combo['name']}.json").read_text())
        result["rounds"] = result["rounds"][:2]  # (check_combination counts 2 steps)
        check_combination(combo, result, engine="RemoteEngines")
        assert all(len(rnd["samples"]) == 2 * 8 for rnd in result["rounds"]), entry["name"]  # both trainers' job
        stale = [h["rollout/staleness"] for h in result["history"] if "rollout/staleness" in h]
        assert len(stale) == 3 and max(stale) == 1, (entry["name"], stale)  # samples generated a step ahead
    dapo = json.loads((tmp_path / "dapo.json").read_text())  # DAPO's extra rounds: jobs of their own, on the pools
    check_combination({**tools, "name": "dapo"}, {**dapo, "rounds": dapo["rounds"][:2]}, engine="RemoteEngines")
    assert max(h.get("dynamic_sampling/rounds", 0) for h in dapo["history"]) > 0
    saved = json.loads((tmp_path / "first" / "checkpoint-2" / "nrollout_partial_rank0.json").read_text())
    first = json.loads((tmp_path / "first.json").read_text())
    left = [h["partial/pool_groups"] for h in first["history"] if "partial/pool_groups" in h][-1]
    assert left > 0 and len(saved) == left and all(g["key"][0] == 1 for g in saved)  # step 2's job (global step 1)
    resumed = [h for h in json.loads((tmp_path / "resumed.json").read_text())["history"]
               if "partial/pool_groups" in h]
    assert len(resumed) == 3 and resumed[-1]["partial/pool_groups"] == left, resumed


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_environment_and_agent_episodes_on_a_balanced_queue_come_home(tmp_path):
    """balanced x environments request by request (whole and partial), x agent and x rollout_func, two processes,
    one engine each, engine 0 slowed, so that engine 1 pulls rank 0's groups.
    Environments: their tool calls go home to rank 0, where their environments live (rollout/episodes/home_tools.py); each
    rank scores its own samples (whole: they come home; partial: each rank trains its own groups, the queue running
    until every rank has its share finished); ``env_check`` raises unless every sample is scored with its own
    episode's environment. Agents: rank 1 runs the pulled groups' episodes on its own endpoint and engine, and the
    finished episodes go home; ``agent_check`` raises unless every sample is scored with its own episode's result.
    A rollout_func: its engine call is a balanced rollout (groups moved). The combinations' checks on each.
    Mutations tried: tool calls run on the engine's rank with that rank's environment at the same place (no
    HomeTools) -> the launch fails; the partial job's shares cut by position (not
    by home) -> the launch fails; a pulled group's episodes run with the puller's own row at the same place (not the
    job's) -> agent_check fails the launch; the rollout_func's calls not routed to the balanced queue -> no groups
    moved, the assertion fails."""
    entries = []
    for name in ("balanced-whole-environment_request_by_request", "balanced-partial-environment_request_by_request",
                 "balanced-whole-agent", "balanced-partial-agent", "balanced-whole-custom", "balanced-partial-custom",
                 "balanced-whole-custom_request_by_request"):
        combo = next(c for c in ALLOWED if c["name"] == name)
        partial = {"rollout_partial_oversample": 0.0} if name == "balanced-partial-agent" else {}  # (no top-ups:
        slow = 0.05  # the fast rank's own groups alone do not end the job)
        if name == "balanced-partial-custom":  # (rank 0's first group waits for step 1's end: one top-up a rank,
            partial, slow = {"rollout_partial_oversample": 0.25}, 0.2  # and rank 0 slow enough that rank 1 pulls
        if name in ("balanced-whole-agent", "balanced-partial-agent"):  # (at 0.05 s a step rank 0 claimed all its
            slow = 0.2  # own groups before rank 1 was free: whole in two full-suite runs of 2026-12-06, partial in
            # one of 2026-12-07, moving none: slow enough that rank 1 pulls)
        entries.append({"name": combo["name"], "episode": combo["episode"], "slow_rank": 0, "slow_s": slow,
                        "options": {**combo["options"], "rollout_max_num_seqs": 4, "per_device_train_batch_size": 16,
                                    "max_steps": 2, **partial}})
    launch_two(tmp_path, entries)
    for entry in entries:
        combo = next(c for c in ALLOWED if c["name"] == entry["name"])
        result = json.loads((tmp_path / f"{combo['name']}.json").read_text())
        check_combination(combo, result)
        assert all(len(rnd["samples"]) == 2 * 16 for rnd in result["rounds"]), entry["name"]  # 2 ranks x 16
        if combo["episode"] in ("agent", "custom"):  # an engine ran another rank's groups (episodes, samples)
            moved = [h["rollout/moved_groups"] for h in result["history"] if "rollout/moved_groups" in h]
            assert moved and max(moved) > 0, (entry["name"], moved)
        else:
            sent = [h["tools/calls_sent_home"] for h in result["history"] if "tools/calls_sent_home" in h]
            assert sent and max(sent) > 0, (entry["name"], sent)  # an engine ran another rank's episodes' tools


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_partial_agent_episodes_run_on_across_steps(tmp_path):
    """agent x partial, two processes: one TP=2 engine over both (each rank its own pool and endpoint, the engine's
    ranks exchanging their calls and stopping together), and one engine per rank with max_staleness=0. Each step
    trains the first groups to finish; the others' agents run on past the weight sync (their calls in the engine then
    aborted with their tokens kept and continued at the next step: tests/test_agent_endpoint.py checks the tokens),
    so groups train one version stale; with max_staleness=0 such groups
    start again instead. The combination's checks, and ``agent_check`` raises unless every sample is scored with its
    own episode's result. Mutations tried: the pool emptied after each step (nothing carried) -> no group trains
    stale, the assertion fails; stale groups never started again -> staleness 1 under max_staleness=0, it fails.
    A rollout_func's groups the same way (``func_fresh``: one TP=2 engine, max_staleness=0): rank 0's first group
    waits for step 1 to end, so it is stale at step 2 and starts again (its function's next engine call unwinds it,
    rollout/episodes/rollout_func.py GroupClosed; a new call runs with the same prompt)."""
    combo = next(c for c in ALLOWED if c["name"] == "shares-partial-agent")
    custom = next(c for c in ALLOWED if c["name"] == "shares-partial-custom")
    entries = [{"name": "tp2", "episode": "agent", "options": {**combo["options"], "rollout_tp_size": 2,
                                                               "max_steps": 4}},
               {"name": "fresh", "episode": "agent", "options": {**combo["options"], "max_staleness": 0,
                                                                 "max_steps": 3}},
               {"name": "func_fresh", "episode": "custom", "options": {**custom["options"], "max_staleness": 0,
                                                                       "rollout_tp_size": 2, "max_steps": 3}}]
    launch_two(tmp_path, entries)
    for entry in entries:
        result = json.loads((tmp_path / f"{entry['name']}.json").read_text())
        result["rounds"] = result["rounds"][:2]  # (check_combination counts 2 steps)
        check_combination(custom if entry["episode"] == "custom" else combo, result)
        steps = [h for h in result["history"] if "partial/staleness_max" in h]
        assert len(steps) == entry["options"]["max_steps"], entry["name"]
        stale = [h["partial/staleness_max"] for h in steps]
        if entry["name"] == "tp2":  # groups that finished after their step trained at the next
            assert max(stale) == 1 and max(h["partial/pool_groups"] for h in steps) > 0, stale
        else:  # every group left over started again at the next step
            assert max(stale) == 0 and sum(h["partial/restarted_samples"] for h in steps) > 0, steps


@pytest.mark.slow
@pytest.mark.vllm
def test_a_resumed_run_starts_the_agent_groups_in_flight_again(tmp_path):
    """agent x partial x checkpoints, one process: the checkpoint at step 2 keeps the rows of the groups still in
    flight (their agents cannot be saved), and the resumed run starts them again beside the step's new groups, so
    its pool holds them after step 3 (without them it would be empty: the resumed run draws no extra groups,
    rollout_partial_oversample=0, so its new groups are exactly the step's share). In the same process, DAPO's
    filter_groups over the agents' pool: its extra rounds add groups to the live pool (the combination's checks).
    The DAPO run's trainer has tools= too: the agent's ``tools`` parameter gets them (``tools_given`` raises
    otherwise).
    Mutations tried: the restored pool ignored on resume -> pool_groups 0 at step 3, the assertion fails; the
    runner not given the trainer's tools -> tools_given raises, the run fails."""
    combo = next(c for c in ALLOWED if c["name"] == "shares-partial-agent")
    options = {**combo["options"], "save_strategy": "steps", "save_steps": 2}
    entries = [{"name": "first", "episode": "agent", "options": {**options, "max_steps": 2}},
               {"name": "resumed", "episode": "agent", "resume": str(tmp_path / "first" / "checkpoint-2"),
                "options": {**options, "max_steps": 3, "output_dir": str(tmp_path / "first"),
                            "rollout_partial_oversample": 0.0}},
               {"name": "dapo", "episode": "agent", "agent_tools": True,  # (with tools=: the agents get them)
                "options": {**combo["options"], "filter_groups": True, "filter_groups_max_rounds": 2}}]
    run_script_in_process(ROOT / "tests/assets/axes_combinations.py", str(tmp_path), json.dumps(entries),
                          env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1"})
    saved = json.loads((tmp_path / "first" / "checkpoint-2" / "nrollout_partial_rank0.json").read_text())
    first = json.loads((tmp_path / "first.json").read_text())
    left = [h["partial/pool_groups"] for h in first["history"] if "partial/pool_groups" in h][-1]
    assert left > 0 and len(saved["groups"] if isinstance(saved, dict) else saved) == left
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    steps = [h for h in resumed["history"] if "partial/pool_groups" in h]
    assert len(steps) == 3 and steps[-1]["partial/pool_groups"] == left, steps  # (steps 1-2: the checkpoint's log)
    dapo = json.loads((tmp_path / "dapo.json").read_text())
    check_combination(combo, dapo)
    assert max(h.get("dynamic_sampling/rounds", 0) for h in dapo["history"]) > 0  # extra rounds joined the pool
