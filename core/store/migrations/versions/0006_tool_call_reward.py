"""tool_calls gains reward: a task's per-turn reward for the call

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05

A tool may grant a reward for a call (`ToolResult.reward`, a step or process reward); the
per-turn estimators of the learner train on it. Rows written before have none (NULL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('tool_calls', sa.Column('reward', sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column('tool_calls', 'reward')
