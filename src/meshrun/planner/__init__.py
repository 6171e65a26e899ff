"""The offline planner behind ``meshrun plan``: args.py (options -> JobConfig), estimate.py (Plan, build_plan:
mesh, batch, memory, communication, bubble, warnings), render.py (JSON and rich tables), step_time.py (time for a
token budget) and cli.py (main, the dry run).

Python use: ``build_plan(load_config(...), nodes=2, gpus_per_node=8)`` returns a :class:`Plan`; ``to_json(plan)``
gives what ``meshrun plan --json`` prints.
"""

from meshrun.planner.args import job_from_args, parse_args
from meshrun.planner.cli import main
from meshrun.planner.estimate import Plan, batch_formula, build_plan
from meshrun.planner.render import to_json

__all__ = ["Plan", "batch_formula", "build_plan", "job_from_args", "main", "parse_args", "to_json"]
