"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('runs',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('pipeline_mode', sa.String(length=16), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('config_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('host', sa.String(length=200), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('stream_head', sa.Integer(), nullable=False),
    sa.Column('summary', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs'))
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_runs_status'), ['status'], unique=False)

    op.create_table('bias_ledger',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('computed_at', sa.Float(), nullable=False),
    sa.Column('family', sa.String(length=200), nullable=False),
    sa.Column('difficulty', sa.String(length=64), nullable=False),
    sa.Column('duration_quantile', sa.Integer(), nullable=True),
    sa.Column('generated', sa.Integer(), nullable=False),
    sa.Column('admitted', sa.Integer(), nullable=False),
    sa.Column('excluded_by_reason', sa.JSON(), nullable=False),
    sa.Column('mean_reward_admitted', sa.Float(), nullable=True),
    sa.Column('mean_reward_excluded', sa.Float(), nullable=True),
    sa.Column('mean_duration_admitted', sa.Float(), nullable=True),
    sa.Column('mean_duration_excluded', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_bias_ledger_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_bias_ledger'))
    )
    with op.batch_alter_table('bias_ledger', schema=None) as batch_op:
        batch_op.create_index('ix_bias_ledger_run_computed', ['run_id', 'computed_at'], unique=False)

    op.create_table('learner_steps',
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('mode', sa.String(length=16), nullable=False),
    sa.Column('first_seq', sa.Integer(), nullable=True),
    sa.Column('last_seq', sa.Integer(), nullable=True),
    sa.Column('num_samples', sa.Integer(), nullable=False),
    sa.Column('num_tokens', sa.Integer(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=True),
    sa.Column('mean_lag', sa.Float(), nullable=True),
    sa.Column('max_lag', sa.Integer(), nullable=True),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('finished_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_learner_steps_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'step', name=op.f('pk_learner_steps'))
    )
    op.create_table('policy_versions',
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('learner_step', sa.Integer(), nullable=True),
    sa.Column('last_seq', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_policy_versions_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'version', name=op.f('pk_policy_versions'))
    )
    op.create_table('task_instances',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('family', sa.String(length=200), nullable=False),
    sa.Column('key', sa.String(length=200), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('difficulty', sa.String(length=64), nullable=False),
    sa.Column('prompt', sa.Text(), nullable=False),
    sa.Column('meta', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_task_instances_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_task_instances')),
    sa.UniqueConstraint('run_id', 'family', 'key', name=op.f('uq_task_instances_run_id_family_key'))
    )
    with op.batch_alter_table('task_instances', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_task_instances_run_id'), ['run_id'], unique=False)

    op.create_table('groups',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('task_instance_id', sa.Integer(), nullable=False),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('dispatch_version', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('completed_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_groups_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['task_instance_id'], ['task_instances.id'], name=op.f('fk_groups_task_instance_id_task_instances')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_groups'))
    )
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_groups_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_groups_task_instance_id'), ['task_instance_id'], unique=False)

    op.create_table('trajectories',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('group_id', sa.Integer(), nullable=True),
    sa.Column('task_instance_id', sa.Integer(), nullable=True),
    sa.Column('sample_index', sa.Integer(), nullable=False),
    sa.Column('purpose', sa.String(length=8), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('stop_reason', sa.String(length=32), nullable=True),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('reward_breakdown', sa.JSON(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('queued_at', sa.Float(), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.Column('engine_s', sa.Float(), nullable=False),
    sa.Column('tools_s', sa.Float(), nullable=False),
    sa.Column('waiting_s', sa.Float(), nullable=False),
    sa.Column('dispatch_version', sa.Integer(), nullable=False),
    sa.Column('min_version', sa.Integer(), nullable=True),
    sa.Column('max_version', sa.Integer(), nullable=True),
    sa.Column('min_kv_version', sa.Integer(), nullable=True),
    sa.Column('num_turns', sa.Integer(), nullable=False),
    sa.Column('num_model_calls', sa.Integer(), nullable=False),
    sa.Column('num_tool_calls', sa.Integer(), nullable=False),
    sa.Column('num_malformed', sa.Integer(), nullable=False),
    sa.Column('num_sampled_tokens', sa.Integer(), nullable=False),
    sa.Column('num_segments', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['group_id'], ['groups.id'], name=op.f('fk_trajectories_group_id_groups')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_trajectories_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['task_instance_id'], ['task_instances.id'], name=op.f('fk_trajectories_task_instance_id_task_instances')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_trajectories'))
    )
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_trajectories_group_id'), ['group_id'], unique=False)
        batch_op.create_index('ix_trajectories_run_status', ['run_id', 'status'], unique=False)

    op.create_table('admission_decisions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('trajectory_id', sa.Integer(), nullable=True),
    sa.Column('group_id', sa.Integer(), nullable=True),
    sa.Column('decision', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.String(length=64), nullable=False),
    sa.Column('learner_version', sa.Integer(), nullable=False),
    sa.Column('lag', sa.Integer(), nullable=True),
    sa.Column('details', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['group_id'], ['groups.id'], name=op.f('fk_admission_decisions_group_id_groups')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_admission_decisions_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['trajectory_id'], ['trajectories.id'], name=op.f('fk_admission_decisions_trajectory_id_trajectories')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_admission_decisions'))
    )
    with op.batch_alter_table('admission_decisions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_admission_decisions_group_id'), ['group_id'], unique=False)
        batch_op.create_index('ix_admission_decisions_run_decision', ['run_id', 'decision'], unique=False)
        batch_op.create_index(batch_op.f('ix_admission_decisions_trajectory_id'), ['trajectory_id'], unique=False)

    op.create_table('learner_stream',
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('trajectory_id', sa.Integer(), nullable=False),
    sa.Column('group_id', sa.Integer(), nullable=True),
    sa.Column('reward', sa.Float(), nullable=False),
    sa.Column('loss_masked', sa.Boolean(), nullable=False),
    sa.Column('admitted_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['group_id'], ['groups.id'], name=op.f('fk_learner_stream_group_id_groups')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_learner_stream_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['trajectory_id'], ['trajectories.id'], name=op.f('fk_learner_stream_trajectory_id_trajectories')),
    sa.PrimaryKeyConstraint('run_id', 'seq', name=op.f('pk_learner_stream')),
    sa.UniqueConstraint('run_id', 'trajectory_id', name=op.f('uq_learner_stream_run_id_trajectory_id'))
    )
    op.create_table('model_calls',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('trajectory_id', sa.Integer(), nullable=False),
    sa.Column('turn', sa.Integer(), nullable=False),
    sa.Column('segment', sa.Integer(), nullable=False),
    sa.Column('context_len', sa.Integer(), nullable=False),
    sa.Column('num_tokens', sa.Integer(), nullable=False),
    sa.Column('prompt_token_ids', sa.LargeBinary(), nullable=False),
    sa.Column('token_ids', sa.LargeBinary(), nullable=False),
    sa.Column('sampler_logprobs', sa.LargeBinary(), nullable=False),
    sa.Column('weights_versions', sa.LargeBinary(), nullable=False),
    sa.Column('kv_versions', sa.LargeBinary(), nullable=False),
    sa.Column('time_offsets', sa.LargeBinary(), nullable=False),
    sa.Column('loss_mask', sa.LargeBinary(), nullable=False),
    sa.Column('topk', sa.Integer(), nullable=False),
    sa.Column('topk_ids', sa.LargeBinary(), nullable=True),
    sa.Column('topk_logprobs', sa.LargeBinary(), nullable=True),
    sa.Column('sampling', sa.JSON(), nullable=False),
    sa.Column('engine_id', sa.String(length=200), nullable=False),
    sa.Column('finish_reason', sa.String(length=16), nullable=False),
    sa.Column('cached_prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('finished_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['trajectory_id'], ['trajectories.id'], name=op.f('fk_model_calls_trajectory_id_trajectories'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_model_calls'))
    )
    with op.batch_alter_table('model_calls', schema=None) as batch_op:
        batch_op.create_index('ix_model_calls_trajectory_turn', ['trajectory_id', 'turn'], unique=False)

    op.create_table('sandboxes',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('trajectory_id', sa.Integer(), nullable=True),
    sa.Column('backend', sa.String(length=16), nullable=False),
    sa.Column('container_id', sa.String(length=100), nullable=False),
    sa.Column('image', sa.String(length=200), nullable=False),
    sa.Column('acquired_at', sa.Float(), nullable=False),
    sa.Column('acquire_s', sa.Float(), nullable=False),
    sa.Column('released_at', sa.Float(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_sandboxes_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['trajectory_id'], ['trajectories.id'], name=op.f('fk_sandboxes_trajectory_id_trajectories')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sandboxes'))
    )
    with op.batch_alter_table('sandboxes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sandboxes_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_sandboxes_trajectory_id'), ['trajectory_id'], unique=False)

    op.create_table('tool_calls',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('trajectory_id', sa.Integer(), nullable=False),
    sa.Column('turn', sa.Integer(), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('arguments', sa.Text(), nullable=False),
    sa.Column('observation', sa.Text(), nullable=False),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('error_type', sa.String(length=32), nullable=True),
    sa.Column('timed_out', sa.Boolean(), nullable=False),
    sa.Column('truncated', sa.Boolean(), nullable=False),
    sa.Column('output_bytes', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('duration_s', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['trajectory_id'], ['trajectories.id'], name=op.f('fk_tool_calls_trajectory_id_trajectories'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tool_calls'))
    )
    with op.batch_alter_table('tool_calls', schema=None) as batch_op:
        batch_op.create_index('ix_tool_calls_trajectory_turn', ['trajectory_id', 'turn'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('tool_calls', schema=None) as batch_op:
        batch_op.drop_index('ix_tool_calls_trajectory_turn')

    op.drop_table('tool_calls')
    with op.batch_alter_table('sandboxes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sandboxes_trajectory_id'))
        batch_op.drop_index(batch_op.f('ix_sandboxes_run_id'))

    op.drop_table('sandboxes')
    with op.batch_alter_table('model_calls', schema=None) as batch_op:
        batch_op.drop_index('ix_model_calls_trajectory_turn')

    op.drop_table('model_calls')
    op.drop_table('learner_stream')
    with op.batch_alter_table('admission_decisions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_admission_decisions_trajectory_id'))
        batch_op.drop_index('ix_admission_decisions_run_decision')
        batch_op.drop_index(batch_op.f('ix_admission_decisions_group_id'))

    op.drop_table('admission_decisions')
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.drop_index('ix_trajectories_run_status')
        batch_op.drop_index(batch_op.f('ix_trajectories_group_id'))

    op.drop_table('trajectories')
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_groups_task_instance_id'))
        batch_op.drop_index(batch_op.f('ix_groups_run_id'))

    op.drop_table('groups')
    with op.batch_alter_table('task_instances', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_task_instances_run_id'))

    op.drop_table('task_instances')
    op.drop_table('policy_versions')
    op.drop_table('learner_steps')
    with op.batch_alter_table('bias_ledger', schema=None) as batch_op:
        batch_op.drop_index('ix_bias_ledger_run_computed')

    op.drop_table('bias_ledger')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_status'))

    op.drop_table('runs')
