"""Experiment trackers behind one small interface: TensorBoard, Weights & Biases and MLflow (``run.tracker``).

Rank 0 logs every record it writes to metrics.jsonl to the tracker as well: the training metrics, the per-rank
timing, and each node's ``system`` record (so every node's GPUs, CPU and network land in the same tracker run, under
``system/node_K/...``); several trackers at once take a comma list (``run.tracker=mlflow,tensorboard``). The job's config (``model.dim``, ...) and the layout of each start (``layout``,
``world_size``, ...) are the run's parameters. A restarted or resumed job continues the same tracker run: its id is
kept in ``<run.dir>/tracker.json`` (one id per tracker).

Each tracker is an optional extra; without it, the first line of the error names it
(``pip install 'meshrun[mlflow]'``). Adding one is a :class:`Tracker` subclass and a line in :data:`TRACKERS`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

from meshrun.config import ConfigError, JobConfig

ID_FILE = "tracker.json"


class Tracker:
    """What rank 0 needs of a tracker. ``step`` is the optimizer step; a metric name is ``section/name``."""

    name = ""

    def log_params(self, params: dict[str, Any]) -> None:
        raise NotImplementedError

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files in ``<run.dir>/tensorboard``; the parameters as a text table (``params``)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, **_: Any):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: ImportError without it

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log_params(self, params: dict[str, Any]) -> None:
        rows = "\n".join(f"| {key} | {value} |" for key, value in params.items())
        self.writer.add_text("params", f"| parameter | value |\n|---|---|\n{rows}")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run in project ``run.tracker_project``, files under ``<run.dir>/wandb``. WANDB_MODE=offline (or
    ``wandb offline``) keeps it on disk for ``wandb sync``."""

    name = "wandb"

    def __init__(self, run_dir: Path, *, project: str, run_id: str | None, **_: Any):
        import wandb

        self.run = wandb.init(project=project, dir=str(run_dir), name=Path(run_dir).resolve().name,
                              id=run_id, resume="allow" if run_id else None, reinit="create_new")
        self.id = self.run.id

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in experiment ``run.tracker_project`` at ``run.tracker_uri`` (default MLFLOW_TRACKING_URI,
    else a local file store in ``<run.dir>/mlruns``). mlflow-skinny is enough."""

    name = "mlflow"

    def __init__(self, run_dir: Path, *, project: str, run_id: str | None, uri: str, **_: Any):
        uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
        if not uri:  # MLflow 3 keeps its file store in maintenance mode and refuses it unless asked for
            uri = (Path(run_dir).resolve() / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client, self.uri = MlflowClient(tracking_uri=uri), uri
        if run_id is None:
            found = self.client.get_experiment_by_name(project)
            experiment = found.experiment_id if found else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment, run_name=Path(run_dir).resolve().name).info.run_id
        self.id = run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        logged = self.client.get_run(self.id).data.params
        fresh = [Param(key, str(value)[:6000]) for key, value in params.items() if key not in logged]
        changed = {key: value for key, value in params.items() if key in logged and logged[key] != str(value)}
        try:
            if fresh:
                self.client.log_batch(self.id, params=fresh)
        except MlflowException as exc:  # pragma: no cover - a server that refuses one of them
            raise ConfigError(f"run.tracker=mlflow: MLflow refused the run's parameters: {exc}") from exc
        for key, value in changed.items():  # MLflow params are write-once: a resume at another size is a tag
            self.client.set_tag(self.id, f"resumed.{key}", str(value))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        for start in range(0, len(items), 1000):  # MLflow's batch limit
            self.client.log_batch(self.id, metrics=items[start:start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.id)


TRACKERS: dict[str, tuple[type[Tracker], str]] = {"tensorboard": (TensorBoardTracker, "tensorboard"),
                                                   "wandb": (WandbTracker, "wandb"),
                                                   "mlflow": (MlflowTracker, "mlflow")}
"""run.tracker -> (class, the extra that installs it)."""


def tracker_names(job: JobConfig) -> list[str]:
    """run.tracker as a list (empty for none), with run.tensorboard=true adding tensorboard."""
    names = [name.strip() for name in job.run.tracker.split(",") if name.strip() not in ("", "none")]
    if job.run.tensorboard and "tensorboard" not in names:
        names.append("tensorboard")
    return names


def check_installed(job: JobConfig) -> None:
    """ConfigError naming the extra of a tracker in run.tracker whose package is not installed (each extra installs
    the module of its name): asked at start-up (train/plan.py), before anything is written into run.dir."""
    for name in tracker_names(job):
        extra = TRACKERS[name][1]
        if importlib.util.find_spec(extra) is None:
            raise ConfigError(_missing(name, extra))


def _missing(name: str, extra: str) -> str:
    return f"run.tracker={name} needs the {extra} package: pip install 'meshrun[{extra}]' (or set run.tracker=none)"


class Trackers(Tracker):
    """Several trackers at once (run.tracker=mlflow,tensorboard): every call goes to each, in order."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log_params(self, params: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def known_runs(run_dir: Path) -> dict[str, str]:
    """{tracker: run id} from <run.dir>/tracker.json (also the single-tracker form an earlier meshrun wrote)."""
    id_file = Path(run_dir) / ID_FILE
    known = json.loads(id_file.read_text()) if id_file.is_file() else {}
    return {known["tracker"]: known["id"]} if "tracker" in known else known


