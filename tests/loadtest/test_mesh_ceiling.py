"""`make bench-mesh-ceiling` end to end on a small load: the sim mesh started with two gateways,
both protocols measured, every streamed token counted (and each gateway's share), CPU per token
and ceilings per process and per stage reported."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.mesh.gateways import stage_of
from loadtest.mesh_ceiling import STAGES, main


def test_both_protocols_count_every_token_and_price_each_stage(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rounds.json"
    args = ["--streams", "4", "--output-len", "8", "--step-ms", "1", "--gateways", "2"]
    main([*args, "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(row["protocol"], row["streams"]) for row in rows] == [("http", 4), ("grpc", 4)]
    for row in rows:
        assert row["streamed_tokens"] == 4 * 8
        assert set(STAGES) <= {stage_of(name) for name in row["cpu_us_per_token"]}
        assert all(us >= 0 for us in row["cpu_us_per_token"].values())
        assert row["itl_p99_ms"] >= row["itl_p50_ms"]  # percentiles in order, not a timing
        assert "client" not in row["ceiling_tok_s_per_core"]
        assert sum(row["gateway_tokens"].values()) == 4 * 8  # each counted by one gateway
        assert set(row["gateway_tokens"]) == {"gateway-0", "gateway-1"}
        stages = {stage_of(name) for name in row["cpu_us_per_token"]} - {"client"}
        assert set(row["stage_ceiling_tok_s"]) <= stages  # (a 10 ms CPU tick may zero one)
    assert "gateway stage ceiling" in capsys.readouterr().out
