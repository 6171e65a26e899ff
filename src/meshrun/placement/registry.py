"""The ordered cluster environments (the first that detects this process wins), and registering your own.

Imports only the interface (:mod:`.base`): the record (:mod:`.process`) and the built-in environments build on
this module, and :mod:`meshrun.placement` fills :data:`ENVIRONMENTS` with the built-ins.
"""

from __future__ import annotations

import importlib
from typing import Mapping

from meshrun.placement.base import ClusterEnvironment, NodePlacement

ENV_VAR = "MESHRUN_ENVIRONMENT"
"""``module:Class`` of a cluster environment to load and register before detecting (``meshrun launch --environment``
sets it, and the workers inherit it)."""


ENVIRONMENTS: tuple[ClusterEnvironment, ...] = ()
"""Tried in this order; replaced (never mutated) by :func:`register_environment`. :mod:`meshrun.placement` puts the
built-in ones here when it is imported (before any module of the package can be used): torchrun, SLURM, Open MPI,
the single process."""


def register_environment(environment: ClusterEnvironment, *, before: str = "single") -> None:
    """Insert ``environment`` ahead of the one named ``before`` (default: ahead of the single-process fallback,
    after the built-in ones). Raises ValueError for a duplicate name or an unknown ``before``."""
    global ENVIRONMENTS
    names = [env.name for env in ENVIRONMENTS]
    if not isinstance(environment, ClusterEnvironment) or not environment.name:
        raise ValueError(f"register_environment: {environment!r} is not a ClusterEnvironment with a name; "
                         "subclass meshrun.placement.ClusterEnvironment and set its `name`.")
    if environment.name in names:
        raise ValueError(f"register_environment: an environment named {environment.name!r} is already registered "
                         f"({', '.join(names)}); give yours another name.")
    if before not in names:
        raise ValueError(f"register_environment: before={before!r} names no registered environment; "
                         f"choose one of {', '.join(names)}.")
    index = names.index(before)
    ENVIRONMENTS = (*ENVIRONMENTS[:index], environment, *ENVIRONMENTS[index:])


def load_environment(spec: str, *, option: str = ENV_VAR) -> ClusterEnvironment:
    """Import ``module:Class`` (or ``module:instance``) and register it (:func:`register_environment`, at its default
    place: after the built-in ones, ahead of the single-process fallback); loading one already registered returns it.
    Raises ValueError naming ``option`` and the fix."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{option}={spec!r}: give module:Class, e.g. my_envs:LSFEnvironment (a subclass of "
                         "meshrun.ClusterEnvironment in my_envs.py on PYTHONPATH)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{option}={spec!r}: cannot import {module_name!r} ({exc}); put it on PYTHONPATH") from None
    found = getattr(module, attr, None)
    environment = found() if isinstance(found, type) and issubclass(found, ClusterEnvironment) else found
    if not isinstance(environment, ClusterEnvironment) or not environment.name:
        raise ValueError(f"{option}={spec!r}: {module_name}.{attr} is "
                         f"{'missing' if found is None else type(found).__name__}; give a subclass of "
                         "meshrun.ClusterEnvironment with a `name` (or an instance of one)")
    registered = environment_named(environment.name)
    if registered is not None and type(registered) is type(environment):
        return registered
    register_environment(environment)
    return environment


def _load_named(environ: Mapping[str, str]) -> None:
    """The environment ``$MESHRUN_ENVIRONMENT`` names, registered before anything is detected."""
    if environ.get(ENV_VAR):
        load_environment(environ[ENV_VAR])


def detect_environment(environ: Mapping[str, str]) -> ClusterEnvironment:
    """The first environment in :data:`ENVIRONMENTS` that detects this process (after loading the one
    ``$MESHRUN_ENVIRONMENT`` names)."""
    _load_named(environ)
    for environment in ENVIRONMENTS:
        if environment.detect(environ):
            return environment
    raise RuntimeError("no cluster environment detects this process: meshrun.placement.registry.ENVIRONMENTS lost "
                       "its single-process fallback; register environments with register_environment")


def environment_named(name: str) -> ClusterEnvironment | None:
    """The registered environment whose name is ``name`` (a ``ProcessPlacement.source``), else None."""
    return next((env for env in ENVIRONMENTS if env.name == name), None)


def detect_node_placement(environ: Mapping[str, str], *, command: str = "") -> NodePlacement | None:
    """Where this node's ``meshrun launch`` sits, from the first environment that places launchers; None when none
    does (flags or a standalone store decide). Raises :class:`PlacementError` with the command line to run."""
    _load_named(environ)
    for environment in ENVIRONMENTS:
        placement = environment.node_placement(environ, command=command)
        if placement is not None:
            return placement
    return None
