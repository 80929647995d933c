"""Placement on a Ray cluster (`[cluster] backend = "ray"`, docs/scale-out.md).

`launch` says how a child starts on a node, `host` is the Ray actor that starts and supervises
it, `placement` is the driver's side (join the cluster, place a role through a placement
group, read what the actors report), `roles` shapes engine replicas and learner workers like
the local children so the job's loop is the same in both modes. Ray is imported lazily: a local
job never needs it installed.
"""
