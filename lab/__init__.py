"""The update-quality lab: bias, variance and learning per compute of every update rule.

A tractable Markov policy (`lab.policy`) gives the exact J and grad J; controlled mismatch
(`lab.mismatch`) makes the sampler differ from the trainer; the learner's real losses
(`learner.losses`, `learner.advantages`) give the gradient estimates (`lab.estimators`);
`lab.estimator_lab` measures them and `lab.pipeline` / `lab.learning` train under pipeline
modes. Entry points: `stalewise lab estimators|learning CONFIG` (see docs/lab.md).
"""
