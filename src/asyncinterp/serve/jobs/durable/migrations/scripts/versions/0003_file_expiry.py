"""Files expire (issue 31): ``asyncinterp_files.expires_at``, OpenAI's ``expires_after`` or the server's ``--file-ttl``.

Files uploaded before this revision keep ``NULL``: they never expire (as they were promised).

Revision ID: 0003
Revises: 0002
"""

from alembic import op
import sqlalchemy as sa

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("asyncinterp_files", sa.Column("expires_at", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("asyncinterp_files") as batch:
        batch.drop_column("expires_at")