def open_tracker(job: JobConfig, run_dir: Path) -> Tracker | None:
    """The trackers run.tracker names (None for none; several behind one :class:`Trackers`), each continuing the run
    recorded in tracker.json if any, with the job's config logged as parameters. Raises ConfigError naming the extra
    when a package is missing."""
    names = tracker_names(job)
    if not names:
        return None
    known, opened = known_runs(run_dir), []
    for name in names:
        cls, extra = TRACKERS[name]
        try:
            tracker = cls(run_dir, project=job.run.tracker_project, uri=job.run.tracker_uri, run_id=known.get(name))
        except ImportError as exc:
            raise ConfigError(_missing(name, extra)) from exc
        if getattr(tracker, "id", None):
            known[name] = tracker.id
        opened.append(tracker)
    if known:
        (Path(run_dir) / ID_FILE).write_text(json.dumps(known) + "\n")
    tracker = opened[0] if len(opened) == 1 else Trackers(opened)
    tracker.log_params({f"{section}.{key}": value for section, values in job.to_dict().items()
                        for key, value in values.items()})
    return tracker


START_PARAMS = ("layout", "world_size", "nodes", "global_batch", "batch_formula", "tokens_per_step", "params",
                "device", "model")
"""The fields of a ``start`` record logged as parameters (the layout the job trains with)."""


def record_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of one metrics.jsonl record as tracker metrics: ``train/loss``; per-rank lists as
    ``ranks/work_s/rank_3``; a node's system record as ``system/node_1/cpu_util_pct``,
    ``system/node_1/gpu_0/util_pct``, ``system/node_1/net/eth0/sent_mb_s`` and, for the interface NCCL/gloo use,
    ``system/node_1/comm_net/sent_mb_s``. Lists of other records (a slowdown's recorded steps) are no metrics."""
    kind = record.get("kind", "train")
    if kind == "system":
        prefix = f"system/node_{record.get('node', 0)}"
        found = _numbers(record, prefix, skip=("step", "time", "node", "rank", "interval_s"))
        for gpu in record.get("gpus", []):
            found.update(_numbers(gpu, f"{prefix}/gpu_{gpu.get('index', 0)}", skip=("index",)))
        for iface, row in record.get("net", {}).items():
            where = "comm_net" if row.get("comm") else f"net/{iface}"
            found.update(_numbers(row, f"{prefix}/{where}", skip=("comm",)))
        return found
    found = _numbers(record, kind, skip=("step", "time"))
    for key, value in record.items() if kind == "ranks" else ():  # its lists hold one value per rank
        if isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            found.update({f"{kind}/{key}/rank_{rank}": float(v) for rank, v in enumerate(value)})
    return found


def _numbers(values: dict[str, Any], prefix: str, *, skip: tuple[str, ...]) -> dict[str, float]:
    return {f"{prefix}/{key}": float(value) for key, value in values.items()
            if key not in skip and isinstance(value, (int, float)) and not isinstance(value, bool)}
