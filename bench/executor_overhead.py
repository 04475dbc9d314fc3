"""Per-step cost of each executor: one request decoding on the 2M OPT, whose forward pass is
tiny, so the step time is mostly how the engine reaches its ranks.

    python bench/executor_overhead.py [--steps 256] [--ray-address ADDR]

Runs loom.LLM with tensor_parallel_size 2 on ``mp`` (worker processes under the supervisor,
frames through it) and on ``ray`` (actors; a local cluster is started when no address is
given), and tensor_parallel_size 1 in the engine's own process as the floor. Prints ms per
decode step for each and the difference to ``mp``. Needs Ray (``pip install 'loom-engine[ray]'``).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from offline_throughput import build_random_model  # bench/, this script's folder, is first on sys.path


def per_step_ms(model: str, steps: int, **engine: object) -> float:
    from loom import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=steps + 16, **engine)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 13))}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    best = float("inf")
    for _ in range(3):  # the best of three: the others share these cores
        started = time.perf_counter()
        llm.generate([prompt], params)
        best = min(best, (time.perf_counter() - started) / steps * 1e3)
    llm.shutdown()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--ray-address", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model = build_random_model("opt-2m", root)
        rows = [("tp=1, in process", per_step_ms(model, args.steps)),
                ("tp=2, mp", per_step_ms(model, args.steps, tensor_parallel_size=2)),
                ("tp=2, ray", per_step_ms(model, args.steps, tensor_parallel_size=2,
                                          distributed_executor_backend="ray", ray_address=args.ray_address))]
    mp = rows[1][1]
    print(f"{'executor':<18} {'ms/step':>8} {'vs mp':>8}")
    for name, ms in rows:
        print(f"{name:<18} {ms:8.2f} {ms - mp:+8.2f}")


if __name__ == "__main__":
    main()
