"""model_calls loses loss_mask: every stored token is sampled, so it was all ones

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05

A training sample's loss mask comes from the one path (core/samples.py): 1 exactly on each
call's sampled tokens. The column is dropped in place (SQLite >= 3.35 has DROP COLUMN), never by
copying the table: the copy's DROP TABLE would cascade to the trainer_logprobs rows that
reference the calls. The downgrade writes the ones back; on SQLite the restored column keeps an
empty default, since SQLite adds a NOT NULL column only with one and removing it would copy the
table.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_column('model_calls', 'loss_mask')


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == 'sqlite'
    op.add_column('model_calls', sa.Column(
        'loss_mask', sa.LargeBinary(), nullable=not sqlite,
        server_default=sa.text("X''") if sqlite else None))
    calls = sa.table('model_calls', sa.column('num_tokens', sa.Integer()),
                     sa.column('loss_mask', sa.LargeBinary()))
    connection = op.get_bind()
    lengths = connection.execute(sa.select(calls.c.num_tokens).distinct()).scalars().all()
    for length in lengths:
        connection.execute(calls.update().where(calls.c.num_tokens == length)
                           .values(loss_mask=b'\x01' * length))
    if not sqlite:
        op.alter_column('model_calls', 'loss_mask', existing_type=sa.LargeBinary(),
                        nullable=False)
