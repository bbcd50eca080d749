"""A Parquet import over HTTP is bounded by its pages' own headers, not only its footer
(server.exchange.parquet_pages): a file whose footer says its columns hold 1,000 bytes while a
page holds a 16 MiB completion is refused before Arrow reads the page, naming the row group;
an honest export imports within the same bound; and a hypothesis pass mutating the bytes of an
export's pages (headers and data) gets an import or an InvalidInput, never another exception."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_lens.server.core.errors import InvalidInput
from rollout_lens.server.exchange import export, importer
from rollout_lens.server.store.db import session_scope
from rollout_lens.server.store.models import RunRow
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from bench.hostile_memory import parquet_with_completion
from bench.parquet_lies import footer_lies
from tests.factories import make_run

CAP = 2**20  # the request's byte cap: the import may decode 4 MiB at once


def _runs(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        return int(session.scalar(select(func.count()).select_from(RunRow)) or 0)


@pytest.fixture
def exported(session_factory: sessionmaker[Session], tmp_path: Path) -> bytes:
    run_id = make_run(session_factory, steps=2, group_size=2)
    with session_scope(session_factory) as session:
        return b"".join(export.export_chunks(session, run_id=run_id, fmt="parquet"))


def test_a_footer_that_hides_a_page_does_not_hide_it(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    honest = parquet_with_completion(16 * 2**20)
    lying = footer_lies(honest, said=1_000)
    path = tmp_path / "lying.parquet"
    path.write_bytes(lying)
    metadata = pq.ParquetFile(path).metadata
    completion = next(
        metadata.row_group(0).column(j)
        for j in range(metadata.num_columns)
        if metadata.row_group(0).column(j).path_in_schema == "completion"
    )
    assert completion.total_uncompressed_size == 1_000 and len(lying) < 64 * 1024
    before = _runs(session_factory)
    with pytest.raises(InvalidInput, match=r"row group 1: its pages decode to more") as refused:
        importer.import_export(session_factory, path, max_bytes=CAP)
    assert "column completion" in str(refused.value) and "page headers" in str(refused.value)
    assert _runs(session_factory) == before


def test_an_honest_export_imports_within_the_bound(
    session_factory: sessionmaker[Session], tmp_path: Path, exported: bytes
) -> None:
    path = tmp_path / "export.parquet"
    path.write_bytes(exported)
    before = _runs(session_factory)
    importer.import_export(session_factory, path, max_bytes=CAP)
    assert _runs(session_factory) == before + 1


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_mutated_pages_are_imported_or_refused(
    session_factory: sessionmaker[Session],
    tmp_path_factory: pytest.TempPathFactory,
    exported: bytes,
    data: st.DataObject,
) -> None:
    """Bytes of the pages (between the magic and the footer) replaced: the import succeeds, or
    refuses with InvalidInput and creates nothing; never another exception."""
    footer = int.from_bytes(exported[-8:-4], "little") + 8
    mutated = bytearray(exported)
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        at = data.draw(st.integers(min_value=4, max_value=len(exported) - footer - 1))
        mutated[at] = data.draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x15, 0x1C]))
    path = tmp_path_factory.mktemp("pages") / "mutated.parquet"
    path.write_bytes(bytes(mutated))
    before = _runs(session_factory)
    try:
        importer.import_export(session_factory, path, max_bytes=CAP)
    except InvalidInput:
        assert _runs(session_factory) == before
    else:
        assert _runs(session_factory) == before + 1
