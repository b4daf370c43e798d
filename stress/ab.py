"""A/B of two revisions: the same benchmark on both trees, alternated, medians and ratios.

    stress/ab.sh REV_A REV_B [--pairs 3] [--what bench|flights|consume|publish|spark-writer|tier]
                 [--whole-tree] [--json F] [-- ARGS]

Each revision is checked out once into a git worktree under ``.cache/ab/`` (``.`` means this
checkout as it is, uncommitted changes included). By default both are measured by the same
harness, this checkout's (stress/, examples/), with the revision's ``eventbus`` package first on
``PYTHONPATH`` (a folder holding only a link to it): the trees differ in the library only, not
in how they are measured. With ``--whole-tree`` each revision runs its *own* tree: the command
runs in the revision's checkout with it alone on ``PYTHONPATH``, so its ``stress/`` and
``examples/`` are the ones measured (``--what flights --whole-tree`` compares the flights job as
each tree ships it, example code included). Either way the interpreter and the installed
packages are this checkout's virtual environment, and runs get ``PYTHONSAFEPATH=1``: ``python
-m`` puts the working directory first on ``sys.path``, which before 2026-11-26 (s30) made every
``--what flights`` run import this checkout's ``eventbus`` on both sides. The runs alternate,
A B A B ..., so that a machine whose speed drifts during the session drifts for both trees
alike. For each numeric figure of the runs' JSON it prints the median per tree and the ratio
B/A of the medians; with ``--json`` it also writes every run. A run that writes no result is
reported and left out (the medians are those of the runs that did); the exit code is then 1.

``--what``:

* ``bench``: ``stress/bench.py --json F ARGS`` (default ARGS ``--events 100000``): raw ceilings,
  ``publish()``, one consumer process, latency; the ratios to raw are in ``ratios.*``.
* ``flights``: ``python -m examples.flights --no-spark --no-progress --summary-json F ARGS``:
  the main job; ``publisher_cpu_us_per_event`` and ``consumer_cpu_us_per_event`` (CPU seconds
  of the processes over events published / handled) are derived for trees whose summary lacks
  them.
* ``consume`` / ``publish``: only the consumer (or publisher) step of the bench with its raw
  ceiling, in a fresh ``redis-server`` each (``stress/perf.py``); faster, for quick iterations.
* ``tier``: ``stress/tier_bench.py --json F ARGS`` (default ARGS ``--events 200000``): offload
  (with its raw ceiling, untyped, two processes), segment bytes, replay.
* ``spark-writer``: one task of the Spark writer (`EventWriter.write`, no Spark) next to
  ``publish_many`` of the same flights (``stress/spark_writer.py``; ARGS e.g. ``--events 50000``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "ab"


@dataclass(frozen=True, slots=True)
class Tree:
    """One side of the A/B: `checkout` is the revision's tree (a worktree made once per commit,
    or this checkout for ``.``), `pkg` a folder whose only entry links to its ``eventbus``."""

    checkout: Path
    pkg: Path
    label: str

    def where(self, whole_tree: bool) -> tuple[Path, str]:
        """(working directory, ``PYTHONPATH``) of a run: the revision's own checkout with
        `whole_tree`, else this checkout with the revision's ``eventbus`` first."""
        if whole_tree:
            return self.checkout, str(self.checkout)
        return ROOT, os.pathsep.join((str(self.pkg), str(ROOT)))


