"""trainer log-probs per sampled token

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('trainer_logprobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('model_call_id', sa.Integer(), nullable=False),
    sa.Column('learner_step', sa.Integer(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=True),
    sa.Column('num_tokens', sa.Integer(), nullable=False),
    sa.Column('logprobs', sa.LargeBinary(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['model_call_id'], ['model_calls.id'], name=op.f('fk_trainer_logprobs_model_call_id_model_calls'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_trainer_logprobs_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_trainer_logprobs'))
    )
    with op.batch_alter_table('trainer_logprobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_trainer_logprobs_model_call_id'), ['model_call_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_trainer_logprobs_run_id'), ['run_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('trainer_logprobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_trainer_logprobs_run_id'))
        batch_op.drop_index(batch_op.f('ix_trainer_logprobs_model_call_id'))

    op.drop_table('trainer_logprobs')
