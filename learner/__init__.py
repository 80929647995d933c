"""The learner: advantage estimators, policy losses and the trainer process.

Importing `learner` (and `config.learner`, `learner.batch`, `learner.metrics`,
`learner.publish`, `learner.cli`) never imports torch, so the job config and the orchestrator
can use the config models and sample records; `learner.advantages`, `learner.losses`,
`learner.trainer` and `learner.model` need torch. The learner never imports the orchestrator
or the sandboxes.
"""

from config.learner import LearnerConfig, PolicyLossConfig, ScoreCenteringConfig

__all__ = ["LearnerConfig", "PolicyLossConfig", "ScoreCenteringConfig"]
