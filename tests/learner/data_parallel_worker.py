"""One rank of the data-parallel gradient test (tests/learner/test_data_parallel.py).

Run as `python data_parallel_worker.py MODEL_DIR CASES_PICKLE OUT_DIR` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. For every case (a learner config and a batch) it builds a
`Learner` on this rank, runs one RL step on the whole batch (the learner takes this rank's
share) and saves the policy gradient left after the step, the parameters and the step's report.
It ends as a data-parallel learner must: each learner closed, then `leave_process_group`.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch

from config.learner import LearnerConfig
from learner.distributed import init_process_group, leave_process_group, workers_from_env
from learner.trainer import Learner


def main(model_dir: str, cases_path: str, out_dir: str) -> None:
    cases = pickle.loads(Path(cases_path).read_bytes())
    first = LearnerConfig.model_validate(cases[0]["config"])
    workers = workers_from_env(first.workers)
    assert workers is not None, "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT must be set"
    init_process_group(workers, "cpu")
    for case in cases:
        cfg = LearnerConfig.model_validate(case["config"])
        learner = Learner(model_dir, cfg, workers=workers)
        report = learner.rl_step(case["samples"])
        gradients = {name: p.grad.clone() for name, p in learner.policy.named_parameters()
                     if p.grad is not None}
        if learner.critic is not None:
            gradients.update({f"critic.{name}": p.grad.clone()
                              for name, p in learner.critic.named_parameters()
                              if p.grad is not None})
        parameters = {name: p.detach().clone() for name, p in learner.policy.named_parameters()}
        torch.save({"gradients": gradients, "parameters": parameters,
                    "report": report.to_json()},
                   Path(out_dir) / f"{case['name']}-rank{workers.rank}.pt")
        learner.close()
    leave_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
