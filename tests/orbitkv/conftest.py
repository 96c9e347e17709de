from __future__ import annotations

import os

import pytest

from tests.manager_process import ManagerProcess

pytest.importorskip("msgpack")


@pytest.fixture
def manager_factory(tmp_path, sock_dir):
    started: list[ManagerProcess] = []

    def make(**kwargs) -> ManagerProcess:
        m = ManagerProcess(tmp_path, sock_dir, **kwargs).start()
        started.append(m)
        return m

    yield make
    for m in started:
        m.stop()
    os.environ.pop("ORBITKV_TEST", None)
