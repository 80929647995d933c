"""evaluations as numbers

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('evaluations',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('label', sa.String(length=32), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=False),
    sa.Column('split', sa.String(length=16), nullable=False),
    sa.Column('instances', sa.Integer(), nullable=False),
    sa.Column('distinct', sa.Integer(), nullable=False),
    sa.Column('solved', sa.Integer(), nullable=False),
    sa.Column('infra_errors', sa.Integer(), nullable=False),
    sa.Column('aborted', sa.Integer(), nullable=False),
    sa.Column('mean_reward', sa.Float(), nullable=False),
    sa.Column('failures', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_evaluations_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_evaluations'))
    )
    with op.batch_alter_table('evaluations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_evaluations_run_id'), ['run_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('evaluations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_evaluations_run_id'))

    op.drop_table('evaluations')
