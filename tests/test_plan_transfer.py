"""``plan`` prices the rollout ranks' weight transfer as what it is (trainer rank 0's device -> host -> gloo ->
the rollout ranks' hosts -> their devices, over the node link when they are on another node) and partial rollouts'
pool in the generation's timing (issue 50). Fast tier: no process, no torch model."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from trl_nrollout.cli import main
from trl_nrollout.plan.devices import GBPS, PROFILES
from trl_nrollout.plan.layout import RolloutLayout
from trl_nrollout.plan.models import model_dims
from trl_nrollout.plan.search import host_transfer_s, predict_split
from trl_nrollout.plan.workload import Workload

H100 = PROFILES["h100"]
WORK = Workload(prompt_len=256.0, completion_mean=512.0, completion_max=512, max_num_seqs=256)


def _layout(world: int, tp: int = 1, prompts: int = 60, n: int = 12) -> RolloutLayout:
    return RolloutLayout.build(num_processes=world, rollout_tp_size=tp, train_batch_size=prompts, rollout_n=n,
                               adv_estimator="grpo")


def test_the_rollout_ranks_transfer_goes_through_host_memory_over_gloo():
    """A 7B's 15 GB to 2 rollout ranks on an H100 node: never less than its bytes over gloo's host-to-host stream
    plus the two PCIe copies (device -> host on trainer rank 0, host -> device on a rollout rank), far above the
    colocated on-device copy the step prices; the same bytes across a slower node link cost more; slower PCIe
    costs more."""
    dims = model_dims("Qwen/Qwen2.5-7B")
    nbytes = dims.num_parameters * dims.dtype_bytes
    pred = predict_split(dims, _layout(2), _layout(6, prompts=60), WORK, H100)
    floor = nbytes / H100.gloo_bw + nbytes / H100.host_rate
    assert pred.transfer_s >= floor and pred.transfer_s > 3.0  # not the 0.16 s of an on-device copy
    assert pred.sync_s == pytest.approx(pred.generation_s + pred.transfer_s + pred.train_s)
    slow_node = replace(H100, node_link_bw=1 * GBPS)
    across = predict_split(dims, _layout(2), _layout(6), WORK, slow_node, cross_node=True)
    assert across.transfer_s > predict_split(dims, _layout(2), _layout(6), WORK, slow_node).transfer_s
    assert across.transfer_s >= nbytes / (1 * GBPS * H100.link_eff)
    assert host_transfer_s(nbytes, 2, False, replace(H100, host_bw=8 * GBPS)) > host_transfer_s(nbytes, 2, False,
                                                                                                 H100)
    # gloo's broadcast is a tree: 7 receivers take 3 rounds, 1 receiver one
    one, seven = host_transfer_s(nbytes, 1, False, H100), host_transfer_s(nbytes, 7, False, H100)
    assert seven - one == pytest.approx(2 * nbytes / H100.gloo_bw)


def test_plan_predict_prints_the_host_transfer_and_the_node_link(capsys):
    """``plan --rollout-ranks --predict`` shows the transfer's path and seconds; with two nodes the rollout ranks
    are across the node link and the row says so."""
    flags = ["--rollout-n", "12", "--model", "Qwen/Qwen2.5-7B-Instruct", "--device", "h100", "--no-memory",
             "--predict", "--trainer-sharding", "zero3", "--use-dynamic-bsz"]
    main(["plan", "--num-processes", "8", "--rollout-ranks", "2", "--train-batch-size", "60", *flags])
    out = capsys.readouterr().out
    seconds = float(re.search(r"weight transfer\s+([\d.]+) s \(device -> host, gloo on the node -> rollout ranks' "
                              r"devices\)", out).group(1))
    assert seconds > 3.0
    main(["plan", "--num-processes", "16", "--nnodes", "2", "--rollout-ranks", "8", "--train-batch-size", "64",
          *flags, "--json"])
    d = json.loads(capsys.readouterr().out)
    assert d["prediction"]["split"]["transfer_s"] > seconds  # 8 receivers: more rounds of the tree
    main(["plan", "--num-processes", "16", "--nnodes", "2", "--rollout-ranks", "8", "--train-batch-size", "64",
          *flags])
    assert "gloo over the node link" in capsys.readouterr().out


def test_partial_rollouts_cut_the_generations_tail():
    """With partial rollouts the pool in flight (share x pool_factor) runs and a step ends with its share's tokens:
    at long tails (mean 1000 of 4096) generation is much shorter than waiting for the longest completion, and a
    larger pool runs more sequences per engine step."""
    from trl_nrollout.plan.cost import predict_step

    dims = model_dims("Qwen/Qwen2.5-7B")
    layout = _layout(8, prompts=64, n=8)
    work = Workload(prompt_len=256.0, completion_mean=1000.0, completion_max=4096, max_num_seqs=256)
    plain = predict_step(dims, layout, work, H100)
    partial = predict_step(dims, layout, replace(work, partial=True, pool_factor=2.0), H100)
    assert partial.phases["generation"] < plain.phases["generation"] / 2
    assert partial.details["decode_steps"] == pytest.approx(64 * 1000 / 128)
    assert partial.details["mean_running"] == pytest.approx(128)
    assert partial.details["kv_bytes"] > plain.details["kv_bytes"]


def _pasted_plan_outputs(doc: str) -> list[tuple[str, str]]:
    """``(command, pasted output)`` for each ``text`` block of ``doc`` that directly follows a ``bash`` block running
    ``trl-nrollout plan`` (prose between them, no other block)."""
    from tests.conftest import ROOT

    text = (ROOT / "docs" / doc).read_text()
    pairs = re.findall(r"```bash\n(trl-nrollout plan [^`]*?)```\n(?:(?!```).)*?```text\n(.*?)```", text, re.DOTALL)
    return [(cmd.replace("\\\n", " ").split("||")[0].split("#")[0], out) for cmd, out in pairs]


def test_docs_walkthroughs_paste_the_plans_real_output(capsys, monkeypatch):
    """Every doc's plan walkthroughs (concepts.md: the 7B on 6 H100s, --predict then --suggest, the 1.5B on one 24 GB
    GPU, full then LoRA; backends.md: rollout ranks on 16 H100s, Ulysses' all-to-alls): every line pasted under a
    ``trl-nrollout plan`` command is a line the command prints now. Mutation tried: a figure of backends.md's
    rollout-rank example edited by one digit fails."""
    import shlex

    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)
    pairs = _pasted_plan_outputs("concepts.md")
    assert len(pairs) >= 4 and any("--lora-r 16" in c for c, _ in pairs) and any("--suggest" in c for c, _ in pairs)
    backends = _pasted_plan_outputs("backends.md")
    assert any("--rollout-ranks 8" in c for c, _ in backends) and any("--sequence-parallel-size 2" in c
                                                                       for c, _ in backends)
    others = [pair for doc in sorted((ROOT / "docs").glob("*.md")) if doc.name not in ("concepts.md", "backends.md")
              for pair in _pasted_plan_outputs(doc.name)]
    for cmd, pasted in pairs + backends + others:
        main(shlex.split(cmd)[1:])
        out = capsys.readouterr()
        printed = {line.rstrip() for line in (out.out + out.err).splitlines()}
        for line in pasted.splitlines():
            assert line.rstrip() in printed, f"{cmd}\nnot printed: {line!r}"


def test_suggest_offloads_the_optimizer_where_sharding_alone_fits_nothing(capsys):
    """A 7B fully trained on one 80 GB H100: no sharding splits anything over one device (16 bytes per parameter,
    113 GiB), so --suggest tries ZeRO-3 with the optimizer on the host (ZeRO-Offload: 4 bytes per parameter on the
    device, bf16 weights and gradients), names its shipped accelerate config and says why; where a sharding fits
    (the 7B on 6 H100s) offload is not offered."""
    from tests.conftest import ROOT
    from trl_nrollout.plan.cost import trainer_state_bytes
    from trl_nrollout.plan.figures import sharding_of

    flags = ["--train-batch-size", "8", "--rollout-n", "8", "--model", "Qwen/Qwen2.5-7B-Instruct", "--device", "h100",
             "--no-memory", "--max-prompt-length", "256", "--max-completion-length", "512", "--suggest", "--json"]
    assert main(["plan", "--num-processes", "1", *flags]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ranked"] and {c["options"]["trainer_sharding"] for c in d["ranked"]} == {"zero3_offload"}
    assert all(c["options"]["accelerate_config"] == "recipes/accelerate/zero3_offload.yaml" for c in d["ranked"])
    assert any("optimizer offloaded to host memory" in n for n in d["notes"])
    assert sharding_of(ROOT / "recipes/accelerate/zero3_offload.yaml") == "zero3_offload"
    dims = model_dims("Qwen/Qwen2.5-7B-Instruct")
    offload = Workload(prompt_len=1, completion_mean=1, completion_max=1, sharded=True, optimizer_offloaded=True)
    assert trainer_state_bytes(dims, offload) == dims.num_parameters * 4
    assert main(["plan", "--num-processes", "6", "--rollout-tp-size", "2", "--train-batch-size", "60", "--rollout-n",
                 "12", "--model", "Qwen/Qwen2.5-7B", "--device", "h100", "--no-memory", "--suggest", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ranked"] and "zero3_offload" not in {c["options"].get("trainer_sharding") for c in d["ranked"]}
