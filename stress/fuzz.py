"""Fuzz the decoders for longer than the test suite does: the properties of
tests/unit/test_decoders_fuzz.py (`PROPERTIES`: only the documented error class comes out of a
decoder, whatever the bytes), each run for ``--minutes`` of this process's CPU time with random
seeds instead of the suite's derandomized 150 examples. CPU time, not wall time: on a shared
machine a wall-clock budget would silently shrink the fuzzing to the process's share of a core.

    python stress/fuzz.py --minutes 5                  # every decoder, 5 minutes each
    python stress/fuzz.py --minutes 30 --only envelope verse-entry --out stress/results/fuzz.log

Prints, per decoder, the examples run, the CPU and wall seconds spent, the slowest example (ms,
wall), the peak RSS of the process, and every finding: the exception, the shrunk example
hypothesis reports, and the blob to reproduce it (``@reproduce_failure``). A finding becomes a
regression test in the suite.
With ``--out``, each decoder's lines are appended as soon as it is done (a run stopped half-way
keeps what it finished). Exits 1 when anything was found.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, seed, settings

ROOT = Path(__file__).resolve().parents[1]
RUN_S = 30.0
"""Seconds of examples per hypothesis run (one seed; a run shrinks what it finds): the batch is
sized from the rate measured so far."""


def load_properties() -> dict[str, Any]:
    """`PROPERTIES` of the test module, imported by path (tests/ is no package)."""
    path = ROOT / "tests" / "unit" / "test_decoders_fuzz.py"
    spec = importlib.util.spec_from_file_location("decoders_fuzz", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return dict(module.PROPERTIES)


def fuzz(prop: Any, cpu_seconds: float, rng: random.Random) -> dict[str, Any]:
    """Run `prop` with random seeds for `cpu_seconds` of this process's CPU time; what was run
    and found (``cpu_s`` and ``wall_s`` spent)."""
    stats: dict[str, Any] = {"examples": 0, "slowest_ms": 0.0, "findings": [], "seen": set()}
    started_all = time.process_time()
    started_wall = time.monotonic()
    deadline = started_all + cpu_seconds
    batch = 50
    while (left := deadline - time.process_time()) > 0:

        @settings(
            max_examples=batch,
            derandomize=False,
            deadline=None,
            database=None,
            print_blob=True,
            suppress_health_check=list(HealthCheck),
        )
        @seed(rng.getrandbits(64))
        @given(prop.strategy)
        def holds(example: Any) -> None:
            started = time.perf_counter()
            try:
                prop.run(example)
            finally:
                stats["examples"] += 1
                ms = (time.perf_counter() - started) * 1000
                stats["slowest_ms"] = max(stats["slowest_ms"], ms)

        try:
            holds()
        except Exception as exc:  # a finding: hypothesis raised it after shrinking
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{type(exc).__name__} at {frame.filename}:{frame.lineno}"
            if where in stats["seen"]:
                continue  # the same bug again, from another seed
            stats["seen"].add(where)
            stats["findings"].append(
                {
                    "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                    "where": "".join(traceback.format_exception(exc)[-3:])[-1500:],
                    "report": "\n".join(getattr(exc, "__notes__", []))[-3000:],
                }
            )
        rate = stats["examples"] / max(time.process_time() - started_all, 1e-3)
        left = deadline - time.process_time()
        batch = int(min(max(rate * min(RUN_S, left), 20), 20_000))
    stats["cpu_s"] = time.process_time() - started_all
    stats["wall_s"] = time.monotonic() - started_wall
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=1.0, help="CPU minutes per decoder (default 1)"
    )
    parser.add_argument("--only", nargs="*", help="decoders by name (default: all)")
    parser.add_argument("--seed", type=int, help="seed of the seeds (default: random)")
    parser.add_argument("--out", type=Path, help="also append the log to this file")
    args = parser.parse_args()
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    props = load_properties()
    names = args.only or sorted(props)
    unknown = sorted(set(names) - set(props))
    if unknown:
        parser.error(f"unknown decoders {unknown}; choose from {sorted(props)}")
    master = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    rng = random.Random(master)

    def log(text: str) -> None:
        print(text, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(text + "\n")

    log(f"stress/fuzz.py --minutes {args.minutes} --seed {master} (decoders: {len(names)})")
    found = 0
    for name in names:
        stats = fuzz(props[name], args.minutes * 60, rng)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        log(
            f"{name}: {stats['examples']} examples, CPU {stats['cpu_s']:.0f} s, "
            f"wall {stats['wall_s']:.0f} s, slowest {stats['slowest_ms']:.1f} ms, "
            f"peak RSS {rss_mb:.0f} MB, findings {len(stats['findings'])}"
        )
        for finding in stats["findings"]:
            found += 1
            log(f"  FINDING {finding['error']}\n{finding['where']}\n{finding['report']}")
    log(f"total findings: {found}\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
