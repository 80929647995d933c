"""learner_stream gains weight: each admitted trajectory's selection-bias weight

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05

`[admission] reweight = "propensity"` gives each admitted trajectory the weight that undoes
admission's selection (core/selection.py); the learner multiplies its advantage by it. Rows
written before (and every row without reweighting) have weight 1, the server default.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('learner_stream', sa.Column('weight', sa.Float(), nullable=False,
                                              server_default=sa.text('1.0')))


def downgrade() -> None:
    op.drop_column('learner_stream', 'weight')
