"""The benchmark under SecAgg+ (federation.secagg): the attackers get each round's K-client
aggregate as one batch of K*B images; attackers that need batch size 1 fail those rows with the reason."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run, write_config


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_secagg_rows_are_one_batch_of_all_clients_images(tmp_path: Path) -> None:
    from benchmark.store import read_jsonl
    from server.tap import AGGREGATE_ID

    config = write_config(tmp_path, **{"federation.secagg": True, "federation.rounds": 1,
                                       "models": [{"name": "DeiT", "arch": "mjp_vit_cifar_patch4_32",
                                                   "variant": "plain", "kwargs": {"depth": 2}, "april": "surgery"}]})
    assert run(config, tmp_path / "out") == 0
    rows = list(read_jsonl(tmp_path / "out" / "results.jsonl"))
    # One aggregate of 2 clients x batch 1: two images, both under the aggregate's partition id.
    assert len(rows) == 2 and {r["partition_id"] for r in rows} == {AGGREGATE_ID}
    assert sorted(r["batch_index"] for r in rows) == [0, 1] and len({r["image_id"] for r in rows}) == 2
    assert all(r["failed"] and "batch size 1" in r["reason"] and "num_images=2" in r["reason"] for r in rows)
