"""Files, batches, answered batch lines and runtime edits (issue 31, items 6-7): :mod:`asyncinterp.serve.openai.batches.tables`.

Revision ID: 0002
Revises: 0001
"""

from alembic import op
import sqlalchemy as sa

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "asyncinterp_files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_index("ix_asyncinterp_files_owner_created", "asyncinterp_files", ["owner", "created_at"])
    op.create_table(
        "asyncinterp_batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("record", sa.JSON, nullable=False),
        sa.Column("input", sa.LargeBinary, nullable=False),
    )
    op.create_index("ix_asyncinterp_batches_owner_created", "asyncinterp_batches", ["owner", "created_at"])
    op.create_table(
        "asyncinterp_batch_lines",
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("line", sa.Integer, primary_key=True),
        sa.Column("ok", sa.Boolean, nullable=False),
        sa.Column("answer", sa.Text, nullable=False),
    )
    op.create_table(
        "asyncinterp_edits",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("digest", sa.String(80), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("record", sa.JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("asyncinterp_edits")
    op.drop_table("asyncinterp_batch_lines")
    op.drop_index("ix_asyncinterp_batches_owner_created", "asyncinterp_batches")
    op.drop_table("asyncinterp_batches")
    op.drop_index("ix_asyncinterp_files_owner_created", "asyncinterp_files")
    op.drop_table("asyncinterp_files")
