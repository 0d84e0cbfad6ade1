"""Run by tests/test_docs.py: the ```python blocks of several docs, one doc after another, in one process.

Each doc's blocks run as one script would (``__name__ == "__main__"``, a fresh namespace, its own working folder),
so the imports of torch, transformers, TRL and vLLM (about 10 s) are paid once for all docs instead of once per doc.
Between docs, what the end of a script would release is released: the trainers a block leaves open are closed (their
engines and process groups), accelerate's process state is reset and the distributed environment variables an
in-process vLLM engine sets are restored.

argv: a JSON file ``[{"name": ..., "code": ..., "cwd": ...}, ...]`` and the JSON file to write
``{name: {"ok": bool, "error": traceback or None, "seconds": float}}`` to (rewritten after each doc, so a crash
leaves the results so far).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback


def release(namespace: dict) -> None:
    """Close what a script's globals ``namespace`` left open, as the end of its process would: its trainers (their
    engines and process groups), accelerate's process state. Also used by tests/conftest.run_script_in_process."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    for value in list(namespace.values()):
        if isinstance(value, Trainer) and hasattr(value, "close"):
            value.close()
    AcceleratorState._reset_state(reset_partial_state=True)


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        docs = json.load(f)
    results: dict[str, dict] = {}
    home = os.getcwd()
    for doc in docs:
        env = dict(os.environ)
        namespace = {"__name__": "__main__", "__file__": os.path.join(doc["cwd"], "block.py")}
        start = time.perf_counter()
        print(f"=== {doc['name']}", flush=True)
        try:
            os.chdir(doc["cwd"])
            exec(compile(doc["code"], f"<{doc['name']}>", "exec"), namespace)
            error = None
        except SystemExit as exit_:  # a block may end with sys.exit(0)
            error = None if exit_.code in (None, 0) else traceback.format_exc()
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            error = traceback.format_exc()
        finally:
            try:
                release(namespace)
                namespace.clear()
                gc.collect()
            except Exception:  # noqa: BLE001
                error = (error or "") + "\nreleasing the block's trainers failed:\n" + traceback.format_exc()
            os.chdir(home)
            os.environ.clear()
            os.environ.update(env)
        results[doc["name"]] = {"ok": error is None, "error": error, "seconds": time.perf_counter() - start}
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
