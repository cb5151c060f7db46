"""The jobs table (issue 31): wire form, envelope, state, lease, result.

Revision ID: 0001
Revises:
"""

from alembic import op
import sqlalchemy as sa

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "asyncinterp_jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("returns", sa.String(16), nullable=False, server_default=""),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("request", sa.LargeBinary, nullable=True),
        sa.Column("request_path", sa.String(255), nullable=True),
        sa.Column("timeout", sa.Float, nullable=False),
        sa.Column("meta", sa.JSON, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float, nullable=True),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("expires_at", sa.Float, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("restarts", sa.JSON, nullable=True),
        sa.Column("lease_owner", sa.String(64), nullable=True),
        sa.Column("lease_until", sa.Float, nullable=True),
        sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("progress", sa.JSON, nullable=True),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("error", sa.JSON, nullable=True),
        sa.Column("result_json", sa.Text, nullable=True),
        sa.Column("result_tensors", sa.LargeBinary, nullable=True),
        sa.Column("result_path", sa.String(255), nullable=True),
        sa.Column("result_bytes", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("compute_seconds", sa.Float, nullable=False, server_default="0"),
    )
    op.create_index("ix_asyncinterp_jobs_state_created", "asyncinterp_jobs", ["state", "created_at"])
    op.create_index("ix_asyncinterp_jobs_owner_created", "asyncinterp_jobs", ["owner", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_asyncinterp_jobs_owner_created", "asyncinterp_jobs")
    op.drop_index("ix_asyncinterp_jobs_state_created", "asyncinterp_jobs")
    op.drop_table("asyncinterp_jobs")
