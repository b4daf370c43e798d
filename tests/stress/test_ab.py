"""The A/B harness (stress/ab.py): which code a run executes. By default this checkout's harness
with the revision's ``eventbus`` first on ``PYTHONPATH``; with ``--whole-tree`` the revision's
own checkout (its examples and stress scripts too). Real subprocesses, stub trees."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_ab() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ab", ROOT / "stress" / "ab.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ab"] = module
    spec.loader.exec_module(module)
    return module


ab = _load_ab()

# A run: ``python -m ab_probe OUT``, as the flights job is run (``-m`` puts the working directory
# first on ``sys.path`` unless told not to); it reports where it ran and which `eventbus` and
# `examples` it imported.
PROBE = """import json, os, sys, eventbus, examples
who = lambda m: getattr(m, "WHO", m.__file__)
json.dump({"cwd": os.getcwd(), "eventbus": who(eventbus), "examples": who(examples)},
          open(sys.argv[1], "w"))
"""


def _stub_tree(tmp_path: Path, name: str) -> Any:
    """A revision's checkout whose `eventbus` and `examples` say `name`, and its package link
    folder; both hold the probe."""
    checkout = tmp_path / name
    for package in ("eventbus", "examples"):
        (checkout / package).mkdir(parents=True)
        (checkout / package / "__init__.py").write_text(f"WHO = {name!r}\n")
    pkg = tmp_path / f"pkg-{name}"
    pkg.mkdir()
    (pkg / "eventbus").symlink_to(checkout / "eventbus")
    for folder in (checkout, pkg):
        (folder / "ab_probe.py").write_text(PROBE)
    return ab.Tree(checkout, pkg, name)


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        ab, "command", lambda what, out, args: [sys.executable, "-m", "ab_probe", str(out)]
    )


@pytest.mark.usefixtures("probe")
def test_whole_tree_runs_the_revisions_own_checkout(tmp_path: Path) -> None:
    side = _stub_tree(tmp_path, "rev-a")

    got = ab.run_once(side, "bench", [], whole_tree=True)

    assert got == {"cwd": str(tmp_path / "rev-a"), "eventbus": "rev-a", "examples": "rev-a"}


@pytest.mark.usefixtures("probe")
def test_the_default_runs_this_checkouts_harness_with_the_revisions_eventbus(
    tmp_path: Path,
) -> None:
    side = _stub_tree(tmp_path, "rev-a")

    got = ab.run_once(side, "bench", [])

    assert got["cwd"] == str(ROOT)
    assert got["eventbus"] == "rev-a"  # not this checkout's, although it runs here
    assert got["examples"] == str(ROOT / "examples" / "__init__.py")


def test_a_stress_script_run_imports_its_neighbours(tmp_path: Path) -> None:
    """`--what consume|publish` run ``stress/perf.py`` by path, which imports ``bench`` beside
    it: a run must find it although ``PYTHONSAFEPATH`` keeps the script's folder off
    ``sys.path`` (it failed with ``ModuleNotFoundError: bench``). The real command line."""
    side = _stub_tree(tmp_path, "rev-a")
    (stress := side.checkout / "stress").mkdir()
    (stress / "bench.py").write_text("WHO = 'rev-a bench'\n")
    (stress / "perf.py").write_text(
        "import json, sys, bench\n"
        "json.dump({'bench': bench.WHO, 'argv': sys.argv[1:]},"
        " open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n"
    )

    got = ab.run_once(side, "consume", ["--events", "10"], whole_tree=True)

    assert got["bench"] == "rev-a bench"
    assert got["argv"][0] == "consume" and got["argv"][-2:] == ["--events", "10"]


def test_a_run_that_writes_no_result_fails_with_its_label(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ab, "command", lambda what, out, args: [sys.executable, "-c", "pass"])

    with pytest.raises(ab.RunFailed, match="rev-a"):
        ab.run_once(_stub_tree(tmp_path, "rev-a"), "bench", [], whole_tree=True)


def test_a_failed_run_is_reported_and_the_other_runs_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run dying (a benchmark's Redis connect timing out under load) lost every run's
    result: the A/B stopped at the failure. Now the medians are those of the runs that wrote
    a result, the JSON lists the failure, and the exit code is 1."""
    trees = {"rev-a": _stub_tree(tmp_path, "rev-a"), "rev-b": _stub_tree(tmp_path, "rev-b")}
    monkeypatch.setattr(ab, "tree", trees.__getitem__)
    calls: list[str] = []

    def run_once(side: Any, what: str, args: list[str], whole_tree: bool = False) -> Any:
        calls.append(side.label)
        if len(calls) == 3:  # pair 2's A run
            raise ab.RunFailed(f"run of {side.label} wrote no result (exit code 1)")
        return {"rate": 100.0 if side.label == "rev-a" else 150.0 + len(calls)}

    monkeypatch.setattr(ab, "run_once", run_once)
    out = tmp_path / "ab.json"
    monkeypatch.setattr(
        sys, "argv", ["ab.py", "rev-a", "rev-b", "--pairs", "3", "--json", str(out)]
    )

    with pytest.raises(SystemExit, match="1 run"):
        ab.main()

    written = json.loads(out.read_text())
    assert calls == ["rev-a", "rev-b"] * 3  # the pairs went on after the failure
    assert len(written["runs_a"]) == 2 and len(written["runs_b"]) == 3
    assert written["failed_a"] == ["pair 2: run of rev-a wrote no result (exit code 1)"]
    assert written["failed_b"] == []
    assert written["medians"]["rate"]["a"] == 100.0
    assert written["medians"]["rate"]["b"] == 154.0  # the median of 152, 154, 156


def test_old_flights_summaries_get_the_cpu_per_event_figures() -> None:
    summary = {
        "events_published": 1000,
        "cpu_s": {"publisher_process": 0.1, "consumer_processes": 0.4},
        "groups": {"order-check": {"handled": 1000}, "aggregate": {"handled": 1000}},
    }

    ab.derive_cpu(summary)

    assert summary["publisher_cpu_us_per_event"] == pytest.approx(100.0)
    assert summary["consumer_cpu_us_per_event"] == pytest.approx(200.0)
    assert json.dumps(summary)  # still JSON
