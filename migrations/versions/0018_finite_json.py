"""JSON columns that hold NaN or Infinity made JSON again (SQLite): those numbers become null

Before, the store wrote a NaN or an infinity in a JSON column as json.dumps does, `NaN` and
`Infinity`, which are not JSON: SQLite's json_extract refuses the whole value, and the step page
reads each group's query from its facts row that way, so a meta `{"score": inf}` shared by a
group made that step's page a 500 for good. The store now writes null (textsafe.finite_json);
this rewrites the rows written before, in the small tables (facts, runs' config and notes), where
SQLite finds them by json_valid. A rollout's own meta is left: it was written by orjson (null
already) but for rare values, and it is read in Python, which takes the tokens. PostgreSQL's json
type never took them (that write failed instead): nothing to do there. A facts row keeps its
sha256 (of the text it had); a later step with the same facts adds the null row beside it.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04 19:40:00
"""

import json
import math
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# table → its primary key and JSON columns
COLUMNS = {"facts": ("id", ("data",)), "runs": ("id", ("config", "notes"))}


def _finite(value: Any) -> Any:
    """A frozen copy of textsafe.finite_value: NaN and infinities anywhere made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return
    for table, (key, columns) in COLUMNS.items():
        for column in columns:
            broken = bind.execute(
                sa.text(
                    f'SELECT "{key}", "{column}" FROM "{table}" '
                    f'WHERE "{column}" IS NOT NULL AND NOT json_valid("{column}")'
                )
            ).all()
            for row_id, text in broken:
                try:
                    value = json.loads(text)  # Python's json takes NaN and Infinity
                except ValueError:
                    continue  # not ours to guess at
                bind.execute(
                    sa.text(f'UPDATE "{table}" SET "{column}" = :text WHERE "{key}" = :id'),
                    {"text": json.dumps(_finite(value), allow_nan=False), "id": row_id},
                )


def downgrade() -> None:
    pass  # null is what the older code reads as well
