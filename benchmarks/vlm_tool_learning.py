"""A vision-language model learns from a tool's picture (issue 66's learning goal): the reward for answering by the
colour that only the tool shows rises, with vLLM engines, partial rollouts on, in 2 processes.

``NRolloutGRPOTrainer`` on ``builtin:tiny-idefics3-tools`` (the built-in VLM with a tool-calling template and one
token that calls ``show_picture``), launched as ``accelerate launch --multi_gpu --num_processes 2`` (two trainer
processes, each with its colocated vLLM engine), ``rollout_partial=True``. The prompts are the ``digits`` prompts as
text only; each sample's environment (``environment_factory``, TRL's per-sample tool host) has a ``show_picture``
method returning a red or a blue picture, the row's ``colour``: the picture reaches the model only through the
tool's result (its image appended to the sample's images, TRL 1.16's contract). The reward is the built-in
``colour_reward`` on the answer after the picture (the last assistant message's text), 0 where the tool did not run
(an answer without looking): on red the fraction of digits, on blue the fraction of other characters, so a model
that does not read the picture cannot score above about 0.5 on average (one kind of answer for both colours). The
start is the random model with its call token made likely (the tests' ``bias_toward_the_picture_call``, scale
``--bias``: a random model calls the tool in a few percent of its turns); ``max_tool_calling_iterations=1``: what a
sample writes after the picture, up to a second call or its end, is its answer.

Logged per step (means over both processes' samples): the reward, ``called``: the share of episodes whose tool ran
(``rewards/called/mean``, a reward function weighted 0), and each step's wall time on trainer rank 0.
``--control``: a second run whose tool shows a grey picture whatever the colour (the same task with the picture's
information removed): its reward stays at or below about 0.5.

    python benchmarks/vlm_tool_learning.py [--steps 30] [--lr 3e-3] [--seed 0] [--control] [--docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

from common import CHILD_ENV, ROOT, check_load, finish, pyplot, save_figure, write_table  # noqa: E402

ACCELERATE = str(Path(sys.executable).parent / "accelerate")
NAME = "vlm_tool_learning"


# ---------------------------------------------------------------------------------------------- the task
class ColourPicture:
    """A sample's environment: ``show_picture`` returns a picture of the row's colour (``grey``: a grey one whatever
    the colour, the control)."""

    grey = False

    def reset(self, colour: str, **row) -> None:
        self.colour, self.shown = colour, 0

    def show_picture(self) -> list:
        """Shows the picture to describe.

        Returns:
            The picture and a caption.
        """
        from PIL import Image

        from trl_nrollout.builtin import VLM_IMAGE_SIZE, colour_image

        self.shown += 1
        image = (Image.new("RGB", (VLM_IMAGE_SIZE, VLM_IMAGE_SIZE), (128, 128, 128)) if self.grey
                 else colour_image(self.colour, seed=self.shown))
        return [{"type": "image", "image": image}, {"type": "text", "text": "here"}]


class GreyPicture(ColourPicture):
    grey = True


def _answer(completion) -> str:
    """The text of an episode's last assistant message (what it wrote before a call, if it called again; "" when it
    ended on a tool's result)."""
    if isinstance(completion, str):
        return completion
    last = completion[-1] if completion else {}
    if last.get("role") != "assistant":
        return ""
    content = last.get("content") or ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def _looked(completion) -> bool:
    """Whether the episode's tool ran (a tool message in its completion)."""
    return isinstance(completion, list) and any(m.get("role") == "tool" for m in completion)


def named_colour(completions: list, colour: list[str], **kwargs) -> list[float]:
    """The built-in ``colour_reward`` on each episode's answer (its last assistant message) where it looked at the
    picture (its tool ran), else 0."""
    from trl_nrollout.builtin import colour_reward

    scores = colour_reward([_answer(c) for c in completions], colour)
    return [s if _looked(c) else 0.0 for s, c in zip(scores, completions, strict=True)]


