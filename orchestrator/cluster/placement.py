"""The Ray driver's side: join the cluster, place a role's actors, watch what they report.

A role (the engine replicas, the learner workers) is N `ChildHost` actors placed through one
placement group of N bundles, each bundle the role's `[cluster.<role>]` request (CPUs, GPUs,
custom resources) under the role's strategy (SPREAD by default: one actor per node where the
cluster has room). Guarantees: `RoleGroup.place` returns only when every actor's child has
started (an engine answers /health) or raises `PlacementError` naming what was asked, what the
cluster has free, and each failed child's log tail; `stop` stops every child and frees the
placement group, also when some actor is gone already.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from config.cluster import ClusterConfig, RoleResources
from orchestrator.cluster.host import ChildHost
from orchestrator.cluster.launch import Launch


class PlacementError(RuntimeError):
    """The cluster could not place or start a role's actors; the message says why."""


def connect(cluster: ClusterConfig) -> None:
    """Join the Ray cluster at `cluster.address` as its driver (once per process)."""
    try:
        import ray
    except ImportError as exc:
        raise PlacementError("cluster.backend = 'ray' needs Ray on every node: "
                             "pip install 'stalewise[ray]'") from exc
    if ray.is_initialized():
        return
    _check_reachable(cluster.address)
    try:
        ray.init(address=cluster.address, namespace=cluster.namespace, log_to_driver=False,
                 configure_logging=False)
    except ConnectionError as exc:
        raise PlacementError(f"no Ray cluster answers at cluster.address = "
                             f"{cluster.address!r} ({exc}); start one with `ray start --head` "
                             f"on the head node (docs/scale-out.md)") from exc


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail fast on a HOST:PORT nothing listens on (Ray itself retries for minutes)."""
    import socket

    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise PlacementError(f"no Ray cluster answers at cluster.address = {address!r} "
                             f"({exc}); start one there with `ray start --head --port={port}`, "
                             f"or fix the address (docs/scale-out.md)") from None


def bundle(res: RoleResources) -> dict[str, float]:
    """One actor's request as a placement-group bundle (Ray refuses zero amounts)."""
    wanted = {"CPU": res.cpus, "GPU": res.gpus, **res.resources}
    wanted = {k: float(v) for k, v in wanted.items() if v > 0}
    if not wanted:
        raise PlacementError("a role asks for no resources at all (cpus = 0, gpus = 0, no "
                             "custom resources); give it at least a fraction of a CPU")
    return wanted


@dataclass
class RoleGroup:
    role: str
    actors: list[Any]
    placement: Any

    @classmethod
    def place(cls, role: str, res: RoleResources, launches: Sequence[Launch], *,
              timeout_s: float, rendezvous: bool = False) -> "RoleGroup":
        """Place and start one actor per launch. With `rendezvous`, several actors are the
        ranks of one `torch.distributed` group: each child gets RANK, WORLD_SIZE and rank 0's
        node address and a free port there as MASTER_ADDR / MASTER_PORT."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        wanted = bundle(res)
        group = placement_group([wanted] * len(launches), strategy=res.strategy,
                                name=f"stalewise-{role}-{secrets.token_hex(4)}")
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise PlacementError(
                f"the cluster found no room for {len(launches)} x {wanted} ({role}, strategy "
                f"{res.strategy}) within {timeout_s:.0f}s; free now: "
                f"{ray.available_resources()}; add nodes, lower [cluster.{role}] or use "
                f"strategy = 'PACK'") from None
        host = ray.remote(ChildHost)
        actors = [
            host.options(
                num_cpus=res.cpus, num_gpus=res.gpus, resources=dict(res.resources),
                max_restarts=0, max_concurrency=4,  # status answers during a replace
                name=f"stalewise-{launch.name}-{secrets.token_hex(4)}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=i),
            ).remote(launch, max_restarts=res.max_restarts)
            for i, launch in enumerate(launches)]
        placed = cls(role, actors, group)
        try:
            envs = [{} for _ in actors]
            if rendezvous and len(actors) > 1:
                address, port = ray.get(actors[0].node_address.remote())
                envs = [{"RANK": str(i), "WORLD_SIZE": str(len(actors)), "LOCAL_RANK": "0",
                         "MASTER_ADDR": address, "MASTER_PORT": str(port)}
                        for i in range(len(actors))]
            statuses = ray.get([a.start.remote(env) for a, env in zip(actors, envs)])
        except BaseException:
            placed.stop()
            raise
        failed = [s for s in statuses if s["state"] == "failed"]
        if failed:
            placed.stop()
            raise PlacementError(f"{len(failed)} of {len(actors)} {role} children did not "
                                 f"start:\n" + "\n".join(f"{s['role']} on {s['node_ip']}: "
                                                         f"{s['failures'][-1]}" for s in failed))
        return placed

    def statuses(self, timeout_s: float = 30.0) -> list[dict]:
        """Each actor's `HostStatus` as a dict; an actor that is gone reports `lost`."""
        import ray

        refs, out = [actor.status.remote() for actor in self.actors], []
        for i, ref in enumerate(refs):  # asked all at once, read in order
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                out.append({"role": f"{self.role}-{i}", "state": "lost", "url": None,
                            "failures": [f"the actor is unreachable: {exc}"]})
        return out

    def call(self, index: int, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        import ray

        return ray.get(getattr(self.actors[index], method).remote(*args), timeout=timeout_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        refs = []
        for actor in self.actors:
            try:
                refs.append(actor.stop.remote(timeout_s))
            except ray.exceptions.RayActorError:
                pass
        for ref in refs:
            try:
                ray.get(ref, timeout=timeout_s + 30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement)