def tree(rev: str) -> Tree:
    """The `Tree` of `rev` (``.``: this checkout as it is); makes its worktree and package link
    on first use. Raises `subprocess.CalledProcessError` for an unknown revision."""
    if rev == ".":
        sha, path = "worktree", ROOT
    else:
        sha = subprocess.run(
            ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        path = CACHE / sha[:12]
        if not (path / "eventbus").is_dir():
            CACHE.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["git", "worktree", "add", "--detach", "-f", str(path), sha],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
    pkg = CACHE / f"pkg-{sha[:12]}"
    pkg.mkdir(parents=True, exist_ok=True)
    link = pkg / "eventbus"
    if not link.is_symlink():
        link.symlink_to(path / "eventbus")
    return Tree(path, pkg, f"{rev} ({sha[:8]})")


def command(what: str, out: Path, args: list[str]) -> list[str]:
    """The command line of one run of `what` writing its JSON to `out` (paths relative to the
    run's working directory), with the interpreter running this script (the checkout's
    ``.venv``, or ``.venv-3.13`` under ``--python 3.13``: a fixed ``.venv`` path was missing
    there)."""
    py = sys.executable
    if what == "bench":
        return [py, "stress/bench.py", "--json", str(out), *(args or ["--events", "100000"])]
    if what == "flights":
        return [
            py,
            "-m",
            "examples.flights",
            "--no-spark",
            "--no-progress",
            "--summary-json",
            str(out),
            *args,
        ]
    if what == "spark-writer":
        return [py, "stress/spark_writer.py", "--runs", "1", "--json", str(out), *args]
    if what == "tier":
        return [py, "stress/tier_bench.py", "--json", str(out), *(args or ["--events", "200000"])]
    return [py, "stress/perf.py", what, "--runs", "1", "--json", str(out), *args]


class RunFailed(Exception):
    """A run wrote no result (its output's tail was written to stderr)."""


def run_once(side: Tree, what: str, args: list[str], whole_tree: bool = False) -> dict[str, Any]:
    """One run of `what` on `side` (`Tree.where` says which code); its JSON result. Raises
    `RunFailed` when it wrote no result, after writing the tail of its output to stderr."""
    cwd, pythonpath = side.where(whole_tree)
    with tempfile.TemporaryDirectory(prefix="ab-") as tmp:
        out = Path(tmp) / "result.json"
        # PYTHONSAFEPATH: ``python -m`` (and the processes it starts the same way, such as the
        # flights workers) would put the working directory first on ``sys.path``, ahead of
        # ``PYTHONPATH``, so that this checkout's ``eventbus`` shadowed the revision's.
        # It also keeps a script's own folder off ``sys.path``: the stress scripts import their
        # neighbours (``import bench``), so that folder goes on ``PYTHONPATH``, last.
        if what != "flights":
            pythonpath = os.pathsep.join((pythonpath, str(Path(cwd) / "stress")))
        env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONSAFEPATH": "1"}
        proc = subprocess.run(
            command(what, out, args), cwd=cwd, env=env, capture_output=True, text=True
        )
        if not out.exists():
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise RunFailed(
                f"run of {side.label} in {cwd} wrote no result (exit code {proc.returncode})"
            )
        result: dict[str, Any] = json.loads(out.read_text())
    if what == "flights":
        derive_cpu(result)
    return result


def derive_cpu(summary: dict[str, Any]) -> None:
    """CPU microseconds per event of the publisher and of the consumer processes, for summaries
    written before the flights job reported them."""
    cpu = summary.get("cpu_s", {})
    handled = sum(g.get("handled", 0) for g in summary.get("groups", {}).values())
    if "publisher_cpu_us_per_event" not in summary and summary.get("events_published"):
        summary["publisher_cpu_us_per_event"] = (
            cpu["publisher_process"] * 1e6 / summary["events_published"]
        )
    if "consumer_cpu_us_per_event" not in summary and handled:
        summary["consumer_cpu_us_per_event"] = cpu["consumer_processes"] * 1e6 / handled


def numbers(d: Any, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a JSON value, keyed by their dotted path."""
    if isinstance(d, bool):
        return {}
    if isinstance(d, int | float):
        return {prefix: float(d)}
    if isinstance(d, dict):
        out: dict[str, float] = {}
        for k, v in d.items():
            out |= numbers(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {}


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def main() -> None:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev_a")
    p.add_argument("rev_b")
    p.add_argument("--pairs", type=int, default=3, help="A B pairs (at least 3 for a verdict)")
    p.add_argument(
        "--what",
        choices=["bench", "flights", "consume", "publish", "spark-writer", "tier"],
        default="bench",
    )
    p.add_argument(
        "--whole-tree",
        action="store_true",
        help="run each revision's own tree (its stress/ and examples/ too), not this "
        "checkout's harness with the revision's eventbus",
    )
    p.add_argument("--json", help="write every run's figures here")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated substrings: print only figures whose name contains one",
    )
    a = p.parse_args(argv)
    trees = [tree(a.rev_a), tree(a.rev_b)]
    runs: list[list[dict[str, float]]] = [[], []]
    # a run that fails (a benchmark's Redis connect timing out on a loaded machine, say) is
    # counted and reported, and the pairs go on: the medians are those of the runs that wrote
    # a result, and a failure never throws away the others' results
    failed: list[list[str]] = [[], []]
    for i in range(a.pairs):
        for side, t in enumerate(trees):
            print(f"pair {i + 1}/{a.pairs}: {'AB'[side]} = {t.label} ...", flush=True)
            try:
                runs[side].append(numbers(run_once(t, a.what, extra, a.whole_tree)))
            except RunFailed as exc:
                print(f"pair {i + 1}: {exc}; going on", file=sys.stderr, flush=True)
                failed[side].append(f"pair {i + 1}: {exc}")
    if not runs[0] or not runs[1]:
        raise SystemExit(f"no result on one side: A failed {failed[0]}, B failed {failed[1]}")
    keys = [k for k in runs[0][0] if all(k in r for side in runs for r in side)]
    only = [s for s in a.only.split(",") if s]
    rows = []
    for k in keys:
        if only and not any(s in k for s in only):
            continue
        ma = statistics.median(r[k] for r in runs[0])
        mb = statistics.median(r[k] for r in runs[1])
        rows.append((k, ma, mb, mb / ma if ma else float("nan")))
    from rich.console import Console
    from rich.table import Table

    t = Table(
        "figure",
        f"A: {trees[0].label}",
        f"B: {trees[1].label}",
        "B/A",
        title=f"A/B, {a.what}{', whole trees' if a.whole_tree else ''}, medians of "
        f"{len(runs[0])} (A) and {len(runs[1])} (B) alternated runs",
    )
    for k, ma, mb, ratio in rows:
        t.add_row(k, _fmt(ma), _fmt(mb), f"{ratio:.3f}")
    Console(width=160).print(t)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "what": a.what,
                    "whole_tree": a.whole_tree,
                    "args": extra,
                    "a": trees[0].label,
                    "b": trees[1].label,
                    "runs_a": runs[0],
                    "runs_b": runs[1],
                    "failed_a": failed[0],
                    "failed_b": failed[1],
                    "medians": {
                        k: {"a": ma, "b": mb, "b_over_a": ratio} for k, ma, mb, ratio in rows
                    },
                },
                indent=2,
            )
        )
        print(f"written {a.json}")
    if failed[0] or failed[1]:
        sys.exit(f"{len(failed[0])} run(s) of A and {len(failed[1])} of B wrote no result")


if __name__ == "__main__":
    main()