def called(completions: list, **kwargs) -> list[float]:
    """1 where the episode's tool ran (a tool message in its completion); weighted 0, logged."""
    return [float(_looked(c)) for c in completions]


def train(out: str, steps: int, lr: float, seed: int, control: bool, bias: float) -> None:
    """The launched side (each of the 2 processes): train, and on rank 0 write ``result.json``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback

    from tests.assets.axes_combinations import bias_toward_the_picture_call
    from trl_nrollout import NRolloutConfig, NRolloutGRPOTrainer
    from trl_nrollout.builtin import image_dataset, resolve_model

    path = resolve_model("builtin:tiny-idefics3-tools")
    model = AutoModelForImageTextToText.from_pretrained(path)
    bias_toward_the_picture_call(model, AutoProcessor.from_pretrained(path).tokenizer, scale=bias)
    clock: list[float] = [time.perf_counter()]

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control_, **kwargs):
            clock.append(time.perf_counter())

    args = NRolloutConfig(output_dir=out, per_device_train_batch_size=32, num_generations=4, max_completion_length=32,
                          max_steps=steps, learning_rate=lr, logging_steps=1, report_to="none", use_cpu=True,
                          bf16=False, save_strategy="no", seed=seed, use_vllm=True, rollout_partial=True,
                          max_tool_calling_iterations=1, reward_weights=[1.0, 0.0], disable_tqdm=True)
    trainer = NRolloutGRPOTrainer(model=model, processing_class=AutoProcessor.from_pretrained(path),
                                  reward_funcs=[named_colour, called], args=args,
                                  train_dataset=image_dataset(512, seed=seed).remove_columns("image"),
                                  environment_factory=GreyPicture if control else ColourPicture,
                                  callbacks=[StepClock()])
    trainer.train()
    if trainer.accelerator.is_main_process:
        Path(out, "result.json").write_text(json.dumps({
            "history": trainer.state.log_history, "step_s": [b - a for a, b in zip(clock, clock[1:])],
            "processes": trainer.accelerator.num_processes}))
    trainer.close()


# ---------------------------------------------------------------------------------------------- the parent
def run(arm: str, args) -> dict:
    """One launch (``arm``: "picture" or "control"): its steps' reward, tool share and wall time."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--train", out, "--steps",
               str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed), "--bias", str(args.bias), *(["--control"] if arm == "control"
                                                                               else [])]
        env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT)}
        print(f"{arm}: 2 processes, {args.steps} steps", file=sys.stderr, flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{arm} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        result = json.loads(Path(out, "result.json").read_text())
    rows = [h for h in result["history"] if "rewards/called/mean" in h]
    steps = [{"step": h["step"], "reward": h["rewards/named_colour/mean"], "called": h["rewards/called/mean"],
              "seconds": s} for h, s in zip(rows, result["step_s"], strict=False)]
    for s in steps:
        print(f"{arm} step {s['step']}: reward {s['reward']:.3f}, tool ran {s['called']:.2f}, {s['seconds']:.1f} s",
              file=sys.stderr)
    return {"arm": arm, "steps": steps, "processes": result["processes"], "wall_s": time.perf_counter() - start}


def summary(arm: dict, window: int = 5) -> dict:
    """First and last ``window`` steps' mean reward, the median step time."""
    rewards = [s["reward"] for s in arm["steps"]]
    return {"first": statistics.fmean(rewards[:window]), "last": statistics.fmean(rewards[-window:]),
            "step_s": statistics.median(s["seconds"] for s in arm["steps"]),
            "called_last": statistics.fmean(s["called"] for s in arm["steps"][-window:])}


def table_lines(result: dict) -> list[str]:
    """The Markdown table of a result (its JSON as written): one row per run."""
    lines = ["| run | reward, steps 1-5 | reward, last 5 steps | tool ran, last 5 steps | step time (median) | "
             "launch wall time |", "|---|---|---|---|---|---|"]
    for arm in result["arms"]:
        s = summary(arm)
        lines.append(f"| {arm['arm']} | {s['first']:.3f} | {s['last']:.3f} | {s['called_last']:.2f} | "
                     f"{s['step_s']:.1f} s | {arm['wall_s']:.0f} s |")
    return lines


def write_outputs(result: dict, out_dir: Path) -> str:
    meta = result["meta"]
    lines = table_lines(result)
    lines += ["", f"`builtin:tiny-idefics3-tools` (call token made likely at the start), text prompts, the picture only "
              f"through the tool (`environment_factory`); 2 processes (vLLM engine each, partial rollouts), 32 samples "
              f"(8 prompts x 4) per process per step, lr {meta['lr']:g}, {meta['steps']} steps, seed {meta['seed']}, "
              f"{meta['cpus']} CPUs. Reward without seeing the picture: at most about 0.5. Load average (1 min) "
              f"{result['load_avg_start'][0]:.2f} at start, {result['load_avg_end'][0]:.2f} at end."]
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5.8, 3.3))
        for arm, colour in zip(result["arms"], ("tab:red", "tab:grey"), strict=False):
            xs = [s["step"] for s in arm["steps"]]
            label = "tool shows the colour" if arm["arm"] == "picture" else "control: tool shows a grey picture"
            ax.plot(xs, [s["reward"] for s in arm["steps"]], marker="o", ms=3, color=colour, label=label)
            ax.plot(xs, [s["called"] for s in arm["steps"]], ls=":", color=colour, alpha=0.6,
                    label="share of episodes whose tool ran" if arm["arm"] == "picture" else None)
        ax.axhline(0.5, color="black", lw=0.8, ls="--", label="best without the picture")
        ax.set(xlabel="step", ylabel="reward", ylim=(-0.02, 1.02),
               title="tiny VLM, picture from a tool: vLLM, partial, 2 processes")
        ax.title.set_fontsize(10)
        ax.legend(fontsize=7, loc="lower right")
        save_figure(fig, out_dir / f"{NAME}.png")
        if meta.get("docs"):
            (ROOT / "docs" / "img" / f"{NAME}.png").write_bytes((out_dir / f"{NAME}.png").read_bytes())
    table = write_table(result, lines, out_dir, NAME)
    if meta.get("docs"):
        (ROOT / "docs" / "results" / f"{NAME}.json").write_text(json.dumps(result, indent=2))
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bias", type=float, default=8.0, help="the call token's start logit along the mean hidden state "
                                                            "(bias_toward_the_picture_call's scale)")
    ap.add_argument("--control", action="store_true", help="also run the grey-picture control (launched side: "
                                                           "this run is the control)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--docs", action="store_true", help="also write docs/img/ and docs/results/")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--train", help=argparse.SUPPRESS)  # the launched side: its output folder
    ap.add_argument("--replot", help=argparse.SUPPRESS)  # a saved result JSON: its table and plot again
    args = ap.parse_args(argv)
    if args.train:
        train(args.train, args.steps, args.lr, args.seed, args.control, args.bias)
        return 0
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        result["meta"]["docs"] = args.docs
        return finish(result, args.out, write_outputs, result["busy_at_start"], tuple(result["load_avg_start"]))
    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    load, busy = check_load(NAME)
    from trl_nrollout.builtin import resolve_model

    resolve_model("builtin:tiny-idefics3-tools")  # built once, before the launch
    arms = [run("picture", args)] + ([run("control", args)] if args.control else [])
    result = {"meta": {"steps": args.steps, "lr": args.lr, "seed": args.seed, "bias": args.bias, "cpus": os.cpu_count(),
                       "docs": args.docs}, "arms": arms, "load_avg_start": list(load),
              "load_avg_end": [round(x, 2) for x in os.getloadavg()], "busy_at_start": busy}
    return finish(result, args.out, write_outputs, busy, load)


if __name__ == "__main__":
    sys.exit(main())
