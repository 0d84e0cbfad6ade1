"""Episode kinds (trainer/episodes.py, chosen once by trainer/collector.py's table): the contributor's proof of issue 61
item 7. docs/architecture.md's "Adding an episode kind" walks through a new kind; this test runs that section's own
code (read from the doc, so the doc and the test cannot drift) on one step of the HF engine."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def section(title: str) -> str:
    """The text of one ``## `` section of docs/architecture.md."""
    return DOC.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_docs_worked_episode_kind_trains(tmp_path):
    """The doc's ``FixedSuffix`` kind, its ``KINDS`` row and an option set on the config: the trainer chooses that
    kind when it is built, and one training step's samples end with the suffix, masked out of the loss with log-prob
    0, while the policy's own tokens stay trained. Mutations tried: ``choose_episode_kind`` skipping the table's
    first row (the kind is never chosen: fails); the collector ignoring a kind's ``tokenized`` (no prompt ids for
    SingleTurn: fails)."""
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import digits_dataset, digits_reward
    from trl_nrollout.trainer.collector import KINDS

    code = "\n\n".join(BLOCK.findall(section("Adding an episode kind")))
    assert "class FixedSuffix" in code and "KINDS.insert" in code
    rows = list(KINDS)
    namespace: dict = {}
    try:
        exec(compile(code, str(DOC), "exec"), namespace)  # the doc's class and its row
        args = NRolloutConfig(output_dir=str(tmp_path), train_batch_size=2, rollout_n=2, max_completion_length=4,
                              max_steps=1, rollout_backend="hf", report_to="none", use_cpu=True, bf16=False,
                              save_strategy="no", logging_steps=1, seed=0)
        args.completion_suffix = " done"  # (in the package: a field of NRolloutConfig)
        trainer = NRolloutGRPOTrainer("builtin:tiny-qwen2", reward_funcs=[digits_reward], args=args,
                                      train_dataset=digits_dataset(8))
        kind = trainer.collector.kind
        assert isinstance(kind, namespace["FixedSuffix"]), type(kind)
        suffix = list(kind.suffix_ids)
        assert suffix
        seen = []
        run = kind.run
        object.__setattr__(kind, "run", lambda job: seen.append(run(job)) or seen[-1])  # (a frozen dataclass)
        trainer.train()
        trainer.close()
    finally:
        KINDS[:] = rows
    assert seen, "the kind never ran"
    batch, episode = seen[0]
    for ids, logprobs, mask in zip(batch.completion_ids, batch.logprobs, episode.tool_mask, strict=True):
        assert ids[-len(suffix):] == suffix
        assert logprobs[-len(suffix):] == [0.0] * len(suffix)
        assert mask[-len(suffix):] == [0] * len(suffix) and all(mask[:-len(suffix)])
    assert any(len(ids) > len(suffix) for ids in batch.completion_ids)  # the policy's own tokens
    assert any("loss" in entry for entry in trainer.state.log_history)


def test_the_doc_names_at_most_three_package_files():
    """The section's list of files a new kind touches: at most three package files plus its test."""
    text = section("Adding an episode kind")
    steps = re.findall(r"^\d\. .*?`((?:trainer|config|rollout)/[\w/]+\.py)`", text, re.MULTILINE)
    assert 1 <= len(set(steps)) <= 3, steps
