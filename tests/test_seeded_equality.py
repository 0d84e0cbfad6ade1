"""scripts/seeded_equality.py: the record a refactor is checked against. Its comparison is pure (two folders of
step values), so it is tested here on records written by hand; the runs themselves are the recipe's and the tools
script's, tested elsewhere."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("seeded_equality", ROOT / "scripts" / "seeded_equality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, steps: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "default.json").write_text(json.dumps(steps))
    return folder


def test_a_changed_value_is_found_and_timings_are_not_compared(tmp_path, capsys):
    """Two records agree where every step's values are equal (NaN equals NaN); one changed value, a missing step or
    a missing run makes them differ, naming the step and the key. Timings never reach a record. Mutation: compare
    step counts only -> the changed loss passes."""
    se = _script()
    history = [{"loss": 0.5, "reward": float("nan"), "step_time": 3.1, "flag": True, "epoch": 0.1},
               {"loss": 0.25, "reward": 1.0, "rollout/wait_s": 0.2, "timing_s/gen": 0.1, "partial/aborted_samples": 3}, {"train_runtime": 9.0}]
    steps = se._steps(history)
    assert steps == [{"loss": 0.5, "reward": steps[0]["reward"], "epoch": 0.1}, {"loss": 0.25, "reward": 1.0, "partial/aborted_samples": 3}]
    a = _write(tmp_path / "a", steps)
    assert se.compare(a, _write(tmp_path / "b", json.loads(json.dumps(steps))))
    changed = [dict(steps[0]), {**steps[1], "loss": 0.2500001}]
    assert not se.compare(a, _write(tmp_path / "c", changed))
    assert "step 2 loss: 0.25 against 0.2500001" in capsys.readouterr().out
    assert not se.compare(a, _write(tmp_path / "d", steps[:1]))
    assert not se.compare(a, tmp_path / "missing")
    assert se.main(["compare", str(a), str(tmp_path / "c")]) == 1
