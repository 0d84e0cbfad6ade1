"""Peak memory and time of the old-policy + reference log-prob passes as n grows: ours vs TRL GRPOTrainer's.

For n = 4, 8, 12, 16 (a fixed number of prompts, so samples grow with n), each configuration runs in a fresh
process (peak RSS only grows within a process) and reports the peak RSS added by the two passes over the
process's state just before them, and their wall time:

- ``trl``: ``GRPOTrainer._get_per_token_logps_and_entropies`` as TRL calls it, chunked at
  ``per_device_train_batch_size``, which must hold all ``prompts x n`` samples of a step when
  ``steps_per_generation=1`` (so its chunk grows with n);
- ``ours``: :func:`trl_nrollout.passes.logprobs.compute_log_probs` with a fixed micro batch (``--micro-batch``) or
  token budget (``--max-token-len``).

The model is a random Qwen2 with a 32k vocabulary (the vocabulary is what makes this pass expensive), built in
memory. Writes JSON, a PNG plot and a Markdown table under ``--out`` (default ``benchmarks/results``).

    python benchmarks/logprob_memory.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_model(vocab: int, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def make_samples(prompts: int, n: int, vocab: int, prompt_len: int, completion_len: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    ps, cs = [], []
    for _ in range(prompts):
        p = torch.randint(3, vocab, (int(torch.randint(prompt_len // 2, prompt_len + 1, (1,), generator=g)),),
                          generator=g).tolist()
        for _ in range(n):
            c_len = int(torch.randint(completion_len // 4, completion_len + 1, (1,), generator=g))
            ps.append(p)
            cs.append(torch.randint(3, vocab, (c_len,), generator=g).tolist())
    return ps, cs


def run_one(impl: str, n: int, args) -> dict:
    """One configuration in this process: returns peak RSS added (MiB) and seconds for old + ref passes."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    policy, ref = build_model(args.vocab), build_model(args.vocab)
    prompts, completions = make_samples(args.prompts, n, args.vocab, args.prompt_len, args.completion_len)
    if impl == "trl":
        from types import SimpleNamespace

        from accelerate import Accelerator
        from trl import GRPOTrainer
        from trl.trainer.utils import add_fused_lm_head

        for m in (policy, ref):  # as GRPOTrainer.__init__ does: TRL's own chunked (fused) LM head
            add_fused_lm_head(m, temperature=1.0, outputs=("log_probs", "entropy"))

        p_max = max(len(p) for p in prompts)
        c_max = max(len(c) for c in completions)
        ids = torch.zeros(len(prompts), p_max + c_max, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids[i, p_max - len(p):p_max] = torch.tensor(p)
            mask[i, p_max - len(p):p_max] = 1
            ids[i, p_max:p_max + len(c)] = torch.tensor(c)
            mask[i, p_max:p_max + len(c)] = 1
        fake_self = SimpleNamespace(accelerator=Accelerator(cpu=True))
        batch = len(prompts)  # per_device_train_batch_size = prompts x n when steps_per_generation = 1

        def passes():
            with torch.no_grad():
                for m in (policy, ref):
                    GRPOTrainer._get_per_token_logps_and_entropies(fake_self, m, ids, mask, c_max, batch_size=batch,
                                                                   compute_entropy=m is policy)
    else:
        from trl_nrollout.passes.logprobs import compute_log_probs

        def passes():
            for m in (policy, ref):
                compute_log_probs(m, prompts, completions, micro_batch_size=args.micro_batch,
                                  max_token_len=args.max_token_len, with_entropy=m is policy)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    passes()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"impl": impl, "n": n, "samples": len(prompts), "peak_rss_added_mib": round(after - before, 1),
            "peak_rss_mib": round(after, 1), "seconds": round(seconds, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--completion-len", type=int, default=96)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--max-token-len", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="smaller samples (about a minute)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--one", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.completion_len = 8, 64
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args)))
        return 0

    from tqdm import tqdm

    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--quick"]
    if args.quick:
        forwarded += ["--prompts", str(args.prompts), "--completion-len", str(args.completion_len)]
    rows = []
    for n in tqdm(args.ns, desc="log-prob passes (n)"):
        for impl in ("trl", "ours"):
            out = subprocess.run([sys.executable, __file__, *forwarded, "--one", impl, str(n)], capture_output=True,
                                 text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"vocab": args.vocab, "prompts": args.prompts, "prompt_len": args.prompt_len,
            "completion_len": args.completion_len, "micro_batch": args.micro_batch,
            "max_token_len": args.max_token_len, "cpus": os.cpu_count(),
            "load_avg_at_start": os.getloadavg()[0]}
    (out_dir / "logprob_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    def get(impl, n, key):
        return next(r[key] for r in rows if r["impl"] == impl and r["n"] == n)

    lines = ["| n | samples | TRL peak RSS added (MiB) | ours (MiB) | ours / TRL | TRL time (s) | ours (s) |",
             "|---|---|---|---|---|---|---|"]
    for n in args.ns:
        t, o = get("trl", n, "peak_rss_added_mib"), get("ours", n, "peak_rss_added_mib")
        lines.append(f"| {n} | {get('ours', n, 'samples')} | {t} | {o} | {o / t if t else float('nan'):.2f} | "
                     f"{get('trl', n, 'seconds')} | {get('ours', n, 'seconds')} |")
    first, last = args.ns[0], args.ns[-1]
    growth_ours = get("ours", last, "peak_rss_added_mib") / max(get("ours", first, "peak_rss_added_mib"), 1e-9)
    growth_trl = get("trl", last, "peak_rss_added_mib") / max(get("trl", first, "peak_rss_added_mib"), 1e-9)
    lines.append("")
    lines.append(f"Peak growth n={first} -> n={last}: ours x{growth_ours:.2f}, TRL x{growth_trl:.2f}.")
    table = "\n".join(lines)
    (out_dir / "logprob_memory.md").write_text(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for impl, label in (("trl", "TRL GRPOTrainer pass"), ("ours", "trl_nrollout (micro-batched, lean head)")):
            axes[0].plot(args.ns, [get(impl, n, "peak_rss_added_mib") for n in args.ns], marker="o", label=label)
            axes[1].plot(args.ns, [get(impl, n, "seconds") for n in args.ns], marker="o", label=label)
        axes[0].set(xlabel="samples per prompt n", ylabel="peak RSS added (MiB)", title="old + ref log-prob passes")
        axes[1].set(xlabel="samples per prompt n", ylabel="seconds", title="time")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "logprob_memory.png", dpi=110)
    except ImportError:
        print("matplotlib not installed: no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
