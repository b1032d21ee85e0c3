"""examples/github-actions.yml: its ptq steps run here, as written, through bash and a `ptq` on PATH,
with the tiny model in place of the default one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "examples" / "github-actions.yml"


def test_example_workflow_commands_run_and_publish_the_report(tiny_model, tmp_path):
    workflow = yaml.safe_load(WORKFLOW.read_text())
    job = workflow["jobs"]["quantization-report"]
    steps = {step["id"]: step for step in job["steps"] if "id" in step}
    assert list(steps) == ["compare", "summary"]
    assert steps["summary"]["if"] == "always()"  # the report is published even when a gate fails

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "ptq"  # the `ptq` console script, for this checkout
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ptq "$@"\n')
    shim.chmod(0o755)
    summary = tmp_path / "step-summary.md"
    env = (
        os.environ
        | job["env"]
        | {
            "PTQ_MODEL": str(tiny_model),
            "GITHUB_STEP_SUMMARY": str(summary),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
    )
    for step_id in ("compare", "summary"):
        done = subprocess.run(
            ["bash", "-e", "-c", steps[step_id]["run"]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"step {step_id}: {done.stderr[-2000:]}"

    out = tmp_path / job["env"]["PTQ_OUT"]
    assert {p.name for p in out.iterdir()} >= {
        "report.md",
        "results.json",
        "report-metrics.png",
        "report-layer-amax.png",
        "report-layer-snr.png",
    }
    published = summary.read_text()
    assert published.startswith(f"# ptq compare: {tiny_model}\n\n✅ **All 3 gate checks pass**")
    assert "| fp8-e4m3 ✅ |" in published
