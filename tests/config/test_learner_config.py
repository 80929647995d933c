"""Learner config: TOML field names, defaults, and errors that say how to fix a value."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest
from pydantic import ValidationError

from config.learner import LearnerConfig, PolicyLossConfig, ScoreCenteringConfig


def test_policy_loss_config_has_exactly_the_documented_fields():
    assert set(PolicyLossConfig.model_fields) == {
        "surrogate",
        "clip_low",
        "clip_high",
        "dual_clip",
        "cispo_low",
        "cispo_high",
        "correction",
        "correction_level",
        "correction_low",
        "correction_high",
        "correction_entropy",
        "ratio_base",
        "masked_in_denominator",
        "aggregation",
        "norm_constant",
        "kl_coef",
        "kl_estimator",
    }
    assert {"weight", "weight_low", "weight_high", "aggregation"} <= set(
        ScoreCenteringConfig.model_fields
    )


def test_a_toml_learner_section_parses():
    text = """
    batch_size = 16
    [advantage]
    estimator = "dr_grpo"
    [loss]
    surrogate = "cispo"
    cispo_high = 4.0
    correction = "mis"
    correction_level = "token"
    correction_low = 0.5
    correction_high = 2.0
    aggregation = "seq_sum_norm"
    norm_constant = 512
    [score_centering]
    weight = "tis"
    weight_high = 2.0
    aggregation = "seq_sum_norm"
    norm_constant = 512
    """
    cfg = LearnerConfig.model_validate(tomllib.loads(text))
    assert cfg.loss.surrogate == "cispo" and cfg.score_centering.weight == "tis"


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(aggregation="seq_sum_norm"), "set norm_constant"),
        (dict(correction="tis"), "set correction_high"),
        (dict(correction="mis"), "IcePop uses correction_low = 0.5"),
        (dict(correction="mis", correction_low=2.0, correction_high=1.0), "must be below"),
        (dict(surrogate="cispo", cispo_low=6.0), "absolute ratio bounds"),
        (dict(surrogate="cispo", dual_clip=3.0), "dual_clip applies to surrogate 'ppo' only"),
        (dict(dual_clip=0.5), "greater than 1"),
        (dict(surrogate="grpo"), "'reinforce', 'ppo', 'gspo', 'gspo_token' or 'cispo'"),
        (dict(clip_hi=0.3), "Extra inputs are not permitted"),
    ],
)
def test_bad_policy_loss_values_are_explained(fields, needle):
    with pytest.raises(ValidationError) as info:
        PolicyLossConfig(**fields)
    assert needle in str(info.value)


def test_learner_config_cross_checks():
    with pytest.raises(ValidationError, match="set them equal"):
        LearnerConfig(loss=dict(aggregation="seq_mean_token_mean"), score_centering=dict())
    with pytest.raises(ValidationError, match="norm_constant .* set them equal"):
        LearnerConfig(
            loss={"aggregation": "seq_sum_norm", "norm_constant": 64},
            score_centering={"aggregation": "seq_sum_norm", "norm_constant": 32},
        )
    with pytest.raises(ValidationError, match="at least micro_batch_size"):
        LearnerConfig(mini_batch_size=2, micro_batch_size=4)
    with pytest.raises(ValidationError, match="set weight_high"):
        ScoreCenteringConfig(weight="tis")


def test_the_learner_package_and_its_config_do_not_import_torch():
    code = (
        "import sys, learner, config.learner, learner.batch, learner.metrics, learner.cli, "
        "learner.publish; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
