"""meshrun: multi-node PyTorch training that is correct, fast and easy to diagnose.

The Python API (see docs/api.md):
  Session                     the pieces for your own script: layouts (DDP, FSDP2, HSDP, TP, PP), sharded batches,
                              exact metrics, checkpoints, health
  PipelineOptions             schedule, micro-batches and loss of Session.prepare_model(layout="pp")
  LocalShardAdamW             torch's AdamW stepping FSDP2/TP (DTensor) parameters on their local shards
  ModelSpec, register_model   the model contract: register your model for meshrun train / plan / --dry-run
  ModelShape                  the resolved transformer shape a ModelSpec builds from
  Trainer, load_config        the reference training job, from Python
  CheckpointConfig, ReplicaConfig   Session's checkpoint and replica-group settings (as [checkpoint], [replicas])
  ProcessPlacement                  where this process sits (torchrun, SLURM, Open MPI or a single process)
  ClusterEnvironment, register_environment   add a cluster environment (Kubernetes, LSF, ...) to that detection
  GlobalOrderSampler          a resumable, reshardable DistributedSampler
"""

__version__ = "0.1.0"

_EXPORTS = {
    "Session": "meshrun.session",
    "PipelineOptions": "meshrun.parallel.module_pipeline",
    "LocalShardAdamW": "meshrun.parallel.local_adamw",
    "Trainer": "meshrun.train.trainer",
    "ModelSpec": "meshrun.models.spec",
    "register_model": "meshrun.models.spec",
    "ModelShape": "meshrun.models.shape",
    "load_config": "meshrun.config",
    "JobConfig": "meshrun.config",
    "DistConfig": "meshrun.config",
    "CheckpointConfig": "meshrun.config",
    "ReplicaConfig": "meshrun.config",
    "ConfigError": "meshrun.config",
    "ProcessPlacement": "meshrun.env",
    "ClusterEnvironment": "meshrun.placement",
    "register_environment": "meshrun.placement",
    "GlobalOrderSampler": "meshrun.data.sampler",
    "DataPosition": "meshrun.data.sampler",
    "init_distributed": "meshrun.comm.process_group",
}


def __getattr__(name: str):
    """Import lazily, so `meshrun plan` and `import meshrun` do not pay for torch.distributed start-up."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'meshrun' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = ["__version__", *_EXPORTS]
