"""What the step probe's digests cost the reference trainer, against its step time, on CPU.

Under chaos every rank runs through `chaos.entry`, whose step probe (`chaos.probe`) digests
the rank's parameters and optimizer state (sha256 of its local shards) after each optimizer
step, or every K steps (``--digest-every``). Each round runs the reference trainer's fault-free
job twice through the harness (`chaos.harness.run_job`, 2 ranks, gloo, its default model,
no checkpoints), in alternating order:
  every      the state digested every step (K = 1, the default)
  never      digested every 10**9 steps: the same probe, no state digest (the baseline)
and reads the trainer's own ``train.metrics`` step time (forward, backward, optimizer step
with the probe's post-hook in it) of steps after the first two (warm-up), and the probe's
``digest_s`` of the `every` runs. The figures are medians over both ranks and all rounds; the
ratios are against `never` in the same run.

Usage: .venv/bin/python scripts/bench_digest.py [--rounds N] [--steps S]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from chaos.harness import Job, run_job
from chaos.plan import Plan
from commlib.observe.events import read_run

VARIANTS = {"every": 1, "never": 10**9}
WARM_UP = 2  # steps left out: the first compiles and allocates


def run(digest_every: int, steps: int, directory: Path) -> dict[str, list[float]]:
    """One fault-free job; its ranks' step times and digest times."""
    job = Job(trainer_args=("--steps", str(steps), "--ckpt-every", "0"), digest_every=digest_every)
    outcome = run_job(job, Plan(), directory, timeout_s=900, inject=False)
    if not outcome.ok:
        raise SystemExit(f"the job in {directory} failed: exit codes {outcome.exit_codes}")
    events = list(read_run(directory / "logs"))
    return {
        "step_s": [e["step_time_s"] for e in events if e["event"] == "train.metrics" and e["step"] > WARM_UP],
        "digest_s": [e["digest_s"] for e in events if e["event"] == "train.step" and "digest_s" in e],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    found: dict[str, dict[str, list[float]]] = {v: {"step_s": [], "digest_s": []} for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench_digest.") as base:
        for r in range(args.rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                measured = run(VARIANTS[variant], args.steps, Path(base) / f"{variant}{r}")
                for key, values in measured.items():
                    found[variant][key] += values
    every, never = (statistics.median(found[v]["step_s"]) for v in ("every", "never"))
    digest = statistics.median(found["every"]["digest_s"])
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "steps": args.steps,
                "step_s_never": round(never, 5),
                "step_s_every": round(every, 5),
                "digest_s": round(digest, 5),
                "step_time_ratio_every_over_never": round(every / never, 4),
                "digest_over_step": round(digest / never, 4),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
