"""Project a real `diloco run` directory (its report.json) to another model size, learner count and link.

The run's measured wire bytes per learner-step are compared with what the bandwidth model predicts for the
run's own configuration; the ratio (framing, both directions, retries) is carried over to the projection.
Step time scales with the parameter count (same tokens per step on the same hardware) unless given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from diloco.sim.bandwidth import CODEC_BITS, METHODS, Method, Workload, bits_per_sync, required_gbps, \
    syncs_per_step, utilisation

REPORT_NAME = "report.json"
_TOP_FIELDS = {"mode": str, "learners": int, "wall_seconds": (int, float), "tokens_trained": int,
               "wire_bytes": int, "model_parameters": int, "step_seconds_median": (int, float),
               "config": dict, "per_learner": list}
_CONFIG_FIELDS = {"fragments": int, "sync_every": int, "overlap": int, "codec": str}


class ReportError(Exception):
    """report.json is missing, unreadable or lacks a field; the message says which."""


@dataclass(frozen=True)
class RunMeasurement:
    """What a finished run measured."""

    mode: str
    """dp, diloco, streaming or decoupled."""

    learners: int
    """Learners in the run."""

    parameters: int
    """Model parameters."""

    step_seconds: float
    """Median inner-step time across learners."""

    wire_bytes: int
    """Bytes sent and received over all learners' connections."""

    steps: int
    """Inner steps summed over learners."""

    method: Method
    """The run's synchronisation settings."""

    @property
    def bits_per_learner_step(self) -> float:
        return self.wire_bytes * 8.0 / self.steps


@dataclass(frozen=True)
class Projection:
    """The run projected to a new model size, learner count and link."""

    run: RunMeasurement
    """The measurement projected from."""

    overhead: float
    """Measured / modelled wire volume of the run itself."""

    workload: Workload
    """Target model size, step time and learners."""

    method: Method
    """Run's method with the measured overhead applied."""

    bits_per_step: float
    """Projected bits per learner per step."""

    gbps: float
    """Link bandwidth assumed for `utilisation`."""

    utilisation: float
    """Projected compute utilisation on that link."""

    target: float
    """Utilisation target for `required_gbps`."""

    required_gbps: float
    """Smallest bandwidth reaching the target."""


def load_run(directory: str | Path) -> RunMeasurement:
    path = Path(directory)
    if not path.is_dir():
        raise ReportError(f"run directory not found: {path}")
    report_path = path / REPORT_NAME
    if not report_path.is_file():
        raise ReportError(f"{report_path} not found (is this a `diloco run` directory?)")
    try:
        report = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"cannot read {report_path}: {exc}") from None
    if not isinstance(report, dict):
        raise ReportError(f"{report_path}: expected a JSON object")
    _check_fields(report, _TOP_FIELDS, report_path, "")
    _check_fields(report["config"], _CONFIG_FIELDS, report_path, "config.")
    config = report["config"]
    if report["mode"] not in METHODS:
        raise ReportError(f"{report_path}: unknown mode {report['mode']!r}")
    if config["codec"] not in CODEC_BITS:
        raise ReportError(f"{report_path}: unknown codec {config['codec']!r}")
    steps = 0
    for i, entry in enumerate(report["per_learner"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("steps"), int):
            raise ReportError(f"{report_path}: per_learner[{i}] lacks an integer 'steps'")
        steps += entry["steps"]
    if steps <= 0 or report["model_parameters"] <= 0 or report["step_seconds_median"] <= 0:
        raise ReportError(f"{report_path}: the run recorded no steps, parameters or step time")
    mode = report["mode"]
    method = Method(mode, config["codec"], 1 if mode == "dp" else config["fragments"],
                    1 if mode == "dp" else config["sync_every"], config["overlap"])
    return RunMeasurement(mode, report["learners"], report["model_parameters"],
                          float(report["step_seconds_median"]), report["wire_bytes"], steps, method)


def _check_fields(obj: dict, fields: dict, path: Path, prefix: str) -> None:
    for name, kind in fields.items():
        if name not in obj:
            raise ReportError(f"{path}: missing field '{prefix}{name}'")
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ReportError(f"{path}: field '{prefix}{name}' has the wrong type ({type(value).__name__})")


def project(run: RunMeasurement, *, parameters: float | None = None, learners: int | None = None,
            gbps: float = 1.0, step_seconds: float | None = None, target: float = 0.95) -> Projection:
    """Project `run` to `parameters`, `learners` and a `gbps` link (defaults: the run's own)."""
    own = Workload(run.parameters, run.step_seconds, run.learners)
    modelled = bits_per_sync(run.method, own) * syncs_per_step(run.method)
    overhead = run.bits_per_learner_step / modelled if modelled > 0 else 1.0
    n = parameters or run.parameters
    t = step_seconds or run.step_seconds * n / run.parameters
    workload = Workload(n, t, learners or run.learners)
    workload.validate()
    method = replace(run.method, overhead=overhead)
    bits = bits_per_sync(method, workload) * syncs_per_step(method)
    return Projection(run, overhead, workload, method, bits, gbps, utilisation(method, workload, gbps),
                      target, required_gbps(method, workload, target))
