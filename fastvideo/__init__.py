"""flowrl's shared package: schedulers, rollout, rewards, losses, FSDP, LoRA, data, checkpoints.

No import side effects; heavy dependencies are imported lazily by the modules that need them.
"""
__version__ = "0.1.0"
