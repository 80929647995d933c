"""The job's `[cluster]` section: where the engine replicas and learner workers run.

`backend = "local"` (the default) starts every child on this machine, as always. `backend =
"ray"` makes this process a Ray driver: each engine replica and each learner worker becomes a
Ray actor that asks for the resources below, is placed through one placement group per role,
and starts and supervises its child process on the node it lands on (docs/scale-out.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from config.base import ConfigSection

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class RoleResources(ConfigSection):
    """What one actor of a role (one engine replica, one learner worker) asks Ray for."""

    cpus: float = Field(1.0, ge=0, description="CPUs reserved for the actor and its child")
    gpus: float = Field(0.0, ge=0, description="GPUs reserved (the child sees them through "
                                                "CUDA_VISIBLE_DEVICES, which Ray sets)")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources, e.g. { engine_node = 1 } to "
                                          "pin replicas to nodes started with that resource")
    strategy: Strategy = Field("SPREAD", description="placement-group strategy for the role's "
                                                     "bundles (one bundle per actor)")
    max_restarts: int = Field(3, ge=0, description="times the actor restarts a child that "
                                                   "died before the role reports it failed")

    @field_validator("resources")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in value.items() if v <= 0}
        if bad:
            raise ValueError(f"custom resource amounts must be > 0, got {bad}; drop the key "
                             f"instead of asking for 0")
        return value


class ClusterConfig(ConfigSection):
    backend: Literal["local", "ray"] = Field(
        "local", description="local = every child on this machine; ray = Ray actors place "
                             "engine replicas and learner workers on the cluster's nodes")
    address: str = Field("auto", description="Ray cluster to join: 'auto' (the one `ray start` "
                                             "made on this node) or 'HOST:PORT' / 'ray://...'")
    namespace: str = Field("stalewise", description="Ray namespace of the job's actors")
    startup_timeout_s: float = Field(
        600.0, gt=0, description="how long placement may wait for the cluster to have room")
    engine: RoleResources = Field(default_factory=RoleResources)
    learner: RoleResources = Field(default_factory=RoleResources)
